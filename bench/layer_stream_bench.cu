// Issue 7's open question, measured without the model: can a batch-1 decode step stream its weights faster
// as one persistent kernel than as a chain of dependent kernels? A step of the 1.4b config reads, per layer,
// four products' weights (33.6, 8.4, 44.6 and 22.3 MB: in_proj, o_proj, mlp_in, mlp_down), 2.6 GB over 24
// layers, each product depending on the one before. Here every product is a phase that streams its bytes
// (16-byte loads, 8 per lane in flight, XOR-folded), and depends on the previous phase's result word. Ways:
//   - "kernels":    one kernel per phase, in stream order, replayed as a CUDA graph;
//   - "pdl":        the same with programmatic dependent launch, the first batch of loads issued before the
//                   wait (the engine's early loads);
//   - "persistent": one cooperative kernel for the whole step, a grid barrier between phases, the next
//                   phase's first batch in registers before the barrier;
//   - "persistent+smem": the same, the next phase's first `prefetch` bytes per block copied into shared
//                   memory by cp.async before the barrier;
//   - "one-read":   the step's bytes read by one kernel with no phases (the streaming ceiling);
//   - "pdl+prologue/R": "pdl" with the fused GEMVs' RMSNorm prologue after each wait, every block reading
//                   the same 8 KB vector (R = 1) or one of R copies of it.
// One JSON line per way and size: µs per step and GB/s.
//
//   bench_layer_stream [--layers N] [--steps N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace {

