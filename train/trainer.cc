// The fragmented mixed-mode trainer: data and modes are pure functions of (seed, step), so a resumed run
// replays the uninterrupted one exactly; checkpoints are directories swapped in whole.
#include "train/trainer.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"
#include "base/rng.h"
#include "tasks/task_mix.h"
#include "train/cuda_step.h"
#include "train/distributed.h"
#include "train/model.h"
#include "train/shards.h"
#include "train/task_data.h"
#include "train/torch_io.h"
#include "engine/json_text.h"

namespace oryx::train {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

constexpr int64_t kIgnore = -100;  // cross-entropy ignore_index

// bf16 autocast on CUDA for the forward pass; weights and optimizer state stay fp32.
class AutocastGuard {
 public:
  explicit AutocastGuard(bool on) : on_(on) {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCUDA, false);
  }

 private:
  bool on_;
};

struct Batch {
  torch::Tensor inputs;   // [B, T] int64
  torch::Tensor targets;  // [B, T] int64, kIgnore where no loss
  torch::Tensor is_attn;  // [B, T] bool
  OryxModelImpl::Modes modes;  // which modes occur in is_attn
  int64_t task_sequences = 0;
};

// Which modes a host copy of a batch's modes (1: attention) holds.
OryxModelImpl::Modes ModesOf(const std::vector<uint8_t>& modes) {
  return {.any_attn = std::find(modes.begin(), modes.end(), 1) != modes.end(),
          .any_lin = std::find(modes.begin(), modes.end(), 0) != modes.end()};
}

// Builds micro-batches: sample n reads a corpus window in shuffled order, or a task sequence when the mixer
// says so. Not thread-safe (it caches the current epoch's order).
class BatchMaker {
 public:
  BatchMaker(const TrainOptions& o, const CorpusReader& reader, const tasks::TaskMixer* mixer)
      : o_(o), reader_(reader), mixer_(mixer), windows_(reader.NumSequences(o.seq_len)) {}

  absl::StatusOr<Batch> Make(int64_t first_sample, int64_t count, torch::Device device) const {
    const int64_t T = o_.seq_len;
    std::vector<int64_t> inputs(count * T), targets(count * T);
    std::vector<uint8_t> modes(count * T);
    std::vector<int32_t> window(T + 1);
    int64_t tasks = 0;
    for (int64_t b = 0; b < count; ++b) {
      const int64_t n = first_sample + b;
      std::vector<uint8_t> loss_mask(T, 1);
      if (mixer_ != nullptr && mixer_->IsTaskSequence(n)) {
        ORYX_ASSIGN_OR_RETURN(tasks::TaskExample ex, mixer_->MakeTaskSequence(n, static_cast<int32_t>(T + 1)));
        std::copy(ex.ids.begin(), ex.ids.end(), window.begin());
        if (o_.answer_only_loss) {
          for (int64_t t = 0; t < T; ++t) loss_mask[t] = ex.loss_mask[t];
        }
        ++tasks;
      } else {
        ORYX_RETURN_IF_ERROR(reader_.ReadSequence(WindowOf(n), T, window.data()));
      }
      std::vector<uint8_t> m =
          SampleModes(o_.seed, n, T, o_.model.fragment_len, o_.model.attn_fraction, o_.mixing);
      for (int64_t t = 0; t < T; ++t) {
        inputs[b * T + t] = window[t];
        targets[b * T + t] = loss_mask[t] ? window[t + 1] : kIgnore;
        modes[b * T + t] = m[t];
      }
    }
    auto opts = torch::TensorOptions().dtype(torch::kInt64);
    Batch batch;
    // clone(): from_blob aliases the local vectors, and to(kCPU) would not copy.
    batch.inputs = torch::from_blob(inputs.data(), {count, T}, opts).clone().to(device);
    batch.targets = torch::from_blob(targets.data(), {count, T}, opts).clone().to(device);
    batch.is_attn = torch::from_blob(modes.data(), {count, T}, torch::kUInt8).to(torch::kBool).to(device);
    batch.modes = ModesOf(modes);
    batch.task_sequences = tasks;
    return batch;
  }

 private:
  // Sample n reads window order[n % windows] of epoch n / windows: a fresh shuffle every epoch.
  int64_t WindowOf(int64_t n) const {
    const int64_t epoch = n / windows_;
    if (epoch != order_epoch_) {
      order_ = ShuffledOrder(windows_, o_.seed, epoch);
      order_epoch_ = epoch;
    }
    return order_[n % windows_];
  }

  const TrainOptions& o_;
  const CorpusReader& reader_;
  const tasks::TaskMixer* mixer_;
  int64_t windows_;
  mutable std::vector<int64_t> order_;  // the shuffle of epoch order_epoch_
  mutable int64_t order_epoch_ = -1;
};

