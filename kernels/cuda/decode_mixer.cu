// A decode step's mixer in one kernel: ConvRopeAppend, ConvWindowUpdate and Recurrent (conv.cu,
// recurrent.cu) fused for sequences whose span is a single token, in one of two layouts.
// - DecodeMixerKernel: a block per (sequence, head, 32 value features), the dh/32 blocks of a head forming a
//   thread-block cluster, so that a single sequence spreads over dh/32 as many SMs. Every block of a head
//   convolves the head's k channels (the recurrence needs all of k) and its own slice of v; once the whole
//   cluster has read the windows, each block moves its slice of them past the token, appends its slice of
//   RoPE(k) and v to the cache, rotates its slice of an attention row's query, and advances its slice of the
//   state, a column per thread-x as RecurrentKernel does.
// - DecodeMixerHeadKernel, for batches: a block of 2 x dh threads per (sequence, head), the head's state
//   copied to shared memory before the wait for the input projection. A batch's blocks need all of the GPU's
//   registers in the first layout, so they start only as the input projection's blocks leave; these are
//   small enough to start beside them, and their state streams in during the projection.
// The math is the three kernels', term for term, in the same order.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kLanes = 32, kGroups = 8;
constexpr int kMaxTaps = 4;  // the widest conv the kernel takes (DecodeMixerApplies): taps and window in registers

// A conv channel at a decode step: its taps, bias and window (the last W inputs; written only by this layer's
// mixer), loaded before the wait for the input projection; Output convolves the token's input with them,
// MoveWindow moves the window past it.
struct ConvChannel {
  float taps[kMaxTaps], past[kMaxTaps], last_tap = 0.f, bias = 0.f;
  __device__ __forceinline__ void Load(const float* weight, float bias_in, const float* window, int64_t W, int64_t C,
                                       int64_t ch) {
    bias = bias_in;
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
  __device__ __forceinline__ float Output(float in, int64_t W, bool silu) const {
    float acc = bias;
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t) {
      if (t < W) acc += taps[t] * past[t];
    }
    acc += last_tap * in;
    return silu ? Silu(acc) : acc;
  }
  __device__ __forceinline__ void MoveWindow(float* window, int64_t W, int64_t C, int64_t ch, float in) const {
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t) {
      if (t + 1 < W) window[t * C + ch] = past[t + 1];
    }
    if (W > 0) window[(W - 1) * C + ch] = in;
  }
};

// What does not depend on the input projection, loaded or computed before the wait: the head's constants (few,
// and not to queue behind the state), the row's mode (uploaded with the forward's metadata), RoPE's angle for
// feature j at this position and the attention query's scale (a double-precision log).
struct HeadConstants {
  float a_log, dt_bias, d_skip, rope_cos = 1.f, rope_sin = 0.f, q_scale = 1.f;
  bool rope, attention_row;
  template <int kDh>
  __device__ __forceinline__ void Load(const DecodeMixerParams& p, int64_t h, int64_t r, int64_t pos, int64_t j,
                                       bool needs_angle) {
    a_log = p.a_log_ptr[h], dt_bias = p.dt_bias_ptr[h];  // (exp'd after the wait: no stall here)
    rope = p.dims.rope_theta > 0, attention_row = p.row_mode_ptr[r] != 0;
    if (rope && needs_angle) RopeAngle(j, kDh, pos, p.dims.rope_theta, p.maybe_rope_freq_ptr, &rope_sin, &rope_cos);
    if (attention_row && needs_angle) q_scale = AttnQueryScale(p.dims.attn_log_scale_base, pos);
    d_skip = p.dims.gdn ? 0.f : p.maybe_d_skip_ptr[h];
  }
};

// A block's sequence and head: the sizes, the token's row of the input projection, the layer's conv window and
// the head's state.
template <int kDh>
struct MixerSite {
  SeqDesc s;
  int64_t h, H, HD, C, P, W, r;
  const float* proj;
  float* window;
  float* state;
  __device__ __forceinline__ MixerSite(const DecodeMixerParams& p)
      : s(p.seqs_ptr[blockIdx.x]), h(blockIdx.y), H(p.dims.heads), HD(H * kDh), C(2 * HD), P(p.dims.proj_width),
        W(p.dims.conv_width - 1), r(s.row), proj(p.proj_ptr + r * P),
        window(GlobalPtr(s.conv + int64_t(p.layer) * W * C)),
        state(GlobalPtr(s.state + (int64_t(p.layer) * H + h) * kDh * kDh)) {}
};

