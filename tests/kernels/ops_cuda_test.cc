// Each CUDA op (kernels/cuda/ops_cuda.h) against its CPU reference (kernels/cpu, the *Reference loops), on
// ragged batches of two sequences where the op takes a batch. Runs only where a CUDA device is visible.
//
// Tolerances, by what differs between the two sides:
//  - fp32 results from identical (bf16-representable) inputs differ only by summation order and, in
//    attention, __expf's few-ulp error: relative 1e-4 of the output's scale (kFp32Tol); the recurrences
//    and attention accumulate over up to 700 terms, which fp32 resolves to ~1e-6 relative per step.
//  - bf16 outputs (norms, SwiGLU, the KV cache) round an fp32 value that itself differs from the
//    reference's by ~1e-6 relative, so the rounding may land one bf16 step apart: 2^-8 relative (kBf16Tol).
#include "kernels/cuda/ops_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/ops.h"

namespace oryx::kernels {
namespace {

using cuda::bf16;
constexpr double kFp32Tol = 1e-4;
constexpr double kBf16Tol = 1.0 / 256;

// A device copy of a host vector, freed at scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : n_(host.size()) {
    ORYX_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(1, n_) * sizeof(T)));
    ORYX_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit DeviceBuffer(size_t n) : DeviceBuffer(std::vector<T>(n)) {}
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  std::vector<T> Host() const {
    std::vector<T> h(n_);
    ORYX_CUDA_CHECK(cudaDeviceSynchronize());
    ORYX_CUDA_CHECK(cudaMemcpy(h.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}
float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }
std::vector<float> RoundBf16(std::vector<float> v) {
  for (float& x : v) x = RoundBf16(x);
  return v;
}
std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}
std::vector<float> ToFloat(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// max |a - b| <= tol * max(max |b|, floor), over the given index range.
void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, double tol, const std::string& what,
                 double floor = 1e-3) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double scale = floor, worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < b.size(); ++i) scale = std::max(scale, double(std::abs(b[i])));
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = std::abs(double(a[i]) - b[i]);
    if (!(d <= worst)) worst = d, at = i;
  }
  EXPECT_LE(worst, tol * scale) << what << ": worst at " << at << ": " << a[at] << " vs " << b[at];
}

// bf16 outputs: each element within one bf16 step of the reference's value.
void ExpectBf16Close(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    ASSERT_LE(std::abs(a[i] - b[i]), kBf16Tol * std::abs(b[i]) + 1e-6) << what << " at " << i;
  }
}

// The kernel switches within a scope: changed through Set, restored at its end.
class ScopedSwitches {
 public:
  ScopedSwitches() = default;
  ScopedSwitches(const ScopedSwitches&) = delete;
  ~ScopedSwitches() { cuda::SetKernelSwitches(saved_); }
  template <typename Change>
  void Set(Change&& change) {
    cuda::KernelSwitches switches = cuda::GetKernelSwitches();
    change(switches);
    cuda::SetKernelSwitches(switches);
  }

 private:
  const cuda::KernelSwitches saved_ = cuda::GetKernelSwitches();
};

cublasHandle_t Cublas() {
  static cublasHandle_t handle = [] {
    cublasHandle_t h;
    ORYX_CUBLAS_CHECK(cublasCreate(&h));
    return h;
  }();
  return handle;
}

TEST(OpsCuda, GemmMatchesMatMulReferenceOnBothPaths) {
  // m == 1 takes the GEMV kernel (when K is a multiple of 8), larger m and odd K cuBLAS; m of 2-8 (K a
  // multiple of 8) the several-row GEMV when KernelSwitches::multirow_bf16 says so (kAuto: small products;
  // every shape here is one) and the tensor-core GEMV does not take it (bf16_mma_gemv_max_rows 0 here; its own
  // test below). The single-row
  // shapes take 4 warps per feature (n 300), 1 (n 8200) and, on a GPU of more than 64 SMs, 2 (n 2048); K =
  // 24592 is past what the GEMV copies into shared memory (48 KiB of x), so it reads x from global memory.
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {1, 300, 256}, {3, 77, 64},   {8, 129, 520},  {9, 64, 128},   {40, 33, 96},
      {2, 17, 10},   {1, 8200, 64}, {1, 2048, 512}, {1, 40, 24592}, {5, 2568, 512}};
  ScopedSwitches switches;
  using MultiRow = cuda::KernelSwitches::MultiRow;
  for (MultiRow mode : {MultiRow::kOff, MultiRow::kOn, MultiRow::kAuto}) {
    switches.Set([&](cuda::KernelSwitches& s) {
      s.multirow_bf16 = mode;
      s.bf16_mma_gemv_max_rows = 0;
    });
    SCOPED_TRACE("several-row GEMV for bf16: " + std::to_string(static_cast<int>(mode)));
    for (auto [m, n, k] : shapes) {
      const std::vector<float> x = RoundBf16(Random(m * k, 1)), w = RoundBf16(Random(n * k, 2));
      std::vector<float> ref(m * n);
      cpu::MatMulReference({m, n, k, k, k, n, x.data(), w.data(), ref.data()});
      DeviceBuffer<bf16> dx(ToBf16(x)), dw(ToBf16(w));
      DeviceBuffer<float> dy(m * n), dy2(m * n);
      EXPECT_EQ(cuda::GemvApplies({m, n, k, k, n, dx.get(), dw.get(), dy.get()}),
                k % 8 == 0 && (m == 1 || (m <= 8 && (mode == MultiRow::kOn || (mode == MultiRow::kAuto &&
                                                                               n * k <= cuda::kMultiRowMaxWeights)))));
      cuda::Gemm({m, n, k, k, n, dx.get(), dw.get(), dy.get()}, Cublas());
      cuda::GemmCublas({m, n, k, k, n, dx.get(), dw.get(), dy2.get()}, Cublas());
      // Sums of k products of magnitude <= 1: the scale is sqrt(k); fp32 order differences ~1e-7 * k.
      ExpectClose(dy.Host(), ref, kFp32Tol, "Gemm m=" + std::to_string(m), std::sqrt(double(k)));
      ExpectClose(dy2.Host(), ref, kFp32Tol, "GemmCublas m=" + std::to_string(m), std::sqrt(double(k)));
      // accumulate: y += x W^T on top of the first result.
      cuda::Gemm({m, n, k, k, n, dx.get(), dw.get(), dy.get(), true}, Cublas());
      std::vector<float> twice = ref;
      for (float& v : twice) v *= 2;
      ExpectClose(dy.Host(), twice, kFp32Tol, "Gemm accumulate m=" + std::to_string(m), std::sqrt(double(k)));
    }
  }
}

// The tensor-core GEMV's SwiGLU epilogue (GemmParams::maybe_swiglu_ptr) writes what the product followed by
// SwiGlu writes, bit for bit (the same sums in the same order): p is a plain product of even N into [M, N].
void ExpectSwiGluEpilogueExact(cuda::GemmParams p) {
  const int64_t f = p.n / 2;
  DeviceBuffer<bf16> separate(p.m * f), fused(p.m * f);
  cuda::Gemm(p, Cublas());
  cuda::SwiGlu({.rows = p.m, .d = f, .in_ptr = p.y_ptr, .y_ptr = separate.get()}, nullptr);
  p.maybe_swiglu_ptr = fused.get();
  cuda::Gemm(p, Cublas());
  const std::vector<float> a = ToFloat(fused.Host()), b = ToFloat(separate.Host());
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0) << "of " << a.size() << " SwiGLU outputs";
}

// bf16 weights against 2-32 rows on tensor cores (MmaGemvApplies), x and W rounded to bf16 so that only the
// summation order differs from MatMulReference. One to four tiles of 8 rows of x (two steps of K a buffer up
// to 16 rows, one beyond), partly past M; N not a multiple of 16 (a block's rows past the end); K of one
// step of 32 (fewer steps than warps) up to 5,440 (1.4b's down projection: 170 steps, 16 warps a block for
// N = 2048); N = 8208 (1.4b's input projection, 8 warps a block); x's rows further apart than K; each product
// also accumulating and, for even N, with the SwiGLU epilogue (the several-row GEMV, which Gemm asks first at
// 2-3 rows, is off). Past 8 rows only
// products of at most kMmaGemvWideMaxWeights weights; with the switch at 8 rows, 9 rows go elsewhere; at 0,
// none take it.
TEST(OpsCuda, Bf16TensorCoreProductMatchesMatMulReference) {
  ScopedSwitches switches;
  switches.Set([](cuda::KernelSwitches& s) {
    s.bf16_mma_gemv_max_rows = 32;
    s.multirow_bf16 = cuda::KernelSwitches::MultiRow::kOff;
  });
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {2, 16, 32},    {3, 33, 64},     {8, 129, 512}, {9, 100, 96},    {16, 2048, 5440},
      {17, 40, 2048}, {24, 8208, 256}, {31, 77, 160}, {32, 2048, 1024}};
  for (auto [m, n, k] : shapes) {
    SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k));
    const int64_t stride = k + 32;
    const std::vector<float> x = RoundBf16(Random(m * stride, 70)), w = RoundBf16(Random(n * k, 71));
    std::vector<float> ref(m * n);
    cpu::MatMulReference({m, n, k, stride, k, n, x.data(), w.data(), ref.data()});
    DeviceBuffer<bf16> dx(ToBf16(x)), dw(ToBf16(w));
    DeviceBuffer<float> dy(m * n);
    const cuda::GemmParams p{m, n, k, stride, n, dx.get(), dw.get(), dy.get()};
    ASSERT_TRUE(cuda::MmaGemvApplies(p));
    cuda::Gemm(p, Cublas());
    ExpectClose(dy.Host(), ref, kFp32Tol, "Gemm", std::sqrt(double(k)));
    cuda::GemmParams twice = p;
    twice.accumulate = true;
    cuda::Gemm(twice, Cublas());
    for (float& v : ref) v *= 2;
    ExpectClose(dy.Host(), ref, kFp32Tol, "Gemm accumulating", std::sqrt(double(k)));
    if (n % 2 == 0) ExpectSwiGluEpilogueExact(p);
  }
  DeviceBuffer<bf16> dx(std::vector<bf16>(64 * 64)), dw(std::vector<bf16>(64 * 64));
  DeviceBuffer<float> dy(64 * 64);
  // (The operands are only checked for alignment, so a large N may name them.)
  auto applies = [&](int64_t m, int64_t k, int64_t n = 64) {
    return cuda::MmaGemvApplies({m, n, k, 64, 64, dx.get(), dw.get(), dy.get()});
  };
  EXPECT_FALSE(applies(1, 64));                                 // one row: the GEMV
  EXPECT_FALSE(applies(33, 64));                                // past kMmaGemvMaxRows: cuBLAS
  EXPECT_FALSE(applies(4, 48));                                 // K not a multiple of 32
  const int64_t wide = cuda::kMmaGemvWideMaxWeights / 64 + 32;  // N of a product just past it at K = 64
  EXPECT_TRUE(applies(8, 64, wide));
  EXPECT_FALSE(applies(9, 64, wide));
  EXPECT_TRUE(applies(9, 64, wide - 64));
  switches.Set([](cuda::KernelSwitches& s) { s.bf16_mma_gemv_max_rows = 8; });
  EXPECT_TRUE(applies(8, 64));
  EXPECT_FALSE(applies(9, 64));
  switches.Set([](cuda::KernelSwitches& s) { s.bf16_mma_gemv_max_rows = 0; });
  EXPECT_FALSE(applies(2, 64));
}