double LearningRate(const TrainOptions& o, int64_t step) {
  if (step < o.warmup_steps) return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  const double progress =
      std::min(1.0, static_cast<double>(step - o.warmup_steps) / std::max<int64_t>(1, o.steps - o.warmup_steps));
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

torch::Tensor Loss(OryxModel& model, const Batch& b, bool autocast) {
  AutocastGuard guard(autocast);
  auto logits = model->Forward(b.inputs, b.is_attn, b.modes);
  return torch::nn::functional::cross_entropy(
      logits.view({-1, logits.size(-1)}).to(torch::kFloat32), b.targets.view({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnore));
}

// Validation loss over evenly spread windows of the val split, in one mode pattern.
absl::StatusOr<double> ValidationLoss(OryxModel& model, const CorpusReader& val, const TrainOptions& o,
                                      const std::string& pattern, torch::Device device, bool autocast) {
  torch::NoGradGuard no_grad;
  const int64_t T = o.seq_len, windows = val.NumSequences(T);
  const int64_t n = std::min(o.eval_sequences, windows);
  if (n <= 0) return absl::FailedPreconditionError("the validation split is shorter than one sequence");
  std::vector<int32_t> window(T + 1);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    ORYX_RETURN_IF_ERROR(val.ReadSequence(i * windows / n, T, window.data()));
    std::vector<int64_t> ids(window.begin(), window.end());
    auto all = torch::from_blob(ids.data(), {1, T + 1}, torch::kInt64).clone().to(device);
    Batch b;
    b.inputs = all.narrow(1, 0, T);
    b.targets = all.narrow(1, 1, T);
    if (pattern == "mixed") {
      std::vector<uint8_t> m =
          SampleModes(o.seed ^ 0x76616c, i, T, o.model.fragment_len, o.model.attn_fraction, ModeMixing::kFragment);
      b.is_attn = torch::from_blob(m.data(), {1, T}, torch::kUInt8).to(torch::kBool).to(device);
      b.modes = ModesOf(m);
    } else {
      b.is_attn = torch::full({1, T}, pattern == "attention", torch::dtype(torch::kBool).device(device));
      b.modes = {.any_attn = pattern == "attention", .any_lin = pattern != "attention"};
    }
    total += Loss(model, b, autocast).item<double>();
  }
  return total / n;
}

std::string Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  return absl::StrFormat("%dm%02ds", s / 60, s % 60);
}

int64_t ParameterCount(OryxModel& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

// Training FLOPs per token: 6 x parameters for the matrix products (forward + backward) plus the
// attention scores and values (12 x layers x HD x T/2 on average over a causal sequence).
double FlopsPerToken(const ModelConfig& c, int64_t params, int64_t seq_len) {
  return 6.0 * params + 6.0 * c.n_layers * c.qk_dim() * seq_len;
}

// "key: checkpoint X, this run Y" for each field in which two configs differ, joined by "; ": the whole
// config twice would bury them. Optional fields are written only when set, so a field on either side alone
// differs too ("(none)" on the other).
std::string ConfigDifferences(const ModelConfig& checkpoint, const ModelConfig& run) {
  const Json was = Json::parse(ToJson(checkpoint)), asked = Json::parse(ToJson(run));
  const auto shown = [](const Json& config, const std::string& key) {
    return config.contains(key) ? config[key].dump() : std::string("(none)");
  };
  std::vector<std::string> keys, diffs;
  for (const auto& [key, value] : asked.items()) keys.push_back(key);
  for (const auto& [key, value] : was.items()) {
    if (!asked.contains(key)) keys.push_back(key);
  }
  for (const std::string& key : keys) {
    if (shown(was, key) != shown(asked, key)) {
      diffs.push_back(absl::StrCat(key, ": checkpoint ", shown(was, key), ", this run ", shown(asked, key)));
    }
  }
  return absl::StrJoin(diffs, "; ");
}

int WorldSize(const TrainOptions& o) { return o.dist.env ? o.dist.env->world_size : 1; }

Json TrainingIdentity(const TrainOptions& o) {
  Json mix = {{"needle_lengths", {o.needle_min_length, o.needle_max_length}},
              {"needle_log_uniform", o.needle_log_uniform}, {"multikey_needles", o.multikey_needles},
              {"mqar_max_pairs", o.mqar_max_pairs}, {"mqar_spread", o.mqar_spread}};
  // Options that came later enter only when set away from their defaults, so that older checkpoints resume.
  if (!o.task_weights.empty()) mix["task_weights"] = o.task_weights;
  if (o.copy_cue_length != 16 || o.copy_answer_length != 32) {
    mix["copy_lengths"] = {o.copy_cue_length, o.copy_answer_length};
  }
  // grad_accum counts a step's micro-batches over all ranks (--accum x ranks): the step's data and
  // arithmetic are the same for every split of them into ranks, so a checkpoint resumes on another count.
  return {{"seq_len", o.seq_len},
          {"batch_size", o.batch_size},
          {"grad_accum", o.grad_accum * WorldSize(o)},
          {"seed", o.seed},
          {"mixing", o.mixing == ModeMixing::kSequence ? "sequence" : "fragment"},
          {"task_fraction", o.task_fraction},
          {"answer_only_loss", o.answer_only_loss},
          {"task_mix", mix}};
}

// A Kineto profile of the host ops and, with cuda, the device's kernels, from construction to Save.
class TraceRecording {
 public:
  explicit TraceRecording(bool cuda) {
    namespace prof = torch::profiler::impl;
    std::set<prof::ActivityType> activities = {prof::ActivityType::CPU};
    if (cuda) activities.insert(prof::ActivityType::CUDA);
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  }
  ~TraceRecording() {
    if (saved_) return;
    try {
      torch::autograd::profiler::disableProfiler();  // a run that ended before the third step
    } catch (const c10::Error&) {
    }
  }
  TraceRecording(const TraceRecording&) = delete;
  TraceRecording& operator=(const TraceRecording&) = delete;

  absl::Status Save(const std::string& path) {
    saved_ = true;
    try {
      torch::autograd::profiler::disableProfiler()->save(path);
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("ORYX_PROFILE_TRACE ", path, ": ", e.what_without_backtrace()));
    }
    std::fprintf(stderr, "profile of 3 steps written to %s\n", path.c_str());
    return absl::OkStatus();
  }

 private:
  bool saved_ = false;
};

