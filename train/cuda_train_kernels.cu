// CUDA kernels of the trainer's fused ops (no LibTorch here; train/cuda_ops.cc wraps them for autograd).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "train/cuda_train_kernels.h"

namespace oryx::train::cuda {

namespace {

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// kVec consecutive elements, loaded and stored as one access (kVec * sizeof(T) bytes, at most 16).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// ---- Column sums of per-tile partials: out[j] = sum_i partial[i][j] -------------------------------------
// The conv and RMSNorm backward kernels below write partials instead of adding atomically, so every sum is
// taken in the same order and the gradients do not depend on scheduling. (ReduceColumns, below the block
// sums: an earlier version gave each column a block, whose reads were strided by the column count.)
template <typename A>
__device__ A WarpSum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A>
__device__ A BlockSum(A v, A* shared) {
  v = WarpSum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // shared is reused from the previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  A total = 0;
  for (int i = 0; i < warps; ++i) total += shared[i];
  return total;
}

// Rows per chunk of the first pass: at least 256, and few enough chunks (at most 256) for the second
// pass to take them in one.
constexpr int kReduceCols = 32, kReduceLanes = 8;
constexpr int64_t kReduceMaxChunks = 256;
inline int64_t ReduceRowsPerChunk(int64_t n) {
  return n <= kReduceMaxChunks * 256 ? 256 : (n + kReduceMaxChunks - 1) / kReduceMaxChunks;
}
inline int64_t ReduceChunks(int64_t n) { return (n + ReduceRowsPerChunk(n) - 1) / ReduceRowsPerChunk(n); }

// out[chunk][j] = sum of partial[r][j] over the chunk's rows. A block takes 32 consecutive columns (each row
// read coalesced) and one chunk; its 8 row lanes add every 8th row, then lane 0 adds the lanes in order.
template <typename A, typename W>
__global__ void ReduceColumnsKernel(const A* partial, int64_t n, int64_t cols, int64_t rows_per_chunk, W* out) {
  __shared__ A lanes[kReduceLanes][kReduceCols];
  const int64_t j = int64_t(blockIdx.x) * kReduceCols + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk, r1 = min(r0 + rows_per_chunk, n);
  A sum = 0;
  if (j < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kReduceLanes) sum += partial[r * cols + j];
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    A total = 0;
    for (int l = 0; l < kReduceLanes; ++l) total += lanes[l][threadIdx.x];
    out[int64_t(blockIdx.y) * cols + j] = static_cast<W>(total);
  }
}

// Elements of scratch that ReduceColumns needs for n rows of cols columns.
inline int64_t ReduceScratchElems(int64_t n, int64_t cols) { return ReduceChunks(n) > 1 ? ReduceChunks(n) * cols : 0; }

// out[j] = sum_i partial[i][j], in a fixed order (no atomics): chunks of rows into scratch, then the chunks.
template <typename A, typename W>
cudaError_t ReduceColumns(const A* partial, int64_t n, int64_t cols, W* out, A* scratch, cudaStream_t stream) {
  const dim3 block(kReduceCols, kReduceLanes);
  const unsigned col_tiles = static_cast<unsigned>((cols + kReduceCols - 1) / kReduceCols);
  const int64_t chunks = ReduceChunks(n), per = ReduceRowsPerChunk(n);
  if (chunks == 1) {
    ReduceColumnsKernel<A, W><<<dim3(col_tiles, 1), block, 0, stream>>>(partial, n, cols, per, out);
    return cudaGetLastError();
  }
  ReduceColumnsKernel<A, A><<<dim3(col_tiles, static_cast<unsigned>(chunks)), block, 0, stream>>>(partial, n, cols,
                                                                                                   per, scratch);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ReduceColumnsKernel<A, W><<<dim3(col_tiles, 1), block, 0, stream>>>(scratch, chunks, cols, chunks, out);
  return cudaGetLastError();
}

// The causal conv works on tiles of kTimeTile steps of one sequence and kThreads channels (one channel per
// thread, consecutive threads on consecutive channels), sliding a window of the last `width` inputs (or
// the next `width` output gradients) through registers, so each element is loaded once; kAhead steps'
// loads are issued together.
constexpr int kMaxWidth = 8;
constexpr int kTimeTile = 32;
// Steps whose loads a thread issues together: one 2-byte load per warp at a time left each SM with too
// little in flight (a reading of the code, not yet measured).
constexpr int kAhead = 8;
constexpr int kThreads = 128;

// out[b, t, c] = bias[c] + sum_j w[c, j] x[b, t - (W-1) + j, c]. Grid: (channel tiles, time tiles, batch).
template <typename T, typename W>
__global__ void CausalConvForwardKernel(const T* x, int64_t ld_x, const W* w, const W* bias, T* out, int time,
                                        int channels, int width) {
  using A = typename Acc<T>::type;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int t0 = blockIdx.y * kTimeTile, t1 = min(t0 + kTimeTile, time);
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * time;
  // wr[k]: the tap of x[t-k]; hist[kMaxWidth-1-k] = x[t-k] once the step's input is shifted in.
  A wr[kMaxWidth], hist[kMaxWidth];
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k) {
    wr[k] = k < width ? static_cast<A>(w[c * width + width - 1 - k]) : static_cast<A>(0);
    // Before the loop (which first shifts left) slot k holds x[t0 - kMaxWidth + k]; only the last width-1
    // slots matter.
    const int tt = t0 - kMaxWidth + k;
    hist[k] = k > kMaxWidth - width && tt >= 0 ? static_cast<A>(x[(row0 + tt) * ld_x + c]) : static_cast<A>(0);
  }
  const A b = static_cast<A>(bias[c]);
  for (int tb = t0; tb < t1; tb += kAhead) {
    A xv[kAhead];  // the next kAhead inputs, loaded together
#pragma unroll
    for (int j = 0; j < kAhead; ++j) xv[j] = tb + j < t1 ? static_cast<A>(x[(row0 + tb + j) * ld_x + c]) : A(0);
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int t = tb + j;
      if (t >= t1) break;
#pragma unroll
      for (int k = 0; k < kMaxWidth - 1; ++k) hist[k] = hist[k + 1];
      hist[kMaxWidth - 1] = xv[j];
      A acc = b;
#pragma unroll
      for (int k = 0; k < kMaxWidth; ++k) acc += wr[k] * hist[kMaxWidth - 1 - k];
      out[(row0 + t) * channels + c] = static_cast<T>(acc);
    }
  }
}

// One pass over a tile, from its last step to its first:
//   dx[t] = sum_k w[c, W-1-k] dout[t+k]                  (next[k] = dout[t+k])
//   partial dw for the tap of x[t-k] += dout[t] x[t-k]   (prev[k] = x[t-k]), partial dbias += dout[t]
// Partials go to partial[tile][c][0..W] (tile = b * time tiles + time tile); ReduceColumns sums them.
template <typename T, typename W>
__global__ void CausalConvBackwardKernel(const T* x, int64_t ld_x, const W* w, const T* dout, T* dx,
                                         typename Acc<T>::type* partial, int time, int channels, int width) {
  using A = typename Acc<T>::type;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int t0 = blockIdx.y * kTimeTile, t1 = min(t0 + kTimeTile, time);
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * time;
  A wr[kMaxWidth], next[kMaxWidth], prev[kMaxWidth], dw[kMaxWidth];
  // Before the loop, which first shifts next right (then loads next[0] = dout[t]) and prev left (then
  // loads prev[width-1] = x[t-(width-1)]): next[k] = dout[t1 + k] for k < width-1, prev[k] = x[t1 - k] for
  // 1 <= k < width.
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k) {
    wr[k] = k < width ? static_cast<A>(w[c * width + width - 1 - k]) : static_cast<A>(0);
    const int tn = t1 + k;
    next[k] = k < width - 1 && tn < time ? static_cast<A>(dout[(row0 + tn) * channels + c]) : static_cast<A>(0);
    const int tp = t1 - k;
    prev[k] = k >= 1 && k < width && tp >= 0 ? static_cast<A>(x[(row0 + tp) * ld_x + c]) : static_cast<A>(0);
    dw[k] = 0;
  }
  A db = 0;
  for (int tb = t1 - 1; tb >= t0; tb -= kAhead) {
    // The next kAhead steps' dout[t] and x[t-(width-1)], loaded together.
    A dv[kAhead], xv[kAhead];
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int t = tb - j, tp = t - (width - 1);
      dv[j] = t >= t0 ? static_cast<A>(dout[(row0 + t) * channels + c]) : A(0);
      xv[j] = t >= t0 && tp >= 0 ? static_cast<A>(x[(row0 + tp) * ld_x + c]) : A(0);
    }
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int t = tb - j;
      if (t < t0) break;
      // next: [dout[t], dout[t+1], ...]
#pragma unroll
      for (int k = kMaxWidth - 1; k > 0; --k) next[k] = next[k - 1];
      next[0] = dv[j];
      // prev: [x[t], x[t-1], ..., x[t-(width-1)]]: drop x[t+1], take x[t-(width-1)]
#pragma unroll
      for (int k = 0; k < kMaxWidth - 1; ++k) prev[k] = prev[k + 1];
#pragma unroll
      for (int k = 0; k < kMaxWidth; ++k) {
        if (k == width - 1) prev[k] = xv[j];
      }
      A acc = 0;
#pragma unroll
      for (int k = 0; k < kMaxWidth; ++k) acc += wr[k] * next[k];
      dx[(row0 + t) * channels + c] = static_cast<T>(acc);
      const A d = next[0];
      db += d;
#pragma unroll
      for (int k = 0; k < kMaxWidth; ++k) dw[k] += d * prev[k];
    }
  }
  A* out = partial + (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * channels * (width + 1);
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k) {
    if (k < width) out[c * (width + 1) + (width - 1 - k)] = dw[k];
  }
  out[c * (width + 1) + width] = db;
}

dim3 ConvGrid(const ConvShape& s) {
  return dim3(static_cast<unsigned>((s.channels + kThreads - 1) / kThreads),
              static_cast<unsigned>((s.time + kTimeTile - 1) / kTimeTile), static_cast<unsigned>(s.rows / s.time));
}

template <typename T, typename W>
cudaError_t Forward(const ConvShape& s, const void* x, const void* w, const void* bias, void* out,
                    cudaStream_t stream) {
  CausalConvForwardKernel<T, W><<<ConvGrid(s), kThreads, 0, stream>>>(
      static_cast<const T*>(x), s.ld_x, static_cast<const W*>(w), static_cast<const W*>(bias), static_cast<T*>(out),
      s.time, s.channels, s.width);
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t Backward(const ConvShape& s, const void* x, const void* w, const void* dout, void* dx, void* dw_and_bias,
                     void* workspace, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const dim3 grid = ConvGrid(s);
  CausalConvBackwardKernel<T, W><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(x), s.ld_x, static_cast<const W*>(w), static_cast<const T*>(dout), static_cast<T*>(dx),
      static_cast<A*>(workspace), s.time, s.channels, s.width);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int64_t n = static_cast<int64_t>(grid.y) * grid.z, cols = static_cast<int64_t>(s.channels) * (s.width + 1);
  return ReduceColumns(static_cast<const A*>(workspace), n, cols, static_cast<W*>(dw_and_bias),
                       static_cast<A*>(workspace) + n * cols, stream);
}

// ---- RMSNorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over each row of `cols` ----------
// Rows of up to 1024 columns: one warp per row, kRowsPerUnit rows per warp in turn. Wider rows: one block
// per row (up to 1024 threads, 16 columns each). A thread keeps its columns in registers (fixed-index
// unrolled loops). The backward's weight gradient is summed over a warp's (block's) rows in registers and
// written as a partial, summed by ReduceColumns.

constexpr int kRowsPerUnit = 16;
constexpr int kWarpsPerBlock = 8;
constexpr int kMaxColsPerThread = 16;  // block kernel

// Threads that share a row: a warp (kWide = false) or the block.
template <bool kWide, typename A>
__device__ A RowSum(A v, A* shared) {
  if constexpr (kWide) {
    return BlockSum(v, shared);
  } else {
    return WarpSum(v);
  }
}

template <bool kWide>
struct RowLayout {
  int64_t unit;  // which warp (block) of the grid: the partial's row
  int lane;      // thread within the row's group
  int stride;    // threads per row
  __device__ RowLayout() {
    if constexpr (kWide) {
      unit = blockIdx.x;
      lane = threadIdx.x;
      stride = blockDim.x;
    } else {
      unit = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
      lane = threadIdx.x % 32;
      stride = 32;
    }
  }
};

