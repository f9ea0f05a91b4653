// Evaluation of a trained model (DESIGN.md §8): perplexity under mode schedules with per-position losses,
// synthetic-task accuracy under routing policies, and the mode agreement that decides self-speculation.
// Perplexity and tasks run on any SequenceModel: the CPU engine (no LibTorch) or the LibTorch reference,
// with the same JSON. LibTorch-free header.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "nlohmann/json.hpp"

namespace oryx::train {

// What perplexity and task evaluation run: the logits [T, V] of a whole sequence under per-token modes
// (1 = attention), from a fresh state.
class SequenceModel {
 public:
  virtual ~SequenceModel() = default;
  virtual const ModelConfig& config() const = 0;
  // The logits [T - first_row, V] of rows first_row .. T-1 of the sequence run in the given modes (1 =
  // attention). The rows before first_row are run but their logits not computed: task scoring needs only
  // the rows that predict answers, and the LM head is a large share of a small model's forward.
  virtual absl::StatusOr<std::vector<float>> Logits(std::span<const int32_t> ids, std::span<const uint8_t> modes,
                                                    int64_t first_row = 0) = 0;
};

struct EvalCommon {
  std::string model_dir;
  std::string backend = "engine";  // engine (the engine's backends) | libtorch (the reference model)
  std::string device = "auto";     // auto | cpu | cuda (auto: the engine's cpu, LibTorch's choice)
  int threads = 0;
  std::string kv_dtype;  // engine only: the KV cache's element type (BackendOptions::kv_dtype; "": the backend's)
  std::string weights = "f32";  // engine only: the projections' format (BackendOptions::weights)
  uint64_t seed = 1;
};

// The engine's backend on common.device as a SequenceModel.
absl::StatusOr<std::unique_ptr<SequenceModel>> OpenEngineModel(const EvalCommon& common);
// The LibTorch reference as a SequenceModel (defined in the LibTorch build only).
absl::StatusOr<std::unique_ptr<SequenceModel>> OpenTorchModel(const EvalCommon& common);

// Perplexity under mode schedules named as ScheduleModes takes them (train/mode_sampling.h: attention, linear,
// mixed[:F], lin-to-attn:P, attn-to-lin:P), sequence i of the evaluation drawing mixed schedules as sample i.
struct PplOptions {
  EvalCommon common;
  std::string data_dir;  // corpus (validation split), unless
  std::vector<std::string> text_files;  // text files to measure instead (no corpus needed)
  std::vector<std::string> schedules = {"attention", "linear", "mixed"};
  int64_t seq_len = 0;      // 0: the model's max_position, capped at 2048
  int64_t sequences = 32;   // evenly spread over the validation split
  bool per_position = true;
};
absl::StatusOr<nlohmann::json> EvalPerplexity(const PplOptions& options, SequenceModel& model);

// Task policies (per example; the prompt is everything before the first answer token):
//   attention | linear    every token in that mode
//   prefill-linear        the prompt in linear mode except its last token, which (like every generated
//                         token) runs in attention mode: "linear prefill, attention generation"
struct TaskEvalOptions {
  EvalCommon common;
  std::string data_dir;     // corpus: haystack text comes from its validation split, unless
  std::vector<std::string> haystack_files;  // text files to take the haystack from instead (no corpus needed)
  std::string task = "niah";  // niah | niah-multikey | passkey | mqar
  std::vector<std::string> policies = {"attention", "linear", "prefill-linear"};
  std::vector<int32_t> lengths = {256, 512, 1024, 2048};
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};  // ignored by mqar
  int32_t seeds = 8;
  int32_t mqar_pairs = 16;
  int32_t multikey_needles = 4;  // niah-multikey: the asked needle and its distractors
  int32_t copy_cue_length = 16, copy_answer_length = 32;  // copy: tokens of the repeat given, and to continue
};
absl::StatusOr<nlohmann::json> EvalTask(const TaskEvalOptions& options, SequenceModel& model);

// Greedy self-speculation on held-out text: attention-mode prefill of a prompt, then rounds of k
// linear-mode drafts verified by attention mode, until gen_tokens are produced (LibTorch reference;
// the engine's measurement is `oryx bench spec`).
struct AgreementOptions {
  EvalCommon common;
  std::string data_dir;
  int64_t k = 4;
  int64_t prompts = 16;
  int64_t prompt_tokens = 256;
  int64_t gen_tokens = 128;
};
absl::StatusOr<nlohmann::json> EvalAgreement(const AgreementOptions& options);

}  // namespace oryx::train