// A single-row product's argmax key (GemmParams::maybe_argmax_key: one atomic per block of the GEMV) gives
// the first maximum of the y the product wrote, at every split of warps per feature (n 300: 4, 2048: 2 on a
// GPU of more than 64 SMs, 8200: 1), with mostly negative outputs, and over exact ties: identical weight rows
// give equal outputs, and the lowest index must win. The key's host-side order is checked on its own too.
TEST(OpsCuda, GemvArgmaxKeyIsTheFirstMaximum) {
  EXPECT_LT(cuda::ArgmaxKey(-2.f, 0), cuda::ArgmaxKey(-1.f, 0));
  EXPECT_LT(cuda::ArgmaxKey(-1.f, 0), cuda::ArgmaxKey(0.5f, 9));
  EXPECT_LT(cuda::ArgmaxKey(1.f, 7), cuda::ArgmaxKey(1.f, 3));  // a tie: the lower index is the larger key
  EXPECT_EQ(cuda::ArgmaxKey(-0.f, 4), cuda::ArgmaxKey(0.f, 4));
  EXPECT_EQ(cuda::ArgmaxToken(cuda::ArgmaxKey(-3.5f, 31999)), 31999);
  for (int64_t n : {300, 2048, 8200}) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE("n=" + std::to_string(n) + " variant " + std::to_string(variant));
      const int64_t k = 256;
      // variant 1: x >= 0 and weights mostly negative, so every output is negative.
      const std::vector<float> x = RoundBf16(Random(k, 3, variant == 1 ? 0.f : -1.f, 1.f));
      std::vector<float> w = RoundBf16(Random(n * k, 4, variant == 1 ? -1.f : -0.2f, variant == 1 ? 0.1f : 1.f));
      if (variant == 2) {  // rows 5, 77 and n - 1 the same as row 40: ties (row 5 the first of them)
        for (int64_t c = 0; c < k; ++c) w[40 * k + c] = std::abs(w[40 * k + c]) * (x[c] > 0 ? 1 : -1);  // the largest
        for (int64_t r : {int64_t{5}, int64_t{77}, n - 1}) std::copy(w.begin() + 40 * k, w.begin() + 41 * k, w.begin() + r * k);
      }
      DeviceBuffer<bf16> dx(ToBf16(x)), dw(ToBf16(w));
      DeviceBuffer<float> dy(n);
      DeviceBuffer<unsigned long long> key(1);
      cuda::GemmParams p{1, n, k, k, n, dx.get(), dw.get(), dy.get()};
      p.maybe_argmax_key = key.get();
      ASSERT_TRUE(cuda::GemvApplies(p));
      cuda::Gemm(p, Cublas());
      const std::vector<float> y = dy.Host();
      const int64_t first = std::max_element(y.begin(), y.end()) - y.begin();
      EXPECT_EQ(cuda::ArgmaxToken(key.Host()[0]), first);
      if (variant == 2) {
        EXPECT_EQ(first, 5);
      } else if (variant == 1) {
        EXPECT_LT(y[first], 0.f) << "the outputs were meant to be negative";
      }
    }
  }
}

// The decode-step products with their input op fused in: against the reference op, rounded to bf16, then
// MatMulReference. The fused prologue's bf16 rounding can land one step away from the reference's for an
// element whose fp32 value differs in the last bits (rarely); the tolerance is kFp32Tol's 10x. K = 2560 gives
// every row count several batches per row, so the second batch goes through the shared-memory prefetch
// (partly past the row's end at one and two rows per warp).
TEST(OpsCuda, FusedGemvMatchesNormThenMatMulReferences) {
  const int64_t dh = 64, N = 72;
  for (int64_t H : {4, 40}) {
    const int64_t K = H * dh;
    for (int64_t m : {1, 3, 8}) {
      for (cuda::GemvInput input : {cuda::GemvInput::kRmsNorm, cuda::GemvInput::kGatedNorm}) {
        SCOPED_TRACE("K=" + std::to_string(K) + " m=" + std::to_string(m) + " input=" + std::to_string(static_cast<int>(input)));
        const int64_t in_stride = K + 8, gate_stride = 3 * K;
        const std::vector<float> in = Random(m * in_stride, 50, -2, 2), gate = Random(m * gate_stride, 51, -3, 3);
        const std::vector<float> weight = Random(K, 52, 0.5f, 1.5f), w = RoundBf16(Random(N * K, 53));
        const std::vector<float> y0 = Random(m * N, 54);
        std::vector<float> x(m * K);
        if (input == cuda::GemvInput::kRmsNorm) {
          cpu::RmsNormReference({m, K, 1e-6f, in_stride, K, in.data(), weight.data(), x.data()});
        } else {
          cpu::GatedRmsNormReference({m, H, dh, 1e-6f, in_stride, gate_stride, K, in.data(), gate.data(), weight.data(), x.data()});
        }
        x = RoundBf16(x);
        std::vector<float> ref(m * N);
        cpu::MatMulReference({m, N, K, K, K, N, x.data(), w.data(), ref.data()});
        for (int64_t i = 0; i < m * N; ++i) ref[i] += y0[i];  // accumulate: y += x W^T
        DeviceBuffer<float> din(in), dgate(gate), dweight(weight);
        DeviceBuffer<bf16> dw(ToBf16(w));
        std::vector<float> product(m * N);  // without the accumulated y0
        for (int64_t i = 0; i < m * N; ++i) product[i] = ref[i] - y0[i];
        // Every count of weight rows per warp (single rows take 1, 2, 4, 8; 0 lets the kernel choose; 72 rows
        // leave the last block partly empty at 4 and 8).
        for (int rows : m == 1 ? std::vector<int>{0, 1, 2, 4, 8} : std::vector<int>{0}) {
          SCOPED_TRACE("rows per warp " + std::to_string(rows));
          DeviceBuffer<float> dy(y0);
          cuda::FusedGemvParams plain{m, N, K, input, 1e-6f, dh, in_stride, gate_stride, N, din.get(), dgate.get(),
                                      dweight.get(), dw.get(), dy.get(), true};
          plain.rows_per_warp = rows;
          cuda::FusedGemv(plain, nullptr);
          ExpectClose(dy.Host(), ref, 10 * kFp32Tol, "FusedGemv", std::sqrt(double(K)));
          if (input == cuda::GemvInput::kGatedNorm) {  // the gate read before the wait, through shared memory
            DeviceBuffer<float> dearly(y0);
            cuda::FusedGemvParams early = plain;
            early.y_ptr = dearly.get(), early.gate_written_earlier = true;
            cuda::FusedGemv(early, nullptr);
            ExpectClose(dearly.Host(), ref, 10 * kFp32Tol, "FusedGemv with the gate staged", std::sqrt(double(K)));
          }
          // Skipping weight rows [24, 40): those columns of y keep their old values, the others are as above.
          DeviceBuffer<float> dskip(y0);
          cuda::FusedGemvParams skip = plain;
          skip.n = N - 16, skip.y_ptr = dskip.get(), skip.skip_begin = 24, skip.skip_rows = 16;
          cuda::FusedGemv(skip, nullptr);
          std::vector<float> skip_ref = ref;
          for (int64_t r = 0; r < m; ++r) {
            for (int64_t n = 24; n < 40; ++n) skip_ref[r * N + n] = y0[r * N + n];
          }
          ExpectClose(dskip.Host(), skip_ref, 10 * kFp32Tol, "FusedGemv with skipped rows", std::sqrt(double(K)));
          // The SwiGLU epilogue: rows j and j + N/2 are feature j's gate and up products. bf16 output: one
          // rounding (2^-9 of the value) on top of the products' fp32 differences.
          DeviceBuffer<bf16> dact(m * (N / 2 + 5));
          cuda::FusedGemvParams swiglu = plain;
          swiglu.accumulate = false, swiglu.y_row_stride = N / 2 + 5, swiglu.maybe_swiglu_ptr = dact.get();
          cuda::FusedGemv(swiglu, nullptr);
          const std::vector<float> act = ToFloat(dact.Host());
          std::vector<float> got(m * N / 2), want(m * N / 2);
          for (int64_t r = 0; r < m; ++r) {
            for (int64_t j = 0; j < N / 2; ++j) {
              const float g = product[r * N + j], u = product[r * N + N / 2 + j];
              want[r * N / 2 + j] = g / (1 + std::exp(-g)) * u;
              got[r * N / 2 + j] = act[r * (N / 2 + 5) + j];
            }
          }
          ExpectClose(got, want, kBf16Tol, "FusedGemv with the SwiGLU epilogue");
        }
      }
    }
  }
}

// FP8 weights (QuantizeRowsFp8): a matrix whose rows span six orders of magnitude (RowMagnitude), quantised
// on the device.
float RowMagnitude(int64_t row) { return std::pow(10.f, static_cast<float>(row % 7) - 4.f); }  // 1e-4 .. 100
// Outputs [M, N] divided by their weight row's magnitude, so that one tolerance fits every row.
std::vector<float> PerRowMagnitude(std::vector<float> y, int64_t n) {
  for (size_t i = 0; i < y.size(); ++i) y[i] /= RowMagnitude(static_cast<int64_t>(i) % n);
  return y;
}
struct Fp8Matrix {
  std::vector<float> dequantised;  // what every product must multiply by: scale[r] * e4m3[r, c]
  std::unique_ptr<DeviceBuffer<cuda::fp8>> q;
  std::unique_ptr<DeviceBuffer<float>> scale;
};
Fp8Matrix QuantizedRandom(int64_t n, int64_t k, uint32_t seed) {
  std::vector<float> w = Random(n * k, seed);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) w[r * k + c] *= RowMagnitude(r);
  }
  w = RoundBf16(w);
  DeviceBuffer<bf16> dw(ToBf16(w));
  Fp8Matrix m;
  m.q = std::make_unique<DeviceBuffer<cuda::fp8>>(n * k);
  m.scale = std::make_unique<DeviceBuffer<float>>(n);
  cuda::QuantizeRowsFp8(dw.get(), n, k, m.q->get(), m.scale->get(), nullptr);
  DeviceBuffer<bf16> back(n * k);
  cuda::DequantizeRowsFp8(m.q->get(), m.scale->get(), n, k, back.get(), nullptr);
  m.dequantised = ToFloat(back.Host());
  // Each weight within half an e4m3 step of the original: 2^-4 relative (3 mantissa bits), or half the
  // smallest subnormal step (2^-10 of the scale) near zero; each scale a power of two that puts the row's
  // largest |w| in (224, 448].
  const std::vector<float> scale = m.scale->Host();
  for (int64_t r = 0; r < n; ++r) {
    int exponent = 0;
    EXPECT_EQ(std::frexp(scale[r], &exponent), 0.5f) << "row " << r << "'s scale " << scale[r];
    float amax = 0;
    for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::abs(w[r * k + c]));
    EXPECT_GT(amax / scale[r], 224.f) << "row " << r;
    EXPECT_LE(amax / scale[r], 448.f) << "row " << r;
    for (int64_t c = 0; c < k; ++c) {
      const float a = w[r * k + c], b = m.dequantised[r * k + c];
      EXPECT_LE(std::abs(a - b), std::max(std::abs(a) / 16, scale[r] / 1024)) << "row " << r << " col " << c;
    }
  }
  return m;
}