template <typename TX, typename TY, typename TW, bool kWide, int kPer>
__global__ void RmsNormForwardKernel(const TX* x, const TW* w, TY* y, typename Acc<TX>::type* rstd, int64_t rows,
                                     int cols, double eps) {
  using A = typename Acc<TX>::type;
  __shared__ A shared[32];
  const RowLayout<kWide> at;
  const int64_t first = at.unit * kRowsPerUnit;
  for (int64_t r = first; r < first + kRowsPerUnit && r < rows; ++r) {
    A v[kPer];
    A ss = 0;
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int c = at.lane + n * at.stride;
      v[n] = c < cols ? static_cast<A>(x[r * cols + c]) : static_cast<A>(0);
      ss += v[n] * v[n];
    }
    const A inv = static_cast<A>(1) / sqrt(RowSum<kWide>(ss, shared) / static_cast<A>(cols) + static_cast<A>(eps));
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int c = at.lane + n * at.stride;
      if (c < cols) y[r * cols + c] = static_cast<TY>(v[n] * inv * static_cast<A>(w[c]));
    }
    if (at.lane == 0) rstd[r] = inv;
  }
}

// dx = rstd * (dy*w - xhat * mean(dy*w * xhat)); partial[unit][c] = sum over the unit's rows of dy * xhat.
template <typename TX, typename TY, typename TW, bool kWide, int kPer>
__global__ void RmsNormBackwardKernel(const TX* x, const TW* w, const TY* dy, const typename Acc<TX>::type* rstd,
                                      TX* dx, typename Acc<TX>::type* partial, int64_t rows, int cols) {
  using A = typename Acc<TX>::type;
  __shared__ A shared[32];
  const RowLayout<kWide> at;
  const int64_t first = at.unit * kRowsPerUnit;
  if (first >= rows) return;  // a whole warp (never a partial one) beyond the last row
  A dw[kPer];
#pragma unroll
  for (int n = 0; n < kPer; ++n) dw[n] = 0;
  for (int64_t r = first; r < first + kRowsPerUnit && r < rows; ++r) {
    const A inv = rstd[r];
    A xh[kPer], g[kPer];
    A dot = 0;
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int c = at.lane + n * at.stride;
      xh[n] = g[n] = 0;
      if (c < cols) {
        xh[n] = static_cast<A>(x[r * cols + c]) * inv;
        const A d = static_cast<A>(dy[r * cols + c]);
        g[n] = d * static_cast<A>(w[c]);
        dw[n] += d * xh[n];
      }
      dot += g[n] * xh[n];
    }
    const A mean = RowSum<kWide>(dot, shared) / static_cast<A>(cols);
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int c = at.lane + n * at.stride;
      if (c < cols) dx[r * cols + c] = static_cast<TX>(inv * (g[n] - xh[n] * mean));
    }
  }
#pragma unroll
  for (int n = 0; n < kPer; ++n) {
    const int c = at.lane + n * at.stride;
    if (c < cols) partial[at.unit * cols + c] = dw[n];
  }
}

int NormBlockThreads(int cols) {  // the wide kernel: enough threads for kMaxColsPerThread columns each
  int threads = 128;
  while (threads < 1024 && threads * kMaxColsPerThread < cols) threads *= 2;
  return threads;
}

int64_t NormUnits(const NormShape& s) { return (s.rows + kRowsPerUnit - 1) / kRowsPerUnit; }

// Launches kernel K<kWide, kPer> for the row width: warps for up to 1024 columns, blocks beyond.
template <typename Launch>
cudaError_t ForNormWidth(const NormShape& s, Launch launch) {
  const int64_t units = NormUnits(s);
  const unsigned warp_blocks = static_cast<unsigned>((units + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (s.cols <= 64) return launch(std::integral_constant<bool, false>(), std::integral_constant<int, 2>(), warp_blocks, 32 * kWarpsPerBlock);
  if (s.cols <= 256) return launch(std::integral_constant<bool, false>(), std::integral_constant<int, 8>(), warp_blocks, 32 * kWarpsPerBlock);
  if (s.cols <= 1024) return launch(std::integral_constant<bool, false>(), std::integral_constant<int, 32>(), warp_blocks, 32 * kWarpsPerBlock);
  return launch(std::integral_constant<bool, true>(), std::integral_constant<int, kMaxColsPerThread>(),
                static_cast<unsigned>(units), NormBlockThreads(s.cols));
}

template <typename TX, typename TY, typename TW>
cudaError_t NormForward(const NormShape& s, const void* x, const void* w, void* y, void* rstd, cudaStream_t stream) {
  using A = typename Acc<TX>::type;
  return ForNormWidth(s, [&](auto wide, auto per, unsigned blocks, int threads) {
    RmsNormForwardKernel<TX, TY, TW, decltype(wide)::value, decltype(per)::value><<<blocks, threads, 0, stream>>>(
        static_cast<const TX*>(x), static_cast<const TW*>(w), static_cast<TY*>(y), static_cast<A*>(rstd), s.rows,
        s.cols, s.eps);
    return cudaGetLastError();
  });
}

template <typename TX, typename TY, typename TW>
cudaError_t NormBackward(const NormShape& s, const void* x, const void* w, const void* dy, const void* rstd, void* dx,
                         void* dw, void* workspace, cudaStream_t stream) {
  using A = typename Acc<TX>::type;
  const cudaError_t e = ForNormWidth(s, [&](auto wide, auto per, unsigned blocks, int threads) {
    RmsNormBackwardKernel<TX, TY, TW, decltype(wide)::value, decltype(per)::value><<<blocks, threads, 0, stream>>>(
        static_cast<const TX*>(x), static_cast<const TW*>(w), static_cast<const TY*>(dy), static_cast<const A*>(rstd),
        static_cast<TX*>(dx), static_cast<A*>(workspace), s.rows, s.cols);
    return cudaGetLastError();
  });
  if (e != cudaSuccess) return e;
  return ReduceColumns(static_cast<const A*>(workspace), NormUnits(s), s.cols, static_cast<TW*>(dw),
                       static_cast<A*>(workspace) + NormUnits(s) * s.cols, stream);
}

// ---- RoPE: out[.., i] = x_i c - x_{i+h} s, out[.., i+h] = x_{i+h} c + x_i s (h = dh/2, s negated for the
// backward). One block per (b, t); each thread takes kVec consecutive pairs (i .. i+kVec-1) of one head,
// as kVec-wide accesses where the strides and pointers allow.
template <typename T, int kVec>
__global__ void RopeKernel(const T* x, int64_t sb, int64_t st, int64_t sh, const float* cos, const float* sin,
                           T* out, int time, int heads, int half, float sign) {
  using A = typename Acc<T>::type;
  using P = Pack<T, kVec>;
  using F = Pack<float, kVec>;
  const int64_t bt = blockIdx.x;
  const int64_t b = bt / time;
  const int t = static_cast<int>(bt - b * time);
  const T* xr = x + b * sb + t * st;
  T* o = out + bt * heads * 2 * half;
  const int groups = half / kVec;
  for (int j = threadIdx.x; j < heads * groups; j += blockDim.x) {
    const int h = j / groups, i = (j - h * groups) * kVec;
    const F cv = *reinterpret_cast<const F*>(cos + t * half + i), sv = *reinterpret_cast<const F*>(sin + t * half + i);
    const P p1 = *reinterpret_cast<const P*>(xr + h * sh + i), p2 = *reinterpret_cast<const P*>(xr + h * sh + half + i);
    P o1, o2;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const A c = static_cast<A>(cv.v[e]), s = sign * static_cast<A>(sv.v[e]);
      const A x1 = static_cast<A>(p1.v[e]), x2 = static_cast<A>(p2.v[e]);
      o1.v[e] = static_cast<T>(x1 * c - x2 * s);
      o2.v[e] = static_cast<T>(x2 * c + x1 * s);
    }
    *reinterpret_cast<P*>(o + h * 2 * half + i) = o1;
    *reinterpret_cast<P*>(o + h * 2 * half + half + i) = o2;
  }
}

template <typename T>
cudaError_t Rope(const RopeShape& r, const void* x, const float* cos, const float* sin, void* out, bool inverse,
                 cudaStream_t stream) {
  constexpr int kVec = 4;
  auto aligned = [](const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  const bool vector = r.half % kVec == 0 && r.sb % kVec == 0 && r.st % kVec == 0 && r.sh % kVec == 0 &&
                      aligned(x, kVec * sizeof(T)) && aligned(out, kVec * sizeof(T)) &&
                      aligned(cos, kVec * sizeof(float)) && aligned(sin, kVec * sizeof(float));
  const int units = r.heads * (vector ? r.half / kVec : r.half);
  const int threads = units < 1024 ? (units + 31) / 32 * 32 : 1024;
  const auto kernel = vector ? RopeKernel<T, kVec> : RopeKernel<T, 1>;
  kernel<<<static_cast<unsigned>(r.batch * r.time), threads, 0, stream>>>(
      static_cast<const T*>(x), r.sb, r.st, r.sh, cos, sin, static_cast<T*>(out), r.time, r.heads, r.half,
      inverse ? -1.0f : 1.0f);
  return cudaGetLastError();
}

// ---- Chunked scan, the part inside each chunk (Mamba-2 and GDN alike) --------------------------------
// For one chunk of C steps with head dim D, cumulative log decays G (within the chunk), state S0 at the
// chunk's start and values U entering the state:
//   out[t] = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
// One block per chunk keeps Q, K, U, S0 (and dOut) and the C x C matrices in shared memory. This version's
// products run on CUDA cores with register tiles per thread (a 16 x 16 thread grid); it serves fp64, where
// the gradient tests check the formulas. fp32 takes the tensor-core version further down.

constexpr int kScanThreads = 256;

template <int M, int N>
struct ThreadTile {
  static constexpr int kRows = M >= 16 ? M / 16 : 1, kCols = N >= 16 ? N / 16 : 1;
  static __device__ int Row(int i) { return threadIdx.x / 16 + 16 * i; }
  static __device__ int Col(int j) { return threadIdx.x % 16 + 16 * j; }
  static __device__ bool Active(int i, int j) { return Row(i) < M && Col(j) < N; }
};

// acc[i][j] += sum_k a(Row(i), k) * b(k, Col(j)) over k < K.
template <int M, int N, int K, typename A, typename FA, typename FB>
__device__ void TileMatMul(FA a, FB b, A (&acc)[ThreadTile<M, N>::kRows][ThreadTile<M, N>::kCols]) {
  using TT = ThreadTile<M, N>;
  if (TT::Row(0) >= M || TT::Col(0) >= N) return;
  for (int k = 0; k < K; ++k) {
    A av[TT::kRows], bv[TT::kCols];
#pragma unroll
    for (int i = 0; i < TT::kRows; ++i) av[i] = a(TT::Row(i), k);
#pragma unroll
    for (int j = 0; j < TT::kCols; ++j) bv[j] = b(k, TT::Col(j));
#pragma unroll
    for (int i = 0; i < TT::kRows; ++i) {
#pragma unroll
      for (int j = 0; j < TT::kCols; ++j) acc[i][j] += av[i] * bv[j];
    }
  }
}

// Calls f(row, col, value) for each of this thread's outputs of a TT product.
template <typename TT, typename T, typename F>
__device__ __forceinline__ void ForEachOutput(const T (&acc)[TT::kRows][TT::kCols], F&& f) {
#pragma unroll
  for (int i = 0; i < TT::kRows; ++i) {
#pragma unroll
    for (int j = 0; j < TT::kCols; ++j) {
      if (TT::Active(i, j)) f(TT::Row(i), TT::Col(j), acc[i][j]);
    }
  }
}

// Writes this thread's outputs of a TT product to dst (row-major, rows ld elements apart).
template <typename TT, typename T>
__device__ void StoreThreadTile(const T (&acc)[TT::kRows][TT::kCols], T* dst, int ld) {
  ForEachOutput<TT>(acc, [&](int row, int col, T v) { dst[row * ld + col] = v; });
}

// Shared tiles have rows padded by one element, so that reading a column (threads on consecutive rows)
// hits 32 different banks.
template <typename T>
__device__ void LoadTile(T* dst, const T* src, int rows, int cols) {
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) dst[(i / cols) * (cols + 1) + i % cols] = src[i];
}

template <typename T, int C, int D>
__global__ void ChunkOutputForwardKernel(const T* q, const T* k, const T* u, const T* g, const T* s0, T* out) {
  extern __shared__ unsigned char smem_raw[];
  constexpr int LD = D + 1, LC = C + 1;
  T* Q = reinterpret_cast<T*>(smem_raw);
  T* Kc = Q + C * LD;
  T* U = Kc + C * LD;
  T* S = U + C * LD;     // [D][D]
  T* Amat = S + D * LD;  // [C][C]
  T* G = Amat + C * LC;  // [C]
  const int64_t chunk = blockIdx.x;
  LoadTile(Q, q + chunk * C * D, C, D);
  LoadTile(Kc, k + chunk * C * D, C, D);
  LoadTile(U, u + chunk * C * D, C, D);
  LoadTile(S, s0 + chunk * D * D, D, D);
  for (int i = threadIdx.x; i < C; i += blockDim.x) G[i] = g[chunk * C + i];
  __syncthreads();
  {  // A[t][s] = exp(G_t - G_s) q_t . k_s for s <= t, else 0
    using TT = ThreadTile<C, C>;
    T acc[TT::kRows][TT::kCols] = {};
    TileMatMul<C, C, D>([&](int t, int i) { return Q[t * LD + i]; }, [&](int i, int s) { return Kc[s * LD + i]; }, acc);
#pragma unroll
    for (int i = 0; i < TT::kRows; ++i) {
#pragma unroll
      for (int j = 0; j < TT::kCols; ++j) {
        const int t = TT::Row(i), s = TT::Col(j);
        if (TT::Active(i, j)) Amat[t * LC + s] = s <= t ? exp(G[t] - G[s]) * acc[i][j] : static_cast<T>(0);
      }
    }
  }
  __syncthreads();
  using TT = ThreadTile<C, D>;
  T from_state[TT::kRows][TT::kCols] = {}, within[TT::kRows][TT::kCols] = {};
  TileMatMul<C, D, D>([&](int t, int i) { return Q[t * LD + i]; }, [&](int i, int j) { return S[i * LD + j]; },
                      from_state);
  TileMatMul<C, D, C>([&](int t, int s) { return Amat[t * LC + s]; }, [&](int s, int j) { return U[s * LD + j]; },
                      within);
#pragma unroll
  for (int i = 0; i < TT::kRows; ++i) {
#pragma unroll
    for (int j = 0; j < TT::kCols; ++j) {
      const int t = TT::Row(i), c = TT::Col(j);
      if (TT::Active(i, j)) out[chunk * C * D + t * D + c] = exp(G[t]) * from_state[i][j] + within[i][j];
    }
  }
}

// The backward of the above: dQ, dK, dU, dG, dS0 from dOut (see ChunkOutputForwardKernel for out).
//   dS0 = Q^T diag(gamma) dOut          dU = A^T dOut          X = dOut S0^T
//   dA = dOut U^T (s <= t)              dM = dA o L            (A = M o L, M = Q K^T, L = exp(G_t - G_s))
//   dQ = diag(gamma) X + dM K           dK = dM^T Q
//   dG_t = gamma_t q_t . X_t + sum_s (dA o A)[t, s] - sum_s (dA o A)[s, t]
template <typename T, int C, int D>
__global__ void ChunkOutputBackwardKernel(const T* q, const T* k, const T* u, const T* g, const T* s0, const T* dout,
                                          T* dq, T* dk, T* du, T* dg, T* ds0) {
  extern __shared__ unsigned char smem_raw[];
  constexpr int LD = D + 1, LC = C + 1;
  T* Q = reinterpret_cast<T*>(smem_raw);
  T* Kc = Q + C * LD;
  T* U = Kc + C * LD;
  T* dO = U + C * LD;
  T* S = dO + C * LD;     // [D][D]
  T* Amat = S + D * LD;   // [C][C]
  T* dA = Amat + C * LC;  // [C][C], then dM
  T* G = dA + C * LC;     // [C]
  T* dG = G + C;          // [C]
  const int64_t chunk = blockIdx.x;
  LoadTile(Q, q + chunk * C * D, C, D);
  LoadTile(Kc, k + chunk * C * D, C, D);
  LoadTile(U, u + chunk * C * D, C, D);
  LoadTile(dO, dout + chunk * C * D, C, D);
  LoadTile(S, s0 + chunk * D * D, D, D);
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = g[chunk * C + i];
    dG[i] = 0;
  }
  __syncthreads();
  {
    using TT = ThreadTile<C, C>;
    T m[TT::kRows][TT::kCols] = {}, da[TT::kRows][TT::kCols] = {};
    TileMatMul<C, C, D>([&](int t, int i) { return Q[t * LD + i]; }, [&](int i, int s) { return Kc[s * LD + i]; }, m);
    TileMatMul<C, C, D>([&](int t, int j) { return dO[t * LD + j]; }, [&](int j, int s) { return U[s * LD + j]; }, da);
#pragma unroll
    for (int i = 0; i < TT::kRows; ++i) {
#pragma unroll
      for (int j = 0; j < TT::kCols; ++j) {
        const int t = TT::Row(i), s = TT::Col(j);
        if (!TT::Active(i, j)) continue;
        const bool keep = s <= t;
        const T l = keep ? exp(G[t] - G[s]) : static_cast<T>(0);
        Amat[t * LC + s] = l * m[i][j];
        dA[t * LC + s] = keep ? da[i][j] : static_cast<T>(0);
      }
    }
  }
  __syncthreads();
  // dG from dA o A: row sums add, column sums subtract. One thread per row (and per column).
  for (int t = threadIdx.x; t < C; t += blockDim.x) {
    T row = 0, col = 0;
    for (int s = 0; s < C; ++s) {
      row += dA[t * LC + s] * Amat[t * LC + s];
      col += dA[s * LC + t] * Amat[s * LC + t];
    }
    dG[t] += row - col;
  }
  {  // dS0 = Q^T diag(gamma) dOut, [D][D]
    using TT = ThreadTile<D, D>;
    T acc[TT::kRows][TT::kCols] = {};
    TileMatMul<D, D, C>([&](int i, int t) { return exp(G[t]) * Q[t * LD + i]; }, [&](int t, int j) { return dO[t * LD + j]; },
                        acc);
    StoreThreadTile<TT>(acc, ds0 + chunk * D * D, D);
  }
  {  // dU = A^T dOut, [C][D]
    using TT = ThreadTile<C, D>;
    T acc[TT::kRows][TT::kCols] = {};
    TileMatMul<C, D, C>([&](int s, int t) { return Amat[t * LC + s]; }, [&](int t, int j) { return dO[t * LD + j]; }, acc);
    StoreThreadTile<TT>(acc, du + chunk * C * D, D);
  }
  __syncthreads();  // the dG sums above read dA before it becomes dM
  for (int i = threadIdx.x; i < C * C; i += blockDim.x) {
    const int t = i / C, s = i % C;
    dA[t * LC + s] = s <= t ? dA[t * LC + s] * exp(G[t] - G[s]) : static_cast<T>(0);
  }
  __syncthreads();
  {  // dQ = diag(gamma) dOut S0^T + dM K; dG += gamma_t q_t . (dOut S0^T)_t
    using TT = ThreadTile<C, D>;
    T x[TT::kRows][TT::kCols] = {}, acc[TT::kRows][TT::kCols] = {};
    TileMatMul<C, D, D>([&](int t, int j) { return dO[t * LD + j]; }, [&](int j, int i) { return S[i * LD + j]; }, x);
    TileMatMul<C, D, C>([&](int t, int s) { return dA[t * LC + s]; }, [&](int s, int i) { return Kc[s * LD + i]; }, acc);
#pragma unroll
    for (int i = 0; i < TT::kRows; ++i) {
      T part = 0;
      const int t = TT::Row(i);
      const T gamma = t < C ? exp(G[t]) : static_cast<T>(0);
#pragma unroll
      for (int j = 0; j < TT::kCols; ++j) {
        if (!TT::Active(i, j)) continue;
        const int c = TT::Col(j);
        dq[chunk * C * D + t * D + c] = gamma * x[i][j] + acc[i][j];
        part += gamma * Q[t * LD + c] * x[i][j];
      }
      if (t < C) atomicAdd(&dG[t], part);
    }
  }
  {  // dK = dM^T Q
    using TT = ThreadTile<C, D>;
    T acc[TT::kRows][TT::kCols] = {};
    TileMatMul<C, D, C>([&](int s, int t) { return dA[t * LC + s]; }, [&](int t, int i) { return Q[t * LD + i]; }, acc);
    StoreThreadTile<TT>(acc, dk + chunk * C * D, D);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < C; t += blockDim.x) dg[chunk * C + t] = dG[t];
}

