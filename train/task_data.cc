// Task ids and ranges for the Oryx tokenizer, and a corpus-backed haystack.
#include "train/task_data.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/rng.h"

namespace oryx::train {

absl::StatusOr<TaskSetup> MakeTaskSetup(const Tokenizer& tok) {
  TaskSetup setup;
  tasks::TaskVocab& v = setup.configs.vocab;
  v.bos = tok.bos_id();
  v.eos = tok.eos_id();
  ORYX_ASSIGN_OR_RETURN(v.sep, tok.TaskTokenId("<|sep|>"));
  ORYX_ASSIGN_OR_RETURN(v.query, tok.TaskTokenId("<|query|>"));
  ORYX_ASSIGN_OR_RETURN(v.answer, tok.TaskTokenId("<|answer|>"));
  ORYX_ASSIGN_OR_RETURN(v.key, tok.TaskTokenId("<|key|>"));
  ORYX_ASSIGN_OR_RETURN(v.value, tok.TaskTokenId("<|value|>"));
  ORYX_ASSIGN_OR_RETURN(v.needle, tok.TaskTokenId("<|needle|>"));
  v.first_free_id = kFirstByteId;  // the fixed ids (special, task, newline, tab) end here
  v.vocab_size = tok.vocab_size();
  // Ordinary pieces start after the 256 byte-fallback pieces; keep clear of them where the vocab allows.
  const int32_t base = std::min(v.first_free_id + 256, v.first_free_id + (v.vocab_size - v.first_free_id) / 4);
  const int32_t mid = base + (v.vocab_size - base) / 2;
  if (mid - base < 8) {
    return absl::InvalidArgumentError(absl::StrCat("vocabulary of ", v.vocab_size, " is too small for the tasks"));
  }
  tasks::TokenRange keys{base, mid}, values{mid, v.vocab_size};
  setup.configs.mqar = {keys, values, values, 8, 0.01};
  setup.configs.niah_single = {keys, values, 2, 3, 1};
  setup.configs.niah_multikey = {keys, values, 2, 3, 4};
  setup.has_digits = true;
  for (int d = 0; d < 10; ++d) {
    std::vector<int32_t> ids = tok.Encode(std::string(1, static_cast<char>('0' + d)));
    if (ids.size() != 1) {
      setup.has_digits = false;
      break;
    }
    v.digits[d] = ids[0];
  }
  if (!setup.has_digits) v.digits.fill(-1);
  return setup;
}

namespace {
// A seeded window of n of `total` tokens: checks n and returns its start.
absl::StatusOr<int64_t> WindowStart(int64_t n, int64_t total, uint64_t seed, const char* source) {
  if (n < 0) return absl::InvalidArgumentError("haystack length must be >= 0");
  if (n > total) {
    return absl::FailedPreconditionError(absl::StrCat("haystack of ", n, " tokens asked from ", source, " of ", total));
  }
  return static_cast<int64_t>(Rng(seed).UniformInt(static_cast<uint64_t>(total - n + 1)));
}

// Special ids (BOS/EOS between documents, task markers) become newlines, so needles stay unambiguous.
void ReplaceSpecialIds(std::vector<int32_t>& ids) {
  for (int32_t& id : ids) {
    if (id < kNewlineId) id = kNewlineId;
  }
}
}  // namespace

absl::StatusOr<std::vector<int32_t>> CorpusHaystack::Tokens(int64_t n, uint64_t seed) const {
  ORYX_ASSIGN_OR_RETURN(int64_t start, WindowStart(n, reader_->num_tokens(), seed, "a corpus split"));
  std::vector<int32_t> out(n);
  ORYX_RETURN_IF_ERROR(reader_->ReadTokens(start, n, out.data()));
  ReplaceSpecialIds(out);
  return out;
}

absl::StatusOr<TextHaystack> TextHaystack::Load(const std::vector<std::string>& files, const Tokenizer& tokenizer) {
  TextHaystack h;
  for (const std::string& f : files) {
    ORYX_ASSIGN_OR_RETURN(std::string text, ReadFile(f));
    tokenizer.EncodeAppend(text, &h.tokens_);
  }
  ReplaceSpecialIds(h.tokens_);
  if (h.tokens_.empty()) return absl::InvalidArgumentError("the haystack files hold no text");
  return h;
}

absl::StatusOr<std::vector<int32_t>> TextHaystack::Tokens(int64_t n, uint64_t seed) const {
  ORYX_ASSIGN_OR_RETURN(int64_t start, WindowStart(n, size(), seed, "haystack files"));
  return std::vector<int32_t>(tokens_.begin() + start, tokens_.begin() + start + n);
}

absl::StatusOr<std::unique_ptr<tasks::HaystackSource>> OpenHaystack(const std::vector<std::string>& text_files,
                                                                    const std::string& corpus_dir,
                                                                    const std::string& split,
                                                                    const Tokenizer& tokenizer) {
  if (!text_files.empty()) {
    ORYX_ASSIGN_OR_RETURN(TextHaystack text, TextHaystack::Load(text_files, tokenizer));
    return std::make_unique<TextHaystack>(std::move(text));
  }
  ORYX_ASSIGN_OR_RETURN(CorpusReader reader, CorpusReader::Open(corpus_dir, split));
  return std::make_unique<CorpusHaystack>(std::move(reader));
}

absl::StatusOr<tasks::TaskKind> ParseTaskName(std::string_view name) {
  return tasks::ParseTaskKind(name == "niah" ? "niah_single" : name == "niah-multikey" ? "niah_multikey" : name);
}

}  // namespace oryx::train
