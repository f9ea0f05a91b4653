// `oryx bench decode|spec|cost|router|serve`: the engine's benchmarks (bench/engine_bench.h). JSON lines with --json (one
// object per measured point), a table otherwise; --out also writes the JSON lines to a file atomically.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/engine_bench.h"
#include "bench/router_bench.h"
#include "cli/commands.h"
#include "base/flags.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/json_text.h"
#ifdef ORYX_HAVE_TORCH
#include "bench/decode_reference.h"
#endif
#ifdef ORYX_HAVE_SERVER
#include "bench/serve_bench.h"
#endif

namespace oryx::cli {

namespace {

// Collects the JSON lines, prints each as it comes (a table row or the line), and writes --out at the end.
struct Output {
  bool json = false;
  std::string out_file;
  std::string lines;
  std::function<void(const nlohmann::json&)> row;
  void Emit(const nlohmann::json& j) {
    lines += JsonText(j) + "\n";
    if (json) {
      std::cout << JsonText(j) << std::endl;
    } else {
      row(j);
    }
  }
  absl::Status Finish() { return out_file.empty() ? absl::OkStatus() : WriteFileAtomic(out_file, lines); }
};


// The flags most benchmarks share, and the output they all write.
struct BenchFlags {
  Output out;
  int64_t threads = 0;
  std::vector<std::string> batches, contexts;
  void AddFlags(FlagSet& f) {
    f.StringList("batches", &batches, "batch sizes");
    f.StringList("contexts", &contexts, "context lengths");
    f.Int("threads", &threads, "CPU threads (0: one per hardware thread)", 0, 1024);
    f.Bool("json", &out.json, "print JSON lines instead of a table");
    f.String("out", &out.out_file, "also write the JSON lines to this file (atomically)");
  }
  // --batches and --contexts into the options, where given.
  absl::Status ParseShapes(std::vector<int64_t>& batch_sizes, std::vector<int64_t>& context_lengths) const {
    if (!batches.empty()) {
      ORYX_ASSIGN_OR_RETURN(batch_sizes, ParsePositiveInts(batches, "batches"));
    }
    if (!contexts.empty()) {
      ORYX_ASSIGN_OR_RETURN(context_lengths, ParsePositiveInts(contexts, "contexts"));
    }
    return absl::OkStatus();
  }
};

int BenchDecode(const Args& rest) {
  BenchFlags c;
  bench::DecodeBenchOptions o;
  int64_t reference_max_context = 1024;
  FlagSet f("oryx bench decode [--model DIR] [--batches 1,4,16] [--contexts 256,1024,4096,8192] [--json]",
            "Decode and prefill throughput of the engine (CPU, or CUDA with --device cuda) by mode, batch and\n"
            "context. Each point carries its fraction of the memory-bandwidth roofline (bytes a decode step must\n"
            "move over the read bandwidth of a buffer that size, measured in the same run) and, run as\n"
            "`oryx-torch bench decode`, its speedup over the LibTorch model's token-by-token decode. Without\n"
            "--model: random weights of a 19M-parameter config. With --device cuda, ORYX_CUDA_* environment\n"
            "variables switch the kernels' paths, to time them against each other (docs/CUDA.md lists them).");
  f.String("model", &o.model_dir, "model directory (default: random weights; cpu: d512 L4 H8x64 F1408 V8192, cuda: --config)");
  c.AddFlags(f);
  f.Int("steps", &o.steps, "timed decode steps per point", 2, 10000);
  f.Int("reference-max-context", &reference_max_context,
        "time LibTorch's decode only up to this context (it prefills token by token)", 0);
  std::string mixer = "mamba2";
  f.String("device", &o.device, "cpu | cuda (the CUDA backend, roofline against the device's copy bandwidth)");
  f.String("weights", &o.weights, kWeightsHelp);
  f.Int("kv-block-tokens", &o.kv_block_tokens, "cpu: positions per KV cache block (0: the engine's 64)", 0, 4096);
  f.String("kv-dtype", &o.kv_dtype, "cpu: the KV cache's element type f32 | bf16 | int8");
  f.String("config", &o.preset, "without --model: random weights of 130m | 1.4b (cuda's default 130m; cpu's a 19M config)");
  f.String("mixer", &mixer, "linear mixer of --config: mamba2 | gdn");
  f.Int("prefill-max-attention", &o.prefill_max_attention, "cuda: time attention-mode prefill up to this context", 0);
  std::vector<std::string> spec_ks;
  const std::string indent = "\n                         ";  // continuation lines of a flag's help
  f.StringList("spec-k", &spec_ks,
               Cat("cuda: also time speculative rounds (k linear-mode drafts, one attention-mode verify) of", indent,
                   "these draft lengths, e.g. 2,4,8, against the decode steps of the same point"));
  f.Double("acceptance", &o.acceptance,
           Cat("cuda, --spec-k: the simulated probability that each draft is accepted (independently, until", indent,
               "the first rejection; random weights make real acceptance meaningless); the default 0.84 is", indent,
               "about what models/default's drafts measure with --data (0.85 at 16K, 32 sequences, k = 4)"));
  f.String("data", &o.data_dir,
           Cat("cuda, --spec-k with --model: a corpus whose validation windows are the contexts; the", indent,
               "acceptance is then the model's own, measured instead of simulated"));
  f.Double("temperature", &o.temperature,
           Cat("cuda: the decode steps draw their next tokens at this temperature (on the device, and on the", indent,
               "host from the returned logits, each timed); with --spec-k and --data the rounds sample their", indent,
               "drafts and tokens at it too (the lossless rule judges sampled drafts); 0 is greedy"));
  return RunWithFlags(f, rest, [&]() -> absl::Status {
    if (mixer != "mamba2" && mixer != "gdn") return absl::InvalidArgumentError(Cat("--mixer: '", mixer, "' (mamba2, gdn)"));
    if (!spec_ks.empty()) {
      ORYX_ASSIGN_OR_RETURN(o.spec_ks, ParsePositiveInts(spec_ks, "spec-k"));
      for (int64_t k : o.spec_ks) {
        if (k > 64) return absl::InvalidArgumentError(Cat("--spec-k: ", k, " is more than 64 drafts"));
      }
    }
    if ((!spec_ks.empty() || f.was_set("acceptance") || f.was_set("data")) && o.device != "cuda") {
      return absl::InvalidArgumentError("--spec-k, --acceptance and --data are for --device cuda");
    }
    if ((f.was_set("acceptance") || f.was_set("data")) && spec_ks.empty()) {
      return absl::InvalidArgumentError("--acceptance and --data need --spec-k");
    }
    if (f.was_set("temperature") && !spec_ks.empty() && !f.was_set("data")) {
      return absl::InvalidArgumentError(
          "--temperature with --spec-k needs --data (sampled acceptance is measured, not simulated)");
    }
    if (f.was_set("temperature") && o.device != "cuda") {
      return absl::InvalidArgumentError("--temperature is for --device cuda");
    }
    if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
      return absl::InvalidArgumentError(Cat("--temperature: ", o.temperature, " is not a finite number >= 0"));
    }
    if (f.was_set("acceptance") && f.was_set("data")) {
      return absl::InvalidArgumentError("--acceptance is simulated; with --data the acceptance is measured");
    }
    o.mixer = mixer == "gdn" ? LinearMixer::kGdn : LinearMixer::kMamba2;
    ORYX_RETURN_IF_ERROR(c.ParseShapes(o.batches, o.contexts));
    o.threads = static_cast<int>(c.threads);
#ifdef ORYX_HAVE_TORCH
    o.reference = [&](const std::string& dir) {
      return bench::MakeTorchReference(dir, reference_max_context, o.steps, o.threads);
    };
#endif
    c.out.row = [header = true](const nlohmann::json& j) mutable {
      if (j.value("bench", "") == "speculative") {
        std::printf("speculative k=%lld context %lld batch %lld: acceptance %.3f (%s), %.2f tokens/round, "
                    "%.3f ms/round, %.3f ms/token, %.2fx attention, %.2fx linear\n",
                    static_cast<long long>(j["k"].get<int64_t>()), static_cast<long long>(j["context"].get<int64_t>()),
                    static_cast<long long>(j["batch"].get<int64_t>()), j["acceptance"].get<double>(),
                    j["acceptance_source"].get<std::string>().substr(0, 8).c_str(),
                    j["tokens_per_round"].get<double>(), j["round_ms"].get<double>(), j["ms_per_token"].get<double>(),
                    j["speedup_over_attention"].get<double>(), j["speedup_over_linear"].get<double>());
        std::fflush(stdout);
        return;
      }
      if (!j.contains("decode_ms_per_step")) {  // prefill and skipped points (cuda): the line itself
        std::printf("%s\n", JsonText(j).c_str());
        return;
      }
      if (header) {
        std::printf("%-10s %8s %6s %12s %12s %10s %10s %10s\n", "mode", "context", "batch", "decode tok/s",
                    "prefill t/s", "ms/step", "roofline", "vs torch");
        header = false;
      }
      const std::string vs = j.contains("speedup_over_libtorch")
                                 ? Cat(static_cast<int>(j["speedup_over_libtorch"].get<double>() * 100) / 100.0, "x")
                                 : "-";
      std::printf("%-10s %8lld %6lld %12.1f %12.1f %10.2f %9.1f%% %10s\n", j["mode"].get<std::string>().c_str(),
                  static_cast<long long>(j["context"].get<int64_t>()), static_cast<long long>(j["batch"].get<int64_t>()),
                  j["decode_tokens_per_s"].get<double>(),
                  j.value("prefill_tokens_per_s", j.value("fill_tokens_per_s", 0.0)),
                  j["decode_ms_per_step"].get<double>(), 100 * j["roofline_fraction"].get<double>(), vs.c_str());
      std::fflush(stdout);
    };
    ORYX_RETURN_IF_ERROR(bench::RunDecodeBench(o, [&](const nlohmann::json& j) { c.out.Emit(j); }));
    return c.out.Finish();
  });
}

int BenchSpec(const Args& rest) {
  BenchFlags c;
  bench::SpecBenchOptions o;
  std::vector<std::string> ks, proposers;
  FlagSet f("oryx bench spec --model DIR --data DIR [--k 1,2,4,8] [--contexts 512,2048] [--batches 1,8] [--json]",
            "Speculative decoding (linear-mode drafts, and n-gram prompt lookup) against attention-mode\n"
            "decoding of the same prompts from the corpus's validation split: acceptance, accepted tokens per\n"
            "round, acceptance per draft position, draft-step and verify costs, and the speedup.");
  f.String("model", &o.model_dir, "model directory", true);
  f.String("data", &o.data_dir, "corpus directory (prompts from its validation split)", true);
  f.StringList("k", &ks, "fixed draft lengths (the adaptive policy is always run too)");
  f.StringList("proposers", &proposers, "linear and/or ngram");
  f.Int("gen-tokens", &o.gen_tokens, "tokens generated per prompt", 2, 1 << 20);
  c.AddFlags(f);
  return RunWithFlags(f, rest, [&]() -> absl::Status {
    ORYX_RETURN_IF_ERROR(c.ParseShapes(o.batches, o.contexts));
    if (!ks.empty()) {
      ORYX_ASSIGN_OR_RETURN(o.ks, ParsePositiveInts(ks, "k"));
    }
    if (!proposers.empty()) {
      o.proposers.clear();
      for (const std::string& p : proposers) {
        for (absl::string_view part : absl::StrSplit(p, ',', absl::SkipEmpty())) {
          if (part != "linear" && part != "ngram") {
            return absl::InvalidArgumentError(Cat("unknown proposer '", std::string(part), "' (linear, ngram)"));
          }
          o.proposers.emplace_back(part);
        }
      }
    }
    o.threads = static_cast<int>(c.threads);
    c.out.row = [header = true](const nlohmann::json& j) mutable {
      if (header) {
        std::printf("%-22s %8s %6s %8s %10s %10s %10s %9s %8s\n", "policy", "context", "batch", "accept",
                    "acc/round", "draft ms", "verify ms", "speedup", "same");
        header = false;
      }
      std::printf("%-22s %8lld %6lld %8.3f %10.2f %10.2f %10.2f %8.2fx %8lld\n", j["policy"].get<std::string>().c_str(),
                  static_cast<long long>(j["context"].get<int64_t>()), static_cast<long long>(j["batch"].get<int64_t>()),
                  j["acceptance_rate"].get<double>(), j["mean_accepted_per_round"].get<double>(),
                  j["draft_step_ms"].get<double>(), j["verify_ms"].get<double>(), j["speedup"].get<double>(),
                  static_cast<long long>(j["outputs_identical_to_attention"].get<int64_t>()));
      std::fflush(stdout);
    };
    ORYX_RETURN_IF_ERROR(bench::RunSpecBench(o, [&](const nlohmann::json& j) { c.out.Emit(j); }));
    return c.out.Finish();
  });
}

int BenchCost(const Args& rest) {
  BenchFlags c;
  bench::CostBenchOptions o;
  int64_t repeats = o.repeats;
  FlagSet f("oryx bench cost [--model DIR] [--device cpu|cuda] [--repeats N] [--json]",
            "Fits the router's cost model (dense FLOPs, KV bytes, attention and recurrence FLOPs of a forward\n"
            "span, plus a fixed cost per forward) to measured span times on a grid of batch sizes, span\n"
            "lengths (prefill segments included), contexts and modes, as `train-router --cost time` does,\n"
            "then reports its error on held-out shapes. Without --model: random weights of the\n"
            "19M-parameter decode-benchmark config.");
  f.String("model", &o.model_dir, "model directory (default: random weights)");
  f.String("device", &o.device, "cpu | cuda");
  f.Int("repeats", &repeats, "timed runs per shape (median)", 1, 1000);
  f.Int("threads", &c.threads, "CPU threads (0: one per hardware thread)", 0, 1024);
  f.Bool("json", &c.out.json, "print JSON lines instead of a table");
  f.String("out", &c.out.out_file, "also write the JSON lines to this file (atomically)");
  return RunWithFlags(f, rest, [&]() -> absl::Status {
    o.repeats = static_cast<int>(repeats);
    o.threads = static_cast<int>(c.threads);
    c.out.row = [header = true](const nlohmann::json& j) mutable {
      if (j.contains("summary")) {
        std::printf("\nheld-out shapes within 20%%: %d of %d; mean |error| %.1f%%, max %.1f%% (calibration: %.1f%%)\n",
                    j["held_out_within_20_percent"].get<int>(), j["held_out_shapes"].get<int>(),
                    100 * j["mean_abs_relative_error"].get<double>(), 100 * j["max_abs_relative_error"].get<double>(),
                    100 * j["calibration_mean_abs_relative_error"].get<double>());
        return;
      }
      if (j.contains("calibration")) return;  // the table shows the held-out shapes; --json has both
      if (header) {
        std::printf("%-10s %6s %7s %8s %12s %13s %8s\n", "mode", "batch", "tokens", "context", "measured ms",
                    "predicted ms", "error");
        header = false;
      }
      std::printf("%-10s %6lld %7lld %8lld %12.2f %13.2f %7.1f%%\n", j["mode"].get<std::string>().c_str(),
                  static_cast<long long>(j["batch"].get<int64_t>()), static_cast<long long>(j["tokens"].get<int64_t>()),
                  static_cast<long long>(j["context"].get<int64_t>()), j["measured_ms"].get<double>(),
                  j["predicted_ms"].get<double>(), 100 * j["relative_error"].get<double>());
      std::fflush(stdout);
    };
    ORYX_RETURN_IF_ERROR(bench::RunCostBench(o, [&](const nlohmann::json& j) { c.out.Emit(j); }));
    return c.out.Finish();
  });
}

int BenchRouter(const Args& rest) {
  BenchFlags c;
  bench::RouterBenchOptions o;
  std::vector<std::string> tasks, policies, lengths, haystack;
  int64_t seeds = o.seeds;
  bool no_oracle = false;
  FlagSet f("oryx bench router --model DIR --data DIR|--haystack FILE... [--tasks T...] [--policies P...] [--json]",
            "Routing policies end to end on retrieval: for needle-in-a-haystack the engine generates each\n"
            "example's answer greedily under the policy, and the answer counts when it is exact; for MQAR the\n"
            "sequence is teacher-forced in the policy's modes and each query counts when its answer is the\n"
            "argmax. Reports accuracy, the share of tokens run in attention mode and GFLOPs per token per\n"
            "(task, length, policy); per policy over all lengths,\n"
            "with the share of the all-linear -> all-attention gap it recovers; and the best policy at 5%,\n"
            "10% and 20% attention. Also runs random routing (random:F) and an oracle that attends exactly\n"
            "on the asked needle. Held-out examples: seeds of the evaluation grid, not the trainer's.");
  f.String("model", &o.model_dir, "model directory", true);
  f.String("data", &o.data_dir, "corpus directory (haystack from its validation split)");
  f.StringList("haystack", &haystack, "text files for the haystack instead of --data");
  f.StringList("tasks", &tasks, "niah, niah-multikey, passkey, mqar [default: niah niah-multikey mqar]");
  f.StringList("policies", &policies, "policies to compare (the oracle is added unless --no-oracle)");
  f.StringList("lengths", &lengths, "sequence lengths [default: 256 512 1024]");
  f.Int("seeds", &seeds, "examples per (length, depth)", 1, 10000);
  f.Bool("no-oracle", &no_oracle, "leave the oracle out");
  f.Int("threads", &c.threads, "CPU threads (0: one per hardware thread)", 0, 1024);
  f.Bool("json", &c.out.json, "print JSON lines instead of a table");
  f.String("out", &c.out.out_file, "also write the JSON lines to this file (atomically)");
  return RunWithFlags(f, rest, [&]() -> absl::Status {
    o.haystack_files = haystack;
    if (o.data_dir.empty() == haystack.empty()) return absl::InvalidArgumentError("give exactly one of --data and --haystack");
    if (!tasks.empty()) o.tasks = SplitList(tasks);
    if (!policies.empty()) o.policies = SplitList(policies);
    if (!lengths.empty()) {
      ORYX_ASSIGN_OR_RETURN(std::vector<int64_t> ls, ParsePositiveInts(lengths, "lengths"));
      o.lengths.assign(ls.begin(), ls.end());
    }
    o.seeds = static_cast<int32_t>(seeds);
    o.oracle = !no_oracle;
    o.threads = static_cast<int>(c.threads);
    c.out.row = [](const nlohmann::json& j) {
      if (j.contains("summary") && j["summary"].is_string()) {
        std::printf("%s: all-attention %.3f, all-linear %.3f\n", j["task"].get<std::string>().c_str(),
                    j["attention_accuracy"].get<double>(), j["linear_accuracy"].get<double>());
        for (const char* k : {"best_at_5pct", "best_at_10pct", "best_at_20pct"}) {
          const auto& b = j[k];
          std::printf("  %-14s %-28s accuracy %.3f, gap recovered %.2f\n", k, b["policy"].get<std::string>().c_str(),
                      b["accuracy"].get<double>(), b["gap_recovered"].get<double>());
        }
        return;
      }
      const bool summary = j.contains("summary");
      std::printf("%-14s %6s %-28s %5d %9.3f %10.3f %10.4f%s\n", j["task"].get<std::string>().c_str(),
                  summary ? "all" : std::to_string(j["length"].get<int>()).c_str(),
                  j["policy"].get<std::string>().c_str(), static_cast<int>(j["n"].get<double>()),
                  j["accuracy"].get<double>(), j["attention_fraction"].get<double>(),
                  j["gflops_per_token"].get<double>(),
                  j.contains("gap_recovered") ? Cat("   gap recovered ", j["gap_recovered"].get<double>()).c_str() : "");
      std::fflush(stdout);
    };
    std::printf("%-14s %6s %-28s %5s %9s %10s %10s\n", "task", "length", "policy", "n", "accuracy", "attn frac",
                "GFLOP/tok");
    ORYX_RETURN_IF_ERROR(bench::RunRouterBench(o, [&](const nlohmann::json& j) { c.out.Emit(j); }));
    return c.out.Finish();
  });
}

#ifdef ORYX_HAVE_SERVER
int BenchServe(const Args& rest) {
  BenchFlags c;
  bench::ServeBenchOptions o;
  std::vector<std::string> levels, rates;
  int64_t requests = 0, seed = 1;
  bool no_prefix_cache = false;
  FlagSet f("oryx bench serve --model DIR [--concurrency 1,4,16 | --rates 5,20] [--prompt-tokens N] [--max-tokens N]",
            "Starts `oryx serve` in this process on a free port and loads it: at each concurrency level, that\n"
            "many clients send streaming completions back to back over HTTP (prompts of --prompt-tokens:\n"
            "random token ids, or --data's validation text; exactly --max-tokens generated). Reports\n"
            "requests/s, generated tokens/s, time to first token, latency, time between tokens and the\n"
            "server's mean decode batch per level.\n"
            "With --device cuda and no --model: random weights of --config (130m, 1.4b).");
  f.String("model", &o.model_dir, "model directory");
  f.String("device", &o.device, "cpu | cuda");
  f.String("config", &o.preset, "cuda without --model: random weights of 130m | 1.4b");
  f.StringList("concurrency", &levels, "concurrent clients, one level each (default 1,4,16)");
  f.StringList("rates", &rates, "open loop instead: request arrival rates per second (Poisson), one level each");
  f.Int("requests", &requests, "requests per level (0: 4 x the level, at least 8)", 0, 1 << 20);
  f.Int("prompt-tokens", &o.prompt_tokens, "prompt length in tokens", 1, 1 << 24);
  f.Int("shared-prefix", &o.shared_prefix_tokens,
        "the first N tokens of a level's prompts are the same (a system prompt), the rest differ", 0, 1 << 24);
  f.Bool("no-prefix-cache", &no_prefix_cache, "every prompt computed in full (the prefix cache off)");
  f.Int("prefix-snapshot-every", &o.prefix_snapshot_every,
        "the prefix cache snapshots prompts every N tokens (a multiple of 64; 0: the backend's prefill span for one "
        "prompt, at least 2048)",
        0, 1 << 30);
  f.Int("max-tokens", &o.max_tokens, "tokens generated per request", 1, 1 << 24);
  f.String("policy", &o.policy, "mode policy of every request; several, comma-separated: request i takes the (i mod n)-th");
  f.String("data", &o.data_dir, "a corpus: prompts from its validation split (default: random token ids)");
  f.Int("max-batch", &o.max_batch, "the server's batch bound (0: the largest level)", 0, 4096);
  f.Int("max-prefill-tokens", &o.max_prefill_tokens, "the server's prompt tokens per step at most (0: no bound)", 0,
        1 << 30);
  int64_t kv_memory_mib = 0;
  f.Int("kv-memory", &kv_memory_mib, "the server's KV memory in MiB (0: the device's)", 0, int64_t{1} << 30);
  f.Int("seed", &seed, "prompt seed", 0);
  f.Int("threads", &c.threads, "CPU threads (0: one per hardware thread)", 0, 1024);
  f.Bool("json", &c.out.json, "print JSON lines instead of a table");
  f.String("out", &c.out.out_file, "also write the JSON lines to this file (atomically)");
  return RunWithFlags(f, rest, [&]() -> absl::Status {
    o.kv_memory = kv_memory_mib << 20;
    if (!levels.empty()) {
      ORYX_ASSIGN_OR_RETURN(o.concurrency, ParsePositiveInts(levels, "concurrency"));
    }
    if (!levels.empty() && !rates.empty()) {
      return absl::InvalidArgumentError("give --concurrency (closed loop) or --rates (open loop), not both");
    }
    for (absl::string_view r : absl::StrSplit(absl::StrJoin(rates, ","), ',', absl::SkipEmpty())) {
      double rate = 0;
      if (!absl::SimpleAtod(r, &rate) || !(rate > 0)) {
        return absl::InvalidArgumentError(Cat("--rates: '", r, "' is not a positive number of requests per second"));
      }
      o.rates.push_back(rate);
    }
    if (o.device != "cpu" && o.device != "cuda") return absl::InvalidArgumentError(Cat("--device: '", o.device, "' (cpu, cuda)"));
    o.requests = requests;
    o.prefix_cache = !no_prefix_cache;
    if (o.prefix_snapshot_every % 64 != 0) {
      return absl::InvalidArgumentError(Cat("--prefix-snapshot-every ", o.prefix_snapshot_every, " is not a multiple of 64"));
    }
    o.seed = static_cast<uint64_t>(seed);
    o.threads = static_cast<int>(c.threads);
    c.out.row = [header = true](const nlohmann::json& j) mutable {
      if (header) {
        std::printf("%9s %8s %8s %10s %14s %14s %12s %12s %10s %10s\n", "load", "requests", "req/s", "tokens/s",
                    "TTFT p50/p90", "latency p50", "inter-token", "gap p99", "mean batch", "steps");
        header = false;
      }
      const std::string load = j.contains("arrival_rate_per_s")
                                   ? absl::StrFormat("%.4g/s", j["arrival_rate_per_s"].get<double>())
                                   : absl::StrFormat("%d", j["concurrency"].get<int64_t>());
      std::printf("%9s %8lld %8.2f %10.1f %6.1f/%6.1f ms %11.1f ms %9.2f ms %9.2f ms %10.2f %10lld\n", load.c_str(),
                  static_cast<long long>(j["requests"].get<int64_t>()), j["requests_per_s"].get<double>(),
                  j["generated_tokens_per_s"].get<double>(), j["ttft_ms"]["p50"].get<double>(),
                  j["ttft_ms"]["p90"].get<double>(), j["latency_ms"]["p50"].get<double>(),
                  j["inter_token_ms_p50"].get<double>(), j["token_gap_ms"]["p99"].get<double>(),
                  j["mean_decode_batch"].get<double>(),
                  static_cast<long long>(j["server_steps"].get<int64_t>()));
      if (j.contains("acceptance_rate")) std::printf("        drafts accepted: %.1f%%\n", 100 * j["acceptance_rate"].get<double>());
      if (j["prefix_hit_rate"].get<double>() > 0) {
        std::printf("        prompt tokens from the prefix cache: %.1f%%, TTFT p99 %.1f ms\n",
                    100 * j["prefix_hit_rate"].get<double>(), j["ttft_ms"]["p99"].get<double>());
      }
      std::fflush(stdout);
    };
    ORYX_RETURN_IF_ERROR(bench::RunServeBench(o, [&](const nlohmann::json& j) { c.out.Emit(j); }));
    return c.out.Finish();
  });
}
#endif

}  // namespace