template <typename T, int C, int D>
constexpr size_t ForwardSmem() {
  return sizeof(T) * (3 * C * (D + 1) + D * (D + 1) + C * (C + 1) + C);
}
template <typename T, int C, int D>
constexpr size_t BackwardSmem() {
  return sizeof(T) * (4 * C * (D + 1) + D * (D + 1) + 2 * C * (C + 1) + 2 * C);
}

template <typename T, int C, int D>
cudaError_t ChunkForward(int64_t chunks, const void* q, const void* k, const void* u, const void* g, const void* s0,
                         void* out, cudaStream_t stream) {
  constexpr size_t smem = ForwardSmem<T, C, D>();
  static const cudaError_t attr = cudaFuncSetAttribute(ChunkOutputForwardKernel<T, C, D>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  ChunkOutputForwardKernel<T, C, D><<<static_cast<unsigned>(chunks), kScanThreads, smem, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(u), static_cast<const T*>(g),
      static_cast<const T*>(s0), static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T, int C, int D>
cudaError_t ChunkBackward(int64_t chunks, const void* q, const void* k, const void* u, const void* g, const void* s0,
                          const void* dout, void* dq, void* dk, void* du, void* dg, void* ds0, cudaStream_t stream) {
  constexpr size_t smem = BackwardSmem<T, C, D>();
  static const cudaError_t attr = cudaFuncSetAttribute(ChunkOutputBackwardKernel<T, C, D>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  ChunkOutputBackwardKernel<T, C, D><<<static_cast<unsigned>(chunks), kScanThreads, smem, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(u), static_cast<const T*>(g),
      static_cast<const T*>(s0), static_cast<const T*>(dout), static_cast<T*>(dq), static_cast<T*>(dk),
      static_cast<T*>(du), static_cast<T*>(dg), static_cast<T*>(ds0));
  return cudaGetLastError();
}

// ---- The same two kernels on tensor cores, for fp32 with chunk = head dim = 64 ---------------------------
// Products of 64 x 64 tiles in shared memory by WMMA (m16n16k8, TF32 operands, fp32 accumulation): the
// precision of the cuBLAS TF32 products that the LibTorch form runs (train/trainer.cc allows TF32 for the
// scans). Each of the 8 warps owns two 16 x 16 output tiles. Rows are padded to kTcLd floats: 32-byte
// aligned for WMMA. (A first version split each operand into two TF32 terms, three products per step, for
// fp32 accuracy; with 7 tiles its backward ran one block per SM, and training was slower than with the
// LibTorch form: results/2026-11-30-h200-chunk-output-tc on the branch wip/chunk-output-kernel.)

namespace wm = nvcuda::wmma;

constexpr int kTc = 64;
constexpr int kTcLd = kTc + 4;
constexpr int kTcTile = kTc * kTcLd;  // floats per padded 64 x 64 tile
using TcAcc = wm::fragment<wm::accumulator, 16, 16, 8, float>;

template <typename Frag>
__device__ void RoundToTf32(Frag& f) {
#pragma unroll
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = wm::__float_to_tf32(f.x[i]);
}

__device__ int TcTileRow() { return (threadIdx.x / 32) / 2; }           // 0..3
__device__ int TcTileCol(int j) { return ((threadIdx.x / 32) % 2) * 2 + j; }  // 0..3

// c[j] += A B over the warp's tiles (TcTileRow(), TcTileCol(j)). A (64 x 64) element (m, k) is at
// a[m * kTcLd + k] (LA = row_major) or a[k * kTcLd + m] (col_major); B element (k, n) at b[k * kTcLd + n]
// (row_major) or b[n * kTcLd + k] (col_major).
template <typename LA, typename LB>
__device__ void TcGemm(const float* a, const float* b, TcAcc (&c)[2]) {
  constexpr bool a_rows = std::is_same_v<LA, wm::row_major>, b_rows = std::is_same_v<LB, wm::row_major>;
  const int tm = TcTileRow();
#pragma unroll 2
  for (int k = 0; k < kTc; k += 8) {
    wm::fragment<wm::matrix_a, 16, 16, 8, wm::precision::tf32, LA> af;
    wm::load_matrix_sync(af, a_rows ? a + tm * 16 * kTcLd + k : a + k * kTcLd + tm * 16, kTcLd);
    RoundToTf32(af);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int tn = TcTileCol(j);
      wm::fragment<wm::matrix_b, 16, 16, 8, wm::precision::tf32, LB> bf;
      wm::load_matrix_sync(bf, b_rows ? b + k * kTcLd + tn * 16 : b + tn * 16 * kTcLd + k, kTcLd);
      RoundToTf32(bf);
      wm::mma_sync(c[j], af, bf, c[j]);
    }
  }
}

__device__ void TcZero(TcAcc (&c)[2]) {
  wm::fill_fragment(c[0], 0.0f);
  wm::fill_fragment(c[1], 0.0f);
}

// Stores the warp's tiles into a 64 x 64 tile with row stride ld (shared or global memory).
__device__ void TcStore(float* dst, int ld, TcAcc (&c)[2]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    wm::store_matrix_sync(dst + TcTileRow() * 16 * ld + TcTileCol(j) * 16, c[j], ld, wm::mem_row_major);
  }
}

