// The ChunkPrep kernels of train/cuda_train_kernels.cu (with call-1-wip.diff applied) run on the CPU: each CUDA
// thread a std::thread, each shuffle through its warp's slots between two barriers. fp64, dh 8, 16 and 64, with
// and without the norms, a strided q, a padded tail, one block or three (the grid-stride loop). Checks the
// forward against a direct computation, dq and dk against central differences of the forward, and dv, ddt and
// dto_end (padded steps included) against their sums.
//
//   sed -n '/^constexpr int kPrepVec/,/^unsigned PrepBlocks/p' train/cuda_train_kernels.cu | sed '$d' > kernels.inc
//   g++ -std=c++20 -O1 -pthread -o emulate emulate_chunk_prepare.cc && ./emulate
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __restrict__
using std::sqrt;
struct Dim { unsigned x = 1, y = 1, z = 1; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
struct Warp { std::barrier<> bar{32}; double slot[32]; };
thread_local Warp* my_warp;
template <typename T> T __shfl_xor_sync(unsigned, T v, int o) {
  int lane = threadIdx.x % 32;
  my_warp->slot[lane] = static_cast<double>(v);
  my_warp->bar.arrive_and_wait();
  T r = static_cast<T>(my_warp->slot[lane ^ o]);
  my_warp->bar.arrive_and_wait();
  return r;
}
struct Strides { int64_t b = 0, t = 0, h = 0; };
struct CombineShape { using Strides = ::Strides; };
struct ChunkPrepShape {
  int64_t batch = 0;
  int time = 0, padded = 0, heads = 0, head_dim = 0;
  Strides q, k, v;
  bool l2_norms = false;
  double q_scale = 1.0, eps = 0.0;
};
template <typename T, int kVec> struct alignas(sizeof(T) * kVec) Pack { T v[kVec]; };
inline int64_t At(const Strides& s, int64_t b, int64_t t, int h) { return b * s.b + t * s.t + h * s.h; }
#include "kernels.inc"
template <typename F> void Launch(unsigned blocks, unsigned threads, F f) {
  gridDim = {blocks, 1, 1}; blockDim = {threads, 1, 1};
  for (unsigned b = 0; b < blocks; ++b) {
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([&, t, b] { threadIdx = {t, 1, 1}; blockIdx = {b, 1, 1}; my_warp = warps[t / 32].get(); f(); });
    for (auto& t : ts) t.join();
  }
}
using T = double;
int main() {
  std::mt19937 rng(3);
  std::normal_distribution<double> nd;
  std::uniform_real_distribution<double> ud(0.1, 1);
  int fails = 0;
  for (int dh : {8, 16, 64}) for (int l2 = 0; l2 < 2; ++l2) for (unsigned blocks : {1u, 3u}) {
    const int B = 2, Tm = 13, H = 3, C = 4, N = 4, P = N * C;  // padded 16 > 13
    ChunkPrepShape s; s.batch = B; s.time = Tm; s.padded = P; s.heads = H; s.head_dim = dh;
    s.l2_norms = l2; s.q_scale = 1 / std::sqrt(double(dh)); s.eps = 1e-6;
    // q: strided part of a wider tensor [B,T,H*dh+8] starting at 8; k, v packed [B,T,H,dh]
    const int wq = H * dh + 8;
    std::vector<T> qb(B * Tm * wq), k(B * Tm * H * dh), v(B * Tm * H * dh), dt(B * H * P), te(B * H * P);
    for (auto* x : {&qb, &k, &v}) for (auto& e : *x) e = 2 * nd(rng);
    for (auto& e : dt) e = ud(rng); for (auto& e : te) e = ud(rng);
    s.q = {Tm * wq, wq, dh}; s.k = {Tm * H * dh, H * dh, dh}; s.v = s.k;
    const T* q = qb.data() + 8;
    auto fwd = [&](const std::vector<T>& qb_, const std::vector<T>& k_, std::vector<std::vector<T>>& outs) {
      outs.assign(4, std::vector<T>(B * H * P * dh, -7));
      auto f = [&] { ChunkPrepForwardKernel<T, T, true>(s, qb_.data() + 8, k_.data(), v.data(), dt.data(), te.data(), outs[0].data(), outs[1].data(), outs[2].data(), outs[3].data()); };
      auto g = [&] { ChunkPrepForwardKernel<T, T, false>(s, qb_.data() + 8, k_.data(), v.data(), dt.data(), te.data(), outs[0].data(), outs[1].data(), outs[2].data(), outs[3].data()); };
      if (l2) Launch(blocks, 64, f); else Launch(blocks, 64, g);
    };
    std::vector<std::vector<T>> outs;
    fwd(qb, k, outs);
    // forward reference
    double err = 0;
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < P; ++t) {
      double sq = 0, sk = 0;
      if (t < Tm) for (int d = 0; d < dh; ++d) { double a = q[At(s.q, b, t, h) + d], c = k[At(s.k, b, t, h) + d]; sq += a * a; sk += c * c; }
      double rq = l2 ? s.q_scale / std::sqrt(sq + s.eps) : 1, rk = l2 ? 1 / std::sqrt(sk + s.eps) : 1;
      int64_t row = (b * H + h) * P + t;
      for (int d = 0; d < dh; ++d) {
        double eq = t < Tm ? q[At(s.q, b, t, h) + d] * rq : 0, ek = t < Tm ? k[At(s.k, b, t, h) + d] * rk : 0;
        double eu = t < Tm ? dt[row] * v[At(s.v, b, t, h) + d] : 0;
        double ref[4] = {eq, ek, eu, te[row] * ek};
        for (int o = 0; o < 4; ++o) err = std::max(err, std::abs(outs[o][row * dh + d] - ref[o]));
      }
    }
    // backward against finite differences of L = sum_o g_o . out_o
    std::vector<std::vector<T>> g(4, std::vector<T>(B * H * P * dh));
    for (auto& x : g) for (auto& e : x) e = nd(rng);
    std::vector<T> dq(B * Tm * H * dh, -7), dk(dq.size(), -7), dv(dq.size(), -7), ddt(dt.size(), -7), dte(dt.size(), -7);
    auto bk = [&](auto kern) { Launch(blocks, 64, [&] { kern(s, l2 ? q : nullptr, k.data(), v.data(), dt.data(), te.data(), g[0].data(), g[1].data(), g[2].data(), g[3].data(), dq.data(), dk.data(), dv.data(), ddt.data(), dte.data()); }); };
    if (l2) bk(ChunkPrepBackwardKernel<T, T, true>); else bk(ChunkPrepBackwardKernel<T, T, false>);
    auto loss = [&](const std::vector<T>& qb_, const std::vector<T>& k_) {
      std::vector<std::vector<T>> o; fwd(qb_, k_, o); double L = 0;
      for (int i = 0; i < 4; ++i) for (size_t j = 0; j < o[i].size(); ++j) L += g[i][j] * o[i][j];
      return L;
    };
    double gerr = 0, gmax = 0; const double hstep = 1e-6;
    for (int trial = 0; trial < 6; ++trial) {
      int b = trial % B, t = (trial * 5) % Tm, h = trial % H, d = (trial * 3) % dh;
      auto qp = qb, qm = qb; qp[At(s.q, b, t, h) + d + 8] += hstep; qm[At(s.q, b, t, h) + d + 8] -= hstep;
      double num_q = (loss(qp, k) - loss(qm, k)) / (2 * hstep);
      auto kp = k, km = k; kp[At(s.k, b, t, h) + d] += hstep; km[At(s.k, b, t, h) + d] -= hstep;
      double num_k = (loss(qb, kp) - loss(qb, km)) / (2 * hstep);
      int64_t packed = ((b * Tm + t) * H + h) * dh + d;
      gerr = std::max({gerr, std::abs(dq[packed] - num_q), std::abs(dk[packed] - num_k)});
      gmax = std::max({gmax, std::abs(num_q), std::abs(num_k)});
    }
    // dv, ddt, dto_end analytically
    double serr = 0;
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < P; ++t) {
      int64_t row = (b * H + h) * P + t; double sdt = 0, ste = 0, sk = 0;
      if (t < Tm) for (int d = 0; d < dh; ++d) sk += k[At(s.k, b, t, h) + d] * k[At(s.k, b, t, h) + d];
      double rk = l2 ? 1 / std::sqrt(sk + s.eps) : 1;
      for (int d = 0; d < dh; ++d) if (t < Tm) {
        sdt += g[2][row * dh + d] * v[At(s.v, b, t, h) + d];
        ste += g[3][row * dh + d] * k[At(s.k, b, t, h) + d] * rk;
        int64_t packed = ((b * Tm + t) * H + h) * dh + d;
        serr = std::max(serr, std::abs(dv[packed] - dt[row] * g[2][row * dh + d]));
      }
      serr = std::max({serr, std::abs(ddt[row] - sdt), std::abs(dte[row] - ste)});
    }
    bool ok = err < 1e-12 && gerr < 1e-6 * std::max(1.0, gmax) && serr < 1e-12;
    fails += !ok;
    std::printf("dh %2d l2 %d blocks %u: fwd %.2e  dq/dk vs fd %.2e (max %.2f)  dv/ddt/dto_end %.2e  %s\n", dh, l2, blocks, err, gerr, gmax, serr, ok ? "ok" : "FAIL");
  }
  return fails;
}
