// The decode step's products, each timed alone at batch 1: the fused input projection (RMSNorm prologue),
// the output projection (gated-norm prologue), the MLP's up projection with the SwiGLU epilogue, the down
// projection (residual add), each launched back to back in a CUDA graph (with programmatic launch, as in a
// decode step) over enough distinct copies of its weights that none is still in L2 when it comes round
// again; beside them, a plain streaming read of the same bytes. One JSON line per product: µs per call and
// the bandwidth reached. Where a decode step's time goes between its kernels' bytes and their fixed costs.
// With --rows, the same four products' shapes at several rows of x (a batch's decode step, a verify span):
// FP8 weights (the GEMVs up to 7 rows, the tensor-core kernel from 8) against bf16 weights through Gemm's own
// choice and through each of its bf16 kernels ("path": the tensor-core GEMV, the several-row GEMV, cuBLAS),
// bytes counted as each reads them.
//
//   bench_gemv [--config 1.4b|130m] [--calls N] [--rows 8,16,32,64]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/flags.h"
#include "bench/bench_util.h"
#include "engine/json_text.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/stream.h"

namespace {

namespace kc = oryx::kernels::cuda;
using kc::bf16;

struct Shape {
  std::string name;
  int64_t d, heads, head_dim, mlp;
};

struct Options {
  Shape shape{"1.4b", 2048, 16, 128, 5440};
  int calls = 64;
  std::vector<int64_t> rows;  // --rows: the several-row products instead
};

// Mean µs per call of `launch(i)` for i = 0..calls-1, captured as one graph and replayed (best of 5).
template <typename F>
double TimeCalls(cudaStream_t stream, int calls, F&& launch) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ORYX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) launch(i);
  ORYX_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ORYX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  ORYX_CUDA_CHECK(cudaEventCreate(&e0));
  ORYX_CUDA_CHECK(cudaEventCreate(&e1));
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {
    ORYX_CUDA_CHECK(cudaEventRecord(e0, stream));
    ORYX_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    ORYX_CUDA_CHECK(cudaEventRecord(e1, stream));
    ORYX_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    ORYX_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (rep > 0) best = std::min(best, 1e3 * ms / calls);  // (the first replay warms up)
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return best;
}

// A stream, a cuBLAS handle on it and zeroed device buffers, released together.
struct Gpu {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  std::vector<void*> owned;
  Gpu() {
    ORYX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ORYX_CUBLAS_CHECK(cublasCreate(&cublas));
    ORYX_CUBLAS_CHECK(cublasSetStream(cublas, stream));
  }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
  ~Gpu() {
    cudaStreamSynchronize(stream);
    for (void* p : owned) cudaFree(p);
    cublasDestroy(cublas);
    cudaStreamDestroy(stream);
  }
  void* Alloc(int64_t bytes) {
    void* p = nullptr;
    ORYX_CUDA_CHECK(cudaMalloc(&p, bytes));
    ORYX_CUDA_CHECK(cudaMemset(p, 0, bytes));
    owned.push_back(p);
    return p;
  }
};

