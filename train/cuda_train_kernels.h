// Launchers of the trainer's CUDA kernels (train/cuda_train_kernels.cu), on raw device pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace oryx::train::cuda {

// The activations' dtype of the conv and RoPE kernels; their weights are fp32 (fp64 with kF64).
enum class ActDType { kBF16, kF32, kF64 };

// A causal depthwise convolution over time: x and out are [rows = batch * time, channels], row r holding
// time step r % time of sequence r / time; x's rows are ld_x elements apart, out's are packed. The weight
// is [channels, width] (tap width-1 multiplies the current step), the bias [channels].
struct ConvShape {
  int64_t rows = 0;
  int time = 0;
  int channels = 0;
  int width = 0;
  int64_t ld_x = 0;
};

bool ConvWidthSupported(int width);  // 1..8

cudaError_t CausalConvForward(ActDType dtype, const ConvShape& s, const void* x, const void* w, const void* bias,
                              void* out, cudaStream_t stream);
// Device scratch the backward needs (per-tile partial sums of the weight and bias gradients).
int64_t ConvWorkspaceBytes(ActDType dtype, const ConvShape& s);
// Writes dx (packed like out) and dw_and_bias [channels, width + 1]: the weight gradient, then the bias's.
// No atomics: the result does not depend on scheduling.
cudaError_t CausalConvBackward(ActDType dtype, const ConvShape& s, const void* x, const void* w, const void* dout,
                               void* dx, void* dw_and_bias, void* workspace, cudaStream_t stream);

// RMSNorm over the last dimension: x [rows, cols] packed, weight [cols], y [rows, cols] packed, and the
// per-row 1/rms saved for the backward (fp32; fp64 with kF64). kF32ToBF16 writes y in bf16, ready for a
// bf16 product.
enum class NormTypes { kF32ToF32, kF32ToBF16, kF64 };  // x -> y; weights as x
struct NormShape {
  int64_t rows = 0;
  int cols = 0;
  double eps = 0;
};

bool NormColsSupported(int cols);  // 1..16384

cudaError_t RmsNormForward(NormTypes t, const NormShape& s, const void* x, const void* w, void* y, void* rstd,
                           cudaStream_t stream);
// Device scratch the backward needs (partial sums of the weight gradient).
int64_t NormWorkspaceBytes(NormTypes t, const NormShape& s);
// dy has y's dtype, dx x's; dx and dw are written.
cudaError_t RmsNormBackward(NormTypes t, const NormShape& s, const void* x, const void* w, const void* dy,
                            const void* rstd, void* dx, void* dw, void* workspace, cudaStream_t stream);

// RoPE over x [batch, time, heads, 2 * half] (element strides sb, st, sh; the last dimension packed) into
// a packed out, with cos, sin [time, half] fp32; `inverse` rotates back (the backward). x's dtype as ActDType.
struct RopeShape {
  int64_t batch = 0;
  int time = 0;
  int heads = 0;
  int half = 0;
  int64_t sb = 0, st = 0, sh = 0;
};
cudaError_t ApplyRope(ActDType dtype, const RopeShape& r, const void* x, const float* cos, const float* sin,
                      void* out, bool inverse, cudaStream_t stream);

// SiLU-gated product out = SiLU(gate) * x over [rows, cols] (the SwiGLU and the mixer's output gate):
// gate and x rows ld_gate and ld_x elements apart, out packed; dtype as ActDType for all three. The
// backward writes packed dgate and dx from a packed dout.
struct GateShape {
  int64_t rows = 0;
  int cols = 0;
  int64_t ld_gate = 0, ld_x = 0;
};
cudaError_t SiluMulForward(ActDType dtype, const GateShape& s, const void* gate, const void* x, void* out,
                           cudaStream_t stream);
cudaError_t SiluMulBackward(ActDType dtype, const GateShape& s, const void* gate, const void* x, const void* dout,
                            void* dgate, void* dx, cudaStream_t stream);

