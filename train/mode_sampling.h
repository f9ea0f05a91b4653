// The per-token mode schedules of training and evaluation (DESIGN.md §3): fragments of tokens, each in
// attention mode with a given probability, or one mode per sequence (the ablation). Plain C++.
#pragma once

#include <cstdint>
#include <vector>

namespace oryx::train {

enum class ModeMixing { kFragment, kSequence };

// Per-token modes (1 = attention, 0 = linear) of sample `sequence`: fragments of `fragment_len` tokens,
// each in attention mode with probability `attn_fraction` (one draw for the whole sequence under
// kSequence). A pure function of its arguments, so training replays exactly and evaluation can draw the
// same kind of schedule.
std::vector<uint8_t> SampleModes(uint64_t seed, int64_t sequence, int64_t len, int64_t fragment_len,
                                 double attn_fraction, ModeMixing mixing);

}  // namespace oryx::train
