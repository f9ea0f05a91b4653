// CUDA kernels of the trainer's fused ops (no LibTorch here; train/cuda_ops.cc wraps them for autograd).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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

// out[b, t, c] = bias[c] + sum_j w[c, j] x[b, t - (W-1) + j, c]. One thread per output: a block per row
// r = b * time + t (grid.x) and tile of channels (grid.y), consecutive threads along c.
template <typename T, typename W>
__global__ void CausalConvForwardKernel(const T* x, int64_t ld_x, const W* w, const W* bias, T* out, int64_t rows,
                                        int time, int channels, int width) {
  using A = typename Acc<T>::type;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.x;
  if (c >= channels) return;
  const int t = static_cast<int>(blockIdx.x % static_cast<unsigned>(time));
  A acc = static_cast<A>(bias[c]);
  for (int j = 0; j < width; ++j) {
    const int tt = t - (width - 1) + j;
    if (tt >= 0) acc += static_cast<A>(w[c * width + j]) * static_cast<A>(x[(r - t + tt) * ld_x + c]);
  }
  out[r * channels + c] = static_cast<T>(acc);
}

// dx[b, t, c] = sum_j w[c, j] dout[b, t + (W-1) - j, c].
template <typename T, typename W>
__global__ void CausalConvInputGradKernel(const T* dout, const W* w, T* dx, int64_t rows, int time, int channels,
                                          int width) {
  using A = typename Acc<T>::type;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.x;
  if (c >= channels) return;
  const int t = static_cast<int>(blockIdx.x % static_cast<unsigned>(time));
  A acc = 0;
  for (int j = 0; j < width; ++j) {
    const int tt = t + (width - 1) - j;
    if (tt < time) acc += static_cast<A>(w[c * width + j]) * static_cast<A>(dout[(r - t + tt) * channels + c]);
  }
  dx[r * channels + c] = static_cast<T>(acc);
}

// dw[c, j] += sum over a strip of rows of dout[r, c] x[r - (W-1) + j, c]; dbias[c] += sum of dout[r, c].
// Blocks tile (channels, strips of rows); each thread sums one channel over its strip, then adds atomically.
constexpr int kMaxWidth = 8;
template <typename T, typename W>
__global__ void CausalConvWeightGradKernel(const T* x, int64_t ld_x, const T* dout, W* dw, W* dbias, int64_t rows,
                                           int time, int channels, int width, int64_t strip) {
  using A = typename Acc<T>::type;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t begin = blockIdx.y * strip;
  const int64_t end = begin + strip < rows ? begin + strip : rows;
  A acc[kMaxWidth] = {};
  A acc_bias = 0;
  int t = static_cast<int>(begin % time);  // advanced with r, no division per row
  for (int64_t r = begin; r < end; ++r, t = t + 1 == time ? 0 : t + 1) {
    const A d = static_cast<A>(dout[r * channels + c]);
    acc_bias += d;
#pragma unroll
    for (int j = 0; j < kMaxWidth; ++j) {
      const int tt = t - (width - 1) + j;
      if (j < width && tt >= 0) acc[j] += d * static_cast<A>(x[(r - t + tt) * ld_x + c]);
    }
  }
  for (int j = 0; j < width; ++j) atomicAdd(&dw[c * width + j], static_cast<W>(acc[j]));
  atomicAdd(&dbias[c], static_cast<W>(acc_bias));
}

constexpr int kThreads = 128;

// grid.x: rows (up to 2^31 - 1), grid.y: channel tiles.
dim3 Grid(int channels, int64_t rows) {
  return dim3(static_cast<unsigned>(rows), static_cast<unsigned>((channels + kThreads - 1) / kThreads));
}

