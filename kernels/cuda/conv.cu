// The shared causal conv fused with its activation, RoPE of the keys, the bf16 KV cache append and RoPE
// of the attention queries; and the conv window update after it. Parallel over (row, channel).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// Conv output of channel `ch` for token t of the sequence's span (before the activation).
__device__ __forceinline__ float ConvAt(const ConvRopeAppendParams& p, const SeqDesc& s, int64_t t, int64_t ch) {
  const int64_t w = p.dims.conv_width, W = w - 1, C = 2LL * p.dims.heads * p.dims.head_dim, P = p.dims.proj_width;
  const float* window = s.conv + int64_t(p.layer) * W * C;
  float acc = p.conv_bias_ptr[ch];
  for (int64_t j = 0; j < w; ++j) {
    const int64_t src = t - W + j;  // token index inside the span; negative: the window
    const float in = src >= 0 ? p.proj_ptr[(s.row + src) * P + ch] : window[(W + src) * C + ch];
    acc += p.conv_weight_ptr[ch * w + j] * in;
  }
  return p.dims.conv_silu ? Silu(acc) : acc;
}

__global__ void ConvRopeAppendKernel(ConvRopeAppendParams p) {
  AfterPrevious();
  const int64_t dh = p.dims.head_dim, HD = p.dims.heads * dh, P = p.dims.proj_width;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.rows * HD) return;
  const int64_t r = idx / HD, c = idx % HD, i = c % dh, half = dh / 2;
  const SeqDesc s = p.seqs_ptr[p.row_seq_ptr[r]];
  const int64_t t = r - s.row, pos = s.pos + t;
  const bool rope = p.dims.rope_theta > 0;
  const int64_t partner = i < half ? c + half : c - half;
  const float k = ConvAt(p, s, t, c), v = ConvAt(p, s, t, HD + c);
  p.kv_ptr[r * 2 * HD + c] = k;
  p.kv_ptr[r * 2 * HD + HD + c] = v;
  if (s.kv_cap > 0) {
    const float k_rot = rope ? Rotate(k, ConvAt(p, s, t, partner), i, dh, pos, p.dims.rope_theta, p.maybe_rope_freq_ptr) : k;
    const int64_t at = (int64_t(p.layer) * s.kv_cap + pos) * HD + c;
    s.k_cache[at] = __float2bfloat16(k_rot);
    s.v_cache[at] = __float2bfloat16(v);
  }
  if (p.row_mode_ptr[r] != 0) {
    const float* q = p.proj_ptr + r * P + P - HD;  // q_attn: the last HD columns
    p.qa_ptr[r * HD + c] = rope ? Rotate(q[c], q[partner], i, dh, pos, p.dims.rope_theta, p.maybe_rope_freq_ptr) : q[c];
  }
}

__global__ void ConvWindowUpdateKernel(ConvWindowUpdateParams p) {
  constexpr int kMaxWindow = 16;
  AfterPrevious();
  const int64_t C = 2LL * p.dims.heads * p.dims.head_dim, W = p.dims.conv_width - 1, P = p.dims.proj_width;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.seqs * C) return;
  const int64_t b = idx / C, ch = idx % C;
  const SeqDesc s = p.seqs_ptr[b];
  float* window = s.conv + int64_t(p.layer) * W * C;
  float old[kMaxWindow];
  for (int64_t j = 0; j < W; ++j) old[j] = window[j * C + ch];
  // Element m of (old window ++ span inputs).
  auto at = [&](int64_t m) { return m < W ? old[m] : p.proj_ptr[(s.row + m - W) * P + ch]; };
  if (s.maybe_span_inputs != nullptr) {
    float* hist = s.maybe_span_inputs + int64_t(p.layer) * (W + s.len) * C;
    for (int64_t m = 0; m < W + s.len; ++m) hist[m * C + ch] = at(m);
  }
  for (int64_t j = 0; j < W; ++j) window[j * C + ch] = at(s.len + j);
}

}  // namespace

void ConvRopeAppend(const ConvRopeAppendParams& p, cudaStream_t stream) {
  const int64_t n = p.rows * p.dims.heads * p.dims.head_dim;
  if (n == 0) return;
  LaunchAfterPrevious(ConvRopeAppendKernel, static_cast<unsigned>(CeilDiv(n, kThreads)), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void ConvWindowUpdate(const ConvWindowUpdateParams& p, cudaStream_t stream) {
  const int64_t n = p.seqs * 2 * p.dims.heads * p.dims.head_dim;
  if (n == 0 || p.dims.conv_width == 1) return;
  LaunchAfterPrevious(ConvWindowUpdateKernel, static_cast<unsigned>(CeilDiv(n, kThreads)), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