std::vector<nlohmann::json> Run(const Options& o) {
  const Shape& s = o.shape;
  const int64_t D = s.d, HD = s.heads * s.head_dim, F = s.mlp, P = 4 * HD + s.heads;  // mamba2, linear mode
  Gpu gpu;
  cudaStream_t stream = gpu.stream;
  cublasHandle_t cublas = gpu.cublas;
  auto alloc = [&](int64_t bytes) { return gpu.Alloc(bytes); };
  // Activations (small, shared by every call) and the norms.
  auto* x = static_cast<float*>(alloc(D * 4));
  auto* o_in = static_cast<float*>(alloc(HD * 4));
  auto* gate = static_cast<float*>(alloc(HD * 4));
  auto* norm = static_cast<float*>(alloc(std::max(D, s.head_dim) * 4));
  auto* y = static_cast<float*>(alloc(std::max({P, D, 2 * F}) * 4));
  auto* act = static_cast<bf16*>(alloc(F * 2));
  kc::FillUniform(x, D, 1, -1.f, 1.f, stream);
  kc::FillUniform(o_in, HD, 2, -1.f, 1.f, stream);
  kc::FillUniform(gate, HD, 3, -1.f, 1.f, stream);
  kc::FillUniform(norm, std::max(D, s.head_dim), 4, 0.5f, 1.5f, stream);
  kc::FillUniform(act, F, 5, -1.f, 1.f, stream);
  // Weight copies: 256 MiB of each product's weights at least (five times the H200's 50 MiB L2).
  auto copies = [&](int64_t rows, int64_t cols) {
    const int64_t bytes = rows * cols * 2, n = std::max<int64_t>(2, (int64_t{256} << 20) / bytes);
    std::vector<const bf16*> w;
    for (int64_t i = 0; i < n; ++i) {
      auto* p = static_cast<bf16*>(alloc(bytes));
      kc::FillUniform(p, rows * cols, 100 + static_cast<uint32_t>(i), -0.02f, 0.02f, stream);
      w.push_back(p);
    }
    return w;
  };
  std::vector<nlohmann::json> out;
  auto emit = [&](const std::string& op, int64_t rows, int64_t cols, double us) {
    const double bytes = 2.0 * rows * cols;
    out.push_back({{"bench", "gemv"}, {"config", s.name}, {"op", op}, {"rows", rows}, {"cols", cols},
                   {"weight_bytes", bytes}, {"us_per_call", us}, {"gb_per_s", bytes / us / 1e3},
                   {"calls", o.calls}});
  };
  const char* early = std::getenv("ORYX_CUDA_EARLY_LOADS");
  const auto in_w = copies(P, D), o_w = copies(D, HD), up_w = copies(2 * F, D), down_w = copies(D, F);
  emit("in_proj (RMSNorm prologue)", P, D, TimeCalls(stream, o.calls, [&](int i) {
         kc::FusedGemvParams p{1, P, D, kc::GemvInput::kRmsNorm, 1e-6f, 0, D, 0, P, x, nullptr, norm,
                               in_w[i % in_w.size()], y, false};
         kc::FusedGemv(p, stream);
       }));
  emit("o_proj (gated-norm prologue, residual add)", D, HD, TimeCalls(stream, o.calls, [&](int i) {
         kc::FusedGemvParams p{1, D, HD, kc::GemvInput::kGatedNorm, 1e-6f, s.head_dim, HD, HD, D, o_in, gate, norm,
                               o_w[i % o_w.size()], y, true};
         kc::FusedGemv(p, stream);
       }));
  emit("mlp_in (RMSNorm prologue, SwiGLU epilogue)", 2 * F, D, TimeCalls(stream, o.calls, [&](int i) {
         kc::FusedGemvParams p{1, 2 * F, D, kc::GemvInput::kRmsNorm, 1e-6f, 0, D, 0, F, x, nullptr, norm,
                               up_w[i % up_w.size()], nullptr, false};
         p.maybe_swiglu_ptr = act;
         kc::FusedGemv(p, stream);
       }));
  emit("mlp_down (residual add)", D, F, TimeCalls(stream, o.calls, [&](int i) {
         kc::Gemm({1, D, F, F, D, act, down_w[i % down_w.size()], y, true}, cublas);
       }));
  // A streaming read of in_proj's bytes (fp32 sum), the same way.
  float* sum = static_cast<float*>(alloc(4));
  emit("stream read (in_proj's bytes)", P, D, TimeCalls(stream, o.calls, [&](int i) {
         const bf16* w = in_w[i % in_w.size()];
         oryx::kernels::StreamParams p{P * D / 2, reinterpret_cast<const float*>(w), nullptr, sum};
         oryx::kernels::cuda::StreamSum(p, stream);
       }));
  ORYX_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto& r : out) r["early_loads"] = early == nullptr || early[0] != '0';
  return out;
}