// FP8 weights in every product: the GEMV (up to 7 rows; it reads the bytes and applies the row's scale), its
// argmax key, the tensor-core kernel (8-128 rows, 64 a launch, K a multiple of 32; K split over blocks, or whole where
// K is short), each product also accumulating into its own output, the fused GEMV at every row count per warp with
// skipped rows and the SwiGLU epilogue, and cuBLAS (more rows, or K not a multiple of 16 or 32: a bf16 copy
// made in front) -- all against MatMulReference over the dequantised weights, which are exact bf16 values, so
// the tolerances are the bf16 products'. 6 rows of K = 24592 are past what the several-row GEMV stages in
// shared memory, so it reads x from global memory. 64 rows of N = 20000: 157 blocks of weight rows in 2 splits,
// more blocks than the GPU holds at once.
TEST(OpsCuda, Fp8WeightsMatchTheProductsOfTheirDequantisedValues) {
  ScopedSwitches switches;
  switches.Set([](cuda::KernelSwitches& s) { s.fp8_mma_gemv_max_rows = 0; });  // (its own test below)
  for (auto [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 300, 256},     {1, 8200, 64},    {1, 2048, 512},  {1, 40, 24592}, {3, 77, 64},      {8, 300, 5440},
           {5, 2048, 2048},   {6, 40, 24592},   {9, 130, 520},   {2, 17, 10},    {1, 24, 40},      {9, 200, 1024},
           {12, 300, 5504},   {16, 2048, 2048}, {33, 130, 512},  {48, 77, 256},  {64, 4100, 1024}, {65, 300, 512},
           {128, 1000, 2048}, {129, 64, 256},   {16, 300, 5440}, {24, 130, 96},  {64, 20000, 512}}) {
    SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k));
    Fp8Matrix w = QuantizedRandom(n, k, 60);
    if (HasFailure()) return;
    const std::vector<float> x = RoundBf16(Random(m * k, 61));
    std::vector<float> ref(m * n);
    cpu::MatMulReference({m, n, k, k, k, n, x.data(), w.dequantised.data(), ref.data()});
    DeviceBuffer<bf16> dx(ToBf16(x)), scratch(n * k);
    DeviceBuffer<float> dy(m * n), dy2(m * n);
    DeviceBuffer<unsigned long long> key(1);
    cuda::GemmParams p{m, n, k, k, n, dx.get(), w.q->get(), dy.get()};
    p.w_scale = w.scale->get(), p.w_bf16_scratch = scratch.get();
    if (m == 1 && k % 16 == 0) p.maybe_argmax_key = key.get();
    EXPECT_EQ(cuda::GemvApplies(p), m <= 8 && k % 16 == 0);
    EXPECT_EQ(cuda::Fp8MmaApplies(p), m >= 8 && m <= 128 && k % 32 == 0);
    cuda::Gemm(p, Cublas());
    const std::vector<float> y = dy.Host();
    ExpectClose(PerRowMagnitude(y, n), PerRowMagnitude(ref, n), kFp32Tol, "Gemm", std::sqrt(double(k)));
    cuda::GemmParams twice = p;  // accumulate: y += the product again
    twice.accumulate = true, twice.maybe_argmax_key = nullptr;
    cuda::Gemm(twice, Cublas());
    std::vector<float> ref2 = ref;
    for (float& v : ref2) v *= 2;
    ExpectClose(PerRowMagnitude(dy.Host(), n), PerRowMagnitude(ref2, n), kFp32Tol, "Gemm accumulating",
                std::sqrt(double(k)));
    if (p.maybe_argmax_key != nullptr) {
      EXPECT_EQ(cuda::ArgmaxToken(key.Host()[0]), std::max_element(y.begin(), y.end()) - y.begin());
    }
    cuda::GemmParams c = p;
    c.y_ptr = dy2.get(), c.maybe_argmax_key = nullptr;
    cuda::GemmCublas(c, Cublas());
    ExpectClose(PerRowMagnitude(dy2.Host(), n), PerRowMagnitude(ref, n), kFp32Tol, "GemmCublas", std::sqrt(double(k)));
  }
  const int64_t K = 2560, N = 72, dh = 64;
  Fp8Matrix w = QuantizedRandom(N, K, 62);
  const std::vector<float> in = Random(K, 63, -2, 2), weight = Random(K, 64, 0.5f, 1.5f);
  std::vector<float> y0 = Random(N, 65);  // the residual, on each row's scale
  for (int64_t i = 0; i < N; ++i) y0[i] *= RowMagnitude(i);
  std::vector<float> x(K);
  cpu::RmsNormReference({1, K, 1e-6f, K, K, in.data(), weight.data(), x.data()});
  x = RoundBf16(x);
  std::vector<float> product(N);
  cpu::MatMulReference({1, N, K, K, K, N, x.data(), w.dequantised.data(), product.data()});
  DeviceBuffer<float> din(in), dweight(weight);
  const double scale = std::sqrt(double(K));
  for (int rows : {0, 1, 2, 4, 8}) {
    SCOPED_TRACE("rows per warp " + std::to_string(rows));
    DeviceBuffer<float> dy(y0);
    cuda::FusedGemvParams p{
        1,          N,        K,   cuda::GemvInput::kRmsNorm, 1e-6f, dh, K, 0, N, din.get(), nullptr, dweight.get(),
        w.q->get(), dy.get(), true};
    p.w_scale = w.scale->get(), p.rows_per_warp = rows;
    cuda::FusedGemv(p, nullptr);
    std::vector<float> want(N);
    for (int64_t i = 0; i < N; ++i) want[i] = y0[i] + product[i];
    ExpectClose(PerRowMagnitude(dy.Host(), N), PerRowMagnitude(want, N), 10 * kFp32Tol, "FusedGemv", scale);
    DeviceBuffer<float> dskip(y0);
    cuda::FusedGemvParams skip = p;
    skip.n = N - 16, skip.y_ptr = dskip.get(), skip.skip_begin = 24, skip.skip_rows = 16;
    cuda::FusedGemv(skip, nullptr);
    for (int64_t i = 24; i < 40; ++i) want[i] = y0[i];
    ExpectClose(PerRowMagnitude(dskip.Host(), N), PerRowMagnitude(want, N), 10 * kFp32Tol,
                "FusedGemv with skipped rows", scale);
    DeviceBuffer<bf16> dact(N / 2);
    cuda::FusedGemvParams swiglu = p;
    swiglu.accumulate = false, swiglu.y_row_stride = N / 2, swiglu.maybe_swiglu_ptr = dact.get();
    cuda::FusedGemv(swiglu, nullptr);
    std::vector<float> act_want(N / 2);
    for (int64_t j = 0; j < N / 2; ++j) {
      const float g = product[j], u = product[N / 2 + j];
      act_want[j] = g / (1 + std::exp(-g)) * u;
    }
    ExpectClose(ToFloat(dact.Host()), act_want, kBf16Tol, "FusedGemv with the SwiGLU epilogue");
  }
}

// Weights [n, k] cycling through all 254 finite e4m3 codes, scale 1, multiplied by Gemm with rows of x that are
// unit vectors, so that each output is one weight (times 1, plus zeros), which must equal DequantizeRowsFp8's
// value bit for bit; `takes` says that the kernel under test takes each product.
void ExpectEveryCodeWidenedExactly(int64_t n, int64_t k, std::initializer_list<int64_t> rows,
                                   bool (*takes)(const cuda::GemmParams&)) {
  std::vector<cuda::fp8> codes(n * k);
  for (int64_t i = 0; i < n * k; ++i) {
    uint8_t c = static_cast<uint8_t>((i * 37 + i / k) % 256);
    if ((c & 0x7f) == 0x7f) c ^= 1;  // 0x7f and 0xff are NaN
    codes[i] = c;
  }
  DeviceBuffer<cuda::fp8> w(codes);
  DeviceBuffer<float> scale(std::vector<float>(n, 1.f));
  DeviceBuffer<bf16> back(n * k);
  cuda::DequantizeRowsFp8(w.get(), scale.get(), n, k, back.get(), nullptr);
  const std::vector<float> dequantised = ToFloat(back.Host());
  for (int64_t m : rows) {
    SCOPED_TRACE("m=" + std::to_string(m));
    std::vector<float> x(m * k, 0.f);
    for (int64_t r = 0; r < m; ++r) x[r * k + (r * 131 + 7) % k] = 1.f;
    DeviceBuffer<bf16> dx(ToBf16(x));
    DeviceBuffer<float> dy(m * n);
    cuda::GemmParams p{m, n, k, k, n, dx.get(), w.get(), dy.get()};
    p.w_scale = scale.get();
    ASSERT_TRUE(takes(p));
    cuda::Gemm(p, Cublas());
    const std::vector<float> y = dy.Host();
    int64_t wrong = 0;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < n; ++j) wrong += y[r * n + j] != dequantised[j * k + (r * 131 + 7) % k];
    }
    EXPECT_EQ(wrong, 0) << "of " << m * n << " outputs";
  }
}

// The FP8 tensor-core kernel widens every e4m3 code exactly, subnormals and zeros included: 16 rows (one launch
// of one tile) and 40 (three tiles); N = 136 leaves a block's last 120 rows past the end.
TEST(OpsCuda, Fp8TensorCoreProductWidensEveryCodeExactly) {
  ScopedSwitches switches;
  switches.Set([](cuda::KernelSwitches& s) { s.fp8_mma_gemv_max_rows = 0; });  // (the tensor-core GEMV: below)
  ExpectEveryCodeWidenedExactly(136, 544, {16, 40}, cuda::Fp8MmaApplies);      // K: 4 chunks of 128 and one of 32
}

