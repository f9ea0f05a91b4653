#include "policies/task_episodes.h"

#include <algorithm>

#include "base/status_macros.h"
#include "base/str_cat.h"

namespace oryx::policies {

absl::StatusOr<std::vector<AnswerScore>> ScoreTeacherForced(Backend& backend,
                                                            std::span<const tasks::TaskExample* const> examples,
                                                            std::span<const std::vector<Mode>> modes) {
  const int64_t V = backend.config().vocab_size;
  std::vector<AnswerScore> scores(examples.size());
  constexpr size_t kGroup = 8;
  for (size_t begin = 0; begin < examples.size(); begin += kGroup) {
    const size_t end = std::min(examples.size(), begin + kGroup);
    std::vector<SequenceState> seqs;
    std::vector<std::span<const int32_t>> inputs;
    std::vector<std::vector<float>> logits(end - begin);
    for (size_t i = begin; i < end; ++i) {
      const std::vector<int32_t>& ids = examples[i]->ids;
      if (modes[i].size() + 1 != ids.size()) {
        return absl::InvalidArgumentError(Cat("example ", i, ": ", modes[i].size(), " modes for ", ids.size() - 1, " inputs"));
      }
      inputs.emplace_back(ids.data(), ids.size() - 1);
      ORYX_ASSIGN_OR_RETURN(SequenceState seq, backend.TryNewSequence());
      seqs.push_back(std::move(seq));
    }
    std::vector<ForwardItem> items;
    for (size_t j = 0; j < seqs.size(); ++j) {
      items.push_back({&seqs[j], inputs[j], modes[begin + j], LogitsRows::kAll, &logits[j], false});
    }
    ORYX_RETURN_IF_ERROR(backend.Forward(items));
    for (size_t j = 0; j < seqs.size(); ++j) {
      const tasks::TaskExample& ex = *examples[begin + j];
      AnswerScore& s = scores[begin + j];
      for (const tasks::AnswerSpan& a : ex.answers) {
        bool right = true;
        for (int32_t p = a.begin; p < a.begin + a.length; ++p) {
          const float* row = logits[j].data() + static_cast<size_t>(p - 1) * V;
          right = right && std::max_element(row, row + V) - row == ex.ids[p];
        }
        s.right += right;
        s.asked += 1;
      }
    }
  }
  return scores;
}

}  // namespace oryx::policies
