// Choosing and making task examples: one dispatcher over the task kinds, the evaluation grid
// (lengths x depths x seeds), and the training mixer that turns a seeded fraction of the training
// sequences into task sequences (needle kinds packed several to a sequence).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tasks/copy.h"
#include "tasks/haystack.h"
#include "tasks/mqar.h"
#include "tasks/niah.h"
#include "tasks/task_example.h"

namespace oryx::tasks {

// Everything needed to make any kind of example.
struct TaskConfigs {
  TaskVocab vocab;
  MqarConfig mqar;
  NiahConfig niah_single;    // num_needles is forced to 1
  NiahConfig niah_multikey;  // num_needles must be >= 2
  PasskeyConfig passkey;
  CopyConfig copy;
};

// Makes one example of `kind`. `haystack` may be null for MQAR; the needle tasks need it and a depth in
// [0, 1] (MQAR ignores depth). Errors: those of the generators, and InvalidArgument for a missing
// haystack or depth.
absl::StatusOr<TaskExample> MakeExample(TaskKind kind, const TaskConfigs& configs,
                                        const HaystackSource* haystack, int32_t length,
                                        std::optional<double> depth, uint64_t seed);

// One evaluation point.
struct EvalPoint {
  int32_t length = 0;
  std::optional<double> depth;  // none when the grid has no depths (MQAR)
  int32_t seed_index = 0;       // 0 .. num_seeds - 1
  uint64_t seed = 0;            // MixSeed of (base_seed, length, depth, seed_index): every point differs
};

// The grid lengths x depths x seeds, in that nesting order (lengths outermost). An empty `depths` gives
// points without depth. Seeds differ between points, so examples at different depths or lengths are
// independent draws (keys, values and haystack offset all change). InvalidArgument for lengths < 1, depths
// outside [0, 1] or num_seeds < 1.
absl::StatusOr<std::vector<EvalPoint>> EvalGrid(std::span<const int32_t> lengths,
                                                std::span<const double> depths, int32_t num_seeds,
                                                uint64_t base_seed);

// Relative weights of the task kinds, in the order of TaskKind (mqar, niah_single, niah_multikey, passkey, copy).
using TaskWeights = std::array<double, 5>;

// How the trainer mixes tasks into its data.
struct TaskMixConfig {
  double task_fraction = 0.0;  // p: the share of training sequences that are task sequences, in [0, 1]
  uint64_t seed = 0;
  // Relative weights of the kinds in the order of TaskKind (mqar, niah_single, niah_multikey, passkey,
  // copy); non-negative, at least one positive (when task_fraction > 0).
  TaskWeights weights = {1.0, 1.0, 1.0, 0.0, 0.0};
  // MQAR pairs per sequence, uniform in [min, max] and then capped by what the length and the key/value
  // ranges allow (configs.mqar.num_pairs is ignored).
  int32_t mqar_min_pairs = 4;
  int32_t mqar_max_pairs = 64;
  // Needle-kind sequences (niah_single, niah_multikey, passkey, copy) are packed: independent examples of lengths
  // uniform in [needle_min_length, needle_max_length] back to back, the last one taking the rest (so it has
  // between needle_min_length and needle_max_length + needle_min_length - 1 tokens). One example per
  // sequence would carry a handful of answer tokens in thousands; packing gives several. The longest
  // example bounds the needle distances trained on, and attention mode does not retrieve much beyond them
  // (docs/RESULTS.md). needle_max_length 0: one example fills the sequence.
  int32_t needle_min_length = 96;
  int32_t needle_max_length = 1024;
  // Draw the packed examples' lengths log-uniformly in [needle_min_length, needle_max_length] instead of
  // uniformly: with a range as wide as a 16K context, short examples (many answers per sequence) and long
  // ones (needles far from their question) then both get their share.
  bool needle_length_log_uniform = false;
  // The share of MQAR sequences whose queries are spread uniformly over the whole sequence (power_a 1)
  // rather than crowded near the pairs (configs.mqar.power_a): long gaps between a pair and its query.
  double mqar_spread_fraction = 0.0;
  TaskConfigs configs;
};

// Applies "kind=weight,kind=weight,..." (kinds by their TaskKind names, e.g. "niah_single=2,copy=1") to
// `weights`; kinds not named keep their weight. InvalidArgument naming the bad entry: an unknown kind, a
// weight that is not a finite number >= 0, or an entry without '='.
absl::Status ApplyTaskWeights(std::string_view spec, TaskWeights& weights);

// Decides, deterministically from (seed, index), which training sequences are task sequences and makes
// them. Needle depths are uniform in [0, 1]. Immutable after Create(); const methods are thread-safe when
// the haystack source is. The haystack (not owned) must outlive the mixer.
class TaskMixer {
 public:
  // Validates the config (and every config of a kind with positive weight; with packing, also that
  // needle_min_length fits each needle kind with positive weight). `haystack` may be null only when the
  // needle kinds all have weight 0.
  static absl::StatusOr<TaskMixer> Create(TaskMixConfig config, const HaystackSource* haystack);

  // True for a task sequence: an independent Bernoulli(task_fraction) draw per index.
  bool IsTaskSequence(int64_t index) const;
  // The kind a task sequence at `index` gets (meaningful when IsTaskSequence(index)).
  TaskKind KindFor(int64_t index) const;
  // The task sequence `index`, exactly `length` tokens, with its answer-only loss mask: one MQAR example,
  // or needle examples packed as the config says (each starting with BOS and ending with EOS; the
  // answers, masks and ids concatenated; kind, prompt_length, depth, needle_position and num_needles
  // are those of the first example, seed the sequence's). It does not check IsTaskSequence(index).
  // Errors: a length too short for the chosen kind.
  absl::StatusOr<TaskExample> MakeTaskSequence(int64_t index, int32_t length) const;

  const TaskMixConfig& config() const { return config_; }

 private:
  TaskMixer(TaskMixConfig config, const HaystackSource* haystack)
      : config_(std::move(config)), haystack_(haystack) {}

  TaskMixConfig config_;
  const HaystackSource* haystack_;  // not owned; may be null
};

}  // namespace oryx::tasks