// FP8 weights on the tensor-core GEMV (KernelSwitches::fp8_mma_gemv_max_rows): against
// MatMulReference over the dequantised weights at 2-32 rows, K from one step of 64 to 5,504, each product also
// accumulating and, for even N, with the SwiGLU epilogue; then every e4m3 code widened exactly
// (ExpectEveryCodeWidenedExactly), at one and three tiles of x. Unlike bf16 weights, FP8 ones of any size take it past
// 8 rows.
TEST(OpsCuda, Fp8WeightsOnTheTensorCoreGemvMatchTheirDequantisedValues) {
  ScopedSwitches switches;
  switches.Set([](cuda::KernelSwitches& s) { s.fp8_mma_gemv_max_rows = 32; });
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {2, 16, 64}, {3, 77, 128}, {8, 300, 5504}, {9, 130, 1024}, {16, 2048, 2048}, {24, 130, 192}, {32, 100, 512}};
  for (auto [m, n, k] : shapes) {
    SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k));
    Fp8Matrix w = QuantizedRandom(n, k, 62);
    if (HasFailure()) return;
    const std::vector<float> x = RoundBf16(Random(m * k, 63));
    std::vector<float> ref(m * n);
    cpu::MatMulReference({m, n, k, k, k, n, x.data(), w.dequantised.data(), ref.data()});
    DeviceBuffer<bf16> dx(ToBf16(x));
    DeviceBuffer<float> dy(m * n);
    cuda::GemmParams p{m, n, k, k, n, dx.get(), w.q->get(), dy.get()};
    p.w_scale = w.scale->get();
    ASSERT_TRUE(cuda::MmaGemvApplies(p));
    cuda::Gemm(p, Cublas());
    ExpectClose(PerRowMagnitude(dy.Host(), n), PerRowMagnitude(ref, n), kFp32Tol, "Gemm", std::sqrt(double(k)));
    cuda::GemmParams twice = p;
    twice.accumulate = true;
    cuda::Gemm(twice, Cublas());
    for (float& v : ref) v *= 2;
    ExpectClose(PerRowMagnitude(dy.Host(), n), PerRowMagnitude(ref, n), kFp32Tol, "Gemm accumulating",
                std::sqrt(double(k)));
    if (n % 2 == 0) ExpectSwiGluEpilogueExact(p);
  }
  ExpectEveryCodeWidenedExactly(136, 576, {8, 24}, cuda::MmaGemvApplies);  // K: 9 steps of 64
  DeviceBuffer<bf16> dx(std::vector<bf16>(8 * 96));
  DeviceBuffer<cuda::fp8> dw(std::vector<cuda::fp8>(8 * 96));
  DeviceBuffer<float> scale(std::vector<float>(8, 1.f)), dy(8 * 8);
  cuda::GemmParams odd{8, 8, 96, 96, 8, dx.get(), dw.get(), dy.get()};  // K not a multiple of 64
  odd.w_scale = scale.get();
  EXPECT_FALSE(cuda::MmaGemvApplies(odd));
  cuda::GemmParams wide{32, cuda::kMmaGemvWideMaxWeights / 64 + 32, 64, 64, 8, dx.get(), dw.get(), dy.get()};
  wide.w_scale = scale.get();
  EXPECT_TRUE(cuda::MmaGemvApplies(wide));  // (FP8 products of any size; only the operands' alignment is read)
}

// d = 300 and 2048 hold the row in registers (up to 2 16-byte pieces a thread); 2050 (not a multiple of 4)
// and 2052 (too long) take the loop.
// A residual RMSNorm split between two products on the tensor-core GEMV (GemmParams::norm_out, norm_in): the
// first adds x W1^T into the residual r, writes u = bf16(r' * weight) and the sums of squares of r' per block
// of 16 columns; the second multiplies u by W2 and scales row m by rsqrt(mean r'^2 + eps). Checked:
// - r' against the residual add (fp32 sums: kFp32Tol), u bit for bit against r' * weight rounded, the sums of
//   squares against the host's (relative 1e-5: fp32 over 16 terms);
// - the second product against its own math from u (only summation orders differ: kFp32Tol), and with the
//   SwiGLU epilogue bit for bit against the separate kernel;
// - the two against AddRmsNorm's math, RmsNormReference rounded to bf16 then MatMulReference: u is rounded
//   before the norm's scale, not after, which moves each output by about a bf16 step of its terms (kBf16Tol).
// Rows: 2 (the several-row GEMV's, which the split must not take), 8 and 19 (3 tiles); N2 not a multiple of 16.
// FP8 weights once, at 8 rows.
TEST(OpsCuda, SplitRmsNormBetweenTwoProductsIsAddRmsNormBetweenThem) {
  const int64_t k1 = 640, n1 = 1088, n2 = 200;  // n1: the norm's width, K of the second product
  const float eps = 1e-5f;
  const int64_t parts = (n1 + 15) / 16;
  for (const auto& [m, fp8] : std::vector<std::pair<int64_t, bool>>{{2, false}, {8, false}, {19, false}, {8, true}}) {
    SCOPED_TRACE("m=" + std::to_string(m) + (fp8 ? " fp8" : " bf16"));
    std::vector<float> w1, w2;
    std::unique_ptr<DeviceBuffer<bf16>> dw1, dw2;
    Fp8Matrix q1, q2;
    if (fp8) {
      q1 = QuantizedRandom(n1, k1, 120), q2 = QuantizedRandom(n2, n1, 121);
      w1 = q1.dequantised, w2 = q2.dequantised;
    } else {
      w1 = RoundBf16(Random(n1 * k1, 120, -0.1f, 0.1f)), w2 = RoundBf16(Random(n2 * n1, 121));
      dw1 = std::make_unique<DeviceBuffer<bf16>>(ToBf16(w1)), dw2 = std::make_unique<DeviceBuffer<bf16>>(ToBf16(w2));
    }
    const std::vector<float> x = RoundBf16(Random(m * k1, 122)), residual = Random(m * n1, 123, -2.f, 2.f),
                             weight = Random(n1, 124, 0.5f, 1.5f);
    std::vector<float> added(m * n1);
    cpu::MatMulReference({m, n1, k1, k1, k1, n1, x.data(), w1.data(), added.data()});
    for (size_t i = 0; i < added.size(); ++i) added[i] += residual[i];
    DeviceBuffer<bf16> dx(ToBf16(x)), du(m * n1);
    DeviceBuffer<float> dr(residual), dweight(weight), dsum_sq(parts * m), dy(m * n2);
    cuda::GemmParams first{m, n1, k1, k1, n1, dx.get(), fp8 ? static_cast<void*>(q1.q->get()) : dw1->get(), dr.get()};
    first.accumulate = true;
    if (fp8) first.w_scale = q1.scale->get();
    first.norm_out = {.scaled_ptr = du.get(), .weight_ptr = dweight.get(), .sum_sq_ptr = dsum_sq.get()};
    ASSERT_TRUE(cuda::MmaGemvApplies(first));
    cuda::Gemm(first, Cublas());
    const std::vector<float> r = dr.Host(), u = ToFloat(du.Host()), sum_sq = dsum_sq.Host();
    ExpectClose(fp8 ? PerRowMagnitude(r, n1) : r, fp8 ? PerRowMagnitude(added, n1) : added, kFp32Tol, "residual",
                std::sqrt(double(k1)));
    int64_t differ = 0;
    for (size_t i = 0; i < u.size(); ++i) differ += u[i] != RoundBf16(r[i] * weight[i % n1]);
    EXPECT_EQ(differ, 0) << "of " << u.size() << " scaled values";
    std::vector<float> rms(m);
    for (int64_t row = 0; row < m; ++row) {
      double total = 0;
      for (int64_t b = 0; b < parts; ++b) {
        double part = 0;
        for (int64_t c = 16 * b; c < std::min(n1, 16 * b + 16); ++c) part += double(r[row * n1 + c]) * r[row * n1 + c];
        EXPECT_NEAR(sum_sq[b * m + row], part, 1e-5 * part) << "row " << row << ", block " << b;
        total += part;
      }
      rms[row] = static_cast<float>(1 / std::sqrt(total / n1 + eps));
    }
    cuda::GemmParams second{m, n2, n1, n1, n2, du.get(), fp8 ? static_cast<void*>(q2.q->get()) : dw2->get(), dy.get()};
    if (fp8) second.w_scale = q2.scale->get();
    second.norm_in = {.sum_sq_ptr = dsum_sq.get(), .eps = eps};
    ASSERT_TRUE(cuda::MmaGemvApplies(second));
    cuda::Gemm(second, Cublas());
    const std::vector<float> y = dy.Host();
    std::vector<float> own(m * n2), normed(m * n1), ref(m * n2);
    cpu::MatMulReference({m, n2, n1, n1, n1, n2, u.data(), w2.data(), own.data()});
    for (size_t i = 0; i < own.size(); ++i) own[i] *= rms[i / n2];
    auto per_row = [&](const std::vector<float>& v) { return fp8 ? PerRowMagnitude(v, n2) : v; };
    ExpectClose(per_row(y), per_row(own), kFp32Tol, "second product", std::sqrt(double(n1)));
    cpu::RmsNormReference({m, n1, eps, n1, n1, added.data(), weight.data(), normed.data()});
    normed = RoundBf16(normed);
    cpu::MatMulReference({m, n2, n1, n1, n1, n2, normed.data(), w2.data(), ref.data()});
    ExpectClose(per_row(y), per_row(ref), kBf16Tol, "against AddRmsNorm then the product", std::sqrt(double(n1)));
    ExpectSwiGluEpilogueExact(second);
  }
}

TEST(OpsCuda, AddRmsNormMatchesRmsNormReference) {
  for (int64_t d : {300, 2048, 2050, 2052}) {
    SCOPED_TRACE("d=" + std::to_string(d));
    const int64_t rows = 5;
    const float eps = 1e-5f;
    std::vector<float> x = Random(rows * d, 3), delta = Random(rows * d, 4), weight = Random(d, 5, 0.5f, 1.5f);
    std::vector<float> sum(rows * d), ref(rows * d);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = x[i] + delta[i];
    cpu::RmsNormReference({rows, d, eps, d, d, sum.data(), weight.data(), ref.data()});
    DeviceBuffer<float> dx(x), ddelta(delta), dweight(weight);
    DeviceBuffer<bf16> dy(rows * d);
    cuda::AddRmsNorm({rows, d, eps, dx.get(), ddelta.get(), dweight.get(), nullptr, dy.get()}, nullptr);
    ExpectClose(dx.Host(), sum, 1e-7, "residual x + delta");
    ExpectBf16Close(ToFloat(dy.Host()), ref, "AddRmsNorm");
    // Selected rows (the final norm of logit rows), no delta: rows 4 and 1 of the updated x, written densely.
    std::vector<int32_t> pick = {4, 1};
    DeviceBuffer<int32_t> dpick(pick);
    DeviceBuffer<bf16> dz(2 * d);
    cuda::AddRmsNorm({2, d, eps, dx.get(), nullptr, dweight.get(), dpick.get(), dz.get()}, nullptr);
    const std::vector<float> z = ToFloat(dz.Host());
    ExpectBf16Close(std::vector<float>(z.begin(), z.begin() + d), std::vector<float>(ref.begin() + 4 * d, ref.begin() + 5 * d),
                    "row 4");
    ExpectBf16Close(std::vector<float>(z.begin() + d, z.end()), std::vector<float>(ref.begin() + d, ref.begin() + 2 * d),
                    "row 1");
  }
}

TEST(OpsCuda, GatedNormAndSwiGluMatchTheirReferences) {
  for (int64_t dh : {5, 64, 128}) {
    const int64_t rows = 3, H = 3, HD = H * dh, gate_stride = 2 * HD;
    const std::vector<float> o = Random(rows * HD, 6), gate = Random(rows * gate_stride, 7, -3, 3),
                             w = Random(dh, 8, 0.5f, 1.5f);
    std::vector<float> ref(rows * HD);
    cpu::GatedRmsNormReference({rows, H, dh, 1e-6f, HD, gate_stride, HD, o.data(), gate.data(), w.data(), ref.data()});
    DeviceBuffer<float> d_o(o), d_gate(gate), d_w(w);
    DeviceBuffer<bf16> dy(rows * HD);
    cuda::GatedNorm({rows, H, dh, 1e-6f, gate_stride, d_o.get(), d_gate.get(), d_w.get(), dy.get()}, nullptr);
    ExpectBf16Close(ToFloat(dy.Host()), ref, "GatedNorm dh=" + std::to_string(dh));
  }
  const int64_t rows = 4, F = 333;
  const std::vector<float> in = Random(rows * 2 * F, 9, -4, 4);
  std::vector<float> ref(rows * F);
  cpu::SwiGluReference({rows, F, 2 * F, 2 * F, F, in.data(), in.data() + F, ref.data()});
  DeviceBuffer<float> din(in);
  DeviceBuffer<bf16> dy(rows * F);
  cuda::SwiGlu({rows, F, din.get(), dy.get()}, nullptr);
  ExpectBf16Close(ToFloat(dy.Host()), ref, "SwiGlu");
}

