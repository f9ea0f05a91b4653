// CUDA kernels of the trainer's fused ops (no LibTorch here; train/cuda_ops.cc wraps them for autograd).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

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

// ---- Column sums of per-tile partials: out[j] = sum_i partial[i][j] -------------------------------------
// One block per column. The conv and RMSNorm backward kernels below write partials instead of adding
// atomically, so every sum is taken in the same order and the gradients do not depend on scheduling.
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

template <typename A, typename W>
__global__ void ReduceColumnsKernel(const A* partial, int64_t n, int64_t cols, W* out) {
  __shared__ A shared[32];
  const int64_t j = blockIdx.x;
  A sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += partial[i * cols + j];
  sum = BlockSum(sum, shared);
  if (threadIdx.x == 0) out[j] = static_cast<W>(sum);
}

template <typename A, typename W>
cudaError_t ReduceColumns(const A* partial, int64_t n, int64_t cols, W* out, cudaStream_t stream) {
  ReduceColumnsKernel<A, W><<<static_cast<unsigned>(cols), 128, 0, stream>>>(partial, n, cols, out);
  return cudaGetLastError();
}

// The causal conv works on tiles of kTimeTile steps of one sequence and kThreads channels (one channel per
// thread, consecutive threads on consecutive channels), sliding a window of the last `width` inputs (or
// the next `width` output gradients) through registers, so each element is loaded once.
constexpr int kMaxWidth = 8;
constexpr int kTimeTile = 32;
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
  for (int t = t0; t < t1; ++t) {
#pragma unroll
    for (int k = 0; k < kMaxWidth - 1; ++k) hist[k] = hist[k + 1];
    hist[kMaxWidth - 1] = static_cast<A>(x[(row0 + t) * ld_x + c]);
    A acc = b;
#pragma unroll
    for (int k = 0; k < kMaxWidth; ++k) acc += wr[k] * hist[kMaxWidth - 1 - k];
    out[(row0 + t) * channels + c] = static_cast<T>(acc);
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
  for (int t = t1 - 1; t >= t0; --t) {
    // next: [dout[t], dout[t+1], ...]
#pragma unroll
    for (int k = kMaxWidth - 1; k > 0; --k) next[k] = next[k - 1];
    next[0] = static_cast<A>(dout[(row0 + t) * channels + c]);
    // prev: [x[t], x[t-1], ..., x[t-(width-1)]]: drop x[t+1], load x[t-(width-1)]
#pragma unroll
    for (int k = 0; k < kMaxWidth - 1; ++k) prev[k] = prev[k + 1];
    const int tp = t - (width - 1);
    const A incoming = tp >= 0 ? static_cast<A>(x[(row0 + tp) * ld_x + c]) : static_cast<A>(0);
#pragma unroll
    for (int k = 0; k < kMaxWidth; ++k) {
      if (k == width - 1) prev[k] = incoming;
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
  return ReduceColumns(static_cast<const A*>(workspace), static_cast<int64_t>(grid.y) * grid.z,
                       static_cast<int64_t>(s.channels) * (s.width + 1), static_cast<W*>(dw_and_bias), stream);
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
  return ReduceColumns(static_cast<const A*>(workspace), NormUnits(s), s.cols, static_cast<TW*>(dw), stream);
}

// ---- RoPE: out[.., i] = x_i c - x_{i+h} s, out[.., i+h] = x_{i+h} c + x_i s (h = dh/2, s negated for the
// backward). One block per (b, t); its threads cover (head, i) pairs.
template <typename T>
__global__ void RopeKernel(const T* x, int64_t sb, int64_t st, int64_t sh, const float* cos, const float* sin,
                           T* out, int time, int heads, int half, float sign) {
  using A = typename Acc<T>::type;
  const int64_t bt = blockIdx.x;
  const int64_t b = bt / time;
  const int t = static_cast<int>(bt - b * time);
  const T* xr = x + b * sb + t * st;
  T* o = out + bt * heads * 2 * half;
  for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
    const int h = j / half, i = j - h * half;
    const A c = static_cast<A>(cos[t * half + i]), s = sign * static_cast<A>(sin[t * half + i]);
    const A x1 = static_cast<A>(xr[h * sh + i]), x2 = static_cast<A>(xr[h * sh + half + i]);
    o[h * 2 * half + i] = static_cast<T>(x1 * c - x2 * s);
    o[h * 2 * half + half + i] = static_cast<T>(x2 * c + x1 * s);
  }
}

template <typename T>
cudaError_t Rope(const RopeShape& r, const void* x, const float* cos, const float* sin, void* out, bool inverse,
                 cudaStream_t stream) {
  const int pairs = r.heads * r.half;
  const int threads = pairs < 1024 ? (pairs + 31) / 32 * 32 : 1024;
  RopeKernel<T><<<static_cast<unsigned>(r.batch * r.time), threads, 0, stream>>>(
      static_cast<const T*>(x), r.sb, r.st, r.sh, cos, sin, static_cast<T*>(out), r.time, r.heads, r.half,
      inverse ? -1.0f : 1.0f);
  return cudaGetLastError();
}

// ---- SiLU-gated product: out = SiLU(g) x; dx = dout SiLU(g), dg = dout x s (1 + g (1 - s)), s = sigmoid(g).
// One pass each way in the accumulation type (LibTorch's silu, mul and their backwards take five kernels and
// round to bf16 between them). Threads over columns, blocks over (column tile, rows).
constexpr int kGateThreads = 256;
constexpr unsigned kGateMaxRowBlocks = 65535;

template <typename T, bool kBackward>
__global__ void SiluMulKernel(GateShape s, const T* gate, const T* x, const T* dout, T* out, T* dgate) {
  using A = typename Acc<T>::type;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= s.cols) return;
  for (int64_t r = blockIdx.y; r < s.rows; r += gridDim.y) {
    const A g = static_cast<A>(gate[r * s.ld_gate + c]), v = static_cast<A>(x[r * s.ld_x + c]);
    const A sig = A(1) / (A(1) + exp(-g));
    const int64_t o = r * s.cols + c;
    if constexpr (kBackward) {
      const A d = static_cast<A>(dout[o]);
      out[o] = static_cast<T>(d * g * sig);                              // dx
      dgate[o] = static_cast<T>(d * v * sig * (A(1) + g * (A(1) - sig)));  // dgate
    } else {
      out[o] = static_cast<T>(g * sig * v);
    }
  }
}

