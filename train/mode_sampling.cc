#include "train/mode_sampling.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/rng.h"

namespace oryx::train {

namespace {
constexpr uint64_t kModeSalt = 0x6d6f6465;  // "mode": keeps mode draws independent of other seeded draws
}  // namespace

std::vector<uint8_t> SampleModes(uint64_t seed, int64_t sequence, int64_t len, int64_t fragment_len,
                                 double attn_fraction, ModeMixing mixing) {
  std::vector<uint8_t> modes(len);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t fragment = mixing == ModeMixing::kSequence ? 0 : t / fragment_len;
    const uint64_t draw = MixSeed({seed, kModeSalt, static_cast<uint64_t>(sequence), static_cast<uint64_t>(fragment)});
    modes[t] = Rng(draw).UniformDouble() < attn_fraction;
  }
  return modes;
}

absl::StatusOr<std::vector<uint8_t>> ScheduleModes(const std::string& name, int64_t len, const ModelConfig& c,
                                                   uint64_t seed, int64_t sequence) {
  std::vector<uint8_t> m(len, 0);
  std::vector<std::string> parts = absl::StrSplit(name, absl::MaxSplits(':', 1));
  const std::string& kind = parts[0];
  double arg = 0;
  if (parts.size() == 2 && !absl::SimpleAtod(parts[1], &arg)) {
    return absl::InvalidArgumentError(absl::StrCat("schedule '", name, "': bad number '", parts[1], "'"));
  }
  if (kind == "attention" || kind == "linear") {
    if (parts.size() != 1) return absl::InvalidArgumentError(absl::StrCat("schedule '", name, "' takes no argument"));
    std::fill(m.begin(), m.end(), kind == "attention");
  } else if (kind == "mixed") {
    const double fraction = parts.size() == 2 ? arg : c.attn_fraction;
    if (fraction < 0 || fraction > 1) return absl::InvalidArgumentError("mixed:F needs F in [0, 1]");
    m = SampleModes(seed, sequence, len, c.fragment_len, fraction, ModeMixing::kFragment);
  } else if (kind == "lin-to-attn" || kind == "attn-to-lin") {
    if (parts.size() != 2 || arg < 0 || arg != std::floor(arg)) {
      return absl::InvalidArgumentError(absl::StrCat("schedule '", name, "' needs a position: ", kind, ":P"));
    }
    for (int64_t t = 0; t < len; ++t) m[t] = (t >= arg) == (kind == "lin-to-attn");
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown schedule '", name, "' (attention, linear, mixed[:F], lin-to-attn:P, attn-to-lin:P)"));
  }
  return m;
}

}  // namespace oryx::train
