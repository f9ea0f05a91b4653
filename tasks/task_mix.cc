// The kind dispatcher, the evaluation grid and the training task mixer.
#include "tasks/task_mix.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

#include "base/rng.h"
#include "base/str_cat.h"

namespace oryx::tasks {
namespace {

// Salts that keep the mixer's independent decisions independent.
constexpr uint64_t kSaltSelect = 1;
constexpr uint64_t kSaltKind = 2;
constexpr uint64_t kSaltParams = 3;
constexpr uint64_t kSaltExample = 4;
constexpr uint64_t kNoDepth = ~0ULL;

constexpr std::array<TaskKind, std::tuple_size_v<TaskWeights>> kKinds = {TaskKind::kMqar, TaskKind::kNiahSingle, TaskKind::kNiahMultiKey,
                                            TaskKind::kPasskey, TaskKind::kCopy};

absl::Status NeedDepth(TaskKind kind, const HaystackSource* haystack, std::optional<double> depth) {
  if (haystack == nullptr) {
    return absl::InvalidArgumentError(Cat(TaskKindName(kind), " needs a haystack source"));
  }
  if (!depth) return absl::InvalidArgumentError(Cat(TaskKindName(kind), " needs a depth"));
  return absl::OkStatus();
}

NiahConfig SingleNeedle(NiahConfig config) {
  config.num_needles = 1;
  return config;
}

absl::Status ValidateKind(TaskKind kind, const TaskConfigs& c) {
  switch (kind) {
    case TaskKind::kMqar:
      return ValidateMqarConfig(c.vocab, c.mqar);
    case TaskKind::kNiahSingle:
      return ValidateNiahConfig(c.vocab, SingleNeedle(c.niah_single));
    case TaskKind::kNiahMultiKey:
      if (c.niah_multikey.num_needles < 2) {
        return absl::InvalidArgumentError(
            Cat("niah_multikey: num_needles ", c.niah_multikey.num_needles, " < 2"));
      }
      return ValidateNiahConfig(c.vocab, c.niah_multikey);
    case TaskKind::kPasskey:
      return ValidatePasskeyConfig(c.vocab, c.passkey);
    case TaskKind::kCopy:
      return ValidateCopyConfig(c.vocab, c.copy);
  }
  return absl::InvalidArgumentError("unknown task kind");
}

// The shortest example of a needle kind that fits at every depth: distractor needles need a needle's
// length of haystack text to move around the asked one.
int32_t NeedleMinLength(TaskKind kind, const TaskConfigs& c) {
  switch (kind) {
    case TaskKind::kNiahSingle:
      return NiahMinLength(SingleNeedle(c.niah_single));
    case TaskKind::kNiahMultiKey:
      return NiahMinLength(c.niah_multikey) + c.niah_multikey.key_length + c.niah_multikey.value_length + 3;
    case TaskKind::kPasskey:
      return PasskeyMinLength(c.passkey);
    case TaskKind::kCopy:
      return CopyMinLength(c.copy);
    case TaskKind::kMqar:
      break;
  }
  return 0;
}

// Uniform on [0, 1] inclusive, in steps of 2^-20.
double DrawDepth(Rng& rng) { return static_cast<double>(rng.UniformInt((1 << 20) + 1)) / (1 << 20); }

// A length in [lo, hi] whose logarithm is uniform.
int32_t LogUniformLength(Rng& rng, int32_t lo, int32_t hi) {
  const double log_lo = std::log(static_cast<double>(lo)), log_hi = std::log(hi + 1.0);
  const double x = std::exp(log_lo + rng.UniformDouble() * (log_hi - log_lo));
  return std::clamp(static_cast<int32_t>(x), lo, hi);
}

// Appends `part` to `packed`, shifting its answer spans; the first part also gives the metadata.
void AppendExample(const TaskExample& part, TaskExample& packed) {
  const int32_t offset = packed.length();
  if (offset == 0) {
    packed.prompt_length = part.prompt_length;
    packed.depth = part.depth;
    packed.needle_position = part.needle_position;
    packed.num_needles = part.num_needles;
  }
  packed.ids.insert(packed.ids.end(), part.ids.begin(), part.ids.end());
  packed.loss_mask.insert(packed.loss_mask.end(), part.loss_mask.begin(), part.loss_mask.end());
  for (const AnswerSpan& a : part.answers) packed.answers.push_back({a.begin + offset, a.length});
}

}  // namespace

absl::StatusOr<TaskExample> MakeExample(TaskKind kind, const TaskConfigs& configs,
                                        const HaystackSource* haystack, int32_t length,
                                        std::optional<double> depth, uint64_t seed) {
  if (kind == TaskKind::kMqar) return MakeMqarExample(configs.vocab, configs.mqar, length, seed);
  if (absl::Status s = NeedDepth(kind, haystack, depth); !s.ok()) return s;
  if (absl::Status s = ValidateKind(kind, configs); !s.ok()) return s;
  switch (kind) {
    case TaskKind::kNiahSingle:
      return MakeNiahExample(configs.vocab, SingleNeedle(configs.niah_single), *haystack, length, *depth,
                             seed);
    case TaskKind::kNiahMultiKey:
      return MakeNiahExample(configs.vocab, configs.niah_multikey, *haystack, length, *depth, seed);
    case TaskKind::kPasskey:
      return MakePasskeyExample(configs.vocab, configs.passkey, *haystack, length, *depth, seed);
    case TaskKind::kCopy:
      return MakeCopyExample(configs.vocab, configs.copy, *haystack, length, *depth, seed);
    case TaskKind::kMqar:
      break;
  }
  return absl::InvalidArgumentError("unknown task kind");
}

absl::StatusOr<std::vector<EvalPoint>> EvalGrid(std::span<const int32_t> lengths,
                                                std::span<const double> depths, int32_t num_seeds,
                                                uint64_t base_seed) {
  if (num_seeds < 1) return absl::InvalidArgumentError(Cat("eval grid: num_seeds ", num_seeds, " < 1"));
  for (int32_t length : lengths) {
    if (length < 1) return absl::InvalidArgumentError(Cat("eval grid: length ", length, " < 1"));
  }
  for (double depth : depths) {
    if (!(depth >= 0.0 && depth <= 1.0)) {
      return absl::InvalidArgumentError(Cat("eval grid: depth ", depth, " outside [0, 1]"));
    }
  }
  std::vector<std::optional<double>> depth_axis(depths.begin(), depths.end());
  if (depth_axis.empty()) depth_axis.push_back(std::nullopt);
  std::vector<EvalPoint> out;
  for (int32_t length : lengths) {
    for (const std::optional<double>& depth : depth_axis) {
      for (int32_t s = 0; s < num_seeds; ++s) {
        const uint64_t depth_word = depth ? std::bit_cast<uint64_t>(*depth) : kNoDepth;
        out.push_back(
            {length, depth, s,
             MixSeed({base_seed, static_cast<uint64_t>(length), depth_word, static_cast<uint64_t>(s)})});
      }
    }
  }
  return out;
}

absl::StatusOr<TaskMixer> TaskMixer::Create(TaskMixConfig config, const HaystackSource* haystack) {
  if (!(config.task_fraction >= 0.0 && config.task_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        Cat("task mix: task_fraction ", config.task_fraction, " outside [0, 1]"));
  }
  double total = 0;
  for (double w : config.weights) {
    if (!(w >= 0.0 && std::isfinite(w))) {
      return absl::InvalidArgumentError(Cat("task mix: weight ", w, " is negative or not finite"));
    }
    total += w;
  }
  if (config.task_fraction > 0 && total <= 0) {
    return absl::InvalidArgumentError("task mix: every task weight is 0 but task_fraction > 0");
  }
  if (!(config.mqar_spread_fraction >= 0.0 && config.mqar_spread_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        Cat("task mix: mqar_spread_fraction ", config.mqar_spread_fraction, " outside [0, 1]"));
  }
  if (config.mqar_min_pairs < 1 || config.mqar_max_pairs < config.mqar_min_pairs) {
    return absl::InvalidArgumentError(Cat("task mix: mqar pairs range [", config.mqar_min_pairs, ", ",
                                             config.mqar_max_pairs, "] is empty or starts below 1"));
  }
  if (config.needle_max_length < 0 ||
      (config.needle_max_length > 0 &&
       (config.needle_min_length < 1 || config.needle_max_length < config.needle_min_length))) {
    return absl::InvalidArgumentError(Cat("task mix: needle length range [", config.needle_min_length, ", ",
                                          config.needle_max_length, "] is empty or starts below 1"));
  }
  for (size_t i = 0; i < kKinds.size(); ++i) {
    if (config.weights[i] <= 0) continue;
    if (TaskUsesHaystack(kKinds[i]) && haystack == nullptr) {
      return absl::InvalidArgumentError(
          Cat("task mix: ", TaskKindName(kKinds[i]), " has weight > 0 but there is no haystack source"));
    }
    TaskConfigs probe = config.configs;
    probe.mqar.num_pairs = config.mqar_min_pairs;
    if (absl::Status s = ValidateKind(kKinds[i], probe); !s.ok()) return s;
    const int32_t min_length = NeedleMinLength(kKinds[i], config.configs);
    if (config.needle_max_length != 0 && config.needle_min_length < min_length) {
      return absl::InvalidArgumentError(Cat("task mix: needle_min_length ", config.needle_min_length, " < ",
                                            min_length, ", the shortest ", TaskKindName(kKinds[i]),
                                            " example that fits at every depth"));
    }
  }
  return TaskMixer(std::move(config), haystack);
}

absl::Status ApplyTaskWeights(std::string_view spec, TaskWeights& weights) {
  TaskWeights out = weights;
  // (absl::string_view is not std::string_view in every Abseil build: convert at the edges.)
  for (absl::string_view entry : absl::StrSplit(absl::string_view(spec.data(), spec.size()), ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    if (entry.find('=') == absl::string_view::npos) {
      return absl::InvalidArgumentError(Cat("task weights: '", entry, "' is not kind=weight"));
    }
    absl::StatusOr<TaskKind> kind = ParseTaskKind(std::string_view(kv.first.data(), kv.first.size()));
    if (!kind.ok()) return absl::InvalidArgumentError(Cat("task weights: ", kind.status().message()));
    double w = 0;
    if (!absl::SimpleAtod(kv.second, &w) || !(w >= 0.0 && std::isfinite(w))) {
      return absl::InvalidArgumentError(Cat("task weights: '", entry, "': the weight must be a number >= 0"));
    }
    out[static_cast<size_t>(*kind)] = w;
  }
  weights = out;
  return absl::OkStatus();
}

bool TaskMixer::IsTaskSequence(int64_t index) const {
  Rng rng(MixSeed({config_.seed, static_cast<uint64_t>(index), kSaltSelect}));
  return rng.UniformDouble() < config_.task_fraction;
}

TaskKind TaskMixer::KindFor(int64_t index) const {
  double total = 0;
  for (double w : config_.weights) total += w;
  Rng rng(MixSeed({config_.seed, static_cast<uint64_t>(index), kSaltKind}));
  const double x = rng.UniformDouble() * total;
  double cumulative = 0;
  for (size_t i = 0; i < kKinds.size(); ++i) {
    cumulative += config_.weights[i];
    if (config_.weights[i] > 0 && x < cumulative) return kKinds[i];
  }
  for (size_t i = kKinds.size(); i-- > 0;) {  // rounding at the top end: the last kind with weight
    if (config_.weights[i] > 0) return kKinds[i];
  }
  return TaskKind::kMqar;
}

absl::StatusOr<TaskExample> TaskMixer::MakeTaskSequence(int64_t index, int32_t length) const {
  const TaskKind kind = KindFor(index);
  Rng params(MixSeed({config_.seed, static_cast<uint64_t>(index), kSaltParams}));
  const uint64_t seed = MixSeed({config_.seed, static_cast<uint64_t>(index), kSaltExample});
  TaskConfigs configs = config_.configs;
  if (kind == TaskKind::kMqar) {
    const int32_t cap =
        std::min({MqarMaxPairs(length), configs.mqar.key_range.size(), configs.mqar.value_range.size()});
    if (cap < 1) {
      return absl::InvalidArgumentError(Cat("task mix: mqar needs at least 5 tokens, got ", length));
    }
    const int32_t pairs =
        static_cast<int32_t>(params.UniformRange(config_.mqar_min_pairs, config_.mqar_max_pairs));
    configs.mqar.num_pairs = std::min(pairs, cap);
    if (config_.mqar_spread_fraction > 0 && params.UniformDouble() < config_.mqar_spread_fraction) {
      configs.mqar.power_a = 1.0;  // every slot equally likely: queries anywhere up to the end
    }
    return MakeExample(kind, configs, haystack_, length, std::nullopt, seed);
  }
  if (config_.needle_max_length == 0) {
    return MakeExample(kind, configs, haystack_, length, DrawDepth(params), seed);
  }
  if (length < 1) return absl::InvalidArgumentError(Cat("task mix: length ", length, " < 1"));
  TaskExample packed;
  packed.kind = kind;
  packed.seed = seed;
  for (uint64_t part = 0; packed.length() < length; ++part) {
    const int32_t left = length - packed.length();
    int32_t n = config_.needle_length_log_uniform
                    ? LogUniformLength(params, config_.needle_min_length, config_.needle_max_length)
                    : static_cast<int32_t>(params.UniformRange(config_.needle_min_length, config_.needle_max_length));
    if (left - n < config_.needle_min_length) n = left;  // the last example takes the rest
    const double depth = DrawDepth(params);
    absl::StatusOr<TaskExample> example =
        MakeExample(kind, configs, haystack_, n, depth,
                    MixSeed({config_.seed, static_cast<uint64_t>(index), kSaltExample, part}));
    if (!example.ok()) return example.status();
    AppendExample(*example, packed);
  }
  return packed;
}

}  // namespace oryx::tasks