// Feature j of RoPE(k) and of v into the sequence's KV cache; of an attention row's rotated query into qa.
template <int kDh>
__device__ __forceinline__ void AppendAndRotate(const DecodeMixerParams& p, const SeqDesc& s, const HeadConstants& c,
                                                const float* ks, float v, int64_t h, int64_t j) {
  const int64_t HD = int64_t(p.dims.heads) * kDh, r = s.row;
  const int64_t partner = j < kDh / 2 ? j + kDh / 2 : j - kDh / 2;
  auto rotate = [&](float self, float other) {
    return j < kDh / 2 ? self * c.rope_cos - other * c.rope_sin : self * c.rope_cos + other * c.rope_sin;
  };
  if (s.kv_cap > 0) {
    const float k = c.rope ? rotate(ks[j], ks[partner]) : ks[j];
    const int64_t column = h * kDh + j;
    GlobalPtr(KeyRows(s, p.layer, HD).Row(s.pos))[column] = __float2bfloat16(k);
    GlobalPtr(ValueRows(s, p.layer, HD).Row(s.pos))[column] = __float2bfloat16(v);
  }
  if (c.attention_row) {
    const float* q = p.proj_ptr + r * p.dims.proj_width + p.dims.proj_width - HD + h * kDh;  // q_attn: the last HD
    p.qa_ptr[r * HD + h * kDh + j] = (c.rope ? rotate(q[j], q[partner]) : q[j]) * c.q_scale;
  }
}