// A packed 64 x 64 fp32 tile from global memory into a padded shared one, 16 bytes per load.
__device__ void TcLoad(float* dst, const float* src) {
  const float4* s4 = reinterpret_cast<const float4*>(src);
#pragma unroll 4
  for (int i = threadIdx.x; i < kTc * kTc / 4; i += blockDim.x) {
    const int r = i / (kTc / 4), c4 = i % (kTc / 4);
    *reinterpret_cast<float4*>(dst + r * kTcLd + 4 * c4) = s4[i];
  }
}

__global__ void __launch_bounds__(256) ChunkOutputForwardTc(const float* q, const float* k, const float* u,
                                                            const float* g, const float* s0, float* out) {
  extern __shared__ __align__(32) unsigned char tc_smem[];
  float* Q = reinterpret_cast<float*>(tc_smem);
  float* K = Q + kTcTile;
  float* U = K + kTcTile;
  float* S = U + kTcTile;
  float* A = S + kTcTile;
  float* G = A + kTcTile;
  const int64_t chunk = blockIdx.x, base = chunk * kTc * kTc;
  TcLoad(Q, q + base);
  TcLoad(K, k + base);
  TcLoad(U, u + base);
  TcLoad(S, s0 + base);
  if (threadIdx.x < kTc) G[threadIdx.x] = g[chunk * kTc + threadIdx.x];
  __syncthreads();
  TcAcc c[2];
  TcZero(c);
  TcGemm<wm::row_major, wm::col_major>(Q, K, c);  // Q K^T
  TcStore(A, kTcLd, c);
  __syncthreads();
  // A = (Q K^T) o L, L[t, s] = exp(G_t - G_s) for s <= t; and Q's rows scaled by gamma_t = exp(G_t).
  for (int i = threadIdx.x; i < kTc * kTc; i += blockDim.x) {
    const int t = i / kTc, s = i % kTc;
    A[t * kTcLd + s] = s <= t ? A[t * kTcLd + s] * expf(G[t] - G[s]) : 0.0f;
    Q[t * kTcLd + s] *= expf(G[t]);
  }
  __syncthreads();
  TcZero(c);
  TcGemm<wm::row_major, wm::row_major>(Q, S, c);  // diag(gamma) Q S0
  TcGemm<wm::row_major, wm::row_major>(A, U, c);  // + A U
  TcStore(out + base, kTc, c);
}

// See ChunkOutputBackwardKernel for the formulas. Six tiles of shared memory (two blocks per SM): U's
// tile takes S0 once dA = dOut U^T is done, and A's takes X = dOut S0^T once dU = A^T dOut and the dG sums
// are.
__global__ void __launch_bounds__(256, 2) ChunkOutputBackwardTc(const float* q, const float* k, const float* u,
                                                                const float* g, const float* s0, const float* dout,
                                                                float* dq, float* dk, float* du, float* dg,
                                                                float* ds0) {
  extern __shared__ __align__(32) unsigned char tc_smem[];
  float* Q = reinterpret_cast<float*>(tc_smem);
  float* K = Q + kTcTile;
  float* US = K + kTcTile;  // U, then S0
  float* dO = US + kTcTile;
  float* A = dO + kTcTile;  // A, then X = dOut S0^T
  float* dA = A + kTcTile;  // dA, then dM
  float* G = dA + kTcTile;
  float* dG = G + kTc;
  const int64_t chunk = blockIdx.x, base = chunk * kTc * kTc;
  TcLoad(Q, q + base);
  TcLoad(K, k + base);
  TcLoad(US, u + base);
  TcLoad(dO, dout + base);
  if (threadIdx.x < kTc) {
    G[threadIdx.x] = g[chunk * kTc + threadIdx.x];
    dG[threadIdx.x] = 0.0f;
  }
  __syncthreads();
  TcAcc c[2];
  TcZero(c);
  TcGemm<wm::row_major, wm::col_major>(Q, K, c);  // M = Q K^T
  TcStore(A, kTcLd, c);
  TcZero(c);
  TcGemm<wm::row_major, wm::col_major>(dO, US, c);  // dO U^T
  TcStore(dA, kTcLd, c);
  __syncthreads();
  TcLoad(US, s0 + base);
  for (int i = threadIdx.x; i < kTc * kTc; i += blockDim.x) {
    const int t = i / kTc, s = i % kTc;
    const bool keep = s <= t;
    A[t * kTcLd + s] = keep ? A[t * kTcLd + s] * expf(G[t] - G[s]) : 0.0f;
    if (!keep) dA[t * kTcLd + s] = 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < kTc) {  // dG from dA o A: row sums add, column sums subtract
    const int t = threadIdx.x;
    float row = 0, col = 0;
    for (int s = 0; s < kTc; ++s) {
      row += dA[t * kTcLd + s] * A[t * kTcLd + s];
      col += dA[s * kTcLd + t] * A[s * kTcLd + t];
    }
    dG[t] += row - col;
  }
  TcZero(c);
  TcGemm<wm::col_major, wm::row_major>(A, dO, c);  // dU = A^T dOut
  TcStore(du + base, kTc, c);
  TcZero(c);
  TcGemm<wm::row_major, wm::col_major>(dO, US, c);  // X = dOut S0^T, kept in c until A is free
  __syncthreads();
  TcStore(A, kTcLd, c);
  __syncthreads();
  if (threadIdx.x < kTc) {  // dG += gamma_t q_t . X_t
    const int t = threadIdx.x;
    float dot = 0;
    for (int i = 0; i < kTc; ++i) dot += Q[t * kTcLd + i] * A[t * kTcLd + i];
    dG[t] += expf(G[t]) * dot;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTc * kTc; i += blockDim.x) {
    const int t = i / kTc, s = i % kTc;
    const float gamma = expf(G[t]);
    A[t * kTcLd + s] *= gamma;   // diag(gamma) X
    dO[t * kTcLd + s] *= gamma;  // diag(gamma) dOut
    if (s <= t) dA[t * kTcLd + s] *= expf(G[t] - G[s]);  // dM = dA o L
  }
  __syncthreads();
  TcZero(c);
  TcGemm<wm::col_major, wm::row_major>(Q, dO, c);  // dS0 = Q^T diag(gamma) dOut
  TcStore(ds0 + base, kTc, c);
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // dQ starts from diag(gamma) X
    wm::load_matrix_sync(c[j], A + TcTileRow() * 16 * kTcLd + TcTileCol(j) * 16, kTcLd, wm::mem_row_major);
  }
  TcGemm<wm::row_major, wm::row_major>(dA, K, c);  // + dM K
  TcStore(dq + base, kTc, c);
  TcZero(c);
  TcGemm<wm::col_major, wm::row_major>(dA, Q, c);  // dK = dM^T Q
  TcStore(dk + base, kTc, c);
  if (threadIdx.x < kTc) dg[chunk * kTc + threadIdx.x] = dG[threadIdx.x];
}

constexpr size_t kTcForwardSmem = sizeof(float) * (5 * kTcTile + kTc);
constexpr size_t kTcBackwardSmem = sizeof(float) * (6 * kTcTile + 2 * kTc);

cudaError_t ChunkForwardTc(int64_t chunks, const void* q, const void* k, const void* u, const void* g,
                           const void* s0, void* out, cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(ChunkOutputForwardTc,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kTcForwardSmem);
  if (attr != cudaSuccess) return attr;
  ChunkOutputForwardTc<<<static_cast<unsigned>(chunks), 256, kTcForwardSmem, stream>>>(
      static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(u),
      static_cast<const float*>(g), static_cast<const float*>(s0), static_cast<float*>(out));
  return cudaGetLastError();
}

cudaError_t ChunkBackwardTc(int64_t chunks, const void* q, const void* k, const void* u, const void* g,
                            const void* s0, const void* dout, void* dq, void* dk, void* du, void* dg, void* ds0,
                            cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      ChunkOutputBackwardTc, cudaFuncAttributeMaxDynamicSharedMemorySize, kTcBackwardSmem);
  if (attr != cudaSuccess) return attr;
  ChunkOutputBackwardTc<<<static_cast<unsigned>(chunks), 256, kTcBackwardSmem, stream>>>(
      static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(u),
      static_cast<const float*>(g), static_cast<const float*>(s0), static_cast<const float*>(dout),
      static_cast<float*>(dq), static_cast<float*>(dk), static_cast<float*>(du), static_cast<float*>(dg),
      static_cast<float*>(ds0));
  return cudaGetLastError();
}


// ---- SiLU-gated product: out = SiLU(g) x; dx = dout SiLU(g), dg = dout x s (1 + g (1 - s)), s = sigmoid(g).
// One pass each way in the accumulation type (LibTorch's silu, mul and their backwards take five kernels and
// round to bf16 between them). Threads over columns (16 bytes each where the rows allow), blocks over
// (column tile, rows).
constexpr int kGateThreads = 256;
constexpr unsigned kGateMaxRowBlocks = 65535;

template <typename T, bool kBackward, int kVec>
__global__ void SiluMulKernel(GateShape s, const T* gate, const T* x, const T* dout, T* out, T* dgate) {
  using A = typename Acc<T>::type;
  using P = Pack<T, kVec>;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * kVec;
  if (c >= s.cols) return;
  for (int64_t r = blockIdx.y; r < s.rows; r += gridDim.y) {
    const P gp = *reinterpret_cast<const P*>(gate + r * s.ld_gate + c);
    const P xp = *reinterpret_cast<const P*>(x + r * s.ld_x + c);
    const int64_t o = r * s.cols + c;
    P dp, first, second;
    if constexpr (kBackward) dp = *reinterpret_cast<const P*>(dout + o);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const A g = static_cast<A>(gp.v[e]), v = static_cast<A>(xp.v[e]);
      const A sig = A(1) / (A(1) + exp(-g));
      if constexpr (kBackward) {
        const A d = static_cast<A>(dp.v[e]);
        first.v[e] = static_cast<T>(d * g * sig);                              // dx
        second.v[e] = static_cast<T>(d * v * sig * (A(1) + g * (A(1) - sig)));  // dgate
      } else {
        first.v[e] = static_cast<T>(g * sig * v);
      }
    }
    *reinterpret_cast<P*>(out + o) = first;
    if constexpr (kBackward) *reinterpret_cast<P*>(dgate + o) = second;
  }
}