// The two mixers' outputs combined per token (train/model.cc), over [batch, time, heads, head_dim] with
// the head dim packed and each operand's own element strides of batch, time and head:
//   out = is_attn[b, t] ? attn : lin + skip[h] * v
// attn and is_attn (packed [batch, time]) null when no token runs attention; skip null without the skip
// term (GDN). out is packed, in lin's dtype. Types: attn and v bf16 or fp32 with lin fp32, or all fp64.
struct CombineShape {
  struct Strides {
    int64_t b = 0, t = 0, h = 0;
  };
  int64_t batch = 0;
  int time = 0, heads = 0, head_dim = 0;
  Strides attn, lin, v, dlin;  // dlin: where the backward writes lin's gradient
};
cudaError_t CombineMixersForward(ActDType attn_dtype, ActDType v_dtype, const CombineShape& s, const void* attn,
                                 const void* lin, const void* v, const void* skip, const bool* is_attn, void* out,
                                 cudaStream_t stream);
// Device scratch the backward needs (per-tile partial sums of the skip gradient).
int64_t CombineWorkspaceBytes(ActDType v_dtype, const CombineShape& s);
// From a packed dout (lin's dtype): dattn (packed; with attn), dlin (at s.dlin), and with skip dv (packed)
// and dskip_cols [heads * head_dim], the skip gradient before its sum over each head's columns.
cudaError_t CombineMixersBackward(ActDType attn_dtype, ActDType v_dtype, const CombineShape& s, const void* v,
                                  const void* skip, const bool* is_attn, const void* dout, void* dattn, void* dlin,
                                  void* dv, void* dskip_cols, void* workspace, cudaStream_t stream);

// The Mamba-2 chunked scan's operands in its chunk layout (train/linear_mixers.cc), in one pass. From q, k, v
// [batch, time, heads, head_dim] (each with its own element strides, the head dim packed), dt and to_end
// [batch, heads, padded] packed (padded = chunks * chunk >= time), writes [batch, heads, padded, head_dim]
// packed:
//   q32 = q, k32 = k, u = dt v, kend = to_end k        (zeros at steps t >= time)
// The operands bf16 or fp32 with the rest fp32, or all fp64; head_dim in {4, 8, 16, 32, 64, 128}, and q, k,
// v 4-element aligned (strides and pointers); otherwise cudaErrorInvalidValue.
struct ChunkPrepShape {
  int64_t batch = 0;
  int time = 0, padded = 0, heads = 0, head_dim = 0;
  CombineShape::Strides q, k, v;  // (the backward reads no q)
};
cudaError_t ChunkPrepareForward(ActDType in_dtype, const ChunkPrepShape& s, const void* q, const void* k,
                                const void* v, const void* dt, const void* to_end, void* q32, void* k32, void* u,
                                void* kend, cudaStream_t stream);
// From the outputs' gradients (null where there is none; packed like the outputs): dq, dk, dv packed
// [batch, time, heads, head_dim] in the operands' dtype, ddt and dto_end like dt (zero at padded steps).
cudaError_t ChunkPrepareBackward(ActDType in_dtype, const ChunkPrepShape& s, const void* k, const void* v,
                                 const void* dt, const void* to_end, const void* dq32, const void* dk32,
                                 const void* du, const void* dkend, void* dq, void* dk, void* dv, void* ddt,
                                 void* dto_end, cudaStream_t stream);

// The chunked scan's output inside each chunk (train/linear_mixers.cc), for `chunks` chunks of `chunk`
// steps and head dim `head_dim`, all packed: q, k, u, out [chunks, chunk, head_dim], g [chunks, chunk] (the
// cumulative log decay within the chunk), s0 [chunks, head_dim, head_dim] (the state entering it):
//   out[t] = exp(g_t) s0^T q_t + sum_{s<=t} exp(g_t - g_s) (q_t . k_s) u_s
// fp32 with chunk 64 and head dim 64; fp64 (for tests) with chunk 16 and head dim 8.
bool ChunkOutputSupported(bool f64, int chunk, int head_dim);
cudaError_t ChunkOutputForward(bool f64, int chunk, int head_dim, int64_t chunks, const void* q, const void* k,
                               const void* u, const void* g, const void* s0, void* out, cudaStream_t stream);