template <int kDh>
__global__ void __launch_bounds__(kLanes * kGroups) DecodeMixerKernel(DecodeMixerParams p) {
  constexpr int kKeys = kDh / kGroups;  // per thread: keys y + 8r of column j
  constexpr unsigned kSlices = kDh / kLanes;  // the blocks of a head (its cluster)
  __shared__ float ks[kDh], qs[kDh], vs[kLanes], red[kGroups][kLanes], norms[2], slice_sq;
  if (!p.early_loads) AfterPrevious();
  const int tid = threadIdx.y * kLanes + threadIdx.x, x = threadIdx.x, y = threadIdx.y;
  const MixerSite<kDh> site(p);
  const SeqDesc& s = site.s;
  const int64_t h = site.h, H = site.H, HD = site.HD, C = site.C, W = site.W, r = site.r;
  const float* proj = site.proj;
  float* window = site.window;
  const int64_t j0 = int64_t(blockIdx.z) * kLanes, j = j0 + x;

  // First the conv's taps, its bias and its window, and what else does not depend on the input projection:
  // with them loaded before the wait, the loads after it are only the projection's outputs, in one round trip.
  const bool conv_thread = tid < kDh + kLanes;
  const int64_t ch = tid < kDh ? h * kDh + tid : HD + h * kDh + j0 + (tid - kDh);
  ConvChannel conv;
  if (conv_thread) conv.Load(p.conv_weight_ptr + ch * (W + 1), p.conv_bias_ptr[ch], window, W, C, ch);
  HeadConstants c;
  c.Load<kDh>(p, h, r, s.pos, j, y == 0);
  const bool gated = p.maybe_gated_ptr != nullptr;
  const float gate_norm = gated && y == 0 ? p.gate_norm_ptr[j] : 0.f;
  // Then the state slice, so that its loads are in flight during the conv (and, with early loads, during
  // the input projection's tail: only this kernel of the layer, in an earlier step, writes it).
  float* state = site.state;
  float S[kKeys];
#pragma unroll
  for (int k = 0; k < kKeys; ++k) S[k] = state[(y + kGroups * k) * kDh + j];
  PrefetchShareToL2(p.maybe_prefetch_ptr, p.prefetch_bytes);
  if (p.early_loads) AfterPrevious();
  const float head_in = proj[4 * HD + h], head_in2 = p.dims.gdn ? proj[4 * HD + H + h] : 0.f;  // dt, or beta and alpha
  const float a_exp = expf(c.a_log);
  const float gate = gated && y == 0 ? proj[p.gate_column + h * kDh + j] : 0.f;

  // The conv of all the head's k channels (threads 0..dh-1) and of this block's v channels (dh..dh+31).
  if (tid < kDh) qs[tid] = proj[2 * HD + h * kDh + tid];  // q_linear
  float conv_in = 0.f;
  if (conv_thread) {
    conv_in = proj[ch];
    const float out = conv.Output(conv_in, W, p.dims.conv_silu);
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
  if (own_k || own_v) conv.MoveWindow(window, W, C, ch, conv_in);
  if (y == 0) AppendAndRotate<kDh>(p, s, c, ks, vs[x], h, j);

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
    const float dt = Softplus(head_in + c.dt_bias), a = expf(-dt * a_exp);
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      const int i = y + kGroups * k;
      S[k] = a * S[k] + dt * ks[i] * v;
      out += S[k] * qs[i];
    }
    out = column_sum(out) + c.d_skip * v;
  } else {
    GdnNorms(ks, qs, kDh, tid, norms);
    const float kn_scale = norms[0], qn_scale = norms[1];
    const float beta = Sigmoid(head_in);
    const float alpha = expf(-a_exp * Softplus(head_in2 + c.dt_bias));
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
    if (y == 0 && !c.attention_row) p.out_ptr[r * HD + h * kDh + j] = out;
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

// The same, a block of 2 x dh threads per (sequence, head). Thread (part, j) convolves channel j of k (part 0)
// or of v (part 1), appends feature j (part 0), and advances column j of the state over half the keys: those
// with i % 8 in the part's four groups. The head's state, dh * dh floats of dynamic shared memory, is copied
// in by cp.async (no registers held) before the wait; the new state goes to memory from registers, a row of
// 32 columns a warp-wide store.
template <int kDh>
__global__ void __launch_bounds__(2 * kDh) DecodeMixerHeadKernel(DecodeMixerParams p) {
  constexpr int kPartGroups = kGroups / 2;
  static_assert(kPartGroups == 4, "the keys loop reads a part's keys as one float4 of k and one of q");
  extern __shared__ float4 state_smem[];
  float* St = reinterpret_cast<float*>(state_smem);  // [dh keys][dh columns]
  __shared__ __align__(16) float ks[kDh], qs[kDh];
  __shared__ float vs[kDh], group_sums[kGroups][kDh], norms[2], scratch[32];
  if (!p.early_loads) AfterPrevious();
  const int part = static_cast<int>(threadIdx.x) / kDh;
  const int64_t j = threadIdx.x % kDh;
  const MixerSite<kDh> site(p);
  const SeqDesc& s = site.s;
  const int64_t h = site.h, H = site.H, HD = site.HD, C = site.C, W = site.W, r = site.r;
  const float* proj = site.proj;
  float* window = site.window;
  float* state = site.state;
  CopyToSharedAsync(St, state, int64_t{kDh} * kDh);
  const int64_t ch = part * HD + h * kDh + j;  // k channel j, or v channel j
  ConvChannel conv;
  conv.Load(p.conv_weight_ptr + ch * (W + 1), p.conv_bias_ptr[ch], window, W, C, ch);
  HeadConstants c;
  c.Load<kDh>(p, h, r, s.pos, j, part == 0);
  const bool gated = p.maybe_gated_ptr != nullptr;
  const float gate_norm = gated ? p.gate_norm_ptr[j] : 0.f;
  PrefetchShareToL2(p.maybe_prefetch_ptr, p.prefetch_bytes);
  if (p.early_loads) AfterPrevious();
  const float head_in = proj[4 * HD + h], head_in2 = p.dims.gdn ? proj[4 * HD + H + h] : 0.f;  // dt, or beta and alpha
  const float a_exp = expf(c.a_log);
  const float gate = gated && part == 0 ? proj[p.gate_column + h * kDh + j] : 0.f;
  if (part == 0) qs[j] = proj[2 * HD + h * kDh + j];  // q_linear
  const float in = proj[ch];
  (part == 0 ? ks : vs)[j] = conv.Output(in, W, p.dims.conv_silu);
  conv.MoveWindow(window, W, C, ch, in);  // (no other block reads this head's channels)
  WaitCopies();
  __syncthreads();
  const float v = vs[j];
  if (part == 0) AppendAndRotate<kDh>(p, s, c, ks, v, h, j);

  // Column j of the state over the part's keys, eight at a time (their k and q in 16-byte loads), added up as
  // DecodeMixerKernel adds them: key i into the partial sum of group i % 8 in key order, then the groups in
  // order (through shared memory), so that both layouts give the same fp32 sums (up to the compiler's
  // contractions). Every thread gets the column's sum.
  const int first_group = part * kPartGroups;
  float sums[kPartGroups];
  auto keys = [&](auto&& body) {
    for (float& sum : sums) sum = 0.f;
#pragma unroll 2
    for (int i = 0; i < kDh; i += kGroups) {
      const float4 k4 = *reinterpret_cast<const float4*>(ks + i + first_group);
      const float4 q4 = *reinterpret_cast<const float4*>(qs + i + first_group);
      body(i + first_group, k4.x, q4.x, 0);
      body(i + first_group + 1, k4.y, q4.y, 1);
      body(i + first_group + 2, k4.z, q4.z, 2);
      body(i + first_group + 3, k4.w, q4.w, 3);
    }
#pragma unroll
    for (int g = 0; g < kPartGroups; ++g) group_sums[first_group + g][j] = sums[g];
    __syncthreads();
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) sum += group_sums[g][j];
    __syncthreads();  // (group_sums is written again by the next pass)
    return sum;
  };
  float out;
  if (!p.dims.gdn) {
    const float dt = Softplus(head_in + c.dt_bias), a = expf(-dt * a_exp);
    out = keys([&](int i, float k, float q, int g) {
      const float next = a * St[i * kDh + j] + dt * k * v;
      state[i * kDh + j] = next;
      sums[g] += next * q;
    });
    out += c.d_skip * v;
  } else {
    GdnNorms(ks, qs, kDh, static_cast<int>(threadIdx.x), norms);
    const float kn_scale = norms[0], qn_scale = norms[1];
    const float beta = Sigmoid(head_in);
    const float alpha = expf(-a_exp * Softplus(head_in2 + c.dt_bias));
    const float kts = keys([&](int i, float k, float, int g) { sums[g] += k * kn_scale * St[i * kDh + j]; });
    out = keys([&](int i, float k, float q, int g) {  // ((kn^T S)[j] is kts)
      const float kn = k * kn_scale;
      const float next = alpha * (St[i * kDh + j] - beta * kn * kts) + beta * kn * v;
      state[i * kDh + j] = next;
      sums[g] += next * q * qn_scale;
    });
  }
  if (!gated) {
    if (part == 0 && !c.attention_row) p.out_ptr[r * HD + h * kDh + j] = out;
    return;
  }
  const float scale = rsqrtf(BlockSum(part == 0 ? out * out : 0.f, scratch) / kDh + p.dims.norm_eps);
  if (part == 0) p.maybe_gated_ptr[r * HD + h * kDh + j] = __float2bfloat16(out * scale * gate_norm * Silu(gate));
}

}  // namespace