template <typename T, typename W>
cudaError_t Forward(const ConvShape& s, const void* x, const void* w, const void* bias, void* out,
                    cudaStream_t stream) {
  CausalConvForwardKernel<T, W><<<Grid(s.channels, s.rows), kThreads, 0, stream>>>(
      static_cast<const T*>(x), s.ld_x, static_cast<const W*>(w), static_cast<const W*>(bias), static_cast<T*>(out),
      s.rows, s.time, s.channels, s.width);
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t Backward(const ConvShape& s, const void* x, const void* w, const void* dout, void* dx, void* dw,
                     void* dbias, cudaStream_t stream) {
  CausalConvInputGradKernel<T, W><<<Grid(s.channels, s.rows), kThreads, 0, stream>>>(
      static_cast<const T*>(dout), static_cast<const W*>(w), static_cast<T*>(dx), s.rows, s.time, s.channels,
      s.width);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int64_t strip = s.rows / 128 > 65535 ? (s.rows + 65534) / 65535 : 128;  // grid.y <= 65535
  const dim3 grid(static_cast<unsigned>((s.channels + kThreads - 1) / kThreads),
                  static_cast<unsigned>((s.rows + strip - 1) / strip));
  CausalConvWeightGradKernel<T, W><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(x), s.ld_x, static_cast<const T*>(dout), static_cast<W*>(dw), static_cast<W*>(dbias),
      s.rows, s.time, s.channels, s.width, strip);
  return cudaGetLastError();
}

// ---- RMSNorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over each row of `cols` ----------
// A block normalises kRowsPerBlock rows one after another; its threads stride over the columns. The
// backward's weight gradient is summed over the block's rows in registers, then added atomically.

constexpr int kRowsPerBlock = 16;
constexpr int kMaxColsPerThread = 16;

template <typename A>
__device__ A BlockSum(A v, A* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // shared is reused from the previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  A total = 0;
  for (int i = 0; i < warps; ++i) total += shared[i];
  return total;
}

template <typename TX, typename TY, typename TW>
__global__ void RmsNormForwardKernel(const TX* x, const TW* w, TY* y, typename Acc<TX>::type* rstd, int64_t rows,
                                     int cols, double eps) {
  using A = typename Acc<TX>::type;
  __shared__ A shared[32];
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, end = r + kRowsPerBlock; r < end && r < rows;
       ++r) {
    const TX* xr = x + r * cols;
    A v[kMaxColsPerThread];  // unrolled loops with fixed indices keep these in registers
    A ss = 0;
#pragma unroll
    for (int n = 0; n < kMaxColsPerThread; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      v[n] = c < cols ? static_cast<A>(xr[c]) : static_cast<A>(0);
      ss += v[n] * v[n];
    }
    const A inv = static_cast<A>(1) / sqrt(BlockSum(ss, shared) / static_cast<A>(cols) + static_cast<A>(eps));
#pragma unroll
    for (int n = 0; n < kMaxColsPerThread; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < cols) y[r * cols + c] = static_cast<TY>(v[n] * inv * static_cast<A>(w[c]));
    }
    if (threadIdx.x == 0) rstd[r] = inv;
  }
}

// dx = rstd * (dy*w - xhat * mean(dy*w * xhat)), dw += sum over rows of dy * xhat, with xhat = x * rstd.
template <typename TX, typename TY, typename TW>
__global__ void RmsNormBackwardKernel(const TX* x, const TW* w, const TY* dy, const typename Acc<TX>::type* rstd,
                                      TX* dx, TW* dw, int64_t rows, int cols) {
  using A = typename Acc<TX>::type;
  __shared__ A shared[32];
  A dw_acc[kMaxColsPerThread] = {};
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock, end = r + kRowsPerBlock; r < end && r < rows;
       ++r) {
    const A inv = rstd[r];
    A xh[kMaxColsPerThread], g[kMaxColsPerThread];
    A dot = 0;
#pragma unroll
    for (int n = 0; n < kMaxColsPerThread; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      xh[n] = g[n] = 0;
      if (c < cols) {
        xh[n] = static_cast<A>(x[r * cols + c]) * inv;
        const A d = static_cast<A>(dy[r * cols + c]);
        g[n] = d * static_cast<A>(w[c]);
        dw_acc[n] += d * xh[n];
      }
      dot += g[n] * xh[n];
    }
    const A mean = BlockSum(dot, shared) / static_cast<A>(cols);
#pragma unroll
    for (int n = 0; n < kMaxColsPerThread; ++n) {
      const int c = threadIdx.x + n * blockDim.x;
      if (c < cols) dx[r * cols + c] = static_cast<TX>(inv * (g[n] - xh[n] * mean));
    }
  }
