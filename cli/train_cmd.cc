// `oryx train`: fragmented mixed-mode training of an Oryx model on a prepared corpus, in one process or as
// the ranks of a data-parallel job (--nproc here, or the torchrun-style environment).
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "base/flags.h"
#include "engine/config.h"
#include "base/status_macros.h"
#include "train/launch.h"
#include "train/trainer.h"

namespace oryx::cli {

namespace {

// args without `--nproc N` / `--nproc=N`: what each rank of --nproc runs.
Args WithoutNproc(const Args& args) {
  Args out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc") {
      ++i;
    } else if (args[i].rfind("--nproc=", 0) != 0) {
      out.push_back(args[i]);
    }
  }
  return out;
}

}  // namespace

int RunTrain(const Args& args) {
  train::TrainOptions o;
  ModelConfig& m = o.model;
  m.d_model = 256;
  m.n_layers = 6;
  m.n_heads = 4;
  m.head_dim = 64;
  m.mlp_hidden = 768;
  m.rope_theta = 10000;
  m.norm_eps = 1e-6;
  m.tie_embeddings = true;
  std::string config_file, mixer = "mamba2", mixing = "fragment", export_dtype = "f32";
  int64_t seed = 1, threads = 0;
  FlagSet flags("oryx train --data DIR --out DIR [--config FILE | model flags] [--resume] [--nproc N]",
                "Trains an Oryx model with fragmented mixed-mode training: each fragment of --fragment-len\n"
                "tokens runs in attention mode with probability --attn-fraction, else in linear mode.\n"
                "--attn-fraction 1 trains the Transformer baseline, 0 the pure linear one; --mixing sequence\n"
                "draws one mode per sequence (the ablation). Writes OUT/checkpoint (training state, swapped\n"
                "in atomically), OUT/model (the exported checkpoint) and OUT/log.jsonl.\n"
                "\n"
                "Data parallel: --nproc N starts N ranks on this host (one per GPU on CUDA, N processes on the\n"
                "CPU); across hosts, start one process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR\n"
                "and MASTER_PORT set (torchrun --no-python does). Each step is --batch x --accum sequences per\n"
                "rank, gradients are averaged over the ranks (NCCL on CUDA, Gloo on the CPU), rank 0 writes OUT;\n"
                "a checkpoint resumes with another number of ranks when --accum x ranks stays the same. A rank\n"
                "that dies stops the job (docs/DESIGN.md §3, data-parallel training).");
  flags.String("data", &o.data_dir, "prepared corpus directory (oryx data prepare)", true);
  flags.String("out", &o.out_dir, "output directory", true);
  flags.String("config", &config_file,
               "config.json of the model (vocab and special ids must match the corpus tokenizer); "
               "overrides the model flags");
  flags.Int("d-model", &m.d_model, "model width D", 1);
  flags.Int("layers", &m.n_layers, "number of layers L", 1);
  flags.Int("heads", &m.n_heads, "heads H", 1);
  flags.Int("head-dim", &m.head_dim, "head dimension dh", 1);
  flags.Int("mlp-hidden", &m.mlp_hidden, "SwiGLU hidden width F", 1);
  flags.String("mixer", &mixer, "linear mixer: mamba2 | gdn");
  flags.Double("rope-theta", &m.rope_theta, "RoPE base (0: no RoPE)");
  flags.Int("max-position", &m.max_position, "longest context the model supports (0: --seq-len)", 0);
  flags.Int("attn-log-scale-base", &m.attn_log_scale_base,
            "attention queries at position p times max(1, ln(p+1)/ln(N)): far matches not diluted by many keys "
            "(0: off)",
            0);
  flags.Int("fragment-len", &m.fragment_len, "tokens per mode fragment", 1);
  flags.Double("attn-fraction", &m.attn_fraction, "probability that a fragment runs in attention mode");
  flags.String("mixing", &mixing, "fragment | sequence (one mode per sequence: the ablation)");
  flags.Int("seq-len", &o.seq_len, "training sequence length", 1);
  flags.Int("batch", &o.batch_size, "sequences per micro-batch", 1);
  flags.Int("accum", &o.grad_accum, "micro-batches per optimizer step", 1);
  flags.Int("steps", &o.steps, "optimizer steps", 1);
  flags.Int("warmup", &o.warmup_steps, "linear warmup steps", 0);
  flags.Double("lr", &o.lr, "peak learning rate (AdamW)");
  flags.Double("min-lr", &o.min_lr, "learning rate at the end of the cosine");
  flags.Double("weight-decay", &o.weight_decay, "AdamW weight decay on matrices");
  flags.Double("grad-clip", &o.grad_clip, "gradient norm clip");
  flags.Double("task-fraction", &o.task_fraction, "share of sequences replaced by synthetic tasks (MQAR, NIAH)");
  flags.Int("needle-min-length", &o.needle_min_length, "task sequences: shortest packed needle example", 1);
  flags.Int("needle-max-length", &o.needle_max_length,
            "task sequences: longest packed needle example (0: one example fills the sequence); needles are "
            "trained at distances up to this", 0);
  flags.Bool("needle-log-uniform", &o.needle_log_uniform,
             "draw packed needle lengths log-uniformly (for a wide range: short and long examples alike)");
  flags.Int("multikey-needles", &o.multikey_needles, "needles per multi-key example (the asked one + distractors)",
            2, 64);
  flags.Int("mqar-max-pairs", &o.mqar_max_pairs, "MQAR key-value pairs per sequence at most", 4, 4096);
  flags.Double("mqar-spread", &o.mqar_spread,
               "share of MQAR sequences whose queries spread over the whole sequence (long gaps)");
  flags.String("task-weights", &o.task_weights,
               "relative weights of the task kinds, e.g. niah_single=2,copy=1 (kinds: mqar niah_single niah_multikey "
               "passkey copy; defaults 1 1 1 0.5 0)");
  flags.Int("copy-cue-length", &o.copy_cue_length, "copy examples: tokens of the repeated passage given", 1, 4096);
  flags.Int("copy-answer-length", &o.copy_answer_length, "copy examples: tokens of it to continue (trained)", 1,
            4096);
  flags.Bool("allow-short-documents", &o.allow_short_documents,
             "train even when the corpus's documents average less than half of --seq-len");
  flags.String(
      "init-from", &o.init_from,
      "start from this model directory's weights with a fresh optimizer and schedule (a run continued "
      "elsewhere from exported weights); the model flags must match its config, except --attn-fraction, "
      "--fragment-len, --rope-theta, --max-position and --attn-log-scale-base (a later stage may change them)");
  flags.Int("log-every", &o.log_every, "steps between progress lines", 1);
  flags.Int("eval-every", &o.eval_every, "steps between validation losses (0: only at the end)", 0);
  flags.Int("eval-sequences", &o.eval_sequences, "validation sequences per mode", 1);
  flags.Int("checkpoint-every", &o.checkpoint_every, "steps between checkpoints (0: only at the end)", 0);
  flags.Double("time-limit", &o.time_limit_s, "checkpoint and stop after this many seconds (0: none)");
  flags.Int("seed", &seed, "seed of initialisation, data order and modes", 0);
  flags.String("device", &o.device, "auto | cpu | cuda");
  flags.Int("threads", &threads, "CPU threads (0: default)", 0, 1024);
  flags.String("export-dtype", &export_dtype, "dtype of OUT/model weights: f32 | bf16");
  flags.Bool("resume", &o.resume, "continue from OUT/checkpoint");
  flags.Double("peak-tflops", &o.peak_tflops,
               "the device's peak TFLOP/s, for the MFU in progress lines (0: 989.4, the H100/H200 bf16 dense "
               "peak, on CUDA; no MFU on the CPU)");
  flags.Int("scan-chunk", &o.scan_chunk, "tokens per chunk of the chunked linear scans (speed only)", 1);
  bool no_cuda_graph = false;
  flags.Bool("no-cuda-graph", &no_cuda_graph,
             "on CUDA, run every micro-batch eagerly instead of replaying a recorded CUDA graph");
  int64_t nproc = 0;
  flags.Int("nproc", &nproc, "data parallel: start N ranks on this host (CUDA: one per GPU, cuda:0 .. N-1)", 1, 4096);
  flags.String("dist-backend", &o.dist.backend, "data parallel: auto (nccl on CUDA, gloo on the CPU) | gloo | nccl");
  flags.Double("dist-timeout", &o.dist.timeout_s,
               "data parallel: seconds a rank waits for the others (to join, or in a collective) before failing");
  flags.Double("bucket-mb", &o.dist.bucket_mb, "data parallel: MiB of gradients per all-reduce");
  bool no_overlap = false;
  flags.Bool("no-overlap", &no_overlap,
             "data parallel: all-reduce the gradients after backward rather than while it runs");
  bool no_save = false;
  flags.Bool("no-save", &no_save, "write no checkpoint or model (throughput measurements)");
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    if (!config_file.empty()) {
      ORYX_ASSIGN_OR_RETURN(o.model, LoadModelConfig(config_file));
    } else if (mixer == "mamba2" || mixer == "gdn") {
      m.linear_mixer = mixer == "gdn" ? LinearMixer::kGdn : LinearMixer::kMamba2;
      m.conv_activation = mixer == "gdn" ? ConvActivation::kSilu : ConvActivation::kIdentity;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--mixer must be mamba2 or gdn, got '", mixer, "'"));
    }
    if (mixing != "fragment" && mixing != "sequence") {
      return absl::InvalidArgumentError(absl::StrCat("--mixing must be fragment or sequence, got '", mixing, "'"));
    }
    if (export_dtype != "f32" && export_dtype != "bf16") {
      return absl::InvalidArgumentError(absl::StrCat("--export-dtype must be f32 or bf16, got '", export_dtype, "'"));
    }
    if (!(o.peak_tflops >= 0)) return absl::InvalidArgumentError("--peak-tflops must be >= 0");
    if (o.model.attn_fraction < 0 || o.model.attn_fraction > 1) {
      return absl::InvalidArgumentError("--attn-fraction must be in [0, 1]");
    }
    o.mixing = mixing == "sequence" ? train::ModeMixing::kSequence : train::ModeMixing::kFragment;
    o.export_dtype = export_dtype == "bf16" ? DType::kBF16 : DType::kF32;
    o.seed = static_cast<uint64_t>(seed);
    o.save = !no_save;
    o.cuda_graph = !no_cuda_graph;
    o.threads = static_cast<int>(threads);
    o.dist.overlap = !no_overlap;
    ORYX_ASSIGN_OR_RETURN(o.dist.env, train::DistEnvFromEnvironment());
    if (nproc > 0) {
      if (o.dist.env) {
        return absl::InvalidArgumentError(
            "--nproc starts its own ranks, but RANK, WORLD_SIZE, ... are set: this process is already a rank of a "
            "job (drop --nproc, or unset them)");
      }
      ORYX_RETURN_IF_ERROR(train::CheckLocalLaunch(o, static_cast<int>(nproc)));
      std::error_code ec;
      const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
      if (ec) return absl::InternalError(absl::StrCat("/proc/self/exe: ", ec.message()));
      Args argv = {self.string(), "train"};
      for (const std::string& a : WithoutNproc(args)) argv.push_back(a);
      return train::LaunchLocalRanks({.nproc = static_cast<int>(nproc), .argv = argv});
    }
    // One process: the data-parallel flags do nothing, but values given are still checked.
    if (!o.dist.env && (flags.was_set("dist-backend") || flags.was_set("dist-timeout") || flags.was_set("bucket-mb"))) {
      ORYX_RETURN_IF_ERROR(train::CheckLocalLaunch(o, 1));
    }
    return train::Train(o);
  });
}

}  // namespace oryx::cli
