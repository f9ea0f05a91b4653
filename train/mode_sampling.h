// The per-token mode schedules of training and evaluation (DESIGN.md §3): fragments of tokens, each in
// attention mode with a given probability, or one mode per sequence (the ablation); and the named schedules
// that perplexity is measured under (DESIGN.md §8). Plain C++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"

namespace oryx::train {

enum class ModeMixing { kFragment, kSequence };

// Per-token modes (1 = attention, 0 = linear) of sample `sequence`: fragments of `fragment_len` tokens,
// each in attention mode with probability `attn_fraction` (one draw for the whole sequence under
// kSequence). A pure function of its arguments, so training replays exactly and evaluation can draw the
// same kind of schedule.
std::vector<uint8_t> SampleModes(uint64_t seed, int64_t sequence, int64_t len, int64_t fragment_len,
                                 double attn_fraction, ModeMixing mixing);

// Per-token modes (1 = attention) of a named schedule over `len` tokens, as `oryx eval ppl --schedules` and
// the Python module's score take them:
//   attention | linear              every token in that mode
//   mixed[:F]                       fragments of the model's fragment_len, each attention with probability F
//                                   (default: the model's attn_fraction), drawn by SampleModes(seed, sequence)
//   lin-to-attn:P | attn-to-lin:P   one switch at position P
// InvalidArgument naming the schedule for anything else.
absl::StatusOr<std::vector<uint8_t>> ScheduleModes(const std::string& name, int64_t len, const ModelConfig& c,
                                                   uint64_t seed, int64_t sequence);

}  // namespace oryx::train