#pragma unroll
  for (int n = 0; n < kMaxColsPerThread; ++n) {
    const int c = threadIdx.x + n * blockDim.x;
    if (c < cols) atomicAdd(&dw[c], static_cast<TW>(dw_acc[n]));
  }
}

int NormThreads(int cols) {
  // Enough warps that no thread holds more than kMaxColsPerThread columns, at most 1024.
  int threads = 32;
  while (threads < 1024 && (threads < cols / kMaxColsPerThread + (cols % kMaxColsPerThread != 0) || threads < 128) &&
         threads < cols) {
    threads *= 2;
  }
  return threads;
}

template <typename TX, typename TY, typename TW>
cudaError_t NormForward(const NormShape& s, const void* x, const void* w, void* y, void* rstd, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((s.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  RmsNormForwardKernel<TX, TY, TW><<<blocks, NormThreads(s.cols), 0, stream>>>(
      static_cast<const TX*>(x), static_cast<const TW*>(w), static_cast<TY*>(y),
      static_cast<typename Acc<TX>::type*>(rstd), s.rows, s.cols, s.eps);
  return cudaGetLastError();
}

template <typename TX, typename TY, typename TW>
cudaError_t NormBackward(const NormShape& s, const void* x, const void* w, const void* dy, const void* rstd, void* dx,
                         void* dw, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((s.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  RmsNormBackwardKernel<TX, TY, TW><<<blocks, NormThreads(s.cols), 0, stream>>>(
      static_cast<const TX*>(x), static_cast<const TW*>(w), static_cast<const TY*>(dy),
      static_cast<const typename Acc<TX>::type*>(rstd), static_cast<TX*>(dx), static_cast<TW*>(dw), s.rows, s.cols);
  return cudaGetLastError();
}

}  // namespace

bool NormColsSupported(int cols) { return cols >= 1 && cols <= 1024 * kMaxColsPerThread; }

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
                            const void* rstd, void* dx, void* dw, cudaStream_t stream) {
  switch (t) {
    case NormTypes::kF32ToF32:
      return NormBackward<float, float, float>(s, x, w, dy, rstd, dx, dw, stream);
    case NormTypes::kF32ToBF16:
      return NormBackward<float, __nv_bfloat16, float>(s, x, w, dy, rstd, dx, dw, stream);
    case NormTypes::kF64:
      return NormBackward<double, double, double>(s, x, w, dy, rstd, dx, dw, stream);
  }
  return cudaErrorInvalidValue;
}

bool ConvWidthSupported(int width) { return width >= 1 && width <= kMaxWidth; }

cudaError_t CausalConvForward(ConvDType dtype, const ConvShape& s, const void* x, const void* w, const void* bias,
                              void* out, cudaStream_t stream) {
  switch (dtype) {
    case ConvDType::kBF16:
      return Forward<__nv_bfloat16, float>(s, x, w, bias, out, stream);
    case ConvDType::kF32:
      return Forward<float, float>(s, x, w, bias, out, stream);
    case ConvDType::kF64:
      return Forward<double, double>(s, x, w, bias, out, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t CausalConvBackward(ConvDType dtype, const ConvShape& s, const void* x, const void* w, const void* dout,
                               void* dx, void* dw, void* dbias, cudaStream_t stream) {
  switch (dtype) {
    case ConvDType::kBF16:
      return Backward<__nv_bfloat16, float>(s, x, w, dout, dx, dw, dbias, stream);
    case ConvDType::kF32:
      return Backward<float, float>(s, x, w, dout, dx, dw, dbias, stream);
    case ConvDType::kF64:
      return Backward<double, double>(s, x, w, dout, dx, dw, dbias, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace oryx::train::cuda
