// The shared causal conv fused with its activation, RoPE of the keys, the bf16 KV cache append and RoPE
// of the attention queries; and the conv window update after it. Parallel over (row, channel pair).
#include <algorithm>

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

// One thread per (row, head, pair i / i + half of the head's features): RoPE rotates exactly those two
// (half = dh / 2 when it applies; dh is even then), so each conv output is computed once and the angle once.
// Rows r = blockIdx.y, blockIdx.y + gridDim.y, ...
__global__ void ConvRopeAppendKernel(ConvRopeAppendParams p) {
  AfterPrevious();
  const int dh = p.dims.head_dim, half = (dh + 1) / 2, HD = p.dims.heads * dh;
  const int pair = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (pair >= p.dims.heads * half) return;
  const int i = pair % half, c_lo = (pair / half) * dh + i, c_hi = c_lo + half;
  const bool has_hi = i + half < dh, rope = p.dims.rope_theta > 0;
  const int64_t P = p.dims.proj_width;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const SeqDesc s = p.seqs_ptr[p.row_seq_ptr[r]];
    const int64_t t = r - s.row, pos = s.pos + t;
    float sn = 0.f, cs = 1.f;
    if (rope) RopeAngle(i, dh, pos, p.dims.rope_theta, p.maybe_rope_freq_ptr, &sn, &cs);
    const float k_lo = ConvAt(p, s, t, c_lo), v_lo = ConvAt(p, s, t, HD + c_lo);
    const float k_hi = has_hi ? ConvAt(p, s, t, c_hi) : 0.f, v_hi = has_hi ? ConvAt(p, s, t, HD + c_hi) : 0.f;
    float* kv = p.kv_ptr + r * 2 * HD;
    kv[c_lo] = k_lo, kv[HD + c_lo] = v_lo;
    if (has_hi) kv[c_hi] = k_hi, kv[HD + c_hi] = v_hi;
    if (s.kv_cap > 0) {
      bf16* key = KeyRows(s, p.layer, HD).Row(pos);
      bf16* value = ValueRows(s, p.layer, HD).Row(pos);
      key[c_lo] = __float2bfloat16(rope ? k_lo * cs - k_hi * sn : k_lo);
      value[c_lo] = __float2bfloat16(v_lo);
      if (has_hi) {
        key[c_hi] = __float2bfloat16(rope ? k_hi * cs + k_lo * sn : k_hi);
        value[c_hi] = __float2bfloat16(v_hi);
      }
    }
    if (p.row_mode_ptr[r] != 0) {
      const float* q = p.proj_ptr + r * P + P - HD;  // q_attn: the last HD columns
      const float q_lo = q[c_lo], q_hi = has_hi ? q[c_hi] : 0.f;
      float* qa = p.qa_ptr + r * HD;
      const float scale = AttnQueryScale(p.dims.attn_log_scale_base, pos);
      qa[c_lo] = (rope ? q_lo * cs - q_hi * sn : q_lo) * scale;
      if (has_hi) qa[c_hi] = (rope ? q_hi * cs + q_lo * sn : q_hi) * scale;
    }
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
  const int64_t pairs = p.dims.heads * ((p.dims.head_dim + 1) / 2);
  if (p.rows == 0 || pairs == 0) return;
  const dim3 grid(static_cast<unsigned>(CeilDiv(pairs, kThreads)), static_cast<unsigned>(std::min<int64_t>(p.rows, 65535)));
  LaunchAfterPrevious(ConvRopeAppendKernel, grid, kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void ConvWindowUpdate(const ConvWindowUpdateParams& p, cudaStream_t stream) {
  const int64_t n = p.seqs * 2 * p.dims.heads * p.dims.head_dim;
  if (n == 0 || p.dims.conv_width == 1) return;
  LaunchAfterPrevious(ConvWindowUpdateKernel, static_cast<unsigned>(CeilDiv(n, kThreads)), kThreads, 0, stream, p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