// Writes dq, dk, du (like q), dg (like g) and ds0 (like s0) from dout (like out).
cudaError_t ChunkOutputBackward(bool f64, int chunk, int head_dim, int64_t chunks, const void* q, const void* k,
                                const void* u, const void* g, const void* s0, const void* dout, void* dq, void* dk,
                                void* du, void* dg, void* ds0, cudaStream_t stream);

// GDN's chunk-to-chunk state passing (train/linear_mixers.cc), over `heads` independent sequences of `chunks`
// chunks, all packed: x [heads, chunks, chunk, 2 head_dim] holds each chunk's solved right-hand sides [U0 W],
// k_end [heads, chunks, chunk, head_dim] the keys times their decay to the chunk's end, decay [heads, chunks]
// the chunk's whole decay a_n, initial [heads, head_dim, head_dim] the first state (null: zero). Chunk n maps
// the state S_n entering it to
//   u_n = U0_n - W_n S_n          S_n+1 = a_n S_n + k_end_n^T u_n
// and the forward writes s0 [heads, chunks, head_dim, head_dim] (each S_n), u [heads, chunks, chunk,
// head_dim] and final_state (S_chunks). Supported shapes as ChunkOutputSupported.
cudaError_t GdnStatesForward(bool f64, int chunk, int head_dim, int64_t heads, int chunks, const void* x,
                             const void* k_end, const void* decay, const void* initial, void* s0, void* u,
                             void* final_state, cudaStream_t stream);
// The backward's sequential part: from the gradients of s0, u and final_state (each null when it has none),
// writes ds_next [heads, chunks, head_dim, head_dim] (the gradient of S_n+1 for each n), du [heads, chunks,
// chunk, head_dim] (u_n's whole gradient) and dinitial (that of S_0; null: not written).
cudaError_t GdnStatesBackward(bool f64, int chunk, int head_dim, int64_t heads, int chunks, const void* x,
                              const void* k_end, const void* decay, const void* gs0, const void* gu, const void* dfinal,
                              void* ds_next, void* du, void* dinitial, cudaStream_t stream);

// GDN's UT-transform matrix in each of `chunks` chunks, all packed: from k [chunks, chunk, head_dim], g and
// beta [chunks, chunk] (the cumulative log decay within the chunk, and the write strengths),
//   l[t][s] = beta_t exp(g_t - g_s) (k_t . k_s) for s < t, else 0      (l [chunks, chunk, chunk])
// The backward writes dk (like k), dg and dbeta (like g) from dl. Shapes as ChunkOutputSupported.
cudaError_t GdnMatrixForward(bool f64, int chunk, int head_dim, int64_t chunks, const void* k, const void* g,
                             const void* beta, void* l, cudaStream_t stream);
cudaError_t GdnMatrixBackward(bool f64, int chunk, int head_dim, int64_t chunks, const void* k, const void* g,
                              const void* beta, const void* dl, void* dk, void* dg, void* dbeta, cudaStream_t stream);

// GDN's UT transform in each of `chunks` chunks, all packed: x = (I + L)^-1 [sv, diag(f) k] ([chunks, chunk,
// 2 head_dim]) from l [chunks, chunk, chunk] (only its strictly lower triangle is read), sv and k [chunks,
// chunk, head_dim] and f [chunks, chunk]. The backward writes dr = (I + L)^-T dx (like x; its first half is
// sv's gradient), dk = diag(f) dr's second half (like k) and df (like f). Shapes as ChunkOutputSupported.
cudaError_t GdnSolveForward(bool f64, int chunk, int head_dim, int64_t chunks, const void* l, const void* sv,
                            const void* k, const void* f, void* x, cudaStream_t stream);
cudaError_t GdnSolveBackward(bool f64, int chunk, int head_dim, int64_t chunks, const void* l, const void* k,
                             const void* f, const void* dx, void* dr, void* dk, void* df, cudaStream_t stream);

}  // namespace oryx::train::cuda