template <typename T, int kVec>
cudaError_t LaunchSiluMul(const GateShape& s, const void* gate, const void* x, const void* dout, void* out,
                          void* dgate, cudaStream_t stream) {
  const int threads_per_row = (s.cols + kVec - 1) / kVec;
  const dim3 grid((threads_per_row + kGateThreads - 1) / kGateThreads,
                  static_cast<unsigned>(s.rows < kGateMaxRowBlocks ? s.rows : kGateMaxRowBlocks));
  if (dout == nullptr) {
    SiluMulKernel<T, false, kVec><<<grid, kGateThreads, 0, stream>>>(
        s, static_cast<const T*>(gate), static_cast<const T*>(x), nullptr, static_cast<T*>(out), nullptr);
  } else {
    SiluMulKernel<T, true, kVec><<<grid, kGateThreads, 0, stream>>>(
        s, static_cast<const T*>(gate), static_cast<const T*>(x), static_cast<const T*>(dout), static_cast<T*>(out),
        static_cast<T*>(dgate));
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t SiluMul(const GateShape& s, const void* gate, const void* x, const void* dout, void* out, void* dgate,
                    cudaStream_t stream) {
  if (s.rows == 0 || s.cols == 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vector = s.cols % kVec == 0 && s.ld_gate % kVec == 0 && s.ld_x % kVec == 0 && aligned(gate) &&
                      aligned(x) && aligned(dout) && aligned(out) && aligned(dgate);
  return vector ? LaunchSiluMul<T, kVec>(s, gate, x, dout, out, dgate, stream)
                : LaunchSiluMul<T, 1>(s, gate, x, dout, out, dgate, stream);
}

// ---- The mixers' outputs combined per token: out = is_attn ? attn : lin + skip[h] v ------------------
// Replaces a cast of each operand, the skip's product and sum, the select, and a copy that packed lin, each
// with its backward; a row reads only the operand its mode takes. Threads over columns (kVec of one head
// each where strides and pointers allow), blocks over (column tile, kCombineRows rows); the backward sums
// dout * v for the skip gradient over a block's rows in registers, as partials for ReduceColumns.
constexpr int kCombineMaxThreads = 256, kCombineRows = 16;
constexpr unsigned kCombineMaxRowBlocks = 65535;

__device__ inline int64_t At(const CombineShape::Strides& s, int64_t b, int64_t t, int h) {
  return b * s.b + t * s.t + h * s.h;
}

// A thread's kVec columns: the first, c, at feature d of head h; and that head's skip weight.
template <typename TL>
struct CombineColumns {
  __device__ CombineColumns(const CombineShape& s, int vec, const TL* skip_ptr)
      : cols(s.heads * s.head_dim), c((blockIdx.x * blockDim.x + threadIdx.x) * vec), rows(s.batch * s.time) {
    h = c < cols ? c / s.head_dim : 0;
    d = c - h * s.head_dim;
    skip = skip_ptr != nullptr ? skip_ptr[h] : TL(0);
  }
  int cols, c, h = 0, d = 0;
  int64_t rows;
  TL skip;
};

// Calls row(r, b, t) for each row r (sequence b, step t) of the tile that starts at row r0.
template <typename F>
__device__ __forceinline__ void ForTileRows(const CombineShape& s, int64_t rows, int64_t r0, F&& row) {
  const int64_t r1 = min(rows, r0 + kCombineRows);
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / s.time;
    row(r, b, r - b * s.time);
  }
}

template <typename TA, typename TV, typename TL, int kVec>
__global__ void CombineForwardKernel(CombineShape s, const TA* __restrict__ attn, const TL* __restrict__ lin,
                                     const TV* __restrict__ v, const TL* __restrict__ skip,
                                     const bool* __restrict__ is_attn, TL* __restrict__ out) {
  const CombineColumns<TL> col(s, kVec, skip);
  if (col.c >= col.cols) return;
  const int h = col.h, d = col.d;
  for (int64_t r0 = int64_t(blockIdx.y) * kCombineRows; r0 < col.rows; r0 += int64_t(gridDim.y) * kCombineRows) {
    ForTileRows(s, col.rows, r0, [&](int64_t r, int64_t b, int64_t t) {
      Pack<TL, kVec> o;
      if (is_attn != nullptr && is_attn[r]) {
        const auto a = *reinterpret_cast<const Pack<TA, kVec>*>(attn + At(s.attn, b, t, h) + d);
#pragma unroll
        for (int e = 0; e < kVec; ++e) o.v[e] = static_cast<TL>(a.v[e]);
      } else {
        o = *reinterpret_cast<const Pack<TL, kVec>*>(lin + At(s.lin, b, t, h) + d);
        if (skip != nullptr) {
          const auto x = *reinterpret_cast<const Pack<TV, kVec>*>(v + At(s.v, b, t, h) + d);
#pragma unroll
          for (int e = 0; e < kVec; ++e) o.v[e] += col.skip * static_cast<TL>(x.v[e]);
        }
      }
      *reinterpret_cast<Pack<TL, kVec>*>(out + r * col.cols + col.c) = o;
    });
  }
}

// dattn = is_attn ? dout : 0; dlin = is_attn ? 0 : dout; dv = is_attn ? 0 : skip[h] dout;
// partial[row tile][col] = sum over the tile's linear rows of dout * v.
template <typename TA, typename TV, typename TL, int kVec>
__global__ void CombineBackwardKernel(CombineShape s, const TV* __restrict__ v, const TL* __restrict__ skip,
                                      const bool* __restrict__ is_attn, const TL* __restrict__ dout,
                                      TA* __restrict__ dattn, TL* __restrict__ dlin, TV* __restrict__ dv,
                                      TL* __restrict__ partial) {
  const CombineColumns<TL> col(s, kVec, skip);
  if (col.c >= col.cols) return;
  const int cols = col.cols, c = col.c, h = col.h, d = col.d;
  const TL sk = col.skip;
  for (int64_t r0 = int64_t(blockIdx.y) * kCombineRows; r0 < col.rows; r0 += int64_t(gridDim.y) * kCombineRows) {
    TL acc[kVec] = {};
    ForTileRows(s, col.rows, r0, [&](int64_t r, int64_t b, int64_t t) {
      const bool attn_row = is_attn != nullptr && is_attn[r];
      const auto g = *reinterpret_cast<const Pack<TL, kVec>*>(dout + r * cols + c);
      Pack<TL, kVec> gl;
      Pack<TA, kVec> ga;
      Pack<TV, kVec> gv;
      Pack<TV, kVec> x;
      if (skip != nullptr && !attn_row) x = *reinterpret_cast<const Pack<TV, kVec>*>(v + At(s.v, b, t, h) + d);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        ga.v[e] = static_cast<TA>(attn_row ? g.v[e] : TL(0));
        gl.v[e] = attn_row ? TL(0) : g.v[e];
        if (skip != nullptr) {
          gv.v[e] = static_cast<TV>(attn_row ? TL(0) : sk * g.v[e]);
          if (!attn_row) acc[e] += g.v[e] * static_cast<TL>(x.v[e]);
        }
      }
      if (dattn != nullptr) *reinterpret_cast<Pack<TA, kVec>*>(dattn + r * cols + c) = ga;
      *reinterpret_cast<Pack<TL, kVec>*>(dlin + At(s.dlin, b, t, h) + d) = gl;
      if (skip != nullptr) *reinterpret_cast<Pack<TV, kVec>*>(dv + r * cols + c) = gv;
    });
    if (skip != nullptr) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) partial[(r0 / kCombineRows) * cols + c + e] = acc[e];
    }
  }
}

int64_t CombineRowTiles(const CombineShape& s) { return (s.batch * s.time + kCombineRows - 1) / kCombineRows; }

// Whether every operand allows vec-wide accesses (sizes in bytes of one element).
bool CombineVectorizes(const CombineShape& s, int vec, std::initializer_list<std::pair<const void*, int>> ptrs) {
  auto strides_ok = [&](const CombineShape::Strides& st) { return st.b % vec == 0 && st.t % vec == 0 && st.h % vec == 0; };
  if (s.head_dim % vec != 0 || !strides_ok(s.attn) || !strides_ok(s.lin) || !strides_ok(s.v) || !strides_ok(s.dlin)) {
    return false;
  }
  for (const auto& [p, size] : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % (size * vec) != 0) return false;
  }
  return true;
}

template <typename TA, typename TV, typename TL>
cudaError_t Combine(const CombineShape& s, const void* attn, const void* lin, const void* v, const void* skip,
                    const bool* is_attn, const void* dout, void* out_or_dlin, void* dattn, void* dv, void* dskip_cols,
                    void* workspace, cudaStream_t stream) {
  if (s.batch * s.time == 0 || s.heads * s.head_dim == 0) return cudaSuccess;
  constexpr int kVec = 4;
  const bool vector = CombineVectorizes(
      s, kVec, {{attn, sizeof(TA)}, {lin, sizeof(TL)}, {v, sizeof(TV)}, {dout, sizeof(TL)},
                {out_or_dlin, sizeof(TL)}, {dattn, sizeof(TA)}, {dv, sizeof(TV)}});
  const int vec = vector ? kVec : 1, units = s.heads * s.head_dim / vec;
  const int64_t tiles = CombineRowTiles(s);
  const int threads = units < kCombineMaxThreads ? (units + 31) / 32 * 32 : kCombineMaxThreads;
  const dim3 grid((units + threads - 1) / threads,
                  static_cast<unsigned>(tiles < kCombineMaxRowBlocks ? tiles : kCombineMaxRowBlocks));
  const auto *a = static_cast<const TA*>(attn);
  const auto *l = static_cast<const TL*>(lin), *sk = static_cast<const TL*>(skip);
  const auto *x = static_cast<const TV*>(v);
  if (dout == nullptr) {
    const auto kernel = vector ? CombineForwardKernel<TA, TV, TL, kVec> : CombineForwardKernel<TA, TV, TL, 1>;
    kernel<<<grid, threads, 0, stream>>>(s, a, l, x, sk, is_attn, static_cast<TL*>(out_or_dlin));
    return cudaGetLastError();
  }
  const int64_t cols = int64_t(s.heads) * s.head_dim;
  auto* partial = static_cast<TL*>(workspace);
  const auto kernel = vector ? CombineBackwardKernel<TA, TV, TL, kVec> : CombineBackwardKernel<TA, TV, TL, 1>;
  kernel<<<grid, threads, 0, stream>>>(s, x, sk, is_attn, static_cast<const TL*>(dout),
                                               static_cast<TA*>(dattn), static_cast<TL*>(out_or_dlin),
                                               static_cast<TV*>(dv), partial);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || skip == nullptr) return e;
  return ReduceColumns<TL, TL>(partial, tiles, cols, static_cast<TL*>(dskip_cols), partial + tiles * cols, stream);
}

// ---- The Mamba-2 scan's chunk operands: q32 = q, k32 = k, u = dt v, kend = to_end k ----------------------
// Replaces three converting copies into the chunk layout and two products, each with its backward. Threads
// over (b, h, t, 4 features) in the outputs' order, so that stores are packed and a row's head_dim / 4
// threads are neighbouring lanes of one warp: the backward sums ddt and dto_end over them by shuffles.
constexpr int kPrepVec = 4, kPrepThreads = 256;

struct PrepIndex {
  int64_t row = 0;  // (b * heads + h) * padded + t: the row of dt, to_end and the outputs
  int64_t b = 0;
  int h = 0, t = 0, d = 0;
};

__device__ inline PrepIndex PrepAt(const ChunkPrepShape& s, int64_t unit) {
  const int per_row = s.head_dim / kPrepVec;
  PrepIndex i;
  i.row = unit / per_row;
  i.d = static_cast<int>(unit - i.row * per_row) * kPrepVec;
  const int64_t bh = i.row / s.padded;
  i.t = static_cast<int>(i.row - bh * s.padded);
  i.b = bh / s.heads;
  i.h = static_cast<int>(bh - i.b * s.heads);
  return i;
}

__host__ __device__ inline int64_t PrepUnits(const ChunkPrepShape& s) { return s.batch * s.heads * s.padded * (s.head_dim / kPrepVec); }

template <typename T>
__device__ inline Pack<T, kPrepVec> LoadOrZero(const T* p, int64_t offset) {
  if (p != nullptr) return *reinterpret_cast<const Pack<T, kPrepVec>*>(p + offset);
  Pack<T, kPrepVec> zero;
#pragma unroll
  for (int e = 0; e < kPrepVec; ++e) zero.v[e] = T(0);
  return zero;
}

template <typename TI, typename TL>
__global__ void ChunkPrepForwardKernel(ChunkPrepShape s, const TI* __restrict__ q, const TI* __restrict__ k,
                                       const TI* __restrict__ v, const TL* __restrict__ dt,
                                       const TL* __restrict__ to_end, TL* __restrict__ q32, TL* __restrict__ k32,
                                       TL* __restrict__ u, TL* __restrict__ kend) {
  using In = Pack<TI, kPrepVec>;
  using Out = Pack<TL, kPrepVec>;
  const int64_t units = PrepUnits(s), stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t unit = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; unit < units; unit += stride) {
    const PrepIndex i = PrepAt(s, unit);
    Out oq, ok, ou, oe;
    if (i.t < s.time) {
      const In pq = *reinterpret_cast<const In*>(q + At(s.q, i.b, i.t, i.h) + i.d);
      const In pk = *reinterpret_cast<const In*>(k + At(s.k, i.b, i.t, i.h) + i.d);
      const In pv = *reinterpret_cast<const In*>(v + At(s.v, i.b, i.t, i.h) + i.d);
      const TL a = dt[i.row], e = to_end[i.row];
#pragma unroll
      for (int j = 0; j < kPrepVec; ++j) {
        oq.v[j] = static_cast<TL>(pq.v[j]);
        ok.v[j] = static_cast<TL>(pk.v[j]);
        ou.v[j] = a * static_cast<TL>(pv.v[j]);
        oe.v[j] = e * ok.v[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < kPrepVec; ++j) oq.v[j] = ok.v[j] = ou.v[j] = oe.v[j] = TL(0);
    }
    const int64_t o = i.row * s.head_dim + i.d;
    *reinterpret_cast<Out*>(q32 + o) = oq;
    *reinterpret_cast<Out*>(k32 + o) = ok;
    *reinterpret_cast<Out*>(u + o) = ou;
    *reinterpret_cast<Out*>(kend + o) = oe;
  }
}