// The products' shapes at each of o.rows rows: FP8 weights against bf16, plain products (no prologue; y
// overwritten), each over copies of its weights that exceed L2.
std::vector<nlohmann::json> RunRows(const Options& o) {
  const Shape& s = o.shape;
  const int64_t D = s.d, HD = s.heads * s.head_dim, F = s.mlp, P = 4 * HD + s.heads;
  const int64_t max_rows = *std::max_element(o.rows.begin(), o.rows.end());
  Gpu gpu;
  cudaStream_t stream = gpu.stream;
  cublasHandle_t cublas = gpu.cublas;
  auto alloc = [&](int64_t bytes) { return gpu.Alloc(bytes); };
  const int64_t widest = std::max({P, D, 2 * F, HD});
  auto* x = static_cast<bf16*>(alloc(max_rows * widest * 2));
  auto* y = static_cast<float*>(alloc(max_rows * widest * 4));
  kc::FillUniform(x, max_rows * widest, 1, -1.f, 1.f, stream);
  struct Weights {
    std::vector<const bf16*> bf16s;
    std::vector<const kc::fp8*> fp8s;
    std::vector<const float*> scales;
  };
  // 256 MiB of copies at least, in each format (five times the H200's 50 MiB L2).
  auto copies = [&](int64_t rows, int64_t cols) {
    Weights w;
    const int64_t n = std::max<int64_t>(2, (int64_t{256} << 20) / (rows * cols));
    for (int64_t i = 0; i < n; ++i) {
      auto* b = static_cast<bf16*>(alloc(rows * cols * 2));
      kc::FillUniform(b, rows * cols, 100 + static_cast<uint32_t>(i), -0.02f, 0.02f, stream);
      auto* q = static_cast<kc::fp8*>(alloc(rows * cols));
      auto* scale = static_cast<float*>(alloc(rows * 4));
      kc::QuantizeRowsFp8(b, rows, cols, q, scale, stream);
      w.bf16s.push_back(b);
      w.fp8s.push_back(q);
      w.scales.push_back(scale);
    }
    return w;
  };
  struct Product {
    std::string op;
    int64_t n, k;
  };
  const std::vector<Product> products = {
      {"in_proj", P, D}, {"o_proj", D, HD}, {"mlp_in", 2 * F, D}, {"mlp_down", D, F}};
  // The kernels compared, each by the switches that route Gemm to it: FP8 weights by Gemm's own choice, by the
  // tensor-core GEMV (2-32 rows) and by the kernels before it (the several-row GEMV, the FP8 tensor-core
  // kernel), and bf16 weights by Gemm's own choice, by the tensor-core GEMV, by the several-row GEMV (2-8) and
  // by cuBLAS. A path is timed where its kernel takes the product under its switches.
  struct Path {
    const char* name;
    bool fp8;
    kc::KernelSwitches switches;
    bool (*takes)(const kc::GemmParams& p);
    void (*run)(const kc::GemmParams& p, void* cublas_handle) = kc::Gemm;
  };
  const kc::KernelSwitches defaults = kc::GetKernelSwitches();
  kc::KernelSwitches mma = defaults, multirow = defaults, fp8_gemv = defaults, fp8_older = defaults;
  fp8_gemv.fp8_mma_gemv_max_rows = static_cast<int>(kc::kMmaGemvMaxRows);
  fp8_older.fp8_mma_gemv_max_rows = 0;
  mma.bf16_mma_gemv_max_rows = static_cast<int>(kc::kMmaGemvMaxRows);
  mma.multirow_bf16 = kc::KernelSwitches::MultiRow::kOff;
  multirow.bf16_mma_gemv_max_rows = 0;
  multirow.multirow_bf16 = kc::KernelSwitches::MultiRow::kOn;
  auto always = [](const kc::GemmParams&) { return true; };
  auto multirow_takes = [](const kc::GemmParams& p) { return p.m > 1 && kc::GemvApplies(p); };
  const std::vector<Path> paths = {{"fp8", true, defaults, always},
                                   {"fp8-mma-gemv", true, fp8_gemv, kc::MmaGemvApplies},
                                   {"fp8-older", true, fp8_older, always},
                                   {"bf16", false, defaults, always},
                                   {"bf16-mma", false, mma, kc::MmaGemvApplies},
                                   {"bf16-multirow", false, multirow, multirow_takes},
                                   {"bf16-cublas", false, defaults, always, kc::GemmCublas}};
  std::vector<nlohmann::json> out;
  for (const Product& product : products) {
    const Weights w = copies(product.n, product.k);
    for (const int64_t m : o.rows) {
      for (const Path& path : paths) {
        // The product over copy c of the weights.
        auto params = [&](size_t c) {
          kc::GemmParams p{m, product.n, product.k, product.k, product.n, x, w.bf16s[c], y};
          if (path.fp8) p.w_ptr = w.fp8s[c], p.w_scale = w.scales[c];
          return p;
        };
        kc::SetKernelSwitches(path.switches);
        if (!path.takes(params(0))) continue;
        const double us = TimeCalls(stream, o.calls,
                                    [&](int i) { path.run(params(static_cast<size_t>(i) % w.fp8s.size()), cublas); });
        const double bytes = (path.fp8 ? 1.0 : 2.0) * product.n * product.k;
        out.push_back({{"bench", "gemm_rows"},
                       {"config", s.name},
                       {"op", product.op},
                       {"rows", m},
                       {"n", product.n},
                       {"k", product.k},
                       {"weights", path.fp8 ? "fp8" : "bf16"},
                       {"path", path.name},
                       {"weight_bytes", bytes},
                       {"us_per_call", us},
                       {"gb_per_s", bytes / us / 1e3},
                       {"calls", o.calls}});
      }
    }
    kc::SetKernelSwitches(defaults);
    ORYX_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "1.4b";
  int64_t calls = 64;
  std::string rows;
  oryx::FlagSet flags("bench_gemv [--config 1.4b|130m] [--calls N] [--rows 8,16,32,64]",
                      "Times the decode step's products alone on the GPU (batch 1, or FP8 against bf16 at --rows); "
                      "JSON lines.");
  flags.String("config", &config, "the shapes: 1.4b | 130m");
  flags.Int("calls", &calls, "calls per timed graph", 1, 4096);
  flags.String("rows", &rows, "rows of x, comma-separated (1-128): FP8 against bf16 weights at each");
  return oryx::RunWithFlags(flags, std::vector<std::string>(argv + 1, argv + argc), [&]() -> absl::Status {
    Options o;
    if (config == "130m") {
      o.shape = {"130m", 768, 12, 64, 2048};
    } else if (config != "1.4b") {
      return absl::InvalidArgumentError("unknown --config '" + config + "' (1.4b, 130m)");
    }
    o.calls = static_cast<int>(calls);
    for (const absl::string_view piece : absl::StrSplit(rows, ',', absl::SkipEmpty())) {
      int64_t m = 0;
      if (!absl::SimpleAtoi(piece, &m) || m < 1 || m > 128) {
        return absl::InvalidArgumentError("--rows: '" + std::string(piece) + "' is not a row count in 1-128");
      }
      o.rows.push_back(m);
    }
    if (kc::DeviceCount() == 0) return absl::FailedPreconditionError("no CUDA device is visible");
    for (auto& r : o.rows.empty() ? Run(o) : RunRows(o)) {
      r["git"] = oryx::bench::GitRevision();
      r["time"] = oryx::bench::UtcTimestamp();
      std::cout << oryx::JsonText(r) << "\n";
    }
    return absl::OkStatus();
  });
}