int RunBench(const Args& args) {
  static const char* kUsage =
      "usage: oryx bench <decode|spec|cost|router|serve> [flags]\n\n"
      "  decode   prefill and decode tokens/s by mode, batch and context, against the memory-bandwidth\n"
      "           roofline (beside LibTorch's token-by-token decode when run as oryx-torch bench decode)\n"
      "  spec     speculative decoding against attention-mode decoding on a trained model\n"
      "  cost     calibrate the router's cost model and measure its error on held-out span shapes\n"
      "  router   retrieval accuracy against attention-token fraction for routing policies\n"
      "  serve    the HTTP server under load: throughput and latency by concurrent clients or arrival rate\n\n"
      "Run 'oryx bench <kind> --help' for its flags.\n";
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string kind = args[0];
  const Args rest(args.begin() + 1, args.end());
  if (kind == "decode") return BenchDecode(rest);
  if (kind == "spec") return BenchSpec(rest);
  if (kind == "cost") return BenchCost(rest);
  if (kind == "router") return BenchRouter(rest);
#ifdef ORYX_HAVE_SERVER
  if (kind == "serve") return BenchServe(rest);
#endif
  std::cerr << "oryx: error: unknown bench '" << kind << "' (decode, spec, cost, router, serve)\n";
  return 2;
}

}  // namespace oryx::cli
