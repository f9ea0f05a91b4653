// The Oryx tokenizer: SentencePiece for the BPE segmentation of valid UTF-8, our own handling of every
// byte SentencePiece would alter (invalid UTF-8, U+2581, NUL), and our own piece-by-piece decoder.
#include "engine/tokenizer.h"

// SentencePiece's headers declare `absl::string_view` as std::string_view, which clashes with Debian's
// Abseil (its own string_view class). The types in SentencePiece's signatures are std::string_view, so
// renaming the namespace for the duration of these two includes changes nothing at link time.
#define absl oryx_sentencepiece_absl
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#undef absl

#include <algorithm>
#include <cstdio>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/file_util.h"
#include "base/status_macros.h"

namespace oryx {

namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space
constexpr std::string_view kUnkText = "\xE2\x81\x87";      // U+2047
constexpr std::array<std::string_view, 4> kBasePieces = {"<pad>", "<unk>", "<s>", "</s>"};

// Length of the well-formed UTF-8 character at the start of `s` (RFC 3629: no overlongs, no
// surrogates, at most U+10FFFF), or 0 if the first byte does not start one. Characters that
// SentencePiece would not pass through unchanged (NUL, U+2581) also count as not well formed.
size_t AcceptedCharLen(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const auto trail = [&](size_t i) { return i < s.size() && (b(i) & 0xC0) == 0x80; };
  const uint8_t c = b(0);
  if (c == 0) return 0;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return trail(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!trail(1) || !trail(2)) return 0;
    if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(1) >= 0xA0) return 0;  // surrogate
    if (s.substr(0, 3) == kSpaceSymbol) return 0;
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!trail(1) || !trail(2) || !trail(3)) return 0;
    if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

absl::Status SpError(std::string_view name, std::string_view what, const sentencepiece::util::Status& s) {
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(name), ": ", std::string(what), ": ", s.ToString()));
}

// A piece's text: SentencePiece writes spaces as U+2581.
std::string SpaceSymbolsToSpaces(std::string_view piece) {
  std::string out;
  for (size_t i = 0; i < piece.size();) {
    if (piece.substr(i, kSpaceSymbol.size()) == kSpaceSymbol) {
      out += ' ';
      i += kSpaceSymbol.size();
    } else {
      out += piece[i++];
    }
  }
  return out;
}

// Text that a model without identity normalisation, or with a dummy prefix or whitespace removal,
// would not give back unchanged.
constexpr std::string_view kProbeText = "  two  spaces\t\ttabs \n\n full\xEF\xBD\x86width A\xCC\x8A \t";

}  // namespace

Tokenizer::Tokenizer() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& path) {
  ORYX_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  return FromBytes(bytes, path);
}

absl::StatusOr<Tokenizer> Tokenizer::FromBytes(std::string_view model_bytes, std::string_view name) {
  Tokenizer tok;
  if (model_bytes.empty())
    return absl::InvalidArgumentError(absl::StrCat(std::string(name), ": empty tokenizer file"));
  sentencepiece::util::Status s = tok.sp_->LoadFromSerializedProto(model_bytes);
  if (!s.ok()) return SpError(name, "not a SentencePiece model", s);
  ORYX_RETURN_IF_ERROR(tok.Init(name));
  return tok;
}