class Trainer {
 public:
  explicit Trainer(const TrainOptions& o) : o_(o), out_(o.out_dir) {}
  absl::Status Run();

 private:
  absl::Status Connect();
  absl::Status Setup();
  absl::Status AgreeToStart(const absl::Status& setup);
  struct StepTotals {
    double loss;
    OryxModelImpl::Modes modes;
    bool out_of_time;
  };
  StepTotals SumOverRanks(double loss, const torch::Tensor& device_loss, OryxModelImpl::Modes modes, bool late);
  absl::Status Finish(bool complete);
  absl::Status Resume();
  absl::Status InitFrom(const std::string& model_dir);
  absl::Status SaveCheckpoint(int64_t step);
  absl::Status Evaluate(int64_t step);
  void Log(const Json& line);

  TrainOptions o_;
  fs::path out_;
  torch::Device device_{torch::kCPU};
  bool autocast_ = false;
  std::optional<CorpusReader> train_, val_;
  std::optional<Tokenizer> tokenizer_;
  std::unique_ptr<CorpusHaystack> haystack_;
  std::optional<tasks::TaskMixer> mixer_;
  std::optional<OryxModel> model_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  // CUDA only: the fused optimizer over optimizer_'s state, and the graphed micro-batch.
  std::unique_ptr<FusedAdamW> fused_;
  std::unique_ptr<GraphedBackward> graphed_;
  OryxModelImpl::Modes graph_modes_;
  int64_t start_step_ = 0;
  Clock::time_point start_ = Clock::now();
  double elapsed_before_ = 0;  // wall seconds of earlier runs (resume)
  std::unique_ptr<std::ofstream> log_;
  // Data parallel: rank 0 alone (lead_) prints, evaluates and writes OUT; the gradients are buckets_'s views.
  int rank_ = 0, world_ = 1;
  bool lead_ = true;
  std::unique_ptr<DistGroup> group_;
  std::unique_ptr<GradientBuckets> buckets_;
};

// The device, and for a rank of a job: its GPU (cuda:LOCAL_RANK) or its share of the CPU cores, then the
// job's process group.
absl::Status Trainer::Connect() {
  ORYX_ASSIGN_OR_RETURN(device_, ParseDevice(o_.device));
  int threads = o_.threads;
  if (const std::optional<DistEnv>& env = o_.dist.env) {
    rank_ = env->rank;
    world_ = env->world_size;
    lead_ = rank_ == 0;
    ORYX_ASSIGN_OR_RETURN(DistBackend backend, ResolveDistBackend(o_.dist.backend, device_));
    if (device_.is_cuda()) {
      ORYX_RETURN_IF_ERROR(UseCudaDevice(env->local_rank));
      device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env->local_rank));
    } else if (threads == 0 && env->local_world_size > 0) {
      threads = std::max(1, torch::get_num_threads() / env->local_world_size);
    }
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.dist.timeout_s * 1000));
    ORYX_ASSIGN_OR_RETURN(group_, DistGroup::Connect(*env, backend, device_, timeout));
  }
  autocast_ = device_.is_cuda();
  // The chunked scans' products run in fp32 outside autocast: let cuBLAS use TF32 for them (10 mantissa
  // bits, more than the bf16 they had under autocast).
  if (device_.is_cuda()) at::globalContext().setFloat32MatmulPrecision("high");
  if (threads > 0) torch::set_num_threads(threads);
  return absl::OkStatus();
}

// Whether every rank is ready, at the same step: a rank that could not start stops the others here rather
// than leaving them in the first collective until the timeout. Then rank 0's weights go to all (they are
// equal already: one seed, or one checkpoint).
absl::Status Trainer::AgreeToStart(const absl::Status& setup) {
  const double step = static_cast<double>(start_step_);
  torch::Tensor flags = torch::tensor({setup.ok() ? 0.0 : 1.0, step, -step}, torch::kFloat64).to(device_);
  group_->AllReduce(flags, c10d::ReduceOp::MAX);
  flags = flags.cpu();
  if (!setup.ok()) return setup;
  if (flags[0].item<double>() > 0) return absl::AbortedError("another rank could not start (its error says why)");
  if (flags[1].item<double>() != -flags[2].item<double>()) {
    return absl::FailedPreconditionError(absl::StrCat("--resume: the ranks' checkpoints are at different steps (",
                                                      -flags[2].item<double>(), " to ", flags[1].item<double>(),
                                                      "): every rank must read the same OUT/checkpoint"));
  }
  torch::NoGradGuard no_grad;
  for (const torch::Tensor& p : (*model_)->parameters()) {
    torch::Tensor data = p.detach();
    group_->Broadcast(data, 0);
  }
  return absl::OkStatus();
}