TEST(OpsCuda, EmbedGathersRowsAndArgmaxTakesTheLowestIndexOfATie) {
  const int64_t V = 50, D = 24;
  const std::vector<float> table = RoundBf16(Random(V * D, 10));
  const std::vector<int32_t> tokens = {3, 49, 0, 3};
  DeviceBuffer<bf16> dtable(ToBf16(table));
  DeviceBuffer<int32_t> dtok(tokens);
  DeviceBuffer<float> dx(tokens.size() * D);
  cuda::Embed({static_cast<int64_t>(tokens.size()), D, dtok.get(), dtable.get(), dx.get()}, nullptr);
  const std::vector<float> x = dx.Host();
  for (size_t r = 0; r < tokens.size(); ++r) {
    for (int64_t c = 0; c < D; ++c) ASSERT_EQ(x[r * D + c], table[tokens[r] * D + c]);
  }
  const int64_t vocab = 1000;
  std::vector<float> logits = Random(3 * vocab, 11);
  logits[0 * vocab + 700] = logits[0 * vocab + 30] = 5.f;  // a tie: 30 wins
  logits[1 * vocab + 999] = 7.f;
  DeviceBuffer<float> dl(logits);
  DeviceBuffer<int32_t> dt(3);
  cuda::Argmax({3, vocab, dl.get(), dt.get()}, nullptr);
  const std::vector<int32_t> got = dt.Host();
  for (int r = 0; r < 3; ++r) {
    int64_t want = -1;
    cpu::SampleGreedyReference({vocab, logits.data() + r * vocab, &want});
    EXPECT_EQ(got[r], want) << "row " << r;
  }
  EXPECT_EQ(got[0], 30);
}

// The entropy and margin a router reads, on the device, against the CPU's (kernels::cpu::DistributionStats):
// spread and peaked rows, a largest logit held twice (margin 0), a vocabulary the 16-byte loads do not
// divide, and a vocabulary of one.
TEST(OpsCuda, DistributionStatsMatchTheCpu) {
  for (const int64_t vocab : {int64_t{32000}, int64_t{1001}, int64_t{1}}) {
    const int64_t rows = 4;
    std::vector<float> logits = Random(rows * vocab, 21);
    for (float& l : logits) l *= 6.f;
    if (vocab > 1) {
      logits[1 * vocab + vocab / 2] += 30.f;                              // peaked
      logits[2 * vocab + 3] = logits[2 * vocab + vocab - 1] = 100.f;      // the largest, twice
      for (int64_t i = 0; i < vocab; ++i) logits[3 * vocab + i] = 0.25f;  // uniform
    }
    DeviceBuffer<float> dl(logits), ds(rows * 2);
    cuda::DistributionStats({rows, vocab, dl.get(), ds.get()}, nullptr);
    const std::vector<float> got = ds.Host();
    for (int64_t r = 0; r < rows; ++r) {
      double entropy = 0, margin = 0;
      if (vocab > 1) cpu::DistributionStatsReference(logits.data() + r * vocab, vocab, &entropy, &margin);
      SCOPED_TRACE("vocab " + std::to_string(vocab) + ", row " + std::to_string(r));
      EXPECT_NEAR(got[2 * r], entropy, 1e-4 * std::max(1.0, entropy));
      EXPECT_NEAR(got[2 * r + 1], margin, 1e-5 * std::max(1.0, margin));
    }
    if (vocab > 1) {
      EXPECT_EQ(got[2 * 2 + 1], 0.f);  // the tie
      EXPECT_NEAR(got[2 * 3], std::log(static_cast<double>(vocab)), 1e-4 * std::log(static_cast<double>(vocab)));
      EXPECT_LT(got[2 * 1], 0.01);  // peaked: near certain
    }
  }
}

// A sequence's paged KV cache on the device (SeqDesc::kv_blocks) made from host keys and values [L][cap][HD]:
// its blocks lie in one buffer in reverse position order, so that a kernel that read positions in memory
// order instead of through the table would fail. Keys() and Values() read it back in the host layout.
class PagedKv {
 public:
  PagedKv(const std::vector<float>& keys, const std::vector<float>& values, int64_t L, int64_t cap, int64_t HD)
      : L_(L), cap_(cap), HD_(HD), blocks_((cap + cuda::kKvBlockTokens - 1) / cuda::kKvBlockTokens) {
    std::vector<float> data(blocks_ * L * 2 * cuda::kKvBlockTokens * HD, 0.f);
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t t = 0; t < cap; ++t) {
        std::copy_n(keys.begin() + (l * cap + t) * HD, HD, data.begin() + At(0, l, t));
        std::copy_n(values.begin() + (l * cap + t) * HD, HD, data.begin() + At(1, l, t));
      }
    }
    data_ = std::make_unique<DeviceBuffer<bf16>>(ToBf16(data));
    std::vector<bf16*> table(blocks_);
    for (int64_t j = 0; j < blocks_; ++j) table[j] = data_->get() + At(0, 0, j * cuda::kKvBlockTokens);
    table_ = std::make_unique<DeviceBuffer<bf16*>>(table);
  }
  // Zeros.
  PagedKv(int64_t L, int64_t cap, int64_t HD)
      : PagedKv(std::vector<float>(L * cap * HD), std::vector<float>(L * cap * HD), L, cap, HD) {}
  bf16* const* table() const { return table_->get(); }
  std::vector<float> Keys() const { return Read(0); }
  std::vector<float> Values() const { return Read(1); }

 private:
  // Where (keys 0 | values 1, layer, position) starts in data_: block j at slot blocks - 1 - j.
  int64_t At(int which, int64_t layer, int64_t pos) const {
    const int64_t slot = blocks_ - 1 - pos / cuda::kKvBlockTokens;
    return ((slot * L_ + layer) * 2 + which) * cuda::kKvBlockTokens * HD_ + (pos % cuda::kKvBlockTokens) * HD_;
  }
  std::vector<float> Read(int which) const {
    const std::vector<float> data = ToFloat(data_->Host());
    std::vector<float> out(L_ * cap_ * HD_);
    for (int64_t l = 0; l < L_; ++l) {
      for (int64_t t = 0; t < cap_; ++t) std::copy_n(data.begin() + At(which, l, t), HD_, out.begin() + (l * cap_ + t) * HD_);
    }
    return out;
  }
  int64_t L_, cap_, HD_, blocks_;
  std::unique_ptr<DeviceBuffer<bf16>> data_;
  std::unique_ptr<DeviceBuffer<bf16*>> table_;
};

// Two sequences of a batch for the ops that take descriptors: spans of `len0` and `len1` tokens at
// positions pos0 and pos1, with their device states.
struct Batch {
  cuda::ModelDims dims{};
  int64_t H, dh, HD, P, W, L = 2, layer = 1, cap;
  std::vector<int> len, pos;
  std::vector<uint8_t> modes;    // [N]
  std::vector<int32_t> row_seq;  // [N]
  int64_t N = 0;
};

Batch MakeBatch(int64_t H, int64_t dh, bool gdn, std::vector<int> len, std::vector<int> pos, uint32_t seed) {
  Batch b;
  b.H = H, b.dh = dh, b.HD = H * dh, b.W = 3;
  b.P = 4 * b.HD + (gdn ? 2 * H : H) + b.HD;
  b.len = len, b.pos = pos;
  b.cap = 0;
  for (size_t s = 0; s < len.size(); ++s) {
    b.cap = std::max<int64_t>(b.cap, pos[s] + len[s]);
    for (int t = 0; t < len[s]; ++t) {
      b.row_seq.push_back(static_cast<int32_t>(s));
      b.modes.push_back((t + s + seed) % 3 == 0);  // a mix of attention and linear rows
    }
  }
  b.N = static_cast<int64_t>(b.row_seq.size());
  b.dims = {static_cast<int32_t>(H * dh), static_cast<int32_t>(H), static_cast<int32_t>(dh), 4, 8, 10,
            static_cast<int32_t>(b.P), gdn, gdn, 1e-6f, 10000.0, /*attn_log_scale_base=*/0};
  return b;
}

