// A decode step's mixer in one kernel: ConvRopeAppend, ConvWindowUpdate and Recurrent (conv.cu,
// recurrent.cu) fused for sequences whose span is a single token. One block per (sequence, head, 32 value
// features), the dh/32 blocks of a head forming a thread-block cluster. Every block of a head convolves the
// head's k channels (the recurrence needs all of k) and its own slice of v; once the whole cluster has
// read the windows, each block moves its slice of them past the token, appends its slice of RoPE(k) and v
// to the cache, rotates its slice of an attention row's query, and advances its slice of the state, a
// column per thread-x as RecurrentKernel does. The math is the three kernels', term for term.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kLanes = 32, kGroups = 8;
constexpr int kMaxTaps = 4;  // the widest conv the kernel takes (DecodeMixerApplies): taps and window in registers

template <int kDh>
__global__ void __launch_bounds__(kLanes * kGroups) DecodeMixerKernel(DecodeMixerParams p) {
  constexpr int kKeys = kDh / kGroups;  // per thread: keys y + 8r of column j
  constexpr unsigned kSlices = kDh / kLanes;  // the blocks of a head (its cluster)
  __shared__ float ks[kDh], qs[kDh], vs[kLanes], red[kGroups][kLanes], norms[2], slice_sq;
  if (!p.early_loads) AfterPrevious();
  const int tid = threadIdx.y * kLanes + threadIdx.x, x = threadIdx.x, y = threadIdx.y;
  const int64_t h = blockIdx.y, j0 = int64_t(blockIdx.z) * kLanes, j = j0 + x;
  const int64_t H = p.dims.heads, HD = H * kDh, C = 2 * HD, P = p.dims.proj_width;
  const int64_t w = p.dims.conv_width, W = w - 1;
  const SeqDesc s = p.seqs_ptr[blockIdx.x];
  const int64_t r = s.row, pos = s.pos;
  const float* proj = p.proj_ptr + r * P;
  float* window = s.conv + int64_t(p.layer) * W * C;

  // First the conv's taps, its bias and its window (written only by this layer's mixer), and the head's
  // constants (few, and not to queue behind the state): with them loaded before the wait, the loads after it
  // are only the input projection's outputs, in one round trip.
  const bool conv_thread = tid < kDh + kLanes;
  const int64_t ch = tid < kDh ? h * kDh + tid : HD + h * kDh + j0 + (tid - kDh);
  const float* weight = p.conv_weight_ptr + ch * w;
  float taps[kMaxTaps], past[kMaxTaps], last_tap = 0.f, bias = 0.f;
  if (conv_thread) {
    bias = p.conv_bias_ptr[ch];
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t) {
      if (t < W) {
        taps[t] = weight[t];
        past[t] = window[t * C + ch];
      } else if (t == W) {
        last_tap = weight[t];
      }
    }
  }
  const float a_log = p.a_log_ptr[h], dt_bias = p.dt_bias_ptr[h];  // (exp'd after the wait: no stall here)
  // The row's mode (uploaded with the forward's metadata), RoPE's angle for feature j at this position and
  // the attention query's scale (a double-precision log): none depends on the input projection, so none is
  // left for after the wait.
  const bool rope = p.dims.rope_theta > 0, attention_row = p.row_mode_ptr[r] != 0;
  float rope_cos = 1.f, rope_sin = 0.f, q_scale = 1.f;
  if (rope && threadIdx.y == 0) RopeAngle(j, kDh, pos, p.dims.rope_theta, p.maybe_rope_freq_ptr, &rope_sin, &rope_cos);
  if (attention_row && threadIdx.y == 0) q_scale = AttnQueryScale(p.dims.attn_log_scale_base, pos);
  const float d_skip = p.dims.gdn ? 0.f : p.maybe_d_skip_ptr[h];
  const bool gated = p.maybe_gated_ptr != nullptr;
  const float gate_norm = gated && y == 0 ? p.gate_norm_ptr[j] : 0.f;
  // Then the state slice, so that its loads are in flight during the conv (and, with early loads, during
  // the input projection's tail: only this kernel of the layer, in an earlier step, writes it).
  float* state = s.state + (int64_t(p.layer) * H + h) * kDh * kDh;
  float S[kKeys];
