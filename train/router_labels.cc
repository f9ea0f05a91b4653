#include "train/router_labels.h"

#include <algorithm>
#include <optional>
#include <vector>

namespace oryx::policies {

std::map<int64_t, double> DecodeLabelWeights(std::span<const AnswerDecoding> decodings, size_t best) {
  const AnswerDecoding& b = decodings[best];
  auto differs = [&](const AnswerDecoding& d, int64_t position, Mode mode) {
    const auto it = d.modes.find(position);
    return it != d.modes.end() && it->second != mode;
  };
  // Each other decoding's regret per position where it chose otherwise.
  std::vector<std::optional<double>> regret(decodings.size());
  for (size_t v = 0; v < decodings.size(); ++v) {
    if (v == best) continue;
    int64_t n = 0;
    for (const auto& [position, mode] : b.modes) n += differs(decodings[v], position, mode);
    if (n > 0) regret[v] = (b.reward - decodings[v].reward) / static_cast<double>(n);
  }
  std::map<int64_t, double> weights;
  for (const auto& [position, mode] : b.modes) {
    for (size_t v = 0; v < decodings.size(); ++v) {
      if (!regret[v] || !differs(decodings[v], position, mode)) continue;
      const auto [it, fresh] = weights.emplace(position, *regret[v]);
      if (!fresh) it->second = std::min(it->second, *regret[v]);
    }
  }
  return weights;
}

}  // namespace oryx::policies