TEST(OpsCuda, ConvRopeAppendAndWindowUpdateMatchCausalConvAndRopeReferences) {
  for (int variant = 0; variant < 4; ++variant) {
    // SiLU or identity; RoPE frequencies from a table or computed per element.
    const bool silu = variant & 1, table = variant & 2;
    SCOPED_TRACE("silu " + std::to_string(silu) + ", frequency table " + std::to_string(table));
    Batch b = MakeBatch(2, 64, silu, {6, 1}, {9, 3}, 1);
    std::vector<double> freq(32);
    for (int i = 0; i < 32; ++i) freq[i] = std::pow(10000.0, -2.0 * i / 64);
    DeviceBuffer<double> dfreq(freq);
    const int64_t C = 2 * b.HD, w = 4, W = b.W, L = b.L, layer = b.layer;
    const std::vector<float> proj = Random(b.N * b.P, 20), weight = Random(C * w, 21), bias = Random(C, 22);
    std::vector<float> windows[2] = {Random(L * W * C, 23), Random(L * W * C, 24)};
    DeviceBuffer<float> dproj(proj), dweight(weight), dbias(bias), dkv(b.N * 2 * b.HD), dqa(b.N * b.HD);
    DeviceBuffer<float> dwin0(windows[0]), dwin1(windows[1]), dstate(1), dhist(L * (W + 6) * C);
    const PagedKv kv0(L, b.cap, b.HD), kv1(L, b.cap, b.HD);
    std::vector<cuda::SeqDesc> seqs = {{0, 6, 9, b.cap, dstate.get(), dwin0.get(), kv0.table(), nullptr, dhist.get()},
                                       {6, 1, 3, b.cap, dstate.get(), dwin1.get(), kv1.table(), nullptr, nullptr}};
    DeviceBuffer<cuda::SeqDesc> dseqs(seqs);
    DeviceBuffer<int32_t> drow(b.row_seq);
    DeviceBuffer<uint8_t> dmode(b.modes);
    b.dims.conv_silu = silu;
    cuda::ConvRopeAppend({b.dims, static_cast<int32_t>(layer), b.N, drow.get(), dmode.get(), dseqs.get(), dproj.get(),
                          dweight.get(), dbias.get(), dkv.get(), dqa.get(), table ? dfreq.get() : nullptr}, nullptr);
    cuda::ConvWindowUpdate({b.dims, static_cast<int32_t>(layer), 2, dseqs.get(), dproj.get()}, nullptr);
    const std::vector<float> kv = dkv.Host(), qa = dqa.Host();
    const std::vector<float> win_after[2] = {dwin0.Host(), dwin1.Host()}, hist = dhist.Host();
    const std::vector<float> caches[2][2] = {{kv0.Keys(), kv0.Values()}, {kv1.Keys(), kv1.Values()}};
    int64_t row = 0;
    for (int s = 0; s < 2; ++s) {
      const int64_t T = b.len[s], pos = b.pos[s];
      std::vector<float> window(windows[s].begin() + layer * W * C, windows[s].begin() + (layer + 1) * W * C);
      const std::vector<float> window_before = window;
      std::vector<float> out(T * C);
      cpu::CausalConvReference({T, C, w, silu, b.P, C, weight.data(), bias.data(), window.data(), proj.data() + row * b.P,
                                out.data()});
      std::vector<float> got(kv.begin() + row * C, kv.begin() + (row + T) * C);
      ExpectClose(got, out, kFp32Tol, "conv outputs, sequence " + std::to_string(s));
      EXPECT_EQ(std::vector<float>(win_after[s].begin() + layer * W * C, win_after[s].begin() + (layer + 1) * W * C), window)
          << "window after, sequence " << s;
      if (s == 0) {  // the span history: the window before, then the raw inputs
        const float* h = hist.data() + layer * (W + T) * C;
        for (int64_t m = 0; m < W + T; ++m) {
          for (int64_t c = 0; c < C; ++c) {
            const float want = m < W ? window_before[m * C + c] : proj[(row + m - W) * b.P + c];
            ASSERT_EQ(h[m * C + c], want) << "history row " << m;
          }
        }
      }
      // The caches hold RoPE(k) and v at the span's positions (layer 1 of 2).
      std::vector<float> k_rot(T * b.HD), v(T * b.HD);
      for (int64_t t = 0; t < T; ++t) {
        std::copy(out.begin() + t * C, out.begin() + t * C + b.HD, k_rot.begin() + t * b.HD);
        std::copy(out.begin() + t * C + b.HD, out.begin() + (t + 1) * C, v.begin() + t * b.HD);
      }
      cpu::RopeReference({T, b.H, b.dh, pos, 10000.0, b.HD, k_rot.data()});
      const int64_t at = (layer * b.cap + pos) * b.HD;
      ExpectBf16Close(std::vector<float>(caches[s][0].begin() + at, caches[s][0].begin() + at + T * b.HD), k_rot,
                      "k cache, sequence " + std::to_string(s));
      ExpectBf16Close(std::vector<float>(caches[s][1].begin() + at, caches[s][1].begin() + at + T * b.HD), v,
                      "v cache, sequence " + std::to_string(s));
      // Attention rows: RoPE of the q_attn columns.
      for (int64_t t = 0; t < T; ++t) {
        if (!b.modes[row + t]) continue;
        std::vector<float> q(proj.begin() + (row + t) * b.P + b.P - b.HD, proj.begin() + (row + t + 1) * b.P);
        cpu::RopeReference({1, b.H, b.dh, pos + t, 10000.0, b.HD, q.data()});
        ExpectClose(std::vector<float>(qa.begin() + (row + t) * b.HD, qa.begin() + (row + t + 1) * b.HD), q, kFp32Tol,
                    "rotated q_attn");
      }
      row += T;
    }
  }
}

TEST(OpsCuda, RecurrentMatchesMamba2AndGdnReferencesWithStateCapture) {
  for (bool gdn : {false, true}) {
    for (int64_t dh : {5, 64, 128}) {
      SCOPED_TRACE((gdn ? "gdn dh=" : "mamba2 dh=") + std::to_string(dh));
      Batch b = MakeBatch(3, dh, gdn, {7, 1}, {0, 0}, 2);
      const int64_t H = b.H, HD = b.HD, dd = dh * dh, L = b.L, layer = b.layer, P = b.P;
      const std::vector<float> proj = Random(b.N * P, 30), kv = Random(b.N * 2 * HD, 31);
      const std::vector<float> dt_bias = Random(H, 32, -1, 0), a_log = Random(H, 33, -1, 1), d_skip = Random(H, 34);
      std::vector<float> states[2] = {Random(L * H * dd, 35, -0.5, 0.5), Random(L * H * dd, 36, -0.5, 0.5)};
      DeviceBuffer<float> dproj(proj), dkv(kv), ddt(dt_bias), dalog(a_log), dd_skip(d_skip), dout(b.N * HD);
      DeviceBuffer<float> ds0(states[0]), ds1(states[1]), dsaved(L * H * 8 * dd), dconv(1);
      std::vector<cuda::SeqDesc> seqs = {{0, 7, 0, 0, ds0.get(), dconv.get(), nullptr, dsaved.get(), nullptr},
                                         {7, 1, 0, 0, ds1.get(), dconv.get(), nullptr, nullptr, nullptr}};
      DeviceBuffer<cuda::SeqDesc> dseqs(seqs);
      DeviceBuffer<uint8_t> dmode(b.modes);
      cuda::Recurrent({b.dims, static_cast<int32_t>(layer), 2, dseqs.get(), dmode.get(), dproj.get(), dkv.get(),
                       ddt.get(), dalog.get(), gdn ? nullptr : dd_skip.get(), dout.get()}, nullptr);
      const std::vector<float> out = dout.Host(), saved = dsaved.Host();
      const std::vector<float> after[2] = {ds0.Host(), ds1.Host()};
      int64_t row = 0;
      for (int s = 0; s < 2; ++s) {
        const int64_t T = b.len[s];
        // The gates as the backend defines them, then the reference recurrence.
        std::vector<float> ga(T * H), gb(T * H);
        for (int64_t t = 0; t < T; ++t) {
          const float* g = proj.data() + (row + t) * P + 4 * HD;
          for (int64_t h = 0; h < H; ++h) {
            auto softplus = [](double x) { return x > 20 ? x : std::log1p(std::exp(x)); };
            if (!gdn) {
              const double dt = softplus(g[h] + dt_bias[h]);
              ga[t * H + h] = static_cast<float>(dt);
              gb[t * H + h] = static_cast<float>(-dt * std::exp(a_log[h]));
            } else {
              ga[t * H + h] = static_cast<float>(1 / (1 + std::exp(-double(g[h]))));
              gb[t * H + h] = static_cast<float>(-std::exp(a_log[h]) * softplus(g[H + h] + dt_bias[h]));
            }
          }
        }
        std::vector<float> state(states[s].begin() + layer * H * dd, states[s].begin() + (layer + 1) * H * dd);
        std::vector<float> ref_out(T * HD), ref_states(T * H * dd);
        const float* q = proj.data() + row * P + 2 * HD;
        const float* k = kv.data() + row * 2 * HD;
        // q (from proj) and k, v (from the conv outputs) next to each other, as the references take them.
        std::vector<float> qkv(T * 3 * HD);
        for (int64_t t = 0; t < T; ++t) {
          std::copy(q + t * P, q + t * P + HD, qkv.begin() + t * 3 * HD);
          std::copy(k + t * 2 * HD, k + (t + 1) * 2 * HD, qkv.begin() + t * 3 * HD + HD);
        }
        if (!gdn) {
          cpu::Mamba2Reference({T, H, dh, 3 * HD, HD, ga.data(), gb.data(), d_skip.data(), qkv.data(), qkv.data() + HD,
                                qkv.data() + 2 * HD, state.data(), ref_states.data(), ref_out.data()});
        } else {
          cpu::GdnReference({T, H, dh, 3 * HD, HD, ga.data(), gb.data(), qkv.data(), qkv.data() + HD, qkv.data() + 2 * HD,
                             state.data(), ref_states.data(), ref_out.data()});
        }
        ExpectClose(std::vector<float>(after[s].begin() + layer * H * dd, after[s].begin() + (layer + 1) * H * dd), state,
                    kFp32Tol, "state after the span");
        for (int64_t t = 0; t < T; ++t) {
          if (b.modes[row + t]) continue;  // attention rows are left to Attention
          ExpectClose(std::vector<float>(out.begin() + (row + t) * HD, out.begin() + (row + t + 1) * HD),
                      std::vector<float>(ref_out.begin() + t * HD, ref_out.begin() + (t + 1) * HD), kFp32Tol,
                      "output of token " + std::to_string(t));
        }
        if (s == 0) {  // captured states: [L, H, T+1, dd], index 0 the state before the span
          for (int64_t h = 0; h < H; ++h) {
            const float* base = saved.data() + (layer * H + h) * (T + 1) * dd;
            ExpectClose(std::vector<float>(base, base + dd),
                        std::vector<float>(states[s].begin() + (layer * H + h) * dd, states[s].begin() + (layer * H + h + 1) * dd),
                        0, "state before the span");
            for (int64_t t = 0; t < T; ++t) {
              const float* want = ref_states.data() + t * H * dd + h * dd;
              ExpectClose(std::vector<float>(base + (t + 1) * dd, base + (t + 2) * dd), std::vector<float>(want, want + dd),
                          kFp32Tol, "state after token " + std::to_string(t));
            }
          }
        }
        row += T;
      }
    }
  }
}