// dq = dq32, dk = dk32 + to_end dkend, dv = dt du; ddt = sum_d du v, dto_end = sum_d dkend k.
template <typename TI, typename TL>
__global__ void ChunkPrepBackwardKernel(ChunkPrepShape s, const TI* __restrict__ k, const TI* __restrict__ v,
                                        const TL* __restrict__ dt, const TL* __restrict__ to_end,
                                        const TL* __restrict__ dq32, const TL* __restrict__ dk32,
                                        const TL* __restrict__ du, const TL* __restrict__ dkend, TI* __restrict__ dq,
                                        TI* __restrict__ dk, TI* __restrict__ dv, TL* __restrict__ ddt,
                                        TL* __restrict__ dto_end) {
  using In = Pack<TI, kPrepVec>;
  const int per_row = s.head_dim / kPrepVec;
  const int64_t units = PrepUnits(s), stride = int64_t(gridDim.x) * blockDim.x;
  // Whole warps step together (stride and block size are multiples of 32), so each row's lanes meet in
  // the shuffles below, idle lanes included.
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < units; base += stride) {
    const int64_t unit = base + threadIdx.x;
    PrepIndex i;
    TL sum_dt = 0, sum_end = 0;
    if (unit < units) {
      i = PrepAt(s, unit);
      if (i.t < s.time) {
        const int64_t o = i.row * s.head_dim + i.d;
        const auto gq = LoadOrZero(dq32, o), gk = LoadOrZero(dk32, o), gu = LoadOrZero(du, o),
                   ge = LoadOrZero(dkend, o);
        const In pk = *reinterpret_cast<const In*>(k + At(s.k, i.b, i.t, i.h) + i.d);
        const In pv = *reinterpret_cast<const In*>(v + At(s.v, i.b, i.t, i.h) + i.d);
        const TL a = dt[i.row], e = to_end[i.row];
        In oq, ok, ov;
#pragma unroll
        for (int j = 0; j < kPrepVec; ++j) {
          oq.v[j] = static_cast<TI>(gq.v[j]);
          ok.v[j] = static_cast<TI>(gk.v[j] + e * ge.v[j]);
          ov.v[j] = static_cast<TI>(a * gu.v[j]);
          sum_dt += gu.v[j] * static_cast<TL>(pv.v[j]);
          sum_end += ge.v[j] * static_cast<TL>(pk.v[j]);
        }
        const int64_t packed = ((i.b * s.time + i.t) * s.heads + i.h) * s.head_dim + i.d;
        *reinterpret_cast<In*>(dq + packed) = oq;
        *reinterpret_cast<In*>(dk + packed) = ok;
        *reinterpret_cast<In*>(dv + packed) = ov;
      }
    }
    for (int o = per_row / 2; o > 0; o >>= 1) {
      sum_dt += __shfl_xor_sync(0xffffffffu, sum_dt, o);
      sum_end += __shfl_xor_sync(0xffffffffu, sum_end, o);
    }
    if (unit < units && i.d == 0) {  // padded steps: both sums are zero
      ddt[i.row] = sum_dt;
      dto_end[i.row] = sum_end;
    }
  }
}

unsigned PrepBlocks(const ChunkPrepShape& s) {
  const int64_t blocks = (PrepUnits(s) + kPrepThreads - 1) / kPrepThreads;
  return static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20));
}

// ---- GDN's state passing from chunk to chunk (train/linear_mixers.cc) ----------------------------------
// With [U0 W] the chunk's solved right-hand sides and Ke = diag(to_end) K, chunk n maps the state entering
// it, S_n [D x D], to
//   u_n = U0_n - W_n S_n          S_n+1 = a_n S_n + Ke_n^T u_n
// and the backward runs the same two products from the last chunk to the first:
//   du_n = gu_n + Ke_n dS_n+1     dS_n = gs0_n + a_n dS_n+1 - W_n^T du_n
// One block per head walks its chunks in order. Each thread owns a 4 x 4 tile of both products (4 rows,
// 4 neighbouring columns), so that every quad it reads from shared memory feeds 16 multiply-adds; the state
// tile stays in its registers. The next chunk's W and Ke (and the thread's tile of U0, or of the
// gradients) are loaded into registers while this chunk computes.
constexpr int kGdnThreads = 256;

template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename T, int C, int D>
struct GdnLayout {
  static constexpr int kLd = D + 4;  // padded rows: quads stay aligned, the 4 rows of a tile in other banks
  static constexpr int kColGroups = D / 4;
  static constexpr int kStaged = (C * D / 4 + kGdnThreads - 1) / kGdnThreads;  // quads a thread stages
  static_assert(D % 4 == 0 && kGdnThreads % kColGroups == 0, "head dim");
  static_assert(kGdnThreads / kColGroups * 4 >= C && kGdnThreads / kColGroups * 4 >= D, "one tile per thread");
  static constexpr size_t kSmem = sizeof(T) * (3 * C + D) * kLd;  // W, Ke, the state, u
};

template <typename T>
__device__ inline Quad<T> QuadAt(const T* p) {
  return *reinterpret_cast<const Quad<T>*>(p);
}

// kBackward = false: x [heads, chunks, C, 2D] ([U0 W]), k_end [heads, chunks, C, D], decay [heads, chunks],
// first = the initial state or null; writes states = s0 (each S_n), rows = u, last = the final state.
// kBackward = true: row_grad = gu, state_grad = gs0 (null: none), first = dfinal or null; writes states =
// ds_next (each dS_n+1), rows = du, last = dinitial (may be null). Grid: heads.
template <typename T, int C, int D, bool kBackward>
__global__ void __launch_bounds__(kGdnThreads) GdnStatesKernel(int chunks, const T* x, const T* k_end,
                                                               const T* decay, const T* row_grad,
                                                               const T* state_grad, const T* first, T* states,
                                                               T* rows, T* last) {
  using L = GdnLayout<T, C, D>;
  constexpr int LD = L::kLd;
  extern __shared__ unsigned char smem_raw[];
  T* W = reinterpret_cast<T*>(smem_raw);  // [C][LD]
  T* Ke = W + C * LD;                      // [C][LD]
  T* S = Ke + C * LD;                      // [D][LD]: the state (its gradient, backward)
  T* Un = S + D * LD;                      // [C][LD]: u (du)
  // P1 = the C x D product (u or du), P2 = the D x D one (the state update); A1, A2 their shared operands.
  T* A1 = kBackward ? Ke : W;
  T* A2 = kBackward ? W : Ke;
  const int c0 = threadIdx.x % L::kColGroups * 4, r0 = threadIdx.x / L::kColGroups * 4;
  const bool p1 = r0 < C, p2 = r0 < D;
  const int64_t head = blockIdx.x;

  Quad<T> staged_w[L::kStaged], staged_k[L::kStaged], tile_next[4], state_next[4];
  auto stage = [&](int n) {  // chunk n's operands into registers
    const int64_t chunk = head * chunks + n;
    const T* xn = x + chunk * C * 2 * D;
#pragma unroll
    for (int m = 0; m < L::kStaged; ++m) {
      const int e = (threadIdx.x + m * kGdnThreads) * 4;
      if (e < C * D) {
        staged_w[m] = QuadAt(xn + (e / D) * 2 * D + D + e % D);
        staged_k[m] = QuadAt(k_end + chunk * C * D + e);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T* src = kBackward ? row_grad : xn;
      const int64_t at = kBackward ? (chunk * C + r0 + i) * D + c0 : (r0 + i) * 2 * D + c0;
      tile_next[i] = (p1 && src != nullptr) ? QuadAt(src + at) : Quad<T>{};
      state_next[i] = (kBackward && p2 && state_grad != nullptr)
                          ? QuadAt(state_grad + (chunk * D + r0 + i) * D + c0)
                          : Quad<T>{};
    }
  };

  T s[4][4];  // this thread's tile of the state: rows r0.., columns c0..
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const Quad<T> q = (p2 && first != nullptr) ? QuadAt(first + (head * D + r0 + i) * D + c0) : Quad<T>{};
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = q.v[j];
  }
  const int n_first = kBackward ? chunks - 1 : 0, step = kBackward ? -1 : 1;
  stage(n_first);
  for (int it = 0, n = n_first; it < chunks; ++it, n += step) {
    const int64_t chunk = head * chunks + n;
#pragma unroll
    for (int m = 0; m < L::kStaged; ++m) {
      const int e = (threadIdx.x + m * kGdnThreads) * 4;
      if (e < C * D) {
        *reinterpret_cast<Quad<T>*>(W + (e / D) * LD + e % D) = staged_w[m];
        *reinterpret_cast<Quad<T>*>(Ke + (e / D) * LD + e % D) = staged_k[m];
      }
    }
    Quad<T> tile[4], state_add[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) tile[i] = tile_next[i], state_add[i] = state_next[i];
    if (p2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        Quad<T> q;
#pragma unroll
        for (int j = 0; j < 4; ++j) q.v[j] = s[i][j];
        *reinterpret_cast<Quad<T>*>(S + (r0 + i) * LD + c0) = q;
        *reinterpret_cast<Quad<T>*>(states + (chunk * D + r0 + i) * D + c0) = q;  // the state entering chunk n
      }
    }
    __syncthreads();  // W, Ke and S are staged
    if (it + 1 < chunks) stage(n + step);
    if (p1) {  // u = U0 - W S, or du = gu + Ke dS
      T acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = tile[i].v[j];
      }
#pragma unroll 4
      for (int k = 0; k < D; k += 4) {
        Quad<T> a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = QuadAt(A1 + (r0 + i) * LD + k);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) b[kk] = QuadAt(S + (k + kk) * LD + c0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              if constexpr (kBackward) {
                acc[i][j] += a[i].v[kk] * b[kk].v[j];
              } else {
                acc[i][j] -= a[i].v[kk] * b[kk].v[j];
              }
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        Quad<T> q;
#pragma unroll
        for (int j = 0; j < 4; ++j) q.v[j] = acc[i][j];
        *reinterpret_cast<Quad<T>*>(Un + (r0 + i) * LD + c0) = q;
        *reinterpret_cast<Quad<T>*>(rows + (chunk * C + r0 + i) * D + c0) = q;
      }
    }
    __syncthreads();  // u is complete
    if (p2) {  // S = a S + Ke^T u, or dS = gs0 + a dS - W^T du
      const T a = decay[chunk];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = a * s[i][j] + state_add[i].v[j];
      }
#pragma unroll 4
      for (int c = 0; c < C; ++c) {
        const Quad<T> ai = QuadAt(A2 + c * LD + r0), bj = QuadAt(Un + c * LD + c0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if constexpr (kBackward) {
              s[i][j] -= ai.v[i] * bj.v[j];
            } else {
              s[i][j] += ai.v[i] * bj.v[j];
            }
          }
        }
      }
    }
    __syncthreads();  // before the next chunk's W, Ke and S overwrite this one's
  }
  if (p2 && last != nullptr) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Quad<T> q;
#pragma unroll
      for (int j = 0; j < 4; ++j) q.v[j] = s[i][j];
      *reinterpret_cast<Quad<T>*>(last + (head * D + r0 + i) * D + c0) = q;
    }
  }
}