#pragma unroll
  for (int k = 0; k < kKeys; ++k) S[k] = state[(y + kGroups * k) * kDh + j];
  if (p.early_loads) AfterPrevious();
  const float head_in = proj[4 * HD + h], head_in2 = p.dims.gdn ? proj[4 * HD + H + h] : 0.f;  // dt, or beta and alpha
  const float a_exp = expf(a_log);
  const float gate = gated && y == 0 ? proj[p.gate_column + h * kDh + j] : 0.f;

  // The conv of all the head's k channels (threads 0..dh-1) and of this block's v channels (dh..dh+31).
  if (tid < kDh) qs[tid] = proj[2 * HD + h * kDh + tid];  // q_linear
  float conv_in = 0.f;
  if (conv_thread) {
    float acc = bias;
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t) {
      if (t < W) acc += taps[t] * past[t];
    }
    conv_in = proj[ch];
    acc += last_tap * conv_in;
    const float out = p.dims.conv_silu ? Silu(acc) : acc;
    if (tid < kDh) {
      ks[tid] = out;
    } else {
      vs[tid - kDh] = out;
    }
  }
  // Every block of the head has read the windows (and this block's ks, vs, qs are in place): each moves
  // its own slice, k channels j0.. and v channels j0.., past the token, from the registers of the threads
  // that loaded them (a move through memory would be two dependent round trips after the wait).
  ClusterSync();
  __syncthreads();
  const bool own_k = tid >= j0 && tid < j0 + kLanes, own_v = tid >= kDh && tid < kDh + kLanes;
  if (own_k || own_v) {
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t) {
      if (t + 1 < W) window[t * C + ch] = past[t + 1];
    }
    if (W > 0) window[(W - 1) * C + ch] = conv_in;
  }

  // This slice of RoPE(k) and v into the cache; of the rotated attention query.
  if (y == 0) {
    const int64_t partner = j < kDh / 2 ? j + kDh / 2 : j - kDh / 2;
    auto rotate = [&](float self, float other) {
      return j < kDh / 2 ? self * rope_cos - other * rope_sin : self * rope_cos + other * rope_sin;
    };
    if (s.kv_cap > 0) {
      const float k = rope ? rotate(ks[j], ks[partner]) : ks[j];
      const int64_t column = h * kDh + j;
      KeyRows(s, p.layer, HD).Row(pos)[column] = __float2bfloat16(k);
      ValueRows(s, p.layer, HD).Row(pos)[column] = __float2bfloat16(vs[x]);
    }
    if (attention_row) {
      const float* q = proj + P - HD + h * kDh;  // q_attn: the last HD columns
      p.qa_ptr[r * HD + h * kDh + j] = (rope ? rotate(q[j], q[partner]) : q[j]) * q_scale;
    }
  }

  // The recurrence of column j; sums over the 8 key groups through shared memory.
  auto column_sum = [&](float partial) {
    red[y][x] = partial;
    __syncthreads();
    float sum = 0.f;
    for (int g = 0; g < kGroups; ++g) sum += red[g][x];
    __syncthreads();
    return sum;
  };
  const float v = vs[x];
  float out = 0.f;
  if (!p.dims.gdn) {
    const float dt = Softplus(head_in + dt_bias), a = expf(-dt * a_exp);
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      const int i = y + kGroups * k;
      S[k] = a * S[k] + dt * ks[i] * v;
      out += S[k] * qs[i];
    }
    out = column_sum(out) + d_skip * v;
  } else {
    GdnNorms(ks, qs, kDh, tid, norms);
    const float kn_scale = norms[0], qn_scale = norms[1];
    const float beta = Sigmoid(head_in);
    const float alpha = expf(-a_exp * Softplus(head_in2 + dt_bias));
    float kts = 0.f;  // (kn^T S)[j]
#pragma unroll
    for (int k = 0; k < kKeys; ++k) kts += ks[y + kGroups * k] * kn_scale * S[k];
    kts = column_sum(kts);
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      const int i = y + kGroups * k;
      const float kn = ks[i] * kn_scale;
      S[k] = alpha * (S[k] - beta * kn * kts) + beta * kn * v;
      out += S[k] * qs[i] * qn_scale;
    }
    out = column_sum(out);
  }
#pragma unroll
  for (int k = 0; k < kKeys; ++k) state[(y + kGroups * k) * kDh + j] = S[k];
  if (!gated) {
    if (y == 0 && !attention_row) p.out_ptr[r * HD + h * kDh + j] = out;
    return;
  }
  // The gated norm: the head's sum of squares from its blocks' slices, added in rank order in each block.
  if (y == 0) {
    const float sq = WarpSum(out * out);
    if (x == 0) slice_sq = sq;
  }
  ClusterSync();
  if (y == 0) {
    float head_sq = 0.f;
#pragma unroll
    for (unsigned rank = 0; rank < kSlices; ++rank) head_sq += *ClusterPeer(&slice_sq, rank);
    const float scale = rsqrtf(head_sq / kDh + p.dims.norm_eps);
    p.maybe_gated_ptr[r * HD + h * kDh + j] = __float2bfloat16(out * scale * gate_norm * Silu(gate));
  }
  if constexpr (kSlices > 1) ClusterSync();  // (the peers have read slice_sq before this block exits)
}

}  // namespace

bool DecodeMixerApplies(const ModelDims& dims) {
  return HopperOrLater() && (dims.head_dim == 32 || dims.head_dim == 64 || dims.head_dim == 128) &&
         dims.conv_width >= 1 && dims.conv_width <= kMaxTaps;
}

void DecodeMixer(const DecodeMixerParams& p_in, cudaStream_t stream) {
  if (p_in.seqs == 0) return;
  DecodeMixerParams p = p_in;
  p.early_loads = EarlyLoads();
  const unsigned slices = static_cast<unsigned>(p.dims.head_dim / kLanes);
  const dim3 grid(static_cast<unsigned>(p.seqs), static_cast<unsigned>(p.dims.heads), slices), block(kLanes, kGroups);
  const dim3 cluster(1, 1, slices);
  switch (p.dims.head_dim) {
    case 32: LaunchAfterPrevious(DecodeMixerKernel<32>, grid, block, 0, stream, cluster, p); break;
    case 64: LaunchAfterPrevious(DecodeMixerKernel<64>, grid, block, 0, stream, cluster, p); break;
    case 128: LaunchAfterPrevious(DecodeMixerKernel<128>, grid, block, 0, stream, cluster, p); break;
    default: ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // callers check DecodeMixerApplies
  }
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