// A step's totals over the ranks: the loss (each rank's is already scaled by 1 / ranks), which modes any
// rank ran, and whether any rank is out of time, so that all stop at the same step.
Trainer::StepTotals Trainer::SumOverRanks(double loss, const torch::Tensor& device_loss, OryxModelImpl::Modes modes,
                                          bool late) {
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  torch::Tensor local_loss =
      device_loss.defined() ? device_loss.to(torch::kFloat64).reshape({1}) : torch::full({1}, loss, f64).to(device_);
  torch::Tensor flags = torch::tensor({modes.any_attn ? 1.0 : 0.0, modes.any_lin ? 1.0 : 0.0, late ? 1.0 : 0.0}, f64);
  torch::Tensor totals = torch::cat({local_loss, flags.to(device_)});
  group_->AllReduce(totals, c10d::ReduceOp::SUM);
  totals = totals.cpu();
  const auto t = totals.accessor<double, 1>();
  return {.loss = t[0], .modes = {.any_attn = t[1] > 0, .any_lin = t[2] > 0}, .out_of_time = t[3] > 0};
}

// The end of a run (complete: all steps done): a rank of a job returns once every rank is here (rank 0's
// last checkpoint written), so that none tears its connections down under another.
absl::Status Trainer::Finish(bool complete) {
  if (group_) group_->Barrier(device_);
  if (lead_ && complete && o_.save) std::fprintf(stderr, "done: model in %s\n", (out_ / "model").c_str());
  return absl::OkStatus();
}

absl::Status Trainer::Setup() {
  ORYX_ASSIGN_OR_RETURN(CorpusReader train, CorpusReader::Open(o_.data_dir, "train"));
  ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(o_.data_dir, "val"));
  train_.emplace(std::move(train));
  val_.emplace(std::move(val));
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(train_->tokenizer_path()));
  tokenizer_.emplace(std::move(tok));

  ModelConfig& c = o_.model;
  c.vocab_size = tokenizer_->vocab_size();
  c.bos_id = tokenizer_->bos_id();
  c.eos_id = tokenizer_->eos_id();
  c.pad_id = tokenizer_->pad_id();
  if (c.max_position == 0) c.max_position = o_.seq_len;
  ORYX_RETURN_IF_ERROR(ValidateModelConfig(c, "model options"));
  if (o_.seq_len < 1 || o_.seq_len > c.max_position) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seq-len ", o_.seq_len, " must be in [1, max_position = ", c.max_position, "]"));
  }
  if (train_->NumSequences(o_.seq_len) < 1) {
    return absl::FailedPreconditionError(absl::StrCat(o_.data_dir, ": the train split holds ",
                                                      train_->num_tokens(), " tokens, fewer than one sequence"));
  }
  if (const Json& split = train_->manifest().json["splits"]["train"];
      !o_.allow_short_documents && split.contains("documents") && split["documents"].is_number_integer() &&
      split["documents"].get<int64_t>() > 0) {
    const int64_t documents = split["documents"].get<int64_t>();
    const int64_t mean = train_->num_tokens() / documents;
    if (2 * mean < o_.seq_len) {
      return absl::FailedPreconditionError(absl::StrCat(
          o_.data_dir, ": the train split's ", documents, " documents average ", mean, " tokens, less than half of ",
          "--seq-len ", o_.seq_len, ": most of every window would be unrelated text. Prepare the corpus with ",
          "longer documents (oryx data prepare --min-document-bytes, about 4 bytes a token), lower --seq-len, ",
          "or pass --allow-short-documents"));
    }
  }
  if (tasks::TaskWeights probe{}; !o_.task_weights.empty()) {
    ORYX_RETURN_IF_ERROR(tasks::ApplyTaskWeights(o_.task_weights, probe));  // a bad spec fails without tasks too
  }
  if (o_.task_fraction > 0) {
    ORYX_ASSIGN_OR_RETURN(TaskSetup setup, MakeTaskSetup(*tokenizer_));
    haystack_ = std::make_unique<CorpusHaystack>(&*train_);
    tasks::TaskMixConfig mix;
    mix.task_fraction = o_.task_fraction;
    mix.seed = o_.seed ^ 0x7461736b;
    mix.weights = {1.0, 1.0, 1.0, setup.has_digits ? 0.5 : 0.0, 0.0};
    ORYX_RETURN_IF_ERROR(tasks::ApplyTaskWeights(o_.task_weights, mix.weights));
    if (mix.weights[static_cast<size_t>(tasks::TaskKind::kPasskey)] > 0 && !setup.has_digits) {
      return absl::InvalidArgumentError("--task-weights: passkey needs a tokenizer whose digits are one token each");
    }
    mix.configs = setup.configs;
    mix.configs.niah_multikey.num_needles = static_cast<int32_t>(o_.multikey_needles);
    mix.configs.copy = {static_cast<int32_t>(o_.copy_cue_length), static_cast<int32_t>(o_.copy_answer_length)};
    mix.needle_min_length = static_cast<int32_t>(o_.needle_min_length);
    mix.needle_max_length = static_cast<int32_t>(o_.needle_max_length);
    mix.needle_length_log_uniform = o_.needle_log_uniform;
    mix.mqar_max_pairs = static_cast<int32_t>(o_.mqar_max_pairs);
    mix.mqar_spread_fraction = o_.mqar_spread;
    ORYX_ASSIGN_OR_RETURN(tasks::TaskMixer mixer, tasks::TaskMixer::Create(mix, haystack_.get()));
    mixer_.emplace(std::move(mixer));
  }

  model_.emplace(OryxModel(c, o_.seed));
  (*model_)->scan_chunk = o_.scan_chunk;
  (*model_)->to(device_);
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : (*model_)->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto adamw = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o_.lr).betas({o_.beta1, o_.beta2}).weight_decay(wd).eps(1e-8));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, adamw(o_.weight_decay));
  groups.emplace_back(no_decay, adamw(0.0));
  optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(o_.lr));

  std::error_code ec;
  if (lead_) fs::create_directories(out_, ec);
  if (ec) return absl::InternalError(absl::StrCat(out_.string(), ": cannot create: ", ec.message()));
  if (o_.resume && !o_.init_from.empty()) {
    return absl::InvalidArgumentError("--resume and --init-from exclude each other");
  }
  if (o_.resume) {
    ORYX_RETURN_IF_ERROR(Resume());
  } else if (lead_ && fs::exists(out_ / "checkpoint")) {
    return absl::FailedPreconditionError(absl::StrCat(
        (out_ / "checkpoint").string(), " exists: pass --resume to continue it, or choose another --out"));
  }
  if (!o_.init_from.empty()) ORYX_RETURN_IF_ERROR(InitFrom(o_.init_from));
  if (lead_) log_ = std::make_unique<std::ofstream>(out_ / "log.jsonl", std::ios::app);
  return absl::OkStatus();
}