// Checks the special-token layout, builds the decode table, and probes the exact round trip.
absl::Status Tokenizer::Init(std::string_view name) {
  const int n = sp_->GetPieceSize();
  const auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(name),
                     ": not an Oryx tokenizer (train it with `oryx tokenizer train`): ", std::string(what)));
  };
  if (n <= 0 || n > 65536) return bad(absl::StrCat("vocabulary size ", n, " is outside [1, 65536]"));
  pieces_.resize(n);
  piece_text_.resize(n);
  for (int id = 0; id < n; ++id) {
    pieces_[id] = sp_->IdToPiece(id);
    piece_text_[id] = SpaceSymbolsToSpaces(pieces_[id]);
  }
  const int32_t fixed[] = {sp_->pad_id(), sp_->unk_id(), sp_->bos_id(), sp_->eos_id()};
  for (int32_t id = 0; id < 4; ++id) {
    if (fixed[id] != id || id >= n || pieces_[id] != kBasePieces[id]) {
      return bad(absl::StrCat("expected ", std::string(kBasePieces[id]), " at id ", id));
    }
    piece_text_[id] = "";
  }
  piece_text_[kUnkId] = std::string(kUnkText);
  for (size_t i = 0; i < kTaskTokenNames.size(); ++i) {
    const int32_t id = kFirstTaskTokenId + static_cast<int32_t>(i);
    if (id >= n || pieces_[id] != kTaskTokenNames[i] || !sp_->IsControl(id)) {
      return bad(absl::StrCat("expected control symbol ", std::string(kTaskTokenNames[i]), " at id ", id));
    }
  }
  if (kTabId >= n || pieces_[kNewlineId] != "\n" || pieces_[kTabId] != "\t") {
    return bad("expected user-defined symbols \"\\n\" at id 18 and \"\\t\" at id 19");
  }
  for (int byte = 0; byte < 256; ++byte) {
    const int id = sp_->PieceToId(absl::StrFormat("<0x%02X>", byte));
    if (id <= 0 || !sp_->IsByte(id)) return bad(absl::StrFormat("byte piece <0x%02X> missing", byte));
    byte_ids_[byte] = id;
    piece_text_[id] = std::string(1, static_cast<char>(byte));
  }
  // SentencePiece on its own normalises; our wrapper relies on it passing valid UTF-8 through.
  std::vector<int> ids;
  sentencepiece::util::Status s = sp_->Encode(kProbeText, &ids);
  if (!s.ok()) return SpError(name, "cannot encode", s);
  std::string back;
  for (int id : ids) back += piece_text_[id];
  if (back != kProbeText) {
    return bad(
        "it does not reproduce whitespace and characters exactly (needs identity normalisation, "
        "no dummy prefix, no whitespace removal)");
  }
  return absl::OkStatus();
}

// Encodes line by line: "\n" is a user-defined symbol that no learned piece contains, so no merge
// crosses it and the result equals SentencePiece's on the whole text, about twice as fast.
void Tokenizer::EncodeValidUtf8(std::string_view text, std::vector<int32_t>* out) const {
  std::vector<int> ids;
  while (!text.empty()) {
    const size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    if (!line.empty()) {
      ids.clear();
      if (sp_->Encode(line, &ids).ok()) {
        out->insert(out->end(), ids.begin(), ids.end());
      } else {  // not expected for valid UTF-8; fall back to bytes so that Encode never fails
        for (char c : line) out->push_back(byte_ids_[static_cast<uint8_t>(c)]);
      }
    }
    if (end == text.size()) break;
    out->push_back(kNewlineId);
    text.remove_prefix(end + 1);
  }
}

void Tokenizer::EncodeAppend(std::string_view text, std::vector<int32_t>* out) const {
  size_t run_start = 0;
  size_t i = 0;
  while (i < text.size()) {
    const size_t len = AcceptedCharLen(text.substr(i));
    if (len > 0) {
      i += len;
      continue;
    }
    EncodeValidUtf8(text.substr(run_start, i - run_start), out);
    out->push_back(byte_ids_[static_cast<uint8_t>(text[i])]);
    run_start = ++i;
  }
  EncodeValidUtf8(text.substr(run_start), out);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> out;
  EncodeAppend(text, &out);
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size()) {
      out += piece_text_[id];
    } else {
      out += kUnkText;
    }
  }
  return out;
}

absl::StatusOr<int32_t> Tokenizer::TaskTokenId(std::string_view name) const {
  for (size_t i = 0; i < kTaskTokenNames.size(); ++i) {
    if (kTaskTokenNames[i] == name) return kFirstTaskTokenId + static_cast<int32_t>(i);
  }
  std::string known;
  for (std::string_view n : kTaskTokenNames) {
    known += ' ';
    known += n;
  }
  return absl::NotFoundError(
      absl::StrCat("no task token named '", std::string(name), "' (known:", known, ")"));
}

std::string_view Tokenizer::IdToPiece(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  return pieces_[id];
}

// --- training -------------------------------------------------------------------------------------

