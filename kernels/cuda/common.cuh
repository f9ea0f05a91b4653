// Device helpers shared by the CUDA kernels: warp/block reductions and the scalar functions of the model.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// c += a b for a 16 x 16 bf16 tile a (row-major fragments) and a 16 x 8 tile b (column fragments), fp32 sums
// (mma.sync m16n8k16). Lane 4g + t holds a's rows g and g + 8 at columns 2t, 2t + 1 (a[0], a[1]) and 2t + 8,
// 2t + 9 (a[2], a[3]); b's column g at rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1); c's rows g (c[0], c[1])
// and g + 8 (c[2], c[3]) at columns 2t, 2t + 1. Callers keep devices before compute capability 8 away.
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the call synchronises the block twice.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// A row of d floats held in registers by the block: thread i holds the 16-byte pieces at columns
// RowPieceColumn(t) = 4 (i + t blockDim.x), t < kPieces, zeros past d. Loading them all at once is one
// round trip (a strided loop over the row takes one per unrolled group). RowFitsPieces: the row is 16-byte
// aligned and short enough.
__device__ __forceinline__ int64_t RowPieceColumn(int t) { return 4 * (threadIdx.x + int64_t(blockDim.x) * t); }

template <int kPieces>
__device__ __forceinline__ bool RowFitsPieces(const float* row, int64_t d) {
  return d % 4 == 0 && d <= 4 * int64_t(blockDim.x) * kPieces && reinterpret_cast<uintptr_t>(row) % 16 == 0;
}

template <int kPieces>
__device__ __forceinline__ void LoadRowPieces(const float* row, int64_t d, float4 (&v)[kPieces]) {
#pragma unroll
  for (int t = 0; t < kPieces; ++t) {
    const int64_t c = RowPieceColumn(t);
    v[t] = c < d ? *reinterpret_cast<const float4*>(row + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

template <int kPieces>
__device__ __forceinline__ float SumOfSquares(const float4 (&v)[kPieces]) {
  float sum = 0.f;
#pragma unroll
  for (int t = 0; t < kPieces; ++t) sum += v[t].x * v[t].x + v[t].y * v[t].y + v[t].z * v[t].z + v[t].w * v[t].w;
  return sum;
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// p, which must point to global memory, marked as such for the compiler. A pointer read from memory (a
// sequence's state, from its SeqDesc) is generic to it, and a store through a generic pointer may alias shared
// memory, so ptxas keeps every later shared-memory load behind it: a loop that stores a value per iteration
// and reads shared memory runs one load at a time. (Not for null pointers.)
template <typename T>
__device__ __forceinline__ T* GlobalPtr(T* p) {
  __builtin_assume(__isGlobal(p));
  return p;
}

// A weight piece: streamed once per step, so it is not kept in L1 (measured on the H200: the fused input
// projection of 1.4b alone took 14.1 against 16.0 µs with L1-allocating loads).
__device__ __forceinline__ uint4 LoadWeight(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// One 16-byte cp.async (both pointers 16-byte aligned; not L1-allocating).
__device__ __forceinline__ void CopyQuadAsync(float* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto smem = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(src) : "memory");
#else
  *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
#endif
}

// n floats from global to shared memory without holding registers (cp.async, 16 bytes a copy; both pointers
// 16-byte aligned, n a multiple of 4), spread over the block's threads; WaitCopies() then a barrier make them
// visible. Kernels use it before the programmatic-launch wait for constants their prologue reads, so that
// no DRAM round trip (behind the weights' early loads) follows the wait.
__device__ __forceinline__ void CopyToSharedAsync(float* dst, const float* src, int64_t n) {
  for (int64_t i = 4 * int64_t(threadIdx.x); i < n; i += 4 * int64_t(blockDim.x)) CopyQuadAsync(dst + i, src + i);
}

// One 4-byte cp.async (L1-allocating, as a plain load would be).
__device__ __forceinline__ void CopyWordAsync(float* dst, const float* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto smem = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem), "l"(src) : "memory");
#else
  *dst = *src;
#endif
}

// Waits for all of the thread's cp.async copies (committed or not).
__device__ __forceinline__ void WaitCopies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// torch's softplus (threshold 20: linear above it), as the CPU backend computes it.
__device__ __forceinline__ float Softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float Silu(float x) { return x / (1.f + expf(-x)); }

// GDN's normalisers from a token's squared norms (DESIGN.md §2): 1/|k| for k, 1/|q|/sqrt(dh) for q.
__device__ __forceinline__ float GdnKeyScale(float kk) { return 1.f / sqrtf(kk + 1e-6f); }
__device__ __forceinline__ float GdnQueryScale(float qq, int64_t dh) {
  return 1.f / sqrtf(qq + 1e-6f) / sqrtf(static_cast<float>(dh));
}

// GDN's per-token normalisers: norms[0] = GdnKeyScale, norms[1] = GdnQueryScale, from k and q in shared
// memory, computed by the block's first warp (tid: the thread's index in the block). Ends with a block
// synchronisation, after which every thread may read norms.
__device__ __forceinline__ void GdnNorms(const float* ks, const float* qs, int64_t dh, int tid, float* norms) {
  if (tid < 32) {
    float kk = 0.f, qq = 0.f;
    for (int64_t d = tid; d < dh; d += 32) kk += ks[d] * ks[d], qq += qs[d] * qs[d];
    kk = WarpSum(kk);
    qq = WarpSum(qq);
    if (tid == 0) norms[0] = GdnKeyScale(kk), norms[1] = GdnQueryScale(qq, dh);
  }
  __syncthreads();
}

// The sine and cosine of half-split RoPE's angle for element i of a head (as kernels/cpu/rope.cc: double
// pos * theta^(-2i/dh), cast to float, then float cos/sin): element i < dh/2 becomes x_i c - x_{i+dh/2} s,
// element i + dh/2 becomes x_{i+dh/2} c + x_i s.
__device__ __forceinline__ void RopeAngle(int64_t i, int64_t dh, int64_t pos, double theta, const double* freq,
                                          float* sin_out, float* cos_out) {
  const int64_t f = i < dh / 2 ? i : i - dh / 2;
  const double inv_freq = freq != nullptr ? freq[f] : pow(theta, -2.0 * static_cast<double>(f) / dh);
  sincosf(static_cast<float>(static_cast<double>(pos) * inv_freq), sin_out, cos_out);
}

// The factor attention mode multiplies the query at `pos` by: max(1, ln(pos + 1) / ln(base)) in double, as
// engine/config.cc's AttnQueryScale; 1 when base is 0 (ModelConfig::attn_log_scale_base).
__device__ __forceinline__ float AttnQueryScale(int64_t base, int64_t pos) {
  if (base <= 0) return 1.f;
  return static_cast<float>(fmax(1.0, log(static_cast<double>(pos) + 1.0) / log(static_cast<double>(base))));
}

// Thread-block clusters (compute capability 9). ClusterSync: waits until every thread of every block of the
// cluster has arrived (release / acquire at cluster scope: shared-memory writes before it are seen by the
// peers after it). ClusterRank: the block's rank in its cluster. ClusterPeer: the address of `local` (in
// this block's shared memory) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ void ClusterSync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ unsigned ClusterRank() {
  unsigned rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
  return rank;
}
template <typename T>
__device__ __forceinline__ T* ClusterPeer(T* local, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t peer;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(peer) : "l"(local), "r"(rank));
  return reinterpret_cast<T*>(peer);
#else
  return local;
#endif
}