bool DecodeMixerApplies(const ModelDims& dims) {
  return HopperOrLater() && (dims.head_dim == 32 || dims.head_dim == 64 || dims.head_dim == 128) &&
         dims.conv_width >= 1 && dims.conv_width <= kMaxTaps;
}

namespace {

// The mixer for head_dim kDh, a head per block or per cluster. The first launch of a head per block asks for the
// shared memory of its state and for KernelSwitches::head_mixer_carveout's split (docs/CUDA.md, "Its L1").
template <int kDh>
void LaunchDecodeMixer(const DecodeMixerParams& p, bool head_blocks, cudaStream_t stream) {
  const auto seqs = static_cast<unsigned>(p.seqs), heads = static_cast<unsigned>(p.dims.heads);
  if (head_blocks) {
    constexpr int kSmem = kDh * kDh * sizeof(float);
    static const bool configured = [] {
      ORYX_CUDA_CHECK(
          cudaFuncSetAttribute(DecodeMixerHeadKernel<kDh>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      if (const int carveout = GetKernelSwitches().head_mixer_carveout; carveout >= 0) {
        ORYX_CUDA_CHECK(cudaFuncSetAttribute(DecodeMixerHeadKernel<kDh>,
                                             cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
      }
      return true;
    }();
    (void)configured;
    LaunchAfterPrevious(DecodeMixerHeadKernel<kDh>, dim3(seqs, heads), dim3(2 * kDh), kSmem, stream, p);
  } else {
    constexpr unsigned kSlices = kDh / kLanes;
    LaunchAfterPrevious(DecodeMixerKernel<kDh>, dim3(seqs, heads, kSlices), dim3(kLanes, kGroups), 0, stream,
                        dim3(1, 1, kSlices), p);
  }
}

}  // namespace

void DecodeMixer(const DecodeMixerParams& p_in, cudaStream_t stream) {
  if (p_in.seqs == 0) return;
  DecodeMixerParams p = p_in;
  p.early_loads = EarlyLoads();
  const KernelSwitches& switches = GetKernelSwitches();
  const bool head_blocks = switches.head_mixer_min_seqs > 0 && p.seqs >= switches.head_mixer_min_seqs &&
                           p.dims.head_dim >= switches.head_mixer_min_dim;
  switch (p.dims.head_dim) {
    case 32: LaunchDecodeMixer<32>(p, head_blocks, stream); break;
    case 64: LaunchDecodeMixer<64>(p, head_blocks, stream); break;
    case 128: LaunchDecodeMixer<128>(p, head_blocks, stream); break;
    default: ORYX_CUDA_CHECK(cudaErrorInvalidValue);  // callers check DecodeMixerApplies
  }
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