absl::Status Trainer::InitFrom(const std::string& model_dir) {
  ORYX_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(model_dir));
  // A later stage may train with another attention share or fragment length, or raise RoPE's base or the
  // context (engine/config.h: WithStageFieldsOf); its exported config then holds this run's.
  if (!SameArchitecture(ckpt.config(), o_.model)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--init-from ", model_dir, ": a model of another config (",
                     ConfigDifferences(WithStageFieldsOf(ckpt.config(), o_.model), o_.model), ")"));
  }
  ORYX_RETURN_IF_ERROR(LoadWeights(ckpt, *model_));
  if (lead_) std::fprintf(stderr, "initialised from %s\n", model_dir.c_str());
  return absl::OkStatus();
}

absl::Status Trainer::Resume() {
  fs::path dir = out_ / "checkpoint";
  if (!fs::exists(dir) && fs::is_directory(out_)) {
    // A crash between the two renames of a swap leaves only the previous checkpoint, renamed.
    for (const auto& e : fs::directory_iterator(out_)) {
      if (e.path().filename().string().rfind("checkpoint.old.", 0) == 0) dir = e.path();
    }
  }
  if (!fs::exists(dir / "state.json")) {
    return absl::NotFoundError(absl::StrCat("--resume: no checkpoint in ", out_.string()));
  }
  ORYX_ASSIGN_OR_RETURN(std::string text, ReadFile((dir / "state.json").string()));
  Json state = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.contains("step") || !state.contains("config") || !state.contains("identity")) {
    return absl::DataLossError(absl::StrCat((dir / "state.json").string(), ": not a trainer state"));
  }
  ORYX_ASSIGN_OR_RETURN(ModelConfig saved, ParseModelConfig(state["config"].dump(), (dir / "state.json").string()));
  if (!(saved == o_.model)) {
    return absl::FailedPreconditionError(absl::StrCat("--resume: ", dir.string(), " holds a model of another config (",
                                                      ConfigDifferences(saved, o_.model), ")"));
  }
  if (state["identity"] != TrainingIdentity(o_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--resume: ", dir.string(), " was trained with ", JsonText(state["identity"]),
                     ", this run asks for ", JsonText(TrainingIdentity(o_)),
                     " (grad_accum counts the micro-batches of a step over all ranks: --accum x ranks)"));
  }
  ORYX_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint((dir / "model").string()));
  ORYX_RETURN_IF_ERROR(LoadWeights(ckpt, *model_));
  try {
    torch::load(*optimizer_, (dir / "optimizer.pt").string(), device_);
  } catch (const c10::Error& e) {
    return absl::DataLossError(absl::StrCat((dir / "optimizer.pt").string(), ": ", e.what_without_backtrace()));
  }
  start_step_ = state["step"].get<int64_t>();
  elapsed_before_ = state.value("elapsed_s", 0.0);
  if (lead_) std::fprintf(stderr, "resuming from %s at step %lld\n", dir.c_str(), static_cast<long long>(start_step_));
  return absl::OkStatus();
}