// Programmatic dependent launch (Hopper): a kernel launched by LaunchAfterPrevious may be scheduled while the
// kernel before it in the stream is still running its last blocks, so that its launch overlaps that kernel's
// tail. Every such kernel calls AfterPrevious() first in every block, before it reads anything an earlier
// kernel wrote, writes anything one reads, or returns (the next kernel's wait covers only this one, so this
// one must not finish before its predecessor). AfterPrevious then lets the next kernel be scheduled.
// ORYX_CUDA_PDL=0 turns it off (plain stream order). On the H200 it takes 7-12% off the launch-bound decode
// steps (130m, models/default) and up to 4% off 1.4b's. (Prefetching the GEMVs' weights into L2 before the
// wait measured slower, in other calls than its baseline; loading them into registers is EarlyLoads.)
__device__ __forceinline__ void AfterPrevious() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 to fetch this block's share of [ptr, ptr + bytes) (ptr 16-byte aligned): the range split evenly over
// the grid's blocks, each share requested by the block's first thread in bulk prefetches of at most 64 KiB
// (Hopper or later; elsewhere nothing). Nothing waits for them: the lines arrive while the kernel goes on.
__device__ __forceinline__ void PrefetchShareToL2(const void* ptr, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (ptr == nullptr || bytes <= 0 || threadIdx.x + threadIdx.y + threadIdx.z != 0) return;
  constexpr int64_t kMostBytes = 65536;
  const int64_t blocks = int64_t{gridDim.x} * gridDim.y * gridDim.z;
  const int64_t block = blockIdx.x + int64_t{gridDim.x} * (blockIdx.y + int64_t{gridDim.y} * blockIdx.z);
  const int64_t share = ((bytes + blocks - 1) / blocks + 15) / 16 * 16;
  const int64_t begin = block * share, end = (begin + share < bytes ? begin + share : bytes) / 16 * 16;
  for (int64_t at = begin; at < end; at += kMostBytes) {
    const auto size = static_cast<uint32_t>(end - at < kMostBytes ? end - at : kMostBytes);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(ptr) + at), "r"(size)
                 : "memory");
  }
