#include "train/mode_sampling.h"

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

}  // namespace oryx::train
