// GdnStatesKernel of train/cuda_train_kernels.cu (with call-1-wip.diff applied) run on the CPU: each CUDA
// thread a std::thread, __syncthreads a barrier of the block, shared memory a buffer per block. Compares the
// kernel, with the columns split (DC < D) and not, forward and backward, with a direct sequential
// computation (fp64).
//
//   python3 -c "s=open('train/cuda_train_kernels.cu').read(); a=s.index('template <typename T>\nstruct alignas(4 * sizeof(T)) Quad'); b=s.index('template <typename T, int C, int D, int DC, bool kBackward>\ncudaError_t LaunchGdnStates'); open('gdn_states_patched.inc','w').write('namespace oryx_emu {\n' + s[a:b].replace('extern __shared__ unsigned char smem_raw[];', '') + '\n}\n')"
//   g++ -std=c++20 -O1 -pthread -o emulate emulate_gdn_states.cc && ./emulate
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)
struct Dim { unsigned x = 1, y = 1, z = 1; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
thread_local std::barrier<>* block_barrier;
thread_local unsigned char* smem_raw;
void __syncthreads() { block_barrier->arrive_and_wait(); }
#include "gdn_states_patched.inc"
template <typename F> void Launch(unsigned blocks, unsigned threads, size_t smem, F f) {
  gridDim = {blocks, 1, 1}; blockDim = {threads, 1, 1};
  for (unsigned b = 0; b < blocks; ++b) {
    std::barrier<> bar(threads);
    std::vector<unsigned char> shared(smem + 64);
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([&, t, b] { threadIdx = {t, 1, 1}; blockIdx = {b, 1, 1}; block_barrier = &bar; smem_raw = shared.data(); f(); });
    for (auto& t : ts) t.join();
  }
}
using T = double;
template <int C, int D, int DC> int Run(int heads, int chunks, std::mt19937& rng) {
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> ud(0.5, 1);
  std::vector<T> x(heads * chunks * C * 2 * D), ke(heads * chunks * C * D), decay(heads * chunks), first(heads * D * D);
  std::vector<T> gu(heads * chunks * C * D), gs0(heads * chunks * D * D), dfinal(heads * D * D);
  for (auto* v : {&x, &ke, &first, &gu, &gs0, &dfinal}) for (auto& e : *v) e = 0.3 * nd(rng);
  for (auto& e : decay) e = ud(rng);
  // reference
  std::vector<T> s0(heads * chunks * D * D), u(heads * chunks * C * D), last(heads * D * D);
  std::vector<T> dsn(heads * chunks * D * D), du(heads * chunks * C * D), dinit(heads * D * D);
  for (int h = 0; h < heads; ++h) {
    std::vector<T> S(first.begin() + h * D * D, first.begin() + (h + 1) * D * D);
    for (int n = 0; n < chunks; ++n) {
      const int64_t ch = h * chunks + n;
      std::copy(S.begin(), S.end(), s0.begin() + ch * D * D);
      for (int r = 0; r < C; ++r) for (int j = 0; j < D; ++j) {
        double acc = x[(ch * C + r) * 2 * D + j];
        for (int k = 0; k < D; ++k) acc -= x[(ch * C + r) * 2 * D + D + k] * S[k * D + j];
        u[(ch * C + r) * D + j] = acc;
      }
      std::vector<T> Sn(D * D);
      for (int i = 0; i < D; ++i) for (int j = 0; j < D; ++j) {
        double acc = decay[ch] * S[i * D + j];
        for (int c = 0; c < C; ++c) acc += ke[(ch * C + c) * D + i] * u[(ch * C + c) * D + j];
        Sn[i * D + j] = acc;
      }
      S = Sn;
    }
    std::copy(S.begin(), S.end(), last.begin() + h * D * D);
    std::vector<T> dS(dfinal.begin() + h * D * D, dfinal.begin() + (h + 1) * D * D);
    for (int n = chunks - 1; n >= 0; --n) {
      const int64_t ch = h * chunks + n;
      std::copy(dS.begin(), dS.end(), dsn.begin() + ch * D * D);
      for (int r = 0; r < C; ++r) for (int j = 0; j < D; ++j) {
        double acc = gu[(ch * C + r) * D + j];
        for (int k = 0; k < D; ++k) acc += ke[(ch * C + r) * D + k] * dS[k * D + j];
        du[(ch * C + r) * D + j] = acc;
      }
      std::vector<T> dn(D * D);
      for (int i = 0; i < D; ++i) for (int j = 0; j < D; ++j) {
        double acc = gs0[(ch * D + i) * D + j] + decay[ch] * dS[i * D + j];
        for (int c = 0; c < C; ++c) acc -= x[(ch * C + c) * 2 * D + D + i] * du[(ch * C + c) * D + j];
        dn[i * D + j] = acc;
      }
      dS = dn;
    }
    std::copy(dS.begin(), dS.end(), dinit.begin() + h * D * D);
  }
  using L = oryx_emu::GdnLayout<T, C, D, DC>;
  std::vector<T> ks0(s0.size(), -9), ku(u.size(), -9), klast(last.size(), -9), kdsn(dsn.size(), -9), kdu(du.size(), -9), kdinit(dinit.size(), -9);
  Launch(heads * L::kSplits, L::kThreads, L::kSmem, [&] {
    oryx_emu::GdnStatesKernel<T, C, D, DC, false>(chunks, x.data(), ke.data(), decay.data(), nullptr, nullptr, first.data(), ks0.data(), ku.data(), klast.data());
  });
  Launch(heads * L::kSplits, L::kThreads, L::kSmem, [&] {
    oryx_emu::GdnStatesKernel<T, C, D, DC, true>(chunks, x.data(), ke.data(), decay.data(), gu.data(), gs0.data(), dfinal.data(), kdsn.data(), kdu.data(), kdinit.data());
  });
  auto err = [](const std::vector<T>& a, const std::vector<T>& b) {
    double e = 0, m = 0; for (size_t i = 0; i < a.size(); ++i) { e = std::max(e, std::abs(a[i] - b[i])); m = std::max(m, std::abs(b[i])); }
    return e / m;
  };
  double e[6] = {err(ks0, s0), err(ku, u), err(klast, last), err(kdsn, dsn), err(kdu, du), err(kdinit, dinit)};
  double worst = *std::max_element(e, e + 6);
  std::printf("C %d D %d DC %d (%d threads, %d blocks): s0 %.1e u %.1e last %.1e ds_next %.1e du %.1e dinitial %.1e  %s\n", C, D, DC, L::kThreads, heads * L::kSplits, e[0], e[1], e[2], e[3], e[4], e[5], worst < 1e-12 ? "ok" : "FAIL");
  return worst < 1e-12 ? 0 : 1;
}
int main() {
  std::mt19937 rng(5);
  return Run<16, 8, 8>(3, 5, rng) + Run<16, 8, 4>(3, 5, rng) + Run<64, 64, 64>(2, 3, rng) + Run<64, 64, 32>(2, 3, rng);
}