#endif
}

// Whether kernels launched by LaunchAfterPrevious may load, before AfterPrevious(), what the kernel just
// before them in the stream does not write: the weights and other constants, the decode mixer's recurrent
// state and conv window (written only by the same layer's mixer a step earlier), and what the caller marks
// as written two or more kernels back (y_written_earlier, gate_written_earlier). That is safe because a
// kernel is scheduled only once its predecessor has passed its own AfterPrevious(), that is, once every
// kernel before the predecessor has finished. The loads then stream during the previous kernel's tail
// (what that saves is measured in docs/CUDA.md, "Early loads"). KernelSwitches::early_loads off loads
// everything after the wait.
inline bool EarlyLoads() { return GetKernelSwitches().early_loads; }

// An attribute of the current device (0 when there is none to ask).
inline int CurrentDeviceAttribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return value;
}

// Whether the device is a Hopper or later (compute capability 9): programmatic dependent launch and
// thread-block clusters. Asked once.
inline bool HopperOrLater() {
  static const bool hopper = CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMajor) >= 9;
  return hopper;
}

// The device's SMs, asked once.
inline int MultiprocessorCount() {
  static const int sms = CurrentDeviceAttribute(cudaDevAttrMultiProcessorCount);
  return sms;
}

// Whether launches use programmatic dependent launch: a Hopper or later, and KernelSwitches::programmatic_launch.
inline bool ProgrammaticLaunch() { return GetKernelSwitches().programmatic_launch && HopperOrLater(); }

// kernel<<<grid, block, smem, stream>>>(args...), allowed to start during the previous kernel's tail (the
// kernel must call AfterPrevious()).
template <typename... Params, typename... Args>
void LaunchAfterPrevious(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         Args&&... args) {
  LaunchAfterPrevious(kernel, grid, block, smem, stream, dim3(1, 1, 1), std::forward<Args>(args)...);
}

// The same in thread-block clusters of `cluster` blocks (compute capability 9; (1, 1, 1): no clusters).
template <typename... Params, typename... Args>
void LaunchAfterPrevious(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         dim3 cluster, Args&&... args) {
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = ProgrammaticLaunch() ? 1 : 0;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = cluster.x;
  attributes[1].val.clusterDim.y = cluster.y;
  attributes[1].val.clusterDim.z = cluster.z;
  const bool clustered = cluster.x * cluster.y * cluster.z > 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = clustered ? 2 : 1;
  ORYX_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__device__ __forceinline__ int64_t CeilDivDevice(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The largest head_dim the kernels take (= the config bound; per-head vectors live in shared memory).
inline constexpr int kMaxHeadDimCuda = 256;

// A sequence's paged KV cache (SeqDesc::kv_blocks), one layer's keys (or values) from position `first` on, at
// column `column` of the row: Row(j) is position first + j. What an attention block walks, and (from 0) where a
// forward writes. Rows of one block are HD apart, so a run of keys that stays in one block costs one look-up in
// the table: Row(i) = Row(j) + (i - j) * HD. The attention kernels read in such runs: a chunk of keys (32 to 256,
// starting at a multiple of its length) either starts on a block boundary or lies inside one block, so its
// 64-key windows from its start, and their aligned sub-runs of 8 to 32 keys, each lie in one block.
struct KvRows {
  static constexpr int kShift = 6;
  static_assert(kKvBlockTokens == 1 << kShift, "positions split by shift and mask");
  bf16* const* blocks;
  int64_t first, offset, HD;  // offset: of the layer's keys or values in a block, plus the column
  __device__ __forceinline__ bf16* Row(int64_t j) const {
    const int64_t p = first + j;
    return blocks[p >> kShift] + offset + (p & (kKvBlockTokens - 1)) * HD;
  }
};
__device__ __forceinline__ KvRows KeyRows(const SeqDesc& s, int layer, int64_t HD, int64_t first = 0,
                                          int64_t column = 0) {
  return {s.kv_blocks, first, int64_t(2 * layer) * kKvBlockTokens * HD + column, HD};
}
__device__ __forceinline__ KvRows ValueRows(const SeqDesc& s, int layer, int64_t HD, int64_t first = 0,
                                            int64_t column = 0) {
  return {s.kv_blocks, first, int64_t(2 * layer + 1) * kKvBlockTokens * HD + column, HD};
}

}  // namespace oryx::kernels::cuda