namespace {

class VectorSentenceIterator : public sentencepiece::SentenceIterator {
 public:
  explicit VectorSentenceIterator(const std::vector<std::string>& v) : v_(v) {}
  bool done() const override { return i_ >= v_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return v_[i_]; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  const std::vector<std::string>& v_;
  size_t i_ = 0;
};

// Collects every non-empty line of the files that is short enough, then keeps an evenly spaced subset
// of at most `max` of them (deterministic, no randomness).
absl::StatusOr<std::vector<std::string>> ReadTrainingLines(const TokenizerTrainOptions& o) {
  std::vector<std::string> lines;
  for (const std::string& path : o.input_files) {
    ORYX_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      const size_t len = end - start;
      if (len > 0 && len <= static_cast<size_t>(o.max_sentence_bytes))
        lines.push_back(text.substr(start, len));
      start = end + 1;
    }
  }
  if (lines.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no training text in ", absl::StrJoin(o.input_files, ", ")));
  }
  if (static_cast<int64_t>(lines.size()) <= o.max_sentences) return lines;
  std::vector<std::string> sample;
  sample.reserve(o.max_sentences);
  for (int64_t k = 0; k < o.max_sentences; ++k) {
    const size_t i = static_cast<size_t>((static_cast<__int128>(k) * lines.size()) / o.max_sentences);
    sample.push_back(std::move(lines[i]));
  }
  return sample;
}

std::string ControlSymbolsFlag() {
  std::string flag;
  for (std::string_view n : kTaskTokenNames) {
    if (!flag.empty()) flag += ',';
    flag += n;
  }
  return flag;
}

}  // namespace

absl::StatusOr<std::string> TrainTokenizerFromSentences(const std::vector<std::string>& sentences,
                                                        int32_t vocab_size) {
  if (vocab_size < kMinVocabSize || vocab_size > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer vocabulary size must be in [", kMinVocabSize, ", 65536], got ", vocab_size));
  }
  if (sentences.empty()) return absl::InvalidArgumentError("no training sentences for the tokenizer");
  int64_t max_len = 0;
  for (const std::string& s : sentences) max_len = std::max<int64_t>(max_len, s.size());
  std::unordered_map<std::string, std::string> kw = {
      {"model_type", "bpe"},
      {"vocab_size", absl::StrCat(vocab_size)},
      {"character_coverage", "0.9995"},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"split_by_unicode_script", "false"},  // lets code pieces mix letters and "_", "->", "();"
      {"allow_whitespace_only_pieces", "true"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"normalization_rule_name", "identity"},
      {"max_sentence_length", absl::StrCat(std::max<int64_t>(max_len, 1))},
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      {"num_threads", "1"},
      {"hard_vocab_limit", "false"},
      {"pad_id", "0"},
      {"unk_id", "1"},
      {"bos_id", "2"},
      {"eos_id", "3"},
      {"control_symbols", ControlSymbolsFlag()},
      {"user_defined_symbols", "\n,\t"},
      {"minloglevel", "2"},
  };
  sentencepiece::SetRandomGeneratorSeed(20240601);
  VectorSentenceIterator it(sentences);
  std::string model;
  sentencepiece::util::Status s = sentencepiece::SentencePieceTrainer::Train(kw, &it, &model);
  if (!s.ok()) return absl::InternalError(absl::StrCat("tokenizer training failed: ", s.ToString()));
  return model;
}

absl::Status TrainTokenizer(const TokenizerTrainOptions& options) {
  if (options.out_path.empty()) return absl::InvalidArgumentError("no output path for the tokenizer");
  if (options.input_files.empty()) return absl::InvalidArgumentError("no input files for the tokenizer");
  if (options.max_sentences <= 0) return absl::InvalidArgumentError("max_sentences must be positive");
  ORYX_ASSIGN_OR_RETURN(std::vector<std::string> lines, ReadTrainingLines(options));
  ORYX_ASSIGN_OR_RETURN(std::string model, TrainTokenizerFromSentences(lines, options.vocab_size));
  ORYX_RETURN_IF_ERROR(Tokenizer::FromBytes(model, options.out_path).status());  // self-check
  return WriteFileAtomic(options.out_path, model);
}

}  // namespace oryx