template <typename T>
cudaError_t SiluMul(const GateShape& s, const void* gate, const void* x, const void* dout, void* out, void* dgate,
                    cudaStream_t stream) {
  if (s.rows == 0 || s.cols == 0) return cudaSuccess;
  const dim3 grid((s.cols + kGateThreads - 1) / kGateThreads,
                  static_cast<unsigned>(s.rows < kGateMaxRowBlocks ? s.rows : kGateMaxRowBlocks));
  if (dout == nullptr) {
    SiluMulKernel<T, false><<<grid, kGateThreads, 0, stream>>>(s, static_cast<const T*>(gate), static_cast<const T*>(x),
                                                               nullptr, static_cast<T*>(out), nullptr);
  } else {
    SiluMulKernel<T, true><<<grid, kGateThreads, 0, stream>>>(s, static_cast<const T*>(gate), static_cast<const T*>(x),
                                                              static_cast<const T*>(dout), static_cast<T*>(out),
                                                              static_cast<T*>(dgate));
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

cudaError_t SiluMulForward(ActDType dtype, const GateShape& s, const void* gate, const void* x, void* out,
                           cudaStream_t stream) {
  return ForActDType(dtype, [&](auto t) { return SiluMul<decltype(t)>(s, gate, x, nullptr, out, nullptr, stream); });
}

cudaError_t SiluMulBackward(ActDType dtype, const GateShape& s, const void* gate, const void* x, const void* dout,
                            void* dgate, void* dx, cudaStream_t stream) {
  return ForActDType(dtype, [&](auto t) { return SiluMul<decltype(t)>(s, gate, x, dout, dx, dgate, stream); });
}

cudaError_t ApplyRope(ActDType dtype, const RopeShape& r, const void* x, const float* cos, const float* sin,
                      void* out, bool inverse, cudaStream_t stream) {
  switch (dtype) {
    case ActDType::kBF16:
      return Rope<__nv_bfloat16>(r, x, cos, sin, out, inverse, stream);
    case ActDType::kF32:
      return Rope<float>(r, x, cos, sin, out, inverse, stream);
    case ActDType::kF64:
      return Rope<double>(r, x, cos, sin, out, inverse, stream);
  }
  return cudaErrorInvalidValue;
}

bool NormColsSupported(int cols) { return cols >= 1 && cols <= 1024 * kMaxColsPerThread; }

int64_t NormWorkspaceBytes(NormTypes t, const NormShape& s) {
  return NormUnits(s) * s.cols * (t == NormTypes::kF64 ? 8 : 4);
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
  return tiles * s.channels * (s.width + 1) * (dtype == ActDType::kF64 ? 8 : 4);
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