// The fused decode-step mixer against the three kernels it replaces, on a batch of three one-token spans
// (an attention row, a linear row, and a draft without a KV cache), both mixers, SiLU or identity conv,
// RoPE from the table, computed, or off, every head_dim it takes, in both layouts (a head per cluster, a head
// per block). Both sides run the same fp32 math in the same order, up to the compiler's contractions:
// kFp32Tol; the moved windows must be equal. A third run writes the gated norm of its outputs
// instead (DecodeMixerParams::maybe_gated_ptr).
TEST(OpsCuda, DecodeMixerEqualsConvWindowAndRecurrenceKernels) {
  int major = 0;
  ORYX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) GTEST_SKIP() << "the fused decode mixer needs thread-block clusters (compute capability 9)";
  for (int case_index = 0; case_index < 2 * 2 * 3 * 3; ++case_index) {
    const bool head_blocks = case_index / 18, gdn = case_index / 9 % 2;
    const int64_t dh = int64_t{32} << (case_index / 3 % 3);
    const int variant = case_index % 3;
    ScopedSwitches switches;
    switches.Set([&](cuda::KernelSwitches& s) {
      s.head_mixer_min_seqs = head_blocks ? 1 : 0;
      s.head_mixer_min_dim = 1;
    });
    SCOPED_TRACE(std::string(head_blocks ? "a head per block, " : "a head per cluster, ") + (gdn ? "gdn" : "mamba2") +
                 " dh=" + std::to_string(dh) + " variant " + std::to_string(variant));
    Batch b = MakeBatch(3, dh, gdn, {1, 1, 1}, {9, 3, 5}, 0);
    b.dims.conv_silu = variant == 1;
    if (variant == 2) b.dims.rope_theta = 0;
    ASSERT_TRUE(cuda::DecodeMixerApplies(b.dims));
    ASSERT_EQ(b.modes, (std::vector<uint8_t>{1, 0, 0}));
    const int64_t H = b.H, HD = b.HD, C = 2 * HD, w = 4, W = b.W, L = b.L, dd = dh * dh, P = b.P;
    std::vector<double> freq(dh / 2);
    for (int64_t i = 0; i < dh / 2; ++i) freq[i] = std::pow(10000.0, -2.0 * i / dh);
    const std::vector<float> proj = Random(b.N * P, 60), weight = Random(C * w, 61), bias = Random(C, 62);
    const std::vector<float> dt_bias = Random(H, 63, -1, 0), a_log = Random(H, 64, -1, 1), d_skip = Random(H, 65);
    DeviceBuffer<double> dfreq(freq);
    DeviceBuffer<float> dproj(proj), dweight(weight), dbias(bias), ddt(dt_bias), dalog(a_log), dskip(d_skip);
    DeviceBuffer<int32_t> drow(b.row_seq);
    DeviceBuffer<uint8_t> dmode(b.modes);
    // Each side's own copy of every state it changes.
    struct Side {
      std::vector<std::unique_ptr<DeviceBuffer<float>>> windows, states;
      std::vector<std::unique_ptr<PagedKv>> kv_caches;
      std::unique_ptr<DeviceBuffer<float>> qa, out, kv;
      std::unique_ptr<DeviceBuffer<cuda::SeqDesc>> seqs;
    } sides[3];
    for (Side& side : sides) {
      std::vector<cuda::SeqDesc> seqs;
      for (int s = 0; s < 3; ++s) {
        side.windows.push_back(std::make_unique<DeviceBuffer<float>>(Random(L * W * C, 70 + s)));
        side.states.push_back(std::make_unique<DeviceBuffer<float>>(Random(L * H * dd, 80 + s, -0.5, 0.5)));
        side.kv_caches.push_back(
            std::make_unique<PagedKv>(Random(L * b.cap * HD, 90 + s), Random(L * b.cap * HD, 95 + s), L, b.cap, HD));
        const bool draft = s == 2;
        seqs.push_back({s, 1, b.pos[s], draft ? 0 : b.cap, side.states[s]->get(), side.windows[s]->get(),
                        draft ? nullptr : side.kv_caches[s]->table(), nullptr, nullptr});
      }
      side.seqs = std::make_unique<DeviceBuffer<cuda::SeqDesc>>(seqs);
      side.qa = std::make_unique<DeviceBuffer<float>>(b.N * HD);
      side.out = std::make_unique<DeviceBuffer<float>>(b.N * HD);
      side.kv = std::make_unique<DeviceBuffer<float>>(b.N * C);
    }
    const double* table = variant == 0 ? dfreq.get() : nullptr;
    const int32_t layer = static_cast<int32_t>(b.layer);
    Side& three = sides[0];
    cuda::ConvRopeAppend({b.dims, layer, b.N, drow.get(), dmode.get(), three.seqs->get(), dproj.get(), dweight.get(),
                          dbias.get(), three.kv->get(), three.qa->get(), table},
                         nullptr);
    cuda::ConvWindowUpdate({b.dims, layer, 3, three.seqs->get(), dproj.get()}, nullptr);
    cuda::Recurrent({b.dims, layer, 3, three.seqs->get(), dmode.get(), dproj.get(), three.kv->get(), ddt.get(),
                     dalog.get(), gdn ? nullptr : dskip.get(), three.out->get()},
                    nullptr);
    Side& fused = sides[1];
    cuda::DecodeMixer({b.dims, layer, 3, fused.seqs->get(), dmode.get(), dproj.get(), dweight.get(), dbias.get(),
                       ddt.get(), dalog.get(), gdn ? nullptr : dskip.get(), fused.qa->get(), fused.out->get(), table},
                      nullptr);
    // The gated norm in the mixer (the CUDA backend's Plan::gated_in_mixer), on a third copy of the states: the
    // linear rows' outputs normed as GatedNorm norms the three kernels' (within a bf16 step: the head's sum
    // of squares is added in another order).
    Side& gated = sides[2];
    const std::vector<float> gate_norm = Random(dh, 66, 0.5f, 1.5f);
    DeviceBuffer<float> dgate_norm(gate_norm);
    DeviceBuffer<bf16> in_mixer(b.N * HD), separate(b.N * HD);
    cuda::DecodeMixerParams with_norm{b.dims,
                                      layer,
                                      3,
                                      gated.seqs->get(),
                                      dmode.get(),
                                      dproj.get(),
                                      dweight.get(),
                                      dbias.get(),
                                      ddt.get(),
                                      dalog.get(),
                                      gdn ? nullptr : dskip.get(),
                                      gated.qa->get(),
                                      gated.out->get(),
                                      table};
    with_norm.maybe_gated_ptr = in_mixer.get(), with_norm.gate_column = 3 * HD;
    with_norm.gate_norm_ptr = dgate_norm.get();
    cuda::DecodeMixer(with_norm, nullptr);
    cuda::GatedNorm(
        {b.N, H, dh, b.dims.norm_eps, P, three.out->get(), dproj.get() + 3 * HD, dgate_norm.get(), separate.get()},
        nullptr);
    const std::vector<float> normed[2] = {ToFloat(separate.Host()), ToFloat(in_mixer.Host())};
    for (int64_t r : {1, 2}) {
      ExpectBf16Close(std::vector<float>(normed[1].begin() + r * HD, normed[1].begin() + (r + 1) * HD),
                      std::vector<float>(normed[0].begin() + r * HD, normed[0].begin() + (r + 1) * HD),
                      "gated norm of linear row " + std::to_string(r));
    }
    ExpectClose(gated.states[1]->Host(), three.states[1]->Host(), kFp32Tol, "state of sequence 1 (gated norm on)");
    const std::vector<float> qa[2] = {three.qa->Host(), fused.qa->Host()},
                             out[2] = {three.out->Host(), fused.out->Host()};
    auto row = [&](const std::vector<float>& v, int64_t r) {
      return std::vector<float>(v.begin() + r * HD, v.begin() + (r + 1) * HD);
    };
    ExpectClose(row(qa[1], 0), row(qa[0], 0), kFp32Tol, "rotated attention query");
    for (int64_t r : {1, 2})
      ExpectClose(row(out[1], r), row(out[0], r), kFp32Tol, "output of linear row " + std::to_string(r));
    for (int s = 0; s < 3; ++s) {
      const std::string what = " of sequence " + std::to_string(s);
      EXPECT_EQ(fused.windows[s]->Host(), three.windows[s]->Host()) << "window" << what;
      ExpectClose(fused.states[s]->Host(), three.states[s]->Host(), kFp32Tol, "state" + what);
      ExpectBf16Close(fused.kv_caches[s]->Keys(), three.kv_caches[s]->Keys(), "k cache" + what);
      ExpectBf16Close(fused.kv_caches[s]->Values(), three.kv_caches[s]->Values(), "v cache" + what);
    }
    // The step did something: the states moved and the window took the token's inputs.
    EXPECT_NE(fused.states[0]->Host(), Random(L * H * dd, 80, -0.5, 0.5));
  }
}

// The chunked scans (mamba2's SSD form, gdn's chunked delta rule) against the token-by-token kernel, on one
// batch run both ways (chunked_min_len 0, then kChunkedScanMinLen): spans of 200, 128 and 129 tokens (3.1,
// exactly 2, and 2 chunks of 64 and one of a single token; 9 chunks in all, so that 2 heads make a count of
// (chunk, head) records that is not a multiple of 4, which the scratch's 16-byte alignment must not assume)
// take the chunked scan from non-zero states; a 150-token span that captures its
// states and a 5-token span stay token by token, so theirs must come out bit for bit the same. Two gate
// regimes: fast decay (a_t, or gdn's alpha_t, in about 0.03..0.95 for mamba2 and 0.15..0.9 for gdn: the
// state entering a chunk mostly forgotten within it) and slow decay (about 0.93..0.998: the state carried
// over the whole span). Tolerance kFp32Tol (1e-4 of the scale): both sides are fp32; the chunked scan
// regroups the sums (over up to dh + 64 terms per output) and takes a decay product over a chunk as one expf
// of a log-decay sum kept in double, where the token kernel multiplies up to 64 expf values: each a relative
// error of at most ~64 ulp (4e-6), 25x inside the tolerance. gdn's substitution carries each token's
// rounding into the later ones through the delta rule's own factors (I - beta k k^T), whose norms are at
// most 1, so it does not grow along the chunk.
TEST(OpsCuda, ChunkedScanMatchesTokenByTokenRecurrence) {
  for (int variant = 0; variant < 4; ++variant) {
    const bool gdn = variant & 2, slow = variant & 1;
    for (int64_t dh : {5, 64, 128, 256}) {
      SCOPED_TRACE(std::string(gdn ? "gdn, " : "mamba2, ") + (slow ? "slow decay dh=" : "fast decay dh=") +
                   std::to_string(dh));
      const std::vector<int> lens = {200, 128, 129, 150, 5};
      Batch b = MakeBatch(2, dh, gdn, lens, {0, 0, 0, 0}, 3);
      const int64_t H = b.H, HD = b.HD, dd = dh * dh, L = b.L, layer = b.layer, P = b.P;
      const std::vector<float> proj = Random(b.N * P, 40), kv = Random(b.N * 2 * HD, 41);
      const std::vector<float> dt_bias = Random(H, 42, -1, 0), d_skip = Random(H, 44);
      const std::vector<float> a_log = slow ? Random(H, 43, -5, -3) : Random(H, 43, -1, 1);
      const std::vector<float> out_init = Random(b.N * HD, 45);  // attention rows keep these
      std::vector<std::vector<float>> states;
      for (size_t q = 0; q < lens.size(); ++q) states.push_back(Random(L * H * dd, 50 + q, -0.5, 0.5));
      DeviceBuffer<float> dproj(proj), dkv(kv), ddt(dt_bias), dalog(a_log), dd_skip(d_skip), dconv(1);
      DeviceBuffer<uint8_t> dmode(b.modes);
      struct Run {
        std::vector<float> out, saved;
        std::vector<std::vector<float>> after;
      };
      auto run = [&](int32_t chunked_min_len, bool count_chunks) {
        std::vector<std::unique_ptr<DeviceBuffer<float>>> ds;
        for (const auto& st : states) ds.push_back(std::make_unique<DeviceBuffer<float>>(st));
        DeviceBuffer<float> dout(out_init), dsaved(L * H * (lens[3] + 1) * dd);
        std::vector<cuda::SeqDesc> seqs;
        int32_t row = 0;
        for (size_t q = 0; q < lens.size(); ++q) {
          seqs.push_back({row, lens[q], 0, 0, ds[q]->get(), dconv.get(), nullptr, q == 3 ? dsaved.get() : nullptr, nullptr});
          row += lens[q];
        }
        DeviceBuffer<cuda::SeqDesc> dseqs(seqs);
        // The spans that keep no states: 200, 128 and 5 tokens (4 + 2 chunks of 64 at kChunkedScanMinLen).
        int64_t chunks = 0;
        for (int64_t len : {200, 128, 129, 5}) chunks += count_chunks ? cuda::ChunkedScanChunks(len, chunked_min_len) : 0;
        if (count_chunks && chunked_min_len > 0) {
          EXPECT_EQ(chunks, 9);  // 4 + 2 + 3; the 5-token span none
        }
        DeviceBuffer<float> dscratch(std::max<int64_t>(1, cuda::ChunkedScanScratchFloats(b.dims, chunks)));
        cuda::Recurrent({b.dims, static_cast<int32_t>(layer), static_cast<int64_t>(lens.size()), dseqs.get(), dmode.get(),
                         dproj.get(), dkv.get(), ddt.get(), dalog.get(), dd_skip.get(), dout.get(), chunked_min_len,
                         chunks, dscratch.get()},
                        nullptr);
        Run r{dout.Host(), dsaved.Host(), {}};
        for (auto& d : ds) r.after.push_back(d->Host());
        return r;
      };
      const Run token = run(0, true), chunked = run(cuda::kChunkedScanMinLen, true);
      {  // told of no chunks, every span runs token by token
        const Run uncounted = run(cuda::kChunkedScanMinLen, false);
        EXPECT_EQ(uncounted.out, token.out) << "no chunks counted: outputs";
        EXPECT_EQ(uncounted.after, token.after) << "no chunks counted: states";
      }
      int64_t row = 0;
      for (size_t q = 0; q < lens.size(); ++q) {
        const int64_t T = lens[q];
        const std::string what = "sequence " + std::to_string(q) + " (" + std::to_string(T) + " tokens)";
        const std::vector<float> out_c(chunked.out.begin() + row * HD, chunked.out.begin() + (row + T) * HD);
        const std::vector<float> out_t(token.out.begin() + row * HD, token.out.begin() + (row + T) * HD);
        if (q < 3) {
          ExpectClose(out_c, out_t, kFp32Tol, what + ": outputs");
          ExpectClose(chunked.after[q], token.after[q], kFp32Tol, what + ": state after the span");
          // Attention rows are left alone.
          for (int64_t t = 0; t < T; ++t) {
            if (!b.modes[row + t]) continue;
            for (int64_t e = 0; e < HD; ++e) ASSERT_EQ(out_c[t * HD + e], out_init[(row + t) * HD + e]) << what;
          }
        } else {
          EXPECT_EQ(out_c, out_t) << what << ": outputs";
          EXPECT_EQ(chunked.after[q], token.after[q]) << what << ": state after the span";
        }
        // The other layer's state is untouched.
        for (int64_t e = 0; e < L * H * dd; ++e) {
          if (e / (H * dd) == layer) continue;
          ASSERT_EQ(chunked.after[q][e], states[q][e]) << what << ": layer 0 state";
        }
        row += T;
      }
      EXPECT_EQ(chunked.saved, token.saved) << "captured states";
    }
  }
}