#define CHECK(x)                                                                                           \
  do {                                                                                                     \
    cudaError_t e = (x);                                                                                   \
    if (e != cudaSuccess) {                                                                                \
      std::fprintf(stderr, "bench_layer_stream: %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)

constexpr int kThreads = 256, kBatch = 8;
constexpr int64_t kBatchPieces = int64_t{kThreads} * kBatch;  // 16-byte pieces a block loads in one batch

struct Phases {
  const uint4* base = nullptr;
  const int64_t* offset = nullptr;  // [phases] first piece of each phase
  const int64_t* pieces = nullptr;  // [phases]
  int count = 0;
};

// This block's share of a phase: pieces [begin, end) of the buffer.
struct Share {
  int64_t begin, end;
};
__device__ __forceinline__ Share ShareOf(const Phases& ph, int p) {
  const int64_t per_block = (ph.pieces[p] + gridDim.x - 1) / gridDim.x;
  const int64_t begin = ph.offset[p] + min(ph.pieces[p], int64_t{blockIdx.x} * per_block);
  return {begin, min(ph.offset[p] + ph.pieces[p], begin + per_block)};
}

__device__ __forceinline__ void LoadBatch(const uint4* base, Share s, int64_t at, uint4 (&r)[kBatch]) {
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int64_t i = at + threadIdx.x + int64_t{b} * kThreads;
    r[b] = i < s.end ? oryx::kernels::cuda::LoadWeight(base + i) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ unsigned Fold(const uint4 (&r)[kBatch]) {
  unsigned acc = 0;
#pragma unroll
  for (int b = 0; b < kBatch; ++b) acc ^= r[b].x ^ r[b].y ^ r[b].z ^ r[b].w;
  return acc;
}

// Streams the share from piece `from` on; `r` holds the batch at `from` already when `loaded`.
__device__ __forceinline__ unsigned StreamFrom(const uint4* base, Share s, int64_t from, uint4 (&r)[kBatch],
                                               bool loaded) {
  unsigned acc = 0;
  for (int64_t at = from; at < s.end; at += kBatchPieces) {
    if (!loaded || at != from) LoadBatch(base, s, at, r);
    acc ^= Fold(r);
  }
  return acc;
}

// A phase's results: one word per block, in row p of `result` (rows gridDim.x words apart; no atomics,
// which on one word would serialise thousands of blocks' updates).
__device__ __forceinline__ void Publish(unsigned acc, unsigned* result, int p) {
  __shared__ unsigned warps[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned all = 0;
    for (int w = 0; w < kThreads / 32; ++w) all ^= warps[w];
    result[int64_t{p} * gridDim.x + blockIdx.x] = all;
  }
}

// The dependency on the previous phase, as a product's on the activations the blocks before it wrote: each
// lane reads the result of another block (32 blocks per warp) of phase p - 1.
__device__ __forceinline__ unsigned Depend(const unsigned* result, int p) {
  if (p == 0) return 0u;
  const unsigned block = (blockIdx.x + threadIdx.x % 32) % gridDim.x;
  return *reinterpret_cast<const volatile unsigned*>(result + int64_t{p - 1} * gridDim.x + block);
}

// A GEMV's RMSNorm prologue, as the engine's fused GEMVs run it after their wait: every block reads a
// vector of kVector floats (the residual, which the kernel before wrote), sums its squares and shares the sum
// through shared memory. With `replicas` > 1, block b reads copy b % replicas of the vector (the question:
// do thousands of blocks reading the same 8 KB at once queue at its L2 slices?).
constexpr int kVector = 2048;
__device__ __forceinline__ unsigned Prologue(const float* vector, int replicas) {
  __shared__ float warps[kThreads / 32];
  const float* x = vector + int64_t(blockIdx.x % replicas) * kVector;
  float sum = 0.f;
  for (int c = threadIdx.x; c < kVector; c += kThreads) sum += x[c] * x[c];
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = sum;
  __syncthreads();
  float all = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) all += warps[w];
  __syncthreads();
  return __float_as_uint(all);
}

__global__ void PhaseKernel(Phases ph, int p, bool early, unsigned* result, const float* vector, int replicas) {
  const Share s = ShareOf(ph, p);
  uint4 r[kBatch];
  if (early) LoadBatch(ph.base, s, s.begin, r);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  unsigned acc = Depend(result, p);
  if (replicas > 0) acc ^= Prologue(vector, replicas);
  acc ^= StreamFrom(ph.base, s, s.begin, r, early);
  Publish(acc, result, p);
}

// All blocks resident (a cooperative launch); `arrive` counts arrivals over the whole step.
__device__ __forceinline__ void GridBarrier(unsigned* arrive, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrive, 1u);
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrive) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

// n 16-byte pieces to shared memory by cp.async (CopyToSharedAsync, kernels/cuda/common.cuh), then awaited
// by WaitShared().
__device__ __forceinline__ void CopyToShared(const uint4* src, uint4* dst, int64_t n) {
  oryx::kernels::cuda::CopyToSharedAsync(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src), 4 * n);
}

__device__ __forceinline__ void WaitShared() {
  oryx::kernels::cuda::WaitCopies();
  __syncthreads();
}

// The whole step; prefetch_pieces > 0: that many pieces of each phase's share go through shared memory.
__global__ void PersistentKernel(Phases ph, int64_t prefetch_pieces, unsigned* result, unsigned* arrive) {
  extern __shared__ uint4 staged[];
  uint4 r[kBatch];
  auto start = [&](int p) {  // the phase's first loads, issued before its barrier
    const Share s = ShareOf(ph, p);
    if (prefetch_pieces > 0) {
      CopyToShared(ph.base + s.begin, staged, min(prefetch_pieces, s.end - s.begin));
    } else {
      LoadBatch(ph.base, s, s.begin, r);
    }
  };
  start(0);
  for (int p = 0; p < ph.count; ++p) {
    const Share s = ShareOf(ph, p);
    unsigned acc = Depend(result, p);
    if (prefetch_pieces > 0) {
      const int64_t n = min(prefetch_pieces, s.end - s.begin);
      WaitShared();
      for (int64_t i = threadIdx.x; i < n; i += kThreads) acc ^= staged[i].x ^ staged[i].y ^ staged[i].z ^ staged[i].w;
      acc ^= StreamFrom(ph.base, s, s.begin + n, r, false);
      __syncthreads();  // everyone is done with `staged` before the next phase's copies land in it
    } else {
      acc ^= StreamFrom(ph.base, s, s.begin, r, true);
    }
    Publish(acc, result, p);
    if (p + 1 < ph.count) start(p + 1);
    GridBarrier(arrive, static_cast<unsigned>(p + 1) * gridDim.x);
  }
}

__global__ void OneReadKernel(Phases ph, int64_t first, int64_t pieces, unsigned* result) {
  const int64_t per_block = (pieces + gridDim.x - 1) / gridDim.x;
  const int64_t begin = first + min(pieces, int64_t{blockIdx.x} * per_block);
  const Share s{begin, min(first + pieces, begin + per_block)};
  uint4 r[kBatch];
  Publish(StreamFrom(ph.base, s, s.begin, r, false), result, 0);
}

struct Options {
  int layers = 24;
  int steps = 10;
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: bench_layer_stream [--layers N] [--steps N]\n"
                  "  --layers N  layers of the 1.4b config's four products per step (default 24)\n"
                  "  --steps N   steps per timed round, best of 3 rounds (default 10)\n");
      std::exit(0);
    }
    if ((a == "--layers" || a == "--steps") && i + 1 < argc) {
      const int v = std::atoi(argv[++i]);
      if (v < 1) {
        std::fprintf(stderr, "bench_layer_stream: %s must be a positive integer\n", a.c_str());
        std::exit(2);
      }
      (a == "--layers" ? o.layers : o.steps) = v;
    } else {
      std::fprintf(stderr,
                   "bench_layer_stream: unknown argument '%s' (usage: bench_layer_stream [--layers N] [--steps N])\n",
                   a.c_str());
      std::exit(2);
    }
  }
  return o;
}