absl::Status Trainer::SaveCheckpoint(int64_t step) {
  const fs::path final_dir = out_ / "checkpoint";
  const fs::path tmp = out_ / absl::StrCat("checkpoint.tmp.", getpid());
  std::error_code ec;
  ORYX_RETURN_IF_ERROR(RemoveTree(tmp.string()));
  fs::create_directories(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat(tmp.string(), ": ", ec.message()));
  ORYX_RETURN_IF_ERROR(ExportCheckpoint(*model_, (tmp / "model").string(), train_->tokenizer_path()));
  try {
    torch::save(*optimizer_, (tmp / "optimizer.pt").string());
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat((tmp / "optimizer.pt").string(), ": ", e.what_without_backtrace()));
  }
  Json state = {{"step", step}, {"config", Json::parse(ToJson(o_.model))}, {"identity", TrainingIdentity(o_)},
                {"elapsed_s", elapsed_before_ + std::chrono::duration<double>(Clock::now() - start_).count()}};
  ORYX_RETURN_IF_ERROR(WriteFileAtomic((tmp / "state.json").string(), JsonText(state, 2)));
  // Swap: the old checkpoint is renamed aside, the new one renamed in, then the old one deleted.
  const fs::path old = out_ / absl::StrCat("checkpoint.old.", getpid());
  if (fs::exists(final_dir)) {
    fs::rename(final_dir, old, ec);
    if (ec) return absl::InternalError(absl::StrCat(final_dir.string(), ": cannot move aside: ", ec.message()));
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(tmp.string(), ": cannot rename into place: ", ec.message()));
  if (absl::Status s = RemoveTree(old.string()); !s.ok()) {
    std::fprintf(stderr, "warning: could not delete the previous checkpoint: %s\n", std::string(s.message()).c_str());
  }
  // The exported model, for the engine and evaluation.
  ORYX_RETURN_IF_ERROR(ExportCheckpoint(*model_, (out_ / "model").string(), train_->tokenizer_path(),
                                        o_.export_dtype, 15u << 20));
  Log({{"event", "checkpoint"}, {"step", step}});
  return absl::OkStatus();
}

absl::Status Trainer::Evaluate(int64_t step) {
  Json line = {{"event", "eval"}, {"step", step}};
  std::string text;
  for (const char* pattern : {"attention", "linear", "mixed"}) {
    ORYX_ASSIGN_OR_RETURN(double loss, ValidationLoss(*model_, *val_, o_, pattern, device_, autocast_));
    line[absl::StrCat("val_loss_", pattern)] = loss;
    absl::StrAppendFormat(&text, "  %s %.4f (ppl %.1f)", pattern, loss, std::exp(loss));
  }
  std::fprintf(stderr, "eval step %lld:%s\n", static_cast<long long>(step), text.c_str());
  Log(line);
  return absl::OkStatus();
}

void Trainer::Log(const Json& line) {
  if (log_) *log_ << JsonText(line) << std::endl;
}