template <typename T, int C, int D, bool kBackward>
cudaError_t LaunchGdnStates(int64_t heads, int chunks, const void* x, const void* k_end, const void* decay,
                            const void* row_grad, const void* state_grad, const void* first, void* states, void* rows,
                            void* last, cudaStream_t stream) {
  constexpr size_t smem = GdnLayout<T, C, D>::kSmem;
  static const cudaError_t attr = cudaFuncSetAttribute(GdnStatesKernel<T, C, D, kBackward>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return attr;
  GdnStatesKernel<T, C, D, kBackward><<<static_cast<unsigned>(heads), kGdnThreads, smem, stream>>>(
      chunks, static_cast<const T*>(x), static_cast<const T*>(k_end), static_cast<const T*>(decay),
      static_cast<const T*>(row_grad), static_cast<const T*>(state_grad), static_cast<const T*>(first),
      static_cast<T*>(states), static_cast<T*>(rows), static_cast<T*>(last));
  return cudaGetLastError();
}

// ---- GDN's UT transform: X = (I + L)^-1 [beta V, f K] in each chunk, L strictly lower triangular --------
// One block per chunk and one thread per column of the right-hand side: the D columns of sv = diag(beta) V,
// then the D columns of diag(f) K (f = beta e^G), built as they are read. Substitution along the column,
// which lives in registers (C unrolled), with L's entries read from shared memory (all threads one
// address: a broadcast); no thread reads another's column, so it needs no barrier.
// kTranspose solves (I + L)^T dR = dX instead (the backward): with the rows in reverse order, (I + L)^T is
// unit lower triangular too, with entries L'[t][s] = L[C-1-s][C-1-t], so the same substitution serves. It
// writes dR, and the gradients that building the right-hand side owes: dK = diag(f) dR_K and
// df_t = dR_K[t] . k_t.
template <typename T, int C, int D, bool kTranspose>
__global__ void __launch_bounds__(2 * D) GdnSolveKernel(const T* l, const T* sv, const T* k, const T* f,
                                                        const T* dx, T* out, T* dk, T* df) {
  constexpr int W = 2 * D;
  static_assert(C >= D, "the row sums reuse L's tile");
  __shared__ T Ls[C * C];
  const int64_t chunk = blockIdx.x;
  const T* lc = l + chunk * C * C;
  for (int i = threadIdx.x; i < C * C; i += W) {
    Ls[i] = kTranspose ? lc[(C - 1 - i % C) * C + (C - 1 - i / C)] : lc[i];
  }
  const int j = threadIdx.x;
  const bool key = j >= D;  // a column of diag(f) K
  auto row = [](int t) { return kTranspose ? C - 1 - t : t; };
  auto at = [&](int t) { return (chunk * C + row(t)) * D + (key ? j - D : j); };  // in [C][D] operands
  T col[C];
#pragma unroll
  for (int t = 0; t < C; ++t) {
    if constexpr (kTranspose) {
      col[t] = dx[(chunk * C + row(t)) * W + j];
    } else {
      col[t] = key ? f[chunk * C + t] * k[at(t)] : sv[at(t)];
    }
  }
  __syncthreads();
#pragma unroll
  for (int t = 1; t < C; ++t) {
    T acc = col[t];
#pragma unroll
    for (int s = 0; s < t; ++s) acc -= Ls[t * C + s] * col[s];
    col[t] = acc;
  }
#pragma unroll
  for (int t = 0; t < C; ++t) out[(chunk * C + row(t)) * W + j] = col[t];
  if constexpr (kTranspose) {
    __syncthreads();  // L's tile is free: it takes the products dR_K[t][i] k_t[i] for the row sums
#pragma unroll
    for (int t = 0; t < C; ++t) {
      if (key) {
        dk[at(t)] = f[chunk * C + row(t)] * col[t];
        Ls[row(t) * D + j - D] = col[t] * k[at(t)];
      }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < C; t += W) {
      T sum = 0;
      for (int i = 0; i < D; ++i) sum += Ls[t * D + i];
      df[chunk * C + t] = sum;
    }
  }
}

template <typename T, int C, int D>
cudaError_t LaunchGdnSolve(int64_t chunks, const void* l, const void* sv, const void* k, const void* f,
                           const void* dx, void* out, void* dk, void* df, cudaStream_t stream) {
  const auto* lt = static_cast<const T*>(l);
  const auto* svt = static_cast<const T*>(sv);
  const auto* kt = static_cast<const T*>(k);
  const auto* ft = static_cast<const T*>(f);
  if (dx != nullptr) {
    GdnSolveKernel<T, C, D, true><<<static_cast<unsigned>(chunks), 2 * D, 0, stream>>>(
        lt, svt, kt, ft, static_cast<const T*>(dx), static_cast<T*>(out), static_cast<T*>(dk), static_cast<T*>(df));
  } else {
    GdnSolveKernel<T, C, D, false><<<static_cast<unsigned>(chunks), 2 * D, 0, stream>>>(
        lt, svt, kt, ft, nullptr, static_cast<T*>(out), nullptr, nullptr);
  }
  return cudaGetLastError();
}

// ---- GDN's UT-transform matrix: L[t][s] = beta_t exp(G_t - G_s) (k_t . k_s) for s < t, else 0 -----------
// One block per chunk on CUDA cores (the ChunkOutput kernels' register tiles). Replaces a product, the
// masked decays (three ops) and two scalings, each with its backward, by one kernel each way.
// Stages chunk `chunk`'s keys (padded rows), G and beta in shared memory and returns this thread's tile of
// the Gram matrix M = K K^T in m.
template <typename T, int C, int D>
__device__ void GdnGram(int64_t chunk, const T* k, const T* g, const T* beta, T* Kc, T* G, T* Beta,
                        T (&m)[ThreadTile<C, C>::kRows][ThreadTile<C, C>::kCols]) {
  constexpr int LD = D + 1;
  LoadTile(Kc, k + chunk * C * D, C, D);
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = g[chunk * C + i];
    Beta[i] = beta[chunk * C + i];
  }
  __syncthreads();
  TileMatMul<C, C, D>([&](int t, int i) { return Kc[t * LD + i]; }, [&](int i, int s) { return Kc[s * LD + i]; }, m);
}

template <typename T, int C, int D>
__global__ void GdnMatrixForwardKernel(const T* k, const T* g, const T* beta, T* l) {
  extern __shared__ unsigned char smem_raw[];
  T* Kc = reinterpret_cast<T*>(smem_raw);  // [C][D + 1]
  T* G = Kc + C * (D + 1);                  // [C]
  T* Beta = G + C;                          // [C]
  const int64_t chunk = blockIdx.x;
  using TT = ThreadTile<C, C>;
  T m[TT::kRows][TT::kCols] = {};
  GdnGram<T, C, D>(chunk, k, g, beta, Kc, G, Beta, m);
  ForEachOutput<TT>(m, [&](int t, int s, T kk) {
    l[chunk * C * C + t * C + s] = s < t ? Beta[t] * exp(G[t] - G[s]) * kk : T(0);
  });
}

// With E = exp(G_t - G_s), M = K K^T and R[t][s] = dL E M (s < t):
//   dbeta_t = sum_s R[t][s]        dG_t = beta_t sum_s R[t][s] - sum_t' beta_t' R[t'][t]
//   dM = dL beta_t E (s < t)       dK = (dM + dM^T) K
template <typename T, int C, int D>
__global__ void GdnMatrixBackwardKernel(const T* k, const T* g, const T* beta, const T* dl, T* dk, T* dg, T* dbeta) {
  extern __shared__ unsigned char smem_raw[];
  constexpr int LD = D + 1, LC = C + 1;
  T* Kc = reinterpret_cast<T*>(smem_raw);  // [C][LD]
  T* dM = Kc + C * LD;                      // [C][LC]
  T* R = dM + C * LC;                       // [C][LC]
  T* G = R + C * LC;                        // [C]
  T* Beta = G + C;                          // [C]
  const int64_t chunk = blockIdx.x;
  {
    using TT = ThreadTile<C, C>;
    T m[TT::kRows][TT::kCols] = {};
    GdnGram<T, C, D>(chunk, k, g, beta, Kc, G, Beta, m);
    ForEachOutput<TT>(m, [&](int t, int s, T kk) {
      const T de = s < t ? dl[chunk * C * C + t * C + s] * exp(G[t] - G[s]) : T(0);
      dM[t * LC + s] = de * Beta[t];
      R[t * LC + s] = de * kk;
    });
  }
  __syncthreads();
  for (int t = threadIdx.x; t < C; t += blockDim.x) {  // one thread per row (and per column)
    T row = 0, col = 0;
    for (int s = 0; s < C; ++s) {
      row += R[t * LC + s];
      col += Beta[s] * R[s * LC + t];
    }
    dbeta[chunk * C + t] = row;
    dg[chunk * C + t] = Beta[t] * row - col;
  }
  using TT = ThreadTile<C, D>;
  T acc[TT::kRows][TT::kCols] = {};
  TileMatMul<C, D, C>([&](int t, int s) { return dM[t * LC + s] + dM[s * LC + t]; },
                      [&](int s, int i) { return Kc[s * LD + i]; }, acc);
  StoreThreadTile<TT>(acc, dk + chunk * C * D, D);
}

template <typename T, int C, int D>
cudaError_t GdnMatrix(int64_t chunks, const void* k, const void* g, const void* beta, const void* dl, void* l_or_dk,
                      void* dg, void* dbeta, cudaStream_t stream) {
  constexpr size_t fwd_smem = sizeof(T) * (C * (D + 1) + 2 * C);
  constexpr size_t bwd_smem = sizeof(T) * (C * (D + 1) + 2 * C * (C + 1) + 2 * C);
  static const cudaError_t attr = cudaFuncSetAttribute(GdnMatrixBackwardKernel<T, C, D>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, bwd_smem);
  if (attr != cudaSuccess) return attr;
  const auto* kt = static_cast<const T*>(k);
  const auto* gt = static_cast<const T*>(g);
  const auto* bt = static_cast<const T*>(beta);
  if (dl == nullptr) {
    GdnMatrixForwardKernel<T, C, D><<<static_cast<unsigned>(chunks), kScanThreads, fwd_smem, stream>>>(
        kt, gt, bt, static_cast<T*>(l_or_dk));
  } else {
    GdnMatrixBackwardKernel<T, C, D><<<static_cast<unsigned>(chunks), kScanThreads, bwd_smem, stream>>>(
        kt, gt, bt, static_cast<const T*>(dl), static_cast<T*>(l_or_dk), static_cast<T*>(dg), static_cast<T*>(dbeta));
  }
  return cudaGetLastError();
}

template <typename F>
cudaError_t ForActDType(ActDType dtype, F&& f) {
  switch (dtype) {
    case ActDType::kBF16:
      return f(__nv_bfloat16{});
    case ActDType::kF32:
      return f(float{});
    case ActDType::kF64:
      return f(double{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool ChunkOutputSupported(bool f64, int chunk, int head_dim) {
  return f64 ? (chunk == 16 && head_dim == 8) : (chunk == 64 && head_dim == 64);
}

cudaError_t ChunkOutputForward(bool f64, int chunk, int head_dim, int64_t chunks, const void* q, const void* k,
                               const void* u, const void* g, const void* s0, void* out, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim)) return cudaErrorInvalidValue;
  return f64 ? ChunkForward<double, 16, 8>(chunks, q, k, u, g, s0, out, stream)
             : ChunkForwardTc(chunks, q, k, u, g, s0, out, stream);
}

cudaError_t ChunkOutputBackward(bool f64, int chunk, int head_dim, int64_t chunks, const void* q, const void* k,
                                const void* u, const void* g, const void* s0, const void* dout, void* dq, void* dk,
                                void* du, void* dg, void* ds0, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim)) return cudaErrorInvalidValue;
  return f64 ? ChunkBackward<double, 16, 8>(chunks, q, k, u, g, s0, dout, dq, dk, du, dg, ds0, stream)
             : ChunkBackwardTc(chunks, q, k, u, g, s0, dout, dq, dk, du, dg, ds0, stream);
}

cudaError_t GdnStatesForward(bool f64, int chunk, int head_dim, int64_t heads, int chunks, const void* x,
                             const void* k_end, const void* decay, const void* initial, void* s0, void* u,
                             void* final_state, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim)) return cudaErrorInvalidValue;
  return f64 ? LaunchGdnStates<double, 16, 8, false>(heads, chunks, x, k_end, decay, nullptr, nullptr, initial, s0, u,
                                                     final_state, stream)
             : LaunchGdnStates<float, 64, 64, false>(heads, chunks, x, k_end, decay, nullptr, nullptr, initial, s0, u,
                                                     final_state, stream);
}

