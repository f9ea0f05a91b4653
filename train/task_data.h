// Glue between the corpus, the tokenizer and the synthetic tasks: task token ids and ranges for a
// tokenizer, and a haystack of real corpus text. Shared by the trainer and the evaluation.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer.h"
#include "tasks/haystack.h"
#include "tasks/task_mix.h"
#include "train/shards.h"

namespace oryx::train {

// Task configs for the Oryx tokenizer: markers from its task tokens; MQAR keys and values in disjoint
// halves of the ordinary vocabulary (above the special and byte-fallback ids); passkey digits when every
// digit is one token (else the passkey kind is unavailable and `has_digits` is false).
struct TaskSetup {
  tasks::TaskConfigs configs;
  bool has_digits = false;
};
absl::StatusOr<TaskSetup> MakeTaskSetup(const Tokenizer& tokenizer);

// Haystack text from one split of a corpus: `n` consecutive tokens at a seeded offset, with special ids
// (BOS/EOS between documents) replaced by newlines so that the needle generators accept the text.
class CorpusHaystack : public tasks::HaystackSource {
 public:
  explicit CorpusHaystack(const CorpusReader* reader) : reader_(reader) {}
  explicit CorpusHaystack(CorpusReader reader) : owned_(std::move(reader)), reader_(&*owned_) {}
  CorpusHaystack(const CorpusHaystack&) = delete;
  CorpusHaystack& operator=(const CorpusHaystack&) = delete;
  absl::StatusOr<std::vector<int32_t>> Tokens(int64_t n, uint64_t seed) const override;

 private:
  std::optional<CorpusReader> owned_;
  const CorpusReader* reader_;  // owned_ or the caller's
};

// Haystack text from plain text files, tokenised once: `n` consecutive tokens at a seeded offset of their
// concatenation (special ids replaced as above). For evaluating where no corpus is at hand.
class TextHaystack : public tasks::HaystackSource {
 public:
  static absl::StatusOr<TextHaystack> Load(const std::vector<std::string>& files, const Tokenizer& tokenizer);
  absl::StatusOr<std::vector<int32_t>> Tokens(int64_t n, uint64_t seed) const override;
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  std::vector<int32_t> tokens_;
};

// The haystack the commands take: the text files when there are any, else the corpus's `split`.
absl::StatusOr<std::unique_ptr<tasks::HaystackSource>> OpenHaystack(const std::vector<std::string>& text_files,
                                                                    const std::string& corpus_dir,
                                                                    const std::string& split,
                                                                    const Tokenizer& tokenizer);

// A task as the commands name it: niah, niah-multikey, passkey, mqar, copy (or the TaskKind names).
absl::StatusOr<tasks::TaskKind> ParseTaskName(std::string_view name);

}  // namespace oryx::train