absl::Status Trainer::Run() {
  ORYX_RETURN_IF_ERROR(Connect());
  if (group_) {
    ORYX_RETURN_IF_ERROR(AgreeToStart(Setup()));
  } else {
    ORYX_RETURN_IF_ERROR(Setup());
  }
  // On CUDA the run goes to one side stream (a CUDA graph is recorded on one), the gradients are allocated
  // once and zeroed in place (the graph adds into them), and the optimizer and clipping are multi-tensor
  // kernels.
  TrainingStream stream(device_);
  const bool cuda = device_.is_cuda();
  const std::vector<torch::Tensor> params = (*model_)->parameters();
  std::vector<torch::Tensor> grads;
  std::unordered_set<const void*> attention_only, linear_only;
  for (const auto& p : (*model_)->AttentionOnlyParameters()) attention_only.insert(p.unsafeGetTensorImpl());
  for (const auto& p : (*model_)->LinearOnlyParameters()) linear_only.insert(p.unsafeGetTensorImpl());
  // Whether a step whose micro-batches ran these modes trains p: not the parameters of a mode none ran.
  auto trains = [&](const torch::Tensor& p, OryxModelImpl::Modes modes) {
    const void* key = p.unsafeGetTensorImpl();
    return !(attention_only.contains(key) && !modes.any_attn) && !(linear_only.contains(key) && !modes.any_lin);
  };
  // Loss scale: the gradient sums over the micro-batches of every rank make the step's mean.
  const double micro_batches = static_cast<double>(o_.grad_accum * world_);
  if (group_) {
    buckets_ = std::make_unique<GradientBuckets>(*group_, params, static_cast<int64_t>(o_.dist.bucket_mb * (1 << 20)));
  }
  if (cuda) {
    torch::NoGradGuard no_grad;
    for (auto p : params) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      grads.push_back(p.grad());
    }
    fused_ = std::make_unique<FusedAdamW>(*optimizer_);
    if (o_.cuda_graph && o_.mixing == ModeMixing::kFragment) {
      graph_modes_ = {.any_attn = o_.model.attn_fraction > 0, .any_lin = o_.model.attn_fraction < 1};
      graphed_ = std::make_unique<GraphedBackward>(
          [this, micro_batches](const torch::Tensor& inputs, const torch::Tensor& targets,
                                const torch::Tensor& is_attn) {
            Batch b{.inputs = inputs, .targets = targets, .is_attn = is_attn, .modes = graph_modes_};
            return Loss(*model_, b, autocast_) / micro_batches;
          },
          /*warmup=*/2);
    }
  }
  const int64_t n_params = ParameterCount(*model_);
  const double flops_per_token = FlopsPerToken(o_.model, n_params, o_.seq_len);
  double peak = o_.peak_tflops * 1e12;
  std::string device_name = device_.is_cuda() ? "cuda" : "cpu";
  if (peak == 0 && device_.is_cuda()) peak = 989.4e12;  // H100/H200 SXM bf16 dense
  std::string ranks;
  if (group_) {
    ranks = absl::StrFormat(" x %d ranks (%s, %d gradient bucket%s%s)", world_, DistBackendName(group_->backend()),
                            buckets_->num_buckets(), buckets_->num_buckets() == 1 ? "" : "s",
                            o_.dist.overlap ? ", all-reduced during backward" : ", all-reduced after backward");
  }
  if (lead_) {
    std::fprintf(
        stderr, "training %lld parameters on %s%s: %lld steps of %lld x %lld x %lld%s tokens, from step %lld\n",
        static_cast<long long>(n_params), device_name.c_str(), graphed_ ? " (CUDA graph)" : "",
        static_cast<long long>(o_.steps), static_cast<long long>(o_.batch_size), static_cast<long long>(o_.grad_accum),
        static_cast<long long>(o_.seq_len), ranks.c_str(), static_cast<long long>(start_step_));
  }
  Json start = {{"event", "start"},
                {"params", n_params},
                {"config", Json::parse(ToJson(o_.model))},
                {"identity", TrainingIdentity(o_)},
                {"device", device_name},
                {"start_step", start_step_}};
  if (group_) {
    start["world_size"] = world_;
    start["dist_backend"] = DistBackendName(group_->backend());
  }
  Log(start);

  BatchMaker batches(o_, *train_, mixer_ ? &*mixer_ : nullptr);
  const int64_t tokens_per_step = o_.batch_size * o_.grad_accum * world_ * o_.seq_len;  // over all ranks
  start_ = Clock::now();
  auto window_start = Clock::now();
  int64_t window_steps = 0;
  double window_wait_s = 0;  // waiting for the gradient all-reduces after backward
  int64_t last_good = start_step_;
  // ORYX_PROFILE_TRACE=FILE records steps 4..6 of this run as a Chrome trace: host ops and, on CUDA, the
  // kernels with their GPU times (bench/summarize_trace.py sums them by op).
  const char* trace_path = lead_ ? std::getenv("ORYX_PROFILE_TRACE") : nullptr;
  std::optional<TraceRecording> profile;
  for (int64_t step = start_step_; step < o_.steps; ++step) {
    if (trace_path != nullptr && step == start_step_ + 3) profile.emplace(cuda);
    if (profile && step == start_step_ + 6) {
      ORYX_RETURN_IF_ERROR(profile->Save(trace_path));
      profile.reset();
    }
    const double lr = LearningRate(o_, step);
    for (auto& g : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    if (buckets_) {
      buckets_->Zero();
    } else if (cuda) {
      at::_foreach_zero_(grads);
    } else {
      optimizer_->zero_grad();
    }
    double loss_sum = 0;
    torch::Tensor device_loss;  // CUDA: summed on the device, read once per step
    OryxModelImpl::Modes step_modes{.any_attn = false, .any_lin = false};
    for (int64_t micro = 0; micro < o_.grad_accum; ++micro) {
      // The step's samples in order, grad_accum micro-batches per rank: rank r reads the r-th slice.
      const int64_t first = ((step * world_ + rank_) * o_.grad_accum + micro) * o_.batch_size;
      ORYX_ASSIGN_OR_RETURN(Batch b, batches.Make(first, o_.batch_size, device_));
      step_modes.any_attn |= b.modes.any_attn;
      step_modes.any_lin |= b.modes.any_lin;
      torch::Tensor loss;
      if (graphed_ && b.modes == graph_modes_) {
        try {
          loss = graphed_->Run(b.inputs, b.targets, b.is_attn);
        } catch (const c10::OutOfMemoryError&) {
          throw;  // not the graph's fault: Train() says what to change
        } catch (const c10::Error& e) {
          return absl::InternalError(absl::StrCat("the CUDA graph of a micro-batch failed at step ", step,
                                                  " (--no-cuda-graph trains without): ", e.what_without_backtrace()));
        }
      } else {
        if (buckets_ && o_.dist.overlap && micro + 1 == o_.grad_accum) buckets_->Overlap();
        loss = Loss(*model_, b, autocast_) / micro_batches;
        loss.backward();
        loss = loss.detach();
      }
      if (cuda) {
        device_loss = device_loss.defined() ? device_loss + loss : loss;
      } else {
        loss_sum += loss.item<double>();
      }
    }
    bool out_of_time_anywhere = false;
    if (group_) {
      window_wait_s += buckets_->Finish();
      const double so_far = std::chrono::duration<double>(Clock::now() - start_).count();
      const StepTotals totals =
          SumOverRanks(loss_sum, device_loss, step_modes, o_.time_limit_s > 0 && so_far >= o_.time_limit_s);
      loss_sum = totals.loss;
      step_modes = totals.modes;
      out_of_time_anywhere = totals.out_of_time;
    } else if (cuda) {
      loss_sum = device_loss.item<double>();
    }
    if (!std::isfinite(loss_sum)) {
      return absl::InternalError(absl::StrCat("loss is ", loss_sum, " at step ", step,
                                              "; stopped without saving. Last good checkpoint: ",
                                              (out_ / "checkpoint").string(), " (step ", last_good, ")"));
    }
    double grad_norm = 0;
    torch::Tensor device_grad_norm;
    if (cuda) {
      device_grad_norm = ClipGradNormFused(params, o_.grad_clip);
      // Parameters of a mode no micro-batch of this step ran have a zero gradient here, and none on the
      // CPU path: skip them, as torch::optim::AdamW skips those without a gradient.
      fused_->Step(lr, [&](const torch::Tensor& p) { return trains(p, step_modes); });
    } else {
      // As in one process, where they have none: no gradient for the parameters of a mode no rank ran.
      if (buckets_) {
        for (torch::Tensor p : params) {
          if (!trains(p, step_modes)) p.mutable_grad() = torch::Tensor();
        }
      }
      grad_norm = torch::nn::utils::clip_grad_norm_(params, o_.grad_clip);
      optimizer_->step();
    }
    ++window_steps;
    const int64_t done = step + 1;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    if (lead_ && (done % o_.log_every == 0 || done == o_.steps)) {
      if (cuda) grad_norm = device_grad_norm.item<double>();
      const double window_s = std::chrono::duration<double>(Clock::now() - window_start).count();
      const double tok_s = window_steps * tokens_per_step / window_s;
      const double eta = (o_.steps - done) * window_s / window_steps;
      Json line = {{"event", "step"}, {"step", done}, {"loss", loss_sum}, {"lr", lr}, {"grad_norm", grad_norm},
                   {"tokens_per_s", tok_s}, {"elapsed_s", elapsed_before_ + elapsed}};
      if (group_) line["allreduce_wait_s"] = window_wait_s / window_steps;
      std::string mfu;
      if (peak > 0) {  // per device
        line["mfu"] = tok_s * flops_per_token / (peak * world_);
        mfu = absl::StrFormat("  mfu %.1f%%", 100.0 * tok_s * flops_per_token / (peak * world_));
      }
      std::fprintf(stderr, "step %lld/%lld  loss %.4f  lr %.2e  gnorm %.2f  %.1fk tok/s%s  ETA %s\n",
                   static_cast<long long>(done), static_cast<long long>(o_.steps), loss_sum, lr, grad_norm,
                   tok_s / 1000, mfu.c_str(), Duration(eta).c_str());
      Log(line);
      window_start = Clock::now();
      window_steps = 0;
      window_wait_s = 0;
    }
    if (lead_ && ((o_.eval_every > 0 && done % o_.eval_every == 0) || done == o_.steps)) {
      ORYX_RETURN_IF_ERROR(Evaluate(done));
    }
    const bool out_of_time = group_ ? out_of_time_anywhere : o_.time_limit_s > 0 && elapsed >= o_.time_limit_s;
    const bool due = (o_.checkpoint_every > 0 && done % o_.checkpoint_every == 0) || done == o_.steps || out_of_time;
    if (o_.save && due) {
      if (lead_) ORYX_RETURN_IF_ERROR(SaveCheckpoint(done));
      last_good = done;
    }
    if (out_of_time && done < o_.steps) {
      if (lead_) {
        std::fprintf(stderr, "time limit reached at step %lld; continue with --resume\n", static_cast<long long>(done));
      }
      return Finish(/*complete=*/false);
    }
  }
  return Finish(/*complete=*/true);
}

}  // namespace

