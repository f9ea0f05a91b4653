// The fragmented mixed-mode trainer (DESIGN.md §3) behind `oryx train`. This header is LibTorch-free so
// that the command-line layer can fill the options without compiling against LibTorch.
//
// Output directory:
//   OUT/checkpoint/  training state: model.safetensors (fp32), optimizer.pt, state.json; replaced as a
//                    whole (a new directory is built beside it, then swapped in), so an interrupted run
//                    leaves the last good one
//   OUT/model/       the exported model (DESIGN.md §4 checkpoint, with tokenizer.model)
//   OUT/log.jsonl    one JSON object per logged step, evaluation and checkpoint
//
// Data parallel (docs/DESIGN.md §3): every rank of a job runs Train() with the job's DistEnv. Rank r trains
// on its own slice of each step's micro-batches, the gradients are averaged over the ranks, and every rank
// takes the same optimizer step; rank 0 alone evaluates and writes OUT.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/config.h"
#include "engine/safetensors.h"
#include "train/launch.h"
#include "train/mode_sampling.h"

namespace oryx::train {

struct DistributedOptions {
  std::optional<DistEnv> env;    // the job this process is a rank of; none: a run of one process
  std::string backend = "auto";  // auto (nccl on CUDA, gloo on the CPU) | gloo | nccl
  double timeout_s = 600;        // joining the job, or a collective, fails after this long
  double bucket_mb = 25;         // gradients are all-reduced in buckets of about this size
  bool overlap = true;           // start a bucket's all-reduce while backward computes the rest
};

struct TrainOptions {
  std::string data_dir;  // a corpus from `oryx data prepare`
  std::string out_dir;
  // The model. vocab_size, bos_id, eos_id and pad_id are taken from the corpus's tokenizer;
  // fragment_len and attn_fraction drive the mode sampling.
  ModelConfig model;
  ModeMixing mixing = ModeMixing::kFragment;  // kSequence: one mode per sequence (the ablation)

  int64_t seq_len = 512;
  int64_t batch_size = 8;  // sequences per micro-batch
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  int64_t steps = 1000;
  int64_t warmup_steps = 100;
  double lr = 3e-3;
  double min_lr = 3e-4;  // cosine decays to this
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95;
  double grad_clip = 1.0;

  double task_fraction = 0.0;    // share of training sequences replaced by synthetic tasks
  bool answer_only_loss = true;  // on task sequences, loss only on answer tokens
  // The task mix (tasks/task_mix.h): needle examples packed at lengths in [min, max] (max 0: one example
  // fills the sequence), log-uniform or uniform; needles per multi-key example; the MQAR pairs' upper bound
  // and the share of MQAR sequences whose queries are spread over the whole sequence.
  int64_t needle_min_length = 96, needle_max_length = 1024;
  bool needle_log_uniform = false;
  int64_t multikey_needles = 4;
  int64_t mqar_max_pairs = 64;
  double mqar_spread = 0.0;
  // Relative weights of the task kinds, "kind=weight,..." over the defaults mqar=1, niah_single=1,
  // niah_multikey=1, passkey=0.5 (0 without one-token digits), copy=0 (tasks::ApplyTaskWeights).
  std::string task_weights;
  // Copy examples: tokens of the repeated passage given (the cue) and to continue (the answer).
  int64_t copy_cue_length = 16, copy_answer_length = 32;
  // Start from these weights (a model directory: config.json and weights, e.g. an earlier run's OUT/model)
  // with a fresh optimizer and schedule, rather than from a random initialisation: a run continued in a
  // later session on another machine, where only the exported weights came back. The model options must
  // match the checkpoint's config.
  std::string init_from;
  // Training windows are cut from documents laid end to end; when the train split's documents average
  // less than half a window, most of each window is unrelated text and nothing teaches the model to use its
  // whole context, so the trainer refuses to start unless this is set.
  bool allow_short_documents = false;

  int64_t log_every = 10;
  int64_t eval_every = 200;       // validation loss in attention, linear and mixed mode
  int64_t eval_sequences = 16;
  int64_t checkpoint_every = 200;
  double time_limit_s = 0;  // checkpoint and stop after this much wall time (0: no limit)
  bool save = true;         // false: no checkpoint or export at all (throughput measurements)

  uint64_t seed = 1;
  std::string device = "auto";  // auto | cpu | cuda
  bool resume = false;           // continue from OUT/checkpoint (same config and data required)
  double peak_tflops = 0;        // for model FLOPs utilisation; 0 = the device's bf16 dense peak if known
  DType export_dtype = DType::kF32;
  // CUDA: record a micro-batch's forward + backward as a CUDA graph and replay it (fragment mixing only;
  // a micro-batch whose modes differ from the recorded ones, which only a run of single-mode fragments
  // can give, runs eagerly).
  bool cuda_graph = true;
  int64_t scan_chunk = 64;  // tokens per chunk of the chunked linear scans (a speed knob; same model)
  int threads = 0;          // CPU intra-op threads (0: LibTorch's default; a CPU rank: the cores over the ranks)
  // Data parallel: each step is the micro-batches of every rank (batch_size x grad_accum x ranks sequences),
  // so a checkpoint resumes with any number of ranks whose ranks x grad_accum is the same.
  DistributedOptions dist;
};


// Trains until `steps` (or the time limit), printing a progress line to stderr. Errors (bad options,
// data, a resume from another config, a non-finite loss) are reported without touching the last good
// checkpoint.
absl::Status Train(const TrainOptions& options);

// What `oryx train --nproc N` checks before it starts N ranks on this host (LaunchLocalRanks): the backend
// against the device, N against the GPUs on CUDA, the distributed options' ranges.
absl::Status CheckLocalLaunch(const TrainOptions& options, int nproc);
absl::Status CheckDistributedOptions(const DistributedOptions& dist);

}  // namespace oryx::train