cudaError_t GdnStatesBackward(bool f64, int chunk, int head_dim, int64_t heads, int chunks, const void* x,
                              const void* k_end, const void* decay, const void* gs0, const void* gu,
                              const void* dfinal, void* ds_next, void* du, void* dinitial, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim)) return cudaErrorInvalidValue;
  return f64 ? LaunchGdnStates<double, 16, 8, true>(heads, chunks, x, k_end, decay, gu, gs0, dfinal, ds_next, du,
                                                    dinitial, stream)
             : LaunchGdnStates<float, 64, 64, true>(heads, chunks, x, k_end, decay, gu, gs0, dfinal, ds_next, du,
                                                    dinitial, stream);
}

cudaError_t GdnMatrixForward(bool f64, int chunk, int head_dim, int64_t chunks, const void* k, const void* g,
                             const void* beta, void* l, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim)) return cudaErrorInvalidValue;
  return f64 ? GdnMatrix<double, 16, 8>(chunks, k, g, beta, nullptr, l, nullptr, nullptr, stream)
             : GdnMatrix<float, 64, 64>(chunks, k, g, beta, nullptr, l, nullptr, nullptr, stream);
}

cudaError_t GdnMatrixBackward(bool f64, int chunk, int head_dim, int64_t chunks, const void* k, const void* g,
                              const void* beta, const void* dl, void* dk, void* dg, void* dbeta, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim) || dl == nullptr) return cudaErrorInvalidValue;
  return f64 ? GdnMatrix<double, 16, 8>(chunks, k, g, beta, dl, dk, dg, dbeta, stream)
             : GdnMatrix<float, 64, 64>(chunks, k, g, beta, dl, dk, dg, dbeta, stream);
}

cudaError_t GdnSolveForward(bool f64, int chunk, int head_dim, int64_t chunks, const void* l, const void* sv,
                            const void* k, const void* f, void* x, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim)) return cudaErrorInvalidValue;
  return f64 ? LaunchGdnSolve<double, 16, 8>(chunks, l, sv, k, f, nullptr, x, nullptr, nullptr, stream)
             : LaunchGdnSolve<float, 64, 64>(chunks, l, sv, k, f, nullptr, x, nullptr, nullptr, stream);
}

cudaError_t GdnSolveBackward(bool f64, int chunk, int head_dim, int64_t chunks, const void* l, const void* k,
                             const void* f, const void* dx, void* dr, void* dk, void* df, cudaStream_t stream) {
  if (!ChunkOutputSupported(f64, chunk, head_dim) || dx == nullptr) return cudaErrorInvalidValue;
  return f64 ? LaunchGdnSolve<double, 16, 8>(chunks, l, nullptr, k, f, dx, dr, dk, df, stream)
             : LaunchGdnSolve<float, 64, 64>(chunks, l, nullptr, k, f, dx, dr, dk, df, stream);
}

cudaError_t SiluMulForward(ActDType dtype, const GateShape& s, const void* gate, const void* x, void* out,
                           cudaStream_t stream) {
  return ForActDType(dtype, [&](auto t) { return SiluMul<decltype(t)>(s, gate, x, nullptr, out, nullptr, stream); });
}

cudaError_t SiluMulBackward(ActDType dtype, const GateShape& s, const void* gate, const void* x, const void* dout,
                            void* dgate, void* dx, cudaStream_t stream) {
  return ForActDType(dtype, [&](auto t) { return SiluMul<decltype(t)>(s, gate, x, dout, dx, dgate, stream); });
}

// attn and v bf16 or fp32 with lin fp32, or all three fp64.
template <typename F>
cudaError_t ForCombineTypes(ActDType attn_dtype, ActDType v_dtype, F&& f) {
  if ((attn_dtype == ActDType::kF64) != (v_dtype == ActDType::kF64)) return cudaErrorInvalidValue;
  if (v_dtype == ActDType::kF64) return f(double{}, double{}, double{});
  return ForActDType(attn_dtype, [&](auto a) {
    return ForActDType(v_dtype, [&](auto x) {
      if constexpr (std::is_same_v<decltype(a), double> || std::is_same_v<decltype(x), double>) {
        return cudaErrorInvalidValue;
      } else {
        return f(a, x, float{});
      }
    });
  });
}

cudaError_t CombineMixersForward(ActDType attn_dtype, ActDType v_dtype, const CombineShape& s, const void* attn,
                                 const void* lin, const void* v, const void* skip, const bool* is_attn, void* out,
                                 cudaStream_t stream) {
  return ForCombineTypes(attn_dtype, v_dtype, [&](auto a, auto x, auto l) {
    return Combine<decltype(a), decltype(x), decltype(l)>(s, attn, lin, v, skip, is_attn, nullptr, out, nullptr,
                                                          nullptr, nullptr, nullptr, stream);
  });
}

int64_t CombineWorkspaceBytes(ActDType v_dtype, const CombineShape& s) {
  const int64_t tiles = CombineRowTiles(s), cols = int64_t(s.heads) * s.head_dim;
  return (tiles * cols + ReduceScratchElems(tiles, cols)) * (v_dtype == ActDType::kF64 ? 8 : 4);
}

cudaError_t CombineMixersBackward(ActDType attn_dtype, ActDType v_dtype, const CombineShape& s, const void* v,
                                  const void* skip, const bool* is_attn, const void* dout, void* dattn, void* dlin,
                                  void* dv, void* dskip_cols, void* workspace, cudaStream_t stream) {
  if (dout == nullptr) return cudaErrorInvalidValue;
  return ForCombineTypes(attn_dtype, v_dtype, [&](auto a, auto x, auto l) {
    return Combine<decltype(a), decltype(x), decltype(l)>(s, nullptr, nullptr, v, skip, is_attn, dout, dlin, dattn,
                                                          dv, dskip_cols, workspace, stream);
  });
}

namespace {

// Whether the kernels take this shape, and 4-element accesses the operands (q null where it is not read).
bool ChunkPrepareSupported(const ChunkPrepShape& s, const void* q, const void* k, const void* v, int elem_bytes) {
  const int dh = s.head_dim;
  if (dh < kPrepVec || dh > 32 * kPrepVec || (dh & (dh - 1)) != 0 || s.padded < s.time) return false;
  auto ok = [&](const CombineShape::Strides& st, const void* p) {
    return p == nullptr || (st.b % kPrepVec == 0 && st.t % kPrepVec == 0 && st.h % kPrepVec == 0 &&
                            reinterpret_cast<uintptr_t>(p) % (kPrepVec * elem_bytes) == 0);
  };
  return ok(s.q, q) && ok(s.k, k) && ok(s.v, v);
}

// Calls launch(TI{}, TL{}) for the operands' dtype TI and its accumulation type TL (bf16 and fp32 with
// fp32, fp64 with fp64), once the shape and the operands pass ChunkPrepareSupported; nothing to do for an
// empty shape.
template <typename F>
cudaError_t ForChunkPrepare(ActDType dtype, const ChunkPrepShape& s, const void* q, const void* k, const void* v,
                            F&& launch) {
  if (PrepUnits(s) == 0) return cudaSuccess;
  return ForActDType(dtype, [&](auto t) {
    using TI = decltype(t);
    if (!ChunkPrepareSupported(s, q, k, v, sizeof(TI))) return cudaErrorInvalidValue;
    launch(t, typename Acc<TI>::type{});
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t ChunkPrepareForward(ActDType in_dtype, const ChunkPrepShape& s, const void* q, const void* k,
                                const void* v, const void* dt, const void* to_end, void* q32, void* k32, void* u,
                                void* kend, cudaStream_t stream) {
  return ForChunkPrepare(in_dtype, s, q, k, v, [&](auto ti, auto tl) {
    using TI = decltype(ti);
    using TL = decltype(tl);
    ChunkPrepForwardKernel<TI, TL><<<PrepBlocks(s), kPrepThreads, 0, stream>>>(
        s, static_cast<const TI*>(q), static_cast<const TI*>(k), static_cast<const TI*>(v),
        static_cast<const TL*>(dt), static_cast<const TL*>(to_end), static_cast<TL*>(q32), static_cast<TL*>(k32),
        static_cast<TL*>(u), static_cast<TL*>(kend));
  });
}

cudaError_t ChunkPrepareBackward(ActDType in_dtype, const ChunkPrepShape& s, const void* k, const void* v,
                                 const void* dt, const void* to_end, const void* dq32, const void* dk32,
                                 const void* du, const void* dkend, void* dq, void* dk, void* dv, void* ddt,
                                 void* dto_end, cudaStream_t stream) {
  return ForChunkPrepare(in_dtype, s, nullptr, k, v, [&](auto ti, auto tl) {
    using TI = decltype(ti);
    using TL = decltype(tl);
    ChunkPrepBackwardKernel<TI, TL><<<PrepBlocks(s), kPrepThreads, 0, stream>>>(
        s, static_cast<const TI*>(k), static_cast<const TI*>(v), static_cast<const TL*>(dt),
        static_cast<const TL*>(to_end), static_cast<const TL*>(dq32), static_cast<const TL*>(dk32),
        static_cast<const TL*>(du), static_cast<const TL*>(dkend), static_cast<TI*>(dq), static_cast<TI*>(dk),
        static_cast<TI*>(dv), static_cast<TL*>(ddt), static_cast<TL*>(dto_end));
  });
}

cudaError_t ApplyRope(ActDType dtype, const RopeShape& r, const void* x, const float* cos, const float* sin,
                      void* out, bool inverse, cudaStream_t stream) {
  return ForActDType(dtype, [&](auto t) { return Rope<decltype(t)>(r, x, cos, sin, out, inverse, stream); });
}

bool NormColsSupported(int cols) { return cols >= 1 && cols <= 1024 * kMaxColsPerThread; }

int64_t NormWorkspaceBytes(NormTypes t, const NormShape& s) {
  return (NormUnits(s) * s.cols + ReduceScratchElems(NormUnits(s), s.cols)) * (t == NormTypes::kF64 ? 8 : 4);
}

cudaError_t RmsNormForward(NormTypes t, const NormShape& s, const void* x, const void* w, void* y, void* rstd,
                           cudaStream_t stream) {
  switch (t) {
    case NormTypes::kF32ToF32:
      return NormForward<float, float, float>(s, x, w, y, rstd, stream);
    case NormTypes::kF32ToBF16:
      return NormForward<float, __nv_bfloat16, float>(s, x, w, y, rstd, stream);
    case NormTypes::kF64:
      return NormForward<double, double, double>(s, x, w, y, rstd, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t RmsNormBackward(NormTypes t, const NormShape& s, const void* x, const void* w, const void* dy,
                            const void* rstd, void* dx, void* dw, void* workspace, cudaStream_t stream) {
  switch (t) {
    case NormTypes::kF32ToF32:
      return NormBackward<float, float, float>(s, x, w, dy, rstd, dx, dw, workspace, stream);
    case NormTypes::kF32ToBF16:
      return NormBackward<float, __nv_bfloat16, float>(s, x, w, dy, rstd, dx, dw, workspace, stream);
    case NormTypes::kF64:
      return NormBackward<double, double, double>(s, x, w, dy, rstd, dx, dw, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

bool ConvWidthSupported(int width) { return width >= 1 && width <= kMaxWidth; }

cudaError_t CausalConvForward(ActDType dtype, const ConvShape& s, const void* x, const void* w, const void* bias,
                              void* out, cudaStream_t stream) {
  switch (dtype) {
    case ActDType::kBF16:
      return Forward<__nv_bfloat16, float>(s, x, w, bias, out, stream);
    case ActDType::kF32:
      return Forward<float, float>(s, x, w, bias, out, stream);
    case ActDType::kF64:
      return Forward<double, double>(s, x, w, bias, out, stream);
  }
  return cudaErrorInvalidValue;
}

int64_t ConvWorkspaceBytes(ActDType dtype, const ConvShape& s) {
  const int64_t tiles = (s.rows / s.time) * ((s.time + kTimeTile - 1) / kTimeTile);
  const int64_t cols = static_cast<int64_t>(s.channels) * (s.width + 1);
  return (tiles * cols + ReduceScratchElems(tiles, cols)) * (dtype == ActDType::kF64 ? 8 : 4);
}

cudaError_t CausalConvBackward(ActDType dtype, const ConvShape& s, const void* x, const void* w, const void* dout,
                               void* dx, void* dw_and_bias, void* workspace, cudaStream_t stream) {
  switch (dtype) {
    case ActDType::kBF16:
      return Backward<__nv_bfloat16, float>(s, x, w, dout, dx, dw_and_bias, workspace, stream);
    case ActDType::kF32:
      return Backward<float, float>(s, x, w, dout, dx, dw_and_bias, workspace, stream);
    case ActDType::kF64:
      return Backward<double, double>(s, x, w, dout, dx, dw_and_bias, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace oryx::train::cuda