namespace {

absl::Status TrainThisProcess(const TrainOptions& options) {
  if (options.data_dir.empty() || options.out_dir.empty()) {
    return absl::InvalidArgumentError("--data and --out are required");
  }
  if (options.batch_size < 1 || options.grad_accum < 1 || options.steps < 1 || options.warmup_steps < 0 ||
      options.log_every < 1 || options.scan_chunk < 1 || !(options.lr > 0) || options.min_lr < 0 ||
      !(options.grad_clip > 0) || options.task_fraction < 0 || options.task_fraction > 1) {
    return absl::InvalidArgumentError(
        "training options out of range: need batch, accumulation, steps, log interval, scan chunk >= 1, lr > 0, "
        "min lr >= 0, grad clip > 0, task fraction in [0, 1]");
  }
  if (options.dist.env) ORYX_RETURN_IF_ERROR(CheckDistributedOptions(options.dist));
  try {
    Trainer trainer(options);
    return trainer.Run();
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(absl::StrCat("out of device memory at --batch ", options.batch_size,
                                                     ": lower --batch (and raise --accum to keep the tokens per "
                                                     "step). LibTorch: ",
                                                     e.what_without_backtrace()));
  } catch (const c10::DistError& e) {
    return absl::UnavailableError(absl::StrCat(
        "a collective operation failed: another rank has most likely stopped (its error, or the launcher's, says "
        "why); a run that wrote a checkpoint continues from it with --resume. c10d: ",
        e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
}

}  // namespace

absl::Status Train(const TrainOptions& options) {
  absl::Status status = TrainThisProcess(options);
  if (status.ok() || !options.dist.env) return status;
  return absl::Status(status.code(), absl::StrCat("rank ", options.dist.env->rank, " of ", options.dist.env->world_size,
                                                  ": ", status.message()));
}

}  // namespace oryx::train
