// CPU decode speed of the engine against the LibTorch reference model, side by side in one run, for a
// random-weight model of a given size: per-token decode time in attention and linear mode after a
// context of N tokens, the ratio engine / LibTorch, and the fraction of the memory-bandwidth roofline
// (bytes a decode step must move: all weights in fp32, plus the KV cache it reads in attention mode,
// over the copy bandwidth measured in the same run). JSON lines on stdout.
//
//   bench_decode_cpu [--contexts 256,1024] [--steps 16] [--d-model 384 --layers 6 --heads 6 --head-dim 64
//                    --mlp-hidden 1024 --vocab 8192] [--threads N]
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "engine/file_util.h"
#include "engine/model.h"
#include "kernels/stream.h"
#include "train/torch_io.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int64_t> contexts = {256, 1024};
  int64_t steps = 16;
  int64_t d_model = 384, layers = 6, heads = 6, head_dim = 64, mlp_hidden = 1024, vocab = 8192;
  int threads = 0;
};

bool Parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << "usage: bench_decode_cpu [--contexts N,N] [--steps N] [--d-model N] [--layers N] [--heads N]\n"
                   "                        [--head-dim N] [--mlp-hidden N] [--vocab N] [--threads N]\n";
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::cerr << "bench_decode_cpu: error: " << a << " needs a value\n";
      return false;
    }
    const std::string v = argv[++i];
    int64_t x = 0;
    if (a == "--contexts") {
      o->contexts.clear();
      for (absl::string_view part : absl::StrSplit(v, ',')) {
        if (!absl::SimpleAtoi(part, &x) || x < 1) return std::cerr << "bench_decode_cpu: error: bad --contexts\n", false;
        o->contexts.push_back(x);
      }
      continue;
    }
    if (!absl::SimpleAtoi(v, &x) || x < 1) {
      std::cerr << "bench_decode_cpu: error: " << a << " needs a positive integer, got '" << v << "'\n";
      return false;
    }
    if (a == "--steps") o->steps = x;
    else if (a == "--d-model") o->d_model = x;
    else if (a == "--layers") o->layers = x;
    else if (a == "--heads") o->heads = x;
    else if (a == "--head-dim") o->head_dim = x;
    else if (a == "--mlp-hidden") o->mlp_hidden = x;
    else if (a == "--vocab") o->vocab = x;
    else if (a == "--threads") o->threads = static_cast<int>(x);
    else return std::cerr << "bench_decode_cpu: error: unknown flag " << a << "\n", false;
  }
  return true;
}

double CopyBandwidth() {
  const int64_t n = 64 << 20;  // 256 MiB per buffer
  std::vector<float> x(n, 1.f), y(n);
  std::vector<double> s;
  for (int i = 0; i < 4; ++i) {
    auto t0 = Clock::now();
    oryx::kernels::cpu::StreamCopy({n, x.data(), y.data(), nullptr});
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return 2.0 * n * 4 / oryx::bench::Median(s);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!Parse(argc, argv, &o)) return 2;
  if (o.threads > 0) torch::set_num_threads(o.threads);
  oryx::ModelConfig c;
  c.vocab_size = o.vocab;
  c.d_model = o.d_model;
  c.n_layers = o.layers;
  c.n_heads = o.heads;
  c.head_dim = o.head_dim;
  c.mlp_hidden = o.mlp_hidden;
  c.rope_theta = 10000;
  c.tie_embeddings = true;
  int64_t max_context = 0;
  for (int64_t n : o.contexts) max_context = std::max(max_context, n);
  c.max_position = max_context + o.steps + 1;
  c.bos_id = 2;
  c.eos_id = 3;
  const std::string dir = "/tmp/oryx_bench_decode_" + std::to_string(getpid());
  oryx::train::OryxModel reference(c, 1);
  reference->eval();
  { std::ofstream(dir + ".tok") << "unused"; }
  if (auto s = oryx::train::ExportCheckpoint(reference, dir, dir + ".tok"); !s.ok()) {
    std::cerr << "bench_decode_cpu: error: " << s.message() << "\n";
    return 1;
  }
  auto engine = oryx::Model::Load(dir);
  (void)oryx::RemoveTree(dir);
  (void)oryx::RemoveTree(dir + ".tok");
  if (!engine.ok()) {
    std::cerr << "bench_decode_cpu: error: " << engine.status().message() << "\n";
    return 1;
  }
  int64_t params = 0;
  for (const auto& p : reference->parameters()) params += p.numel();
  const double bandwidth = CopyBandwidth();
  torch::NoGradGuard no_grad;
  for (int64_t context : o.contexts) {
    for (bool attention : {true, false}) {
      const oryx::Mode mode = attention ? oryx::Mode::kAttention : oryx::Mode::kLinear;
      // Engine: prefill the context as one span, then single-token decode steps.
      oryx::SequenceState seq = engine->NewSequence();
      std::vector<int32_t> ctx(context);
      for (int64_t t = 0; t < context; ++t) ctx[t] = static_cast<int32_t>((t * 7919) % o.vocab);
      std::vector<oryx::Mode> ctx_modes(context, oryx::Mode::kAttention);
      std::vector<float> logits;
      if (!engine->Forward(seq, ctx, ctx_modes, false, &logits).ok()) return 1;
      std::vector<double> engine_s;
      for (int64_t i = 0; i < o.steps; ++i) {
        const int32_t tok = static_cast<int32_t>(i % o.vocab);
        auto t0 = Clock::now();
        if (!engine->Forward(seq, std::span(&tok, 1), std::span(&mode, 1), false, &logits).ok()) return 1;
        engine_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      // LibTorch reference: token-by-token state (its prefill is token by token too).
      auto state = reference->InitialState(1);
      auto on = torch::full({1}, true, torch::kBool), mode_t = torch::full({1}, attention, torch::kBool);
      for (int64_t t = 0; t < context; ++t) reference->StepReference(torch::full({1}, int64_t{ctx[t]}), on, state);
      std::vector<double> torch_s;
      for (int64_t i = 0; i < o.steps; ++i) {
        auto t0 = Clock::now();
        reference->StepReference(torch::full({1}, i % o.vocab), mode_t, state);
        torch_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      const double engine_step = oryx::bench::Median(engine_s), torch_step = oryx::bench::Median(torch_s);
      const double kv_bytes = attention ? 2.0 * 4 * c.n_layers * (context + 1) * c.qk_dim() : 0.0;
      const double state_bytes = 2.0 * 4 * c.n_layers * c.n_heads * c.head_dim * c.head_dim;
      const double bytes = 4.0 * params + kv_bytes + state_bytes;
      nlohmann::json r = {{"bench", "decode_cpu"}, {"mode", attention ? "attention" : "linear"},
                          {"context", context}, {"params", params}, {"steps", o.steps},
                          {"engine_ms_per_token", engine_step * 1e3}, {"libtorch_ms_per_token", torch_step * 1e3},
                          {"engine_speedup_over_libtorch", torch_step / engine_step},
                          {"bytes_per_step", bytes}, {"copy_bandwidth_gb_s", bandwidth / 1e9},
                          {"roofline_fraction", bytes / bandwidth / engine_step},
                          {"machine", oryx::bench::MachineInfo()}, {"git", oryx::bench::GitRevision()},
                          {"time", oryx::bench::UtcTimestamp()}};
      std::cout << r.dump() << std::endl;
    }
  }
  return 0;
}