TEST(OpsCuda, AttentionMatchesAttentionReferenceOverManyChunks) {
  for (int64_t dh : {5, 32, 64, 128, 256}) {
    // Sequence 0: a verify span of `span` rows ending at position 699 (700 keys: three 256-key chunks, or one);
    // sequence 1: one decode row at position 40. With `grouped`, sequence 0's rows go in groups of
    // kAttentionGroupRows (one block reads a chunk for all of them; dh 5 has no group kernel and ignores them).
    // group_size 16: on tensor cores, span 11 in one group (GroupAttentionMmaApplies; else the case is skipped).
    for (int span : {2, 3, 11}) {
      for (int group_size : {0, cuda::kAttentionGroupRows, cuda::kAttentionMmaGroupRows}) {
        const bool grouped = group_size > 0;
        SCOPED_TRACE("dh=" + std::to_string(dh) + ", span " + std::to_string(span) +
                     (grouped ? ", groups of " + std::to_string(group_size) : ""));
        const int NA = span + 1;
        Batch b = MakeBatch(2, dh, false, {span, 1}, {700 - span, 40}, 0);
        if (group_size > cuda::kAttentionGroupRows && !cuda::GroupAttentionMmaApplies(b.dims)) continue;
        b.modes.assign(b.N, 1);
        const int64_t H = b.H, HD = b.HD, L = b.L, layer = b.layer, cap = 704;
        const std::vector<float> caches[2][2] = {
            {RoundBf16(Random(L * cap * HD, 40)), RoundBf16(Random(L * cap * HD, 41))},
            {RoundBf16(Random(L * cap * HD, 42)), RoundBf16(Random(L * cap * HD, 43))}};
        const std::vector<float> qa = Random(b.N * HD, 44, -2, 2);
        const PagedKv kv0(caches[0][0], caches[0][1], L, cap, HD), kv1(caches[1][0], caches[1][1], L, cap, HD);
        DeviceBuffer<float> dqa(qa), dout(b.N * HD), dstate(1);
        std::vector<cuda::SeqDesc> seqs = {
            {0, span, 700 - span, cap, dstate.get(), dstate.get(), kv0.table(), nullptr, nullptr},
            {span, 1, 40, cap, dstate.get(), dstate.get(), kv1.table(), nullptr, nullptr}};
        DeviceBuffer<cuda::SeqDesc> dseqs(seqs);
        std::vector<int32_t> attn(NA), groups;
        for (int i = 0; i < NA; ++i) attn[i] = i;
        for (int a0 = 0; grouped && a0 < span; a0 += group_size) {
          groups.insert(groups.end(), {a0, std::min(group_size, span - a0)});
        }
        groups.insert(groups.end(), {span, 1});
        DeviceBuffer<int32_t> drow(b.row_seq), dattn(attn), dgroups(groups);
        // Chunks up to the longest each kernel takes: the CUDA-core kernels' and the tensor-core groups'.
        const int32_t group_rows = std::min(std::max(group_size, 1), span);
        std::vector<int64_t> chunks = {32, 256, cuda::kAttentionChunk};
        if (grouped && cuda::GroupAttentionMmaTakes(b.dims, group_rows)) chunks.push_back(cuda::kGroupMmaChunk);
        for (int64_t chunk : chunks) {
          const int64_t max_chunks = (700 + chunk - 1) / chunk + 1;  // one more than needed: extra blocks exit
          DeviceBuffer<float> dpartial(NA * H * max_chunks * (dh + 2));
          cuda::Attention(
              {b.dims, static_cast<int32_t>(layer), NA, chunk, max_chunks, dattn.get(), drow.get(), dseqs.get(),
               dqa.get(), dpartial.get(), dout.get(), grouped ? static_cast<int64_t>(groups.size() / 2) : 0,
               grouped ? dgroups.get() : nullptr, group_rows},
              nullptr);
          const std::vector<float> out = dout.Host();
          int64_t row = 0;
          for (int s = 0; s < 2; ++s) {
            const int64_t T = b.len[s], keys = b.pos[s] + T;
            std::vector<float> ref(T * HD), scratch(T * keys);
            const float* kc = caches[s][0].data() + layer * cap * HD;
            const float* vc = caches[s][1].data() + layer * cap * HD;
            cpu::AttentionReference({T, keys, H, dh, HD, HD, HD, qa.data() + row * HD, kc, vc, ref.data(), scratch.data()});
            ExpectClose(std::vector<float>(out.begin() + row * HD, out.begin() + (row + T) * HD), ref, kFp32Tol,
                        "sequence " + std::to_string(s) + ", chunk " + std::to_string(chunk), 1.0);
            row += T;
          }
        }
      }
    }
  }
}

// The tensor-core prefill kernel against the CPU reference: a 150-row span ending at position 699 (keys over
// eleven 64-key tiles, its rows in tiles of 64 with a partial last one, a third of them linear and skipped),
// a 70-row prefill from position 0 (a row whose first key tile is its only one) and a single row. Queries and
// probabilities enter the products as two bf16 terms (2^-17 relative), the keys and values are bf16 on both
// sides, and the sums are fp32 in another order, so the fp32 kernels' bound holds (kFp32Tol).
TEST(OpsCuda, TiledAttentionMatchesAttentionReference) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (prop.major < 8) GTEST_SKIP() << "tensor-core attention needs compute capability 8";
  for (int64_t dh : {64, 128}) {
    SCOPED_TRACE("dh=" + std::to_string(dh));
    const std::vector<int> lens = {150, 70, 1}, pos = {550, 0, 40};
    Batch b = MakeBatch(2, dh, false, lens, pos, 0);
    b.modes.assign(b.N, 1);
    for (int t = 0; t < lens[0]; ++t) b.modes[t] = t % 3 != 1;
    const int64_t H = b.H, HD = b.HD, L = b.L, layer = b.layer, cap = 704;
    std::vector<std::vector<float>> k_caches, v_caches;
    std::vector<std::unique_ptr<PagedKv>> paged;
    for (size_t q = 0; q < lens.size(); ++q) {
      k_caches.push_back(RoundBf16(Random(L * cap * HD, 60 + 2 * q)));
      v_caches.push_back(RoundBf16(Random(L * cap * HD, 61 + 2 * q)));
      paged.push_back(std::make_unique<PagedKv>(k_caches.back(), v_caches.back(), L, cap, HD));
    }
    const std::vector<float> qa = Random(b.N * HD, 64, -2, 2);
    DeviceBuffer<float> dqa(qa), dout(b.N * HD), dstate(1);
    std::vector<cuda::SeqDesc> seqs;
    std::vector<int32_t> attn, tiles;
    int32_t row = 0;
    for (size_t q = 0; q < lens.size(); ++q) {
      seqs.push_back({row, lens[q], pos[q], cap, dstate.get(), dstate.get(), paged[q]->table(), nullptr, nullptr});
      const int first = static_cast<int>(attn.size());
      for (int t = 0; t < lens[q]; ++t) {
        if (b.modes[row + t]) attn.push_back(row + t);
      }
      const int n = static_cast<int>(attn.size()) - first;
      for (int a0 = 0; a0 < n; a0 += cuda::kAttentionTileRows) {
        tiles.insert(tiles.end(), {first + a0, std::min(cuda::kAttentionTileRows, n - a0)});
      }
      row += lens[q];
    }
    DeviceBuffer<cuda::SeqDesc> dseqs(seqs);
    DeviceBuffer<int32_t> drow(b.row_seq), dattn(attn), dtiles(tiles);
    cuda::TiledAttention({b.dims, static_cast<int32_t>(layer), static_cast<int64_t>(attn.size()), 0, 0, dattn.get(),
                          drow.get(), dseqs.get(), dqa.get(), nullptr, dout.get(), static_cast<int64_t>(tiles.size() / 2),
                          dtiles.get(), cuda::kAttentionTileRows},
                         nullptr);
    const std::vector<float> out = dout.Host();
    row = 0;
    for (size_t q = 0; q < lens.size(); ++q) {
      const int64_t T = lens[q], keys = pos[q] + T;
      std::vector<float> ref(T * HD), scratch(T * keys), got(T * HD), want(T * HD);
      cpu::AttentionReference({T, keys, H, dh, HD, HD, HD, qa.data() + row * HD,
                               k_caches[q].data() + layer * cap * HD, v_caches[q].data() + layer * cap * HD, ref.data(),
                               scratch.data()});
      for (int64_t t = 0; t < T; ++t) {  // attention rows only; the others are not written
        if (!b.modes[row + t]) continue;
        std::copy_n(out.begin() + (row + t) * HD, HD, got.begin() + t * HD);
        std::copy_n(ref.begin() + t * HD, HD, want.begin() + t * HD);
      }
      ExpectClose(got, want, kFp32Tol, "sequence " + std::to_string(q), 1.0);
      row += T;
    }
  }
}

}  // namespace
}  // namespace oryx::kernels