// Best mean µs per step over 3 rounds of `steps` steps on `stream` (after one warm-up step).
template <typename Step>
double TimeSteps(cudaStream_t stream, int steps, Step&& step) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  step();
  double best = 1e30;
  for (int round = 0; round < 3; ++round) {
    CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < steps; ++i) step();
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, 1e3 * ms / steps);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = Parse(argc, argv);
  int device = 0, sms = 0, major = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, device));

  // The 1.4b decode step's products (bench_gemv's shapes), layer after layer.
  const std::vector<int64_t> layer_bytes = {33619968, 8388608, 44564480, 22282240};
  std::vector<int64_t> offset, pieces;
  int64_t total = 0;
  for (int l = 0; l < opt.layers; ++l) {
    for (int64_t b : layer_bytes) {
      offset.push_back(total / 16);
      pieces.push_back(b / 16);
      total += b;
    }
  }
  const int phases = static_cast<int>(pieces.size());
  char* buffer = nullptr;
  int64_t *d_offset = nullptr, *d_pieces = nullptr;
  unsigned *result = nullptr, *arrive = nullptr;
  CHECK(cudaMalloc(&buffer, total));
  CHECK(cudaMemset(buffer, 1, total));
  CHECK(cudaMalloc(&d_offset, phases * sizeof(int64_t)));
  CHECK(cudaMalloc(&d_pieces, phases * sizeof(int64_t)));
  CHECK(cudaMemcpy(d_offset, offset.data(), phases * sizeof(int64_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_pieces, pieces.data(), phases * sizeof(int64_t), cudaMemcpyHostToDevice));
  const int64_t max_blocks = int64_t{8} * sms;  // the most blocks any way below launches
  CHECK(cudaMalloc(&result, phases * max_blocks * sizeof(unsigned)));
  CHECK(cudaMalloc(&arrive, sizeof(unsigned)));
  const Phases ph{reinterpret_cast<const uint4*>(buffer), d_offset, d_pieces, phases};
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  auto emit = [&](const char* way, int blocks, int64_t prefetch_bytes, double us) {
    std::printf("{\"bench\":\"layer_stream\",\"device\":\"%s\",\"way\":\"%s\",\"layers\":%d,\"blocks\":%d,"
                "\"prefetch_bytes\":%lld,\"bytes_per_step\":%lld,\"us_per_step\":%.2f,\"gb_per_s\":%.1f}\n",
                prop.name, way, opt.layers, blocks, static_cast<long long>(prefetch_bytes),
                static_cast<long long>(total), us, total / us / 1e3);
    std::fflush(stdout);
  };

  float* vector = nullptr;  // up to 64 copies of the prologue's vector
  CHECK(cudaMalloc(&vector, 64 * kVector * sizeof(float)));
  CHECK(cudaMemset(vector, 0, 64 * kVector * sizeof(float)));
  // One kernel per phase, as a graph; pdl adds programmatic launch and the early batch; with pdl at 4 blocks
  // per SM, also each phase with the RMSNorm prologue over one shared vector or over 8 or 64 copies.
  struct Chain {
    int pdl, per_sm, replicas;
  };
  std::vector<Chain> chains = {{0, 2, 0}, {0, 4, 0}};
  if (major >= 9) {
    for (Chain c : std::vector<Chain>{{1, 2, 0}, {1, 4, 0}, {1, 4, 1}, {1, 4, 8}, {1, 4, 64}}) chains.push_back(c);
  }
  for (const Chain& chain : chains) {
    {
      const int pdl = chain.pdl, per_sm = chain.per_sm, replicas = chain.replicas;
      const int blocks = per_sm * sms;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      CHECK(cudaMemsetAsync(arrive, 0, sizeof(unsigned), stream));  // (what the persistent kernel's step has)
      for (int p = 0; p < phases; ++p) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = pdl;
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(blocks);
        config.blockDim = dim3(kThreads);
        config.stream = stream;
        config.attrs = attr;
        config.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&config, PhaseKernel, ph, p, pdl == 1, result, static_cast<const float*>(vector),
                                 replicas));
      }
      CHECK(cudaStreamEndCapture(stream, &graph));
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const std::string way = std::string(pdl ? "pdl" : "kernels") +
                              (replicas > 0 ? "+prologue/" + std::to_string(replicas) : std::string());
      emit(way.c_str(), blocks, 0, TimeSteps(stream, opt.steps, [&] { CHECK(cudaGraphLaunch(exec, stream)); }));
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
    }
  }

  // One cooperative kernel per step.
  CHECK(cudaFuncSetAttribute(PersistentKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  for (int64_t prefetch_kb : {0, 32, 64, 96, 192}) {
    const size_t smem = static_cast<size_t>(prefetch_kb) * 1024;
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PersistentKernel, kThreads, smem));
    if (per_sm == 0) continue;
    for (int use : {1, 2, 4}) {
      if (use > per_sm) continue;
      const int blocks = use * sms;
      int64_t prefetch_pieces = static_cast<int64_t>(smem / 16);
      void* args[] = {const_cast<Phases*>(&ph), &prefetch_pieces, &result, &arrive};
      const double us = TimeSteps(stream, opt.steps, [&] {  // (one memset per step, as the graphs above have)
        CHECK(cudaMemsetAsync(arrive, 0, sizeof(unsigned), stream));
        CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(PersistentKernel), dim3(blocks), dim3(kThreads),
                                          args, smem, stream));
      });
      emit(prefetch_kb > 0 ? "persistent+smem" : "persistent", blocks, static_cast<int64_t>(smem), us);
    }
  }

  // The ceiling: the step's bytes in one read.
  for (int per_sm : {2, 4}) {
    const int blocks = per_sm * sms;
    emit("one-read", blocks, 0, TimeSteps(stream, opt.steps, [&] {
           OneReadKernel<<<blocks, kThreads, 0, stream>>>(ph, 0, total / 16, result);
         }));
  }
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaFree(buffer));
  CHECK(cudaFree(d_offset));
  CHECK(cudaFree(d_pieces));
  CHECK(cudaFree(result));
  CHECK(cudaFree(arrive));
  CHECK(cudaFree(vector));
  return 0;
}
