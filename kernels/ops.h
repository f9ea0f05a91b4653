// The per-layer compute ops of the Oryx model (DESIGN.md §2) on raw fp32 buffers: projections, norms, RoPE,
// causal conv, attention over a KV cache, the mamba2 / gdn recurrences, the SwiGLU gate, and the greedy token choice.
//
// Implemented on the CPU in kernels/cpu/<op>.cc (Eigen). The CUDA ops work on ragged batches in bf16 and are
// declared apart, in kernels/cuda/ops_cuda.h.
//
// Dimension legend: M rows (tokens) of a projection, K input features, N output features, T tokens of a span,
// Tq queries, Tk keys (KV cache length), H heads, dh head dim, C conv channels, w conv width, V vocab.
//
// Contract for every op: buffers are row-major fp32 owned by the caller; the last dimension is contiguous and
// the `*_stride` fields give the step, in elements, between consecutive rows / tokens. Inputs are validated at
// the engine boundary; kernels only debug-assert. Outputs must not alias inputs unless a field says "in place".
// The ops keep no state between calls and are safe to call concurrently on disjoint outputs.
#pragma once

#include <cstdint>
#include <cstring>

namespace oryx::kernels {

// The largest head_dim the CPU kernels take (their per-head temporaries live on the stack); the config
// loader enforces the same bound.
inline constexpr int64_t kMaxHeadDim = 256;

// y = x · W^T, the projection layout of the checkpoint (weight [out, in]). M = 1 is a decode step.
struct MatMulParams {
  int64_t m, n, k;
  int64_t x_row_stride;  // >= k
  int64_t w_row_stride;  // >= k
  int64_t y_row_stride;  // >= n
  const float* x_ptr;    // [M, K]
  const float* w_ptr;    // [N, K]
  float* y_ptr;          // [M, N]
};

// Weights in fewer bytes than fp32, for the CPU backend's projections: bf16 (fp32 rounded to nearest even,
// its upper 16 bits) or int8 with one fp32 scale per output row (symmetric: w[o, i] ~ scale[o] * q[o, i], q in
// [-127, 127], scale = max |w[o, :]| / 127). Decode reads 2 or 4 times fewer weight bytes; the activations stay
// fp32 and so do the sums. kW8A8 packs the weights as kInt8 and quantises each activation row too, to int8
// with one scale per row (x[r, i] ~ sx[r] * q, sx = max |x[r, :]| / 127), so that the products are integer dot
// products (AVX-512 VNNI: 64 multiply-adds an instruction) summed exactly in int32, then scaled. kFp8 is the
// CUDA backend's (e4m3 with a power-of-two scale per row: kernels/cuda/ops_cuda.h QuantizeRowsFp8).
enum class WeightFormat : uint8_t { kF32, kBf16, kInt8, kW8A8, kFp8 };
constexpr bool IsInt8(WeightFormat format) { return format == WeightFormat::kInt8 || format == WeightFormat::kW8A8; }
constexpr int64_t BytesPerWeight(WeightFormat format) {
  return IsInt8(format) ? 1 : format == WeightFormat::kBf16 ? 2 : 4;
}

// y = x · dequant(W)^T over weights in a WeightFormat other than kF32. Rows are contiguous (row stride k).
struct PackedMatMulParams {
  int64_t m, n, k;
  int64_t x_row_stride, y_row_stride;
  WeightFormat format;
  const float* x_ptr;      // [M, K]
  const void* w_ptr;       // [N, K] uint16_t (bf16) or int8_t
  const float* scale_ptr;  // [N] (int8, w8a8; unused for bf16)
  float* y_ptr;            // [M, N]
  // w8a8: x already quantised by QuantizeRows (q [M, K], row scales [M]), as when one x feeds many panels;
  // null: quantised here.
  const uint8_t* xq_ptr = nullptr;
  const float* xq_scale_ptr = nullptr;
};

// y = x / sqrt(mean(x^2) + eps) * weight, per row of d values.
struct RmsNormParams {
  int64_t rows, d;
  float eps;
  int64_t x_row_stride, y_row_stride;
  const float* x_ptr;       // [rows, d]
  const float* weight_ptr;  // [d]
  float* y_ptr;             // [rows, d]; may equal x_ptr (in place) when the strides match
};

// The layer's gated per-head norm: y[h*dh + i] = o_h[i] / sqrt(mean(o_h^2) + eps) * weight[i] * SiLU(g[h*dh + i]).
struct GatedRmsNormParams {
  int64_t rows, heads, head_dim;
  float eps;
  int64_t o_row_stride, gate_row_stride, y_row_stride;
  const float* o_ptr;       // [rows, H, dh] mixer output
  const float* gate_ptr;    // [rows, H*dh] g = W_G u
  const float* weight_ptr;  // [dh] gate_norm.weight, shared by all heads
  float* y_ptr;             // [rows, H*dh]
};

// Half-split ("rotate half") RoPE in place; token t of the span sits at position start_pos + t. The angle
// pos * theta^(-2i/dh) is computed in double and cast to float before cos/sin, as the LibTorch model does.
struct RopeParams {
  int64_t tokens, heads, head_dim;  // head_dim even
  int64_t start_pos;
  double theta;                     // rope_theta > 0 (the engine skips the op when rope_theta = 0)
  int64_t x_token_stride;           // >= H*dh; heads are contiguous inside a token
  float* x_ptr;                     // [T, H, dh] in place
};

// Causal depthwise conv over the span, continuing from the window of the last w-1 inputs before it:
// out_t[c] = act(bias[c] + sum_{j<w} weight[c, j] * in_{t-(w-1)+j}[c]); weight[c, w-1] multiplies token t.
// On return the window holds the last w-1 raw (pre-activation) inputs, oldest first. T = 1 is a decode step.
struct CausalConvParams {
  int64_t tokens, channels, width;  // width >= 1
  bool apply_silu;                  // act = SiLU (gdn) or identity (mamba2)
  int64_t in_token_stride, out_token_stride;
  const float* weight_ptr;          // [C, w]
  const float* bias_ptr;            // [C]
  float* window_ptr;                // [w-1, C] in/out, oldest first; zeros at the sequence start
  const float* in_ptr;              // [T, C]
  float* out_ptr;                   // [T, C]
};

// The element type of the CPU backend's KV cache: fp32; bf16 (fp32 rounded to nearest even, its upper 16
// bits), which halves the bytes an attention step reads from the cache; or int8, a quarter of fp32's bytes:
// each head's row is head_dim int8 values q then its fp32 scale s (4 bytes, unaligned), the value q * s, with
// s = max |x| / 127 over the row (QuantizeKvRow). Scores and sums stay fp32.
enum class KvFormat : uint8_t { kF32, kBf16, kInt8 };
inline int64_t KvElementBytes(KvFormat f) { return f == KvFormat::kF32 ? 4 : f == KvFormat::kBf16 ? 2 : 1; }
// Elements of one head's row of keys (or values) in the cache: head_dim, and the scale's 4 bytes for int8.
inline int64_t KvHeadRowElements(KvFormat f, int64_t head_dim) {
  return f == KvFormat::kInt8 ? head_dim + 4 : head_dim;
}

// Softmax attention of the last Tq positions of a Tk-long KV cache (Tq <= Tk): query i sees keys
// 0 .. Tk - Tq + i, scale 1/sqrt(dh), max-subtracted softmax. q is already RoPE'd, as are cached keys.
struct AttentionParams {
  int64_t q_tokens, kv_tokens, heads, head_dim;
  int64_t q_token_stride, kv_token_stride, out_token_stride;  // heads contiguous inside a token
  const float* q_ptr;  // [Tq, H, dh]
  const float* k_ptr;  // [Tk, H, dh]
  const float* v_ptr;  // [Tk, H, dh]
  float* out_ptr;      // [Tq, H, dh]
  float* scratch_ptr;  // [Tq, Tk] working space for the scores (the caller owns it, so calls allocate nothing)
  // A paged KV cache when kv_block_tokens > 0: key s of head h is element kv_col + h * kv_head_stride +
  // (s % kv_block_tokens) * kv_token_stride of k_blocks[s / kv_block_tokens], and likewise its value; k_ptr and
  // v_ptr are unused. The blocks hold kv_format elements (float, uint16_t bf16, or int8_t rows of head_dim values
  // and their scale; a contiguous cache is fp32).
  int64_t kv_block_tokens = 0;
  const void* const* k_blocks = nullptr;
  const void* const* v_blocks = nullptr;
  int64_t kv_col = 0;
  KvFormat kv_format = KvFormat::kF32;
  float* widen_ptr = nullptr;  // bf16, int8: [kv_block_tokens, dh] working space for one block's rows in fp32
  // Paged: elements from one head's keys to the next head's in a block; 0 means head_dim (the heads side by
  // side in a token's row). The CPU backend's blocks hold each head's rows together: block_tokens * dh.
  int64_t kv_head_stride = 0;
};

// Recurrent state S [H, dh, dh] fp32, S[h][i][j] pairs key feature i with value feature j; Read = S^T q.
//
// mamba2, token by token over the span: S = exp(log_a) S + dt k v^T;  out = S^T q + d_skip * v.
// dt is already softplus'd; log_a = -dt * exp(A_log).
struct Mamba2Params {
  int64_t tokens, heads, head_dim;
  int64_t qkv_token_stride;     // token step of q, k and v (>= H*dh; they may be views of one buffer)
  int64_t out_token_stride;
  const float* dt_ptr;          // [T, H]
  const float* log_a_ptr;       // [T, H]
  const float* d_skip_ptr;      // [H]
  const float* q_ptr;           // [T, H, dh]
  const float* k_ptr;           // [T, H, dh]
  const float* v_ptr;           // [T, H, dh]
  float* state_ptr;             // [H, dh, dh] in/out: the state before the span, then after it
  float* maybe_states_out_ptr;  // [T, H, dh, dh] the state after each token (speculative rollback), or null
  float* out_ptr;               // [T, H, dh]
};

// gdn, token by token over the span. The kernel takes RAW q and k and normalises them itself (DESIGN.md §2:
// the normalisation belongs to the linear op only; attention sees raw k):
//   kn = k / sqrt(sum k^2 + 1e-6),  qn = q / sqrt(sum q^2 + 1e-6) / sqrt(dh),
//   S = alpha (S - beta kn (kn^T S)) + beta kn v^T,  out = S^T qn,  alpha = exp(log_alpha).
struct GdnParams {
  int64_t tokens, heads, head_dim;
  int64_t qkv_token_stride;
  int64_t out_token_stride;
  const float* beta_ptr;        // [T, H] sigmoid already applied
  const float* log_alpha_ptr;   // [T, H] = -exp(A_log) * softplus(w_alpha . u + dt_bias)
  const float* q_ptr;           // [T, H, dh] raw
  const float* k_ptr;           // [T, H, dh] raw
  const float* v_ptr;           // [T, H, dh]
  float* state_ptr;             // [H, dh, dh] in/out
  float* maybe_states_out_ptr;  // [T, H, dh, dh] or null
  float* out_ptr;               // [T, H, dh]
};

// The SwiGLU gate: y = SiLU(gate) * up, elementwise (the projections around it are MatMul).
struct SwiGluParams {
  int64_t rows, d;
  int64_t gate_row_stride, up_row_stride, y_row_stride;
  const float* gate_ptr;  // [rows, d]
  const float* up_ptr;    // [rows, d]
  float* y_ptr;           // [rows, d]; may equal gate_ptr or up_ptr (in place) when the strides match
};

// The greedy token of logits [V]: the largest logit, the lowest index on ties. (Sampling with temperature, top-k
// and top-p lives in engine/sampler.cc, which calls SampleGreedy for temperature 0.)
struct SampleParams {
  int64_t vocab;
  const float* logits_ptr;  // [V]
  int64_t* token_ptr;       // [1] output
};

namespace cpu {
// All CPU ops are single-threaded for now (the engine parallelises over sequences); each file says how it
// would split. Each fast op has a slow, obviously correct XxxReference beside it (loops, double accumulators).
void MatMul(const MatMulParams& p);
void MatMulReference(const MatMulParams& p);
// Dot products over the packed rows for up to a few x rows (decode, verify spans); more rows dequantise the
// weights block by block into fp32 and multiply with MatMul.
void PackedMatMul(const PackedMatMulParams& p);
// w8a8's activations: row r of x [m, k] (row stride `stride`) as q[r * k + i] = round(x / scale[r]) + 128 in
// [1, 255], scale[r] = max |x[r, :]| / 127 (1 for a zero row).
void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t stride, uint8_t* q, float* scale);
void PackedMatMulReference(const PackedMatMulParams& p);
// w [n, k] fp32 packed: bf16 -> uint16_t out[n * k]; int8 and w8a8 -> int8_t out[n * k] and scale[n].
void PackWeights(const float* w, int64_t n, int64_t k, WeightFormat format, void* out, float* scale);
// bf16 <-> fp32 over n values: rounded to nearest even (NaN stays NaN), and widened exactly.
void RoundToBf16(const float* in, int64_t n, uint16_t* out);
void WidenBf16(const uint16_t* in, int64_t n, float* out);
// An int8 KV cache row (KvFormat::kInt8): n values to n int8 and the fp32 scale after them (n + 4 bytes), and
// back: out[i] = q[i] * scale.
void QuantizeKvRow(const float* in, int64_t n, int8_t* out);
void DequantizeKvRow(const int8_t* in, int64_t n, float* out);
// The scale of such a row of n values (stored unaligned after them).
inline float KvRowScale(const int8_t* row, int64_t n) {
  float s;
  std::memcpy(&s, row + n, sizeof(s));
  return s;
}
void RmsNorm(const RmsNormParams& p);
void RmsNormReference(const RmsNormParams& p);
void GatedRmsNorm(const GatedRmsNormParams& p);
void GatedRmsNormReference(const GatedRmsNormParams& p);
void Rope(const RopeParams& p);
void RopeReference(const RopeParams& p);
void CausalConv(const CausalConvParams& p);
void CausalConvReference(const CausalConvParams& p);
void Attention(const AttentionParams& p);
void AttentionReference(const AttentionParams& p);
void Mamba2(const Mamba2Params& p);
void Mamba2Reference(const Mamba2Params& p);
void Gdn(const GdnParams& p);
void GdnReference(const GdnParams& p);
void SwiGlu(const SwiGluParams& p);
void SwiGluReference(const SwiGluParams& p);
void SampleGreedy(const SampleParams& p);
void SampleGreedyReference(const SampleParams& p);
// The entropy (nats) of softmax(logits[0, n)) and the top-1 minus top-2 logit, n >= 2: one pass of float
// exps after the maximum, within 1e-6 nats of the reference (a softmax, then -sum p log p in double: three
// passes and two double exps a logit).
void DistributionStats(const float* logits, int64_t n, double* entropy, double* margin);
void DistributionStatsReference(const float* logits, int64_t n, double* entropy, double* margin);
}  // namespace cpu

}  // namespace oryx::kernels
