// The CUDA ops of the Oryx forward (DESIGN.md §2) over a ragged batch: bf16 weights and bf16 GEMM inputs,
// fp32 residual stream, fp32 recurrent state and accumulation, a bf16 KV cache. Where kernels/cpu runs one
// op per call, these fuse what a decode step would otherwise launch separately (conv + activation + RoPE +
// KV append; residual add + RMSNorm; gate computation inside the recurrence), and take the whole batch at
// once through per-sequence descriptors. Each op has its CPU reference composition in tests/kernels.
//
// Dimension legend: N rows (tokens of all sequences of a batch), B sequences, T tokens of one sequence's
// span, D d_model, H heads, dh head dim, HD = H*dh, P fused in_proj width, F mlp hidden, V vocab,
// w conv width, W = w-1 conv window rows, L layers, cap KV capacity (tokens) of a sequence.
//
// Contract: all pointers are device pointers, row-major, last dimension contiguous; `stream` is the
// cudaStream_t to launch on. Inputs are validated by the backend before any launch; kernels do no checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace oryx::kernels::cuda {

using bf16 = __nv_bfloat16;

// Positions per block of the paged KV cache. A block holds, for every layer, the rotated keys and then the
// values of kKvBlockTokens consecutive positions: [L][2][kKvBlockTokens][HD] bf16. A sequence's cache is a
// table of blocks in position order (block j: positions [64j, 64j + 64)), anywhere in device memory, so
// that growing a cache copies nothing and clones share blocks. The kernels reach rows through KeyRow /
// ValueRow (common.cuh).
inline constexpr int kKvBlockTokens = 64;

// One sequence of a batched forward, on the device. Layer il's slices sit at il * (layer stride).
struct SeqDesc {
  int32_t row;              // first row of this sequence's span in the batch buffers
  int32_t len;              // T
  int64_t pos;              // position of the span's first token (tokens already in the cache)
  int64_t kv_cap;           // positions the KV cache has blocks for (0: a draft sequence without KV cache)
  float* state;             // [L, H, dh, dh] recurrent state S[h][i][j] (i key, j value feature)
  float* conv;              // [L, W, 2HD] the last W conv inputs, oldest first
  bf16* const* kv_blocks;   // [kv_cap / kKvBlockTokens] the cache's blocks in position order (null for a draft)
  float* maybe_span_states; // [L, H, T+1, dh, dh]: the state before the span and after each token, or null
  float* maybe_span_inputs; // [L, W+T, 2HD]: the conv window before the span, then the span's inputs, or null
};

// Shapes of the model that the ops need.
struct ModelDims {
  int32_t d_model, heads, head_dim, conv_width, mlp_hidden, vocab;
  int32_t proj_width;  // P = 4HD + G + HD, rows: k, v, q_linear, g, gates (G = H or 2H), q_attn
  bool gdn;            // linear mixer: gdn (else mamba2)
  bool conv_silu;      // conv activation SiLU (else identity)
  float norm_eps;
  double rope_theta;   // 0: no RoPE
  int64_t attn_log_scale_base;  // attention queries x AttnQueryScale(base, position) (common.cuh); 0: off
};

// Weights in FP8 (`--weights fp8`): W[n, k] = row_scale[n] * e4m3[n, k], the scale a power of two chosen per
// row so that the row's largest |w| lands in e4m3's top binade. Power-of-two scales cost nothing in precision
// (a float format's relative step does not depend on the scale) and make every dequantised weight exactly a
// bf16, so the GEMV (which reads the FP8 bytes) and the cuBLAS path (which reads a bf16 copy made in front of
// it) multiply by the same weights.
using fp8 = uint8_t;  // __nv_fp8_e4m3's storage
// The scale of a row whose largest |w| is amax: the smallest power of two 2^e with amax / 2^e <= 448 (e4m3's
// largest finite value), computed exactly (the same on the host); 1 for a zero row.
__host__ __device__ inline float Fp8RowScale(float amax) {
  if (!(amax > 0.f)) return 1.f;
  int e = 0;
  const float f = frexpf(amax / 448.f, &e);  // amax / 448 = f 2^e, f in [0.5, 1)
  return ldexpf(1.f, f == 0.5f ? e - 1 : e);
}
// dst[r, :] = e4m3(src[r, :] / scale[r]) (round to nearest even, saturating), scale[r] = Fp8RowScale(max |src[r, :]|).
void QuantizeRowsFp8(const bf16* src, int64_t rows, int64_t cols, fp8* dst, float* scale, cudaStream_t stream);
// dst[r, :] = bf16(scale[r] * e4m3 src[r, :]) (exact).
void DequantizeRowsFp8(const fp8* src, const float* scale, int64_t rows, int64_t cols, bf16* dst, cudaStream_t stream);

// y[M, N] (fp32) = x[M, K] (bf16) · W[N, K]^T (bf16, or FP8 with w_scale), fp32 accumulation. `handle` is a
// cublasHandle_t bound to the stream the caller uses. Gemm takes a GEMV kernel for a single row (K a multiple
// of 8, 16-byte aligned operands), and for up to 8 rows of FP8 weights (K a multiple of 16) or of bf16 weights
// (KernelSwitches::multirow_bf16: by default those of at most kMultiRowMaxWeights weights); weights of 2 to 32
// rows take a tensor-core GEMV first (MmaGemvApplies), FP8 weights of 8 to 128 rows a tensor-core kernel
// (Fp8MmaApplies); cuBLAS otherwise; GemmCublas always cuBLAS
// (the GEMV's reference in tests). FP8 weights on the cuBLAS path are first dequantised into w_bf16_scratch
// ([N, K], required then).
struct GemmParams {
  int64_t m, n, k;
  int64_t x_row_stride, y_row_stride;
  const bf16* x_ptr;  // [M, K]
  const void* w_ptr;  // [N, K] contiguous: bf16, or fp8 where w_scale is set
  float* y_ptr;       // [M, N]
  bool accumulate = false;  // y += x W^T (a residual add)
  bool early_loads = false;  // set by Gemm (EarlyLoads in common.cuh)
  // With accumulate: y was last written by a kernel two or more launches before this one (not the one just
  // before), so its old values may be read before the programmatic-launch wait.
  bool y_written_earlier = false;
  // A single row (m = 1) only: *maybe_argmax_key = max(*maybe_argmax_key, ArgmaxKey(y[n], n)) over the
  // product's outputs, so that the argmax of y comes out of the product itself (a greedy decode step's LM
  // head: no kernel over the logits after it). The caller zeroes the key first; ArgmaxToken reads it.
  unsigned long long* maybe_argmax_key = nullptr;
  // The up projection's SwiGLU in the product's epilogue (MmaGemvApplies products only, N even, no
  // accumulate): act[m, j] = bf16(SiLU(y[m, j]) y[m, N/2 + j]) into this [M, N/2] instead of y, exactly what
  // SwiGlu writes from y.
  bf16* maybe_swiglu_ptr = nullptr;
  const float* w_scale = nullptr;  // [N]: w_ptr holds FP8 e4m3 (see QuantizeRowsFp8)
  bf16* w_bf16_scratch = nullptr;  // FP8 on the cuBLAS path: room for [N, K] bf16
  // An RMSNorm split between two products on the tensor-core GEMV (MmaGemvApplies), so that no kernel runs
  // between a residual add and the product that reads its norm (a batch's decode step):
  // - the product that adds into the residual (accumulate, no SwiGLU epilogue) also writes bf16(y'[m, n] *
  //   norm_out.weight_ptr[n]) of y's new values y' into norm_out.scaled_ptr ([M, N]), and the sums of squares of
  //   y' over each block's 16 columns into norm_out.sum_sq_ptr ([CeilDiv(N, 16), M]);
  // - the product that reads that as its x (its K the first's N) scales row m's sums by
  //   rsqrt(sum of norm_in.sum_sq_ptr[., m] / K + norm_in.eps).
  // Together: RMSNorm(y') * weight times W, x rounded to bf16 before the norm's scale instead of after (the
  // rounding's relative error is the same at any scale).
  struct NormOut {
    bf16* scaled_ptr = nullptr;
    const float* weight_ptr = nullptr;
    float* sum_sq_ptr = nullptr;
  };
  struct NormIn {
    const float* sum_sq_ptr = nullptr;
    float eps = 0.f;
  };
  NormOut norm_out = {};
  NormIn norm_in = {};
  // The tensor-core GEMV (MmaGemvApplies) asks L2 for these bytes, shared out over its blocks, before its
  // programmatic-launch wait: a later kernel's weights, which nothing writes (other paths ignore them).
  const void* maybe_prefetch_ptr = nullptr;
  int64_t prefetch_bytes = 0;
};
// A float's bits as an unsigned key with the floats' order (-0 is +0, so that equal values have equal keys).
__host__ __device__ inline uint32_t OrderedBits(float value) {
  value = value == 0.f ? 0.f : value;
#ifdef __CUDA_ARCH__
  const uint32_t bits = __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
#endif
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
// Keys that order (value, index) pairs as the argmax does: the larger value first, ties to the lower index.
__host__ __device__ inline unsigned long long ArgmaxKey(float value, int64_t index) {
  return (static_cast<unsigned long long>(OrderedBits(value)) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}
__host__ __device__ inline int32_t ArgmaxToken(unsigned long long key) {
  return static_cast<int32_t>(0xffffffffu - (key & 0xffffffffu));
}
void Gemm(const GemmParams& p, void* cublas_handle);
// The largest bf16 product (n * k weights) that KernelSwitches::MultiRow::kAuto gives the several-row GEMV.
// On the H200, models/default's products (up to 8192 x 512, its LM head) at 4-8 rows took 0.15-0.19 ms a
// linear step by it against 0.25 ms by cuBLAS; 1.4b's (2048 x 11K and more) are left to cuBLAS.
inline constexpr int64_t kMultiRowMaxWeights = int64_t{8} << 20;
// Whether Gemm takes the GEMV kernel: one row (up to 8 without an argmax key, for FP8 weights or for bf16 with
// KernelSwitches::multirow_bf16), K a multiple of 8 (16 for FP8), x and W 16-byte aligned, x's row stride a
// multiple of 8.
bool GemvApplies(const GemmParams& p);
// Whether Gemm takes the FP8 tensor-core kernel: FP8 weights, KernelSwitches::fp8_mma_min_rows to
// kFp8MmaMaxRows rows, K a multiple of 32, x and W 16-byte aligned, x's row stride a multiple of 8, no argmax
// key, K at most 12,288 (for its staged x), a Hopper or later (thread-block clusters). It is
// checked before GemvApplies.
inline constexpr int64_t kFp8MmaMaxRows = 128;
bool Fp8MmaApplies(const GemmParams& p);
// Whether Gemm takes the tensor-core GEMV (MmaGemvKernel in matmul.cu): 2 to KernelSwitches::bf16_mma_gemv_max_rows
// rows of bf16 weights, or fp8_mma_gemv_max_rows of FP8 ones (at most kMmaGemvMaxRows), past 8 rows only bf16
// products of at most kMmaGemvWideMaxWeights weights, K a multiple of 32 (64 for FP8), x and W 16-byte
// aligned, x's row stride a multiple of 8, no argmax key, compute capability 8 or later. Gemm asks first for
// FP8 weights; for bf16 after GemvApplies for up to 3 rows. On the H100, 1.4b's products at 8 rows took 0.67-0.91x of
// the time of the several-row GEMV or cuBLAS that had them; past 8 rows each block reads as many bytes of x from L2 as
// of weights, and cuBLAS was faster for its largest product (the up projection, 2 x 5440 x 2048: 18.2 against 19.1 µs
// at 16 rows).
inline constexpr int64_t kMmaGemvMaxRows = 32;
inline constexpr int64_t kMmaGemvWideMaxWeights = int64_t{20} << 20;
bool MmaGemvApplies(const GemmParams& p);
void GemmCublas(const GemmParams& p, void* cublas_handle);

// The decode-step product with its input op fused in front (one kernel instead of two per projection):
//   y[m, n] (+)= sum_k in'[m, k] W[n, k],  in' = bf16 of
//     kRmsNorm:   RMSNorm(x) * weight                        (in: x [M, K] fp32, weight [K])
//     kGatedNorm: RMSNormPerHead(o) * weight * SiLU(gate)    (in: o [M, K = H*dh], gate, weight [dh])
// exactly what AddRmsNorm / GatedNorm write, so the result is the unfused path's up to summation order.
// accumulate: y += (the residual add). Taken for up to max_rows rows (single rows by default) with K a
// multiple of 8, 16 for FP8 weights (FusedGemvApplies); the kernel itself takes 1 <= M <= 8 of bf16 weights,
// one row of FP8. (The SwiGLU goes in the up projection's epilogue: maybe_swiglu_ptr.)
enum class GemvInput : uint8_t { kRmsNorm, kGatedNorm };
struct FusedGemvParams {
  int64_t m, n, k;
  GemvInput input;
  float eps;
  int64_t head_dim;          // kGatedNorm
  int64_t in_row_stride, gate_row_stride, y_row_stride;
  const float* in_ptr;       // [M, K]
  const float* gate_ptr;     // kGatedNorm: [M, K] at gate_row_stride
  const float* weight_ptr;   // kRmsNorm: [K]; kGatedNorm: [dh]
  const void* w_ptr;         // [N, K]: bf16, or fp8 where w_scale is set
  float* y_ptr;              // [M, N]
  bool accumulate;
  const float* w_scale = nullptr;  // [N]: w_ptr holds FP8 e4m3 (see QuantizeRowsFp8)
  // Rows [skip_begin, skip_begin + skip_rows) of the weight are skipped: the kernel computes n rows, row i
  // from weight row i (i < skip_begin) or i + skip_rows, written to the same column of y.
  int64_t skip_begin = 0, skip_rows = 0;
  // When set, the SwiGLU of the product is written instead of y: rows come in pairs (gate row j, up row
  // j + n/2), and y'[m, j] = bf16(SiLU(gate) * up), [M, n/2] at y_row_stride (accumulate and skip unused).
  bf16* maybe_swiglu_ptr = nullptr;
  int rows_per_warp = 0;  // weight rows each warp streams: 1, 2, 4 or 8 (0: chosen by n)
  bool early_loads = false;  // set by FusedGemv (EarlyLoads in common.cuh)
  bool stage = false;        // set by FusedGemv: the prologue's constants go through shared memory
  bool y_written_earlier = false;  // as GemmParams's
  // kGatedNorm: the gate was last written by a kernel two or more launches before this one, so it may be
  // read before the programmatic-launch wait (staged into shared memory with the norm weight).
  bool gate_written_earlier = false;
};
bool FusedGemvApplies(int64_t m, int64_t k, bool fp8 = false, int64_t max_rows = 1);
void FusedGemv(const FusedGemvParams& p, cudaStream_t stream);

// x[r] = embed[tokens[r]] (bf16 table to the fp32 residual stream). Parallel over (row, feature).
struct EmbedParams {
  int64_t rows, d;
  const int32_t* tokens_ptr;  // [N], row r's token at r * tokens_stride
  const bf16* table_ptr;      // [V, D]
  float* x_ptr;               // [N, D]
  int64_t tokens_stride = 1;
};
void Embed(const EmbedParams& p, cudaStream_t stream);

// Optionally x += maybe_delta, then y = bf16(x / sqrt(mean(x^2) + eps) * weight). With maybe_rows, only
// rows maybe_rows[0..rows) of x are read and their norms written densely to y (the final norm of the logit
// rows). One block per row.
struct AddRmsNormParams {
  int64_t rows, d;
  float eps;
  float* x_ptr;                // [N, D] in/out residual stream (written only when maybe_delta_ptr)
  const float* maybe_delta_ptr;  // [N, D] added to x first, or null
  const float* weight_ptr;     // [D]
  const int32_t* maybe_rows_ptr;  // [rows] which rows of x, or null (all, in order)
  bf16* y_ptr;                 // [rows, D]
};
void AddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream);

// The layer's shared causal conv (continuing each sequence's window), its activation, RoPE on the keys,
// the KV cache append (bf16), and RoPE of the attention queries:
//   kv[r, c]   = act(bias[c] + sum_j weight[c, j] * in_{t-W+j}[c])       c < 2HD (k then v), fp32
//   key[pos_r] = RoPE(kv[r, :HD]),  value[pos_r] = kv[r, HD:]              (sequences with a cache)
//   qa[r]      = RoPE(proj[r, q_attn])                                     (rows of attention mode)
// Reads the window, does not write it (ConvWindowUpdate does, after). Parallel over (row, channel < HD).
struct ConvRopeAppendParams {
  ModelDims dims;
  int32_t layer;
  int64_t rows;
  const int32_t* row_seq_ptr;   // [N] sequence index of each row
  const uint8_t* row_mode_ptr;  // [N] 1: attention
  const SeqDesc* seqs_ptr;      // [B]
  const float* proj_ptr;        // [N, P]
  const float* conv_weight_ptr; // [2HD, w]
  const float* conv_bias_ptr;   // [2HD]
  float* kv_ptr;                // [N, 2HD] conv outputs (k, v) after the activation, k not rotated
  float* qa_ptr;                // [N, HD] rotated attention queries (attention rows only)
  const double* maybe_rope_freq_ptr;  // [dh/2] theta^(-2i/dh) in double (computed per element when null)
};
void ConvRopeAppend(const ConvRopeAppendParams& p, cudaStream_t stream);

// Moves each sequence's conv window past its span (the last W of window ++ span inputs) and, where the
// sequence keeps its span, records window ++ inputs in maybe_span_inputs. Parallel over (sequence, channel).
struct ConvWindowUpdateParams {
  ModelDims dims;
  int32_t layer;
  int64_t seqs;
  const SeqDesc* seqs_ptr;  // [B]
  const float* proj_ptr;    // [N, P] raw conv inputs at columns [0, 2HD)
};
void ConvWindowUpdate(const ConvWindowUpdateParams& p, cudaStream_t stream);

// The linear mixer over every sequence's span, token by token, from its state (DESIGN.md §2):
//   mamba2: dt = softplus(g + dt_bias), a = exp(-dt exp(A_log)); S = a S + dt k v^T; out = S^T q + D v
//   gdn:    beta = sigmoid(g0), alpha = exp(-exp(A_log) softplus(g1 + dt_bias)), kn, qn L2-normalised
//           (qn / sqrt(dh)); S = alpha (S - beta kn (kn^T S)) + beta kn v^T; out = S^T qn
// with g the gate columns of proj. Writes out for linear-mode rows only (attention rows take Attention's
// output); records the state after each token where the sequence keeps its span. One block per
// (sequence, head, 32 value features): that slice of S stays in shared memory over the whole span.
// Chunked scan: with chunked_min_len > 0, a sequence whose span has at least that many tokens and keeps no
// states runs in chunks of 64 tokens instead (per chunk the decay-masked 64 x 64 scores q_t . k_s, what
// each token writes into the state (gdn: by the chunked delta rule's triangular solve), the contribution of
// the state entering the chunk, then the chunk's state update), the same fp32 math regrouped. gdn runs a
// span's chunks in order; mamba2 runs all chunks in parallel and passes the state between them after, in
// scan_scratch (ChunkedScanScratchFloats of scan_chunks, the count ChunkedScanChunks gives; with
// scan_chunks 0 every mamba2 span runs token by token). State-capturing spans always run token by token.
inline constexpr int32_t kChunkedScanMinLen = 128;  // the backend's threshold (> the longest span it runs in a CUDA graph, 64)
struct RecurrentParams {
  ModelDims dims;
  int32_t layer;
  int64_t seqs;
  const SeqDesc* seqs_ptr;      // [B]
  const uint8_t* row_mode_ptr;  // [N]
  const float* proj_ptr;        // [N, P]: q_linear at 2HD, gates at 4HD
  const float* kv_ptr;          // [N, 2HD] conv outputs
  const float* dt_bias_ptr;     // [H]
  const float* a_log_ptr;       // [H]
  const float* maybe_d_skip_ptr;  // [H] mamba2
  float* out_ptr;               // [N, HD]
  int32_t chunked_min_len = 0;  // 0: every span token by token
  int64_t scan_chunks = 0;      // mamba2: the chunks of the spans that take the chunked scan
  float* scan_scratch = nullptr;  // mamba2: [ChunkedScanScratchFloats]
};
void Recurrent(const RecurrentParams& p, cudaStream_t stream);
// The chunks of a span that keeps no states in the chunked scan (0: the span runs token by token);
// scan_chunks is their sum over the batch's spans.
int64_t ChunkedScanChunks(int64_t span_len, int32_t chunked_min_len);
// Floats of scan_scratch for that many chunks (0 for gdn).
int64_t ChunkedScanScratchFloats(const ModelDims& dims, int64_t chunks);

// A decode step's ConvRopeAppend + ConvWindowUpdate + Recurrent in one kernel, for batches whose every
// sequence's span is one token and keeps nothing for rollback (no maybe_span_states / maybe_span_inputs):
// the same outputs (qa at attention rows, out at linear rows, the caches, windows and states), except that
// the fp32 conv outputs (kv) are not written. One block per (sequence, head, 32 value features), the blocks
// of a head a thread-block cluster; a Hopper or later and head_dim 32, 64 or 128 (DecodeMixerApplies).
struct DecodeMixerParams {
  ModelDims dims;
  int32_t layer;
  int64_t seqs;                  // B (= N)
  const SeqDesc* seqs_ptr;       // [B], each with len 1
  const uint8_t* row_mode_ptr;   // [N] 1: attention
  const float* proj_ptr;         // [N, P]
  const float* conv_weight_ptr;  // [2HD, w]
  const float* conv_bias_ptr;    // [2HD]
  const float* dt_bias_ptr;      // [H]
  const float* a_log_ptr;        // [H]
  const float* maybe_d_skip_ptr; // [H] mamba2
  float* qa_ptr;                 // [N, HD]
  float* out_ptr;                // [N, HD]
  const double* maybe_rope_freq_ptr;  // as ConvRopeAppendParams
  bool early_loads = false;           // set by DecodeMixer (EarlyLoads in common.cuh)
  // With no attention row in the forward: the outputs' gated norm, what GatedNorm writes from them, into this
  // [N, HD] instead of out_ptr: bf16(RMSNormPerHead(out) * gate_norm * SiLU(gate)), the gate in proj's
  // columns [gate_column, gate_column + HD). (The head's sum of squares is added up in another order than
  // GatedNorm's.)
  bf16* maybe_gated_ptr = nullptr;
  int64_t gate_column = 0;
  const float* gate_norm_ptr = nullptr;  // [dh]
  // The first prefetch_bytes of the next product's weights (the up projection's), which the mixer asks L2 to
  // fetch before its wait (PrefetchShareToL2; docs/CUDA.md, "The up projection's first weights in L2").
  const void* maybe_prefetch_ptr = nullptr;
  int64_t prefetch_bytes = 0;
};
bool DecodeMixerApplies(const ModelDims& dims);
void DecodeMixer(const DecodeMixerParams& p, cudaStream_t stream);

// Softmax attention of each attention-mode row over its sequence's cache, causal (row at position p sees
// keys 0..p), scale 1/sqrt(dh), split over chunks of `chunk` keys (flash-decoding): the first kernel
// writes each chunk's (max, sum, unnormalised output) into `partial`, the second combines them.
// Grid: (attention row or group of rows, head, chunk). AttentionChunkFor picks the chunk so that short
// contexts still spread over the whole GPU (attn_rows: the rows or row groups that get blocks), and takes
// chunks longer than 256 keys (up to max_chunk) only where at least about three waves of blocks remain.
inline constexpr int kAttentionChunk = 512;  // the longest chunk of the CUDA-core kernels (their shared memory)
inline constexpr int kGroupMmaChunk = 1024;  // the longest chunk of the tensor-core group kernel (streamed)
int64_t AttentionChunkFor(int64_t max_keys, int64_t attn_rows, int64_t heads, int64_t max_chunk = 256);
struct AttentionParams {
  ModelDims dims;
  int32_t layer;
  int64_t attn_rows;               // NA
  int64_t chunk;                   // keys per block, <= kAttentionChunk
  int64_t max_chunks;              // >= chunks of the longest row (ceil((pos + 1) / chunk))
  const int32_t* attn_rows_ptr;    // [NA] row indices
  const int32_t* row_seq_ptr;      // [N]
  const SeqDesc* seqs_ptr;         // [B]
  const float* qa_ptr;             // [N, HD] rotated queries
  float* partial_ptr;              // [NA, H, max_chunks, dh + 2]
  float* out_ptr;                  // [N, HD] written at attention rows
  // Optional: the attention rows in groups of up to kAttentionGroupRows consecutive entries of attn_rows of
  // one sequence, in position order, each group's key chunks read once for all its rows (head_dim 32, 64,
  // 128 or 256; otherwise, or when null, a block per row). Up to kAttentionMmaGroupRows where
  // GroupAttentionMmaTakes(dims, group_rows).
  int64_t attn_groups = 0;               // NG
  const int32_t* groups_ptr = nullptr;   // [NG, 2]: first index into attn_rows, rows
  int32_t group_rows = 0;                // the most rows of a group
};
inline constexpr int kAttentionGroupRows = 8;
void Attention(const AttentionParams& p, cudaStream_t stream);

// The same on tensor cores for long spans (prefill), flash-attention style: a block per (group of up to
// kAttentionTileRows attention rows of one sequence in position order, given in groups_ptr, head), keys
// streamed through shared memory in tiles of 64 with an online softmax; the fp32 queries and probabilities
// enter the bf16 products as two bf16 terms each (16 bits of mantissa), fp32 accumulation and softmax. No
// partials (partial_ptr, chunk unused). head_dim 64 or 128 on compute capability 8 or later
// (TiledAttentionApplies).
inline constexpr int kAttentionTileRows = 64;
bool TiledAttentionApplies(const ModelDims& dims);
void TiledAttention(const AttentionParams& p, cudaStream_t stream);
// Attention's first kernel for groups of rows (groups_ptr set) on tensor cores: the same partials as the
// CUDA-core group kernel, for AttentionCombine, for groups of up to kAttentionMmaGroupRows rows (the 16 rows
// of an mma). head_dim 64 or 128 on compute capability 8 or later; ORYX_CUDA_GROUP_MMA=0: never. Attention
// calls it when GroupAttentionMmaTakes the largest group (group_rows), whose groups may then have up to 16 rows.
inline constexpr int kAttentionMmaGroupRows = 16;
bool GroupAttentionMmaApplies(const ModelDims& dims);
// Whether Attention runs groups of at most `rows` rows (the largest group) on tensor cores.
bool GroupAttentionMmaTakes(const ModelDims& dims, int64_t rows);
void GroupAttentionMma(const AttentionParams& p, cudaStream_t stream);

// y = bf16(RMSNormPerHead(o) * weight * SiLU(g)), g the gate columns [3HD, 4HD) of proj. One block per row.
struct GatedNormParams {
  int64_t rows, heads, head_dim;
  float eps;
  int64_t gate_row_stride;
  const float* o_ptr;       // [N, HD]
  const float* gate_ptr;    // [N, HD] at stride gate_row_stride
  const float* weight_ptr;  // [dh]
  bf16* y_ptr;              // [N, HD]
};
void GatedNorm(const GatedNormParams& p, cudaStream_t stream);

// y = bf16(SiLU(gate) * up) from the fused [N, 2F] product (gate columns first).
struct SwiGluParams {
  int64_t rows, d;
  const float* in_ptr;  // [N, 2F]
  bf16* y_ptr;          // [N, F]
};
void SwiGlu(const SwiGluParams& p, cudaStream_t stream);

// tokens[r * tokens_stride] = argmax logits[r] (ties to the lowest index). One block per row.
struct ArgmaxParams {
  int64_t rows, vocab;
  const float* logits_ptr;  // [rows, V]
  int32_t* tokens_ptr;      // [rows], strided
  int64_t tokens_stride = 1;
};
void Argmax(const ArgmaxParams& p, cudaStream_t stream);

// What a router reads of each row of logits (kernels::cpu::DistributionStats, engine/sampler.h's LogitStats):
// stats[2r] the entropy of softmax(logits[r]) in nats, stats[2r + 1] the top-1 minus top-2 logit (0 and 0
// for a vocabulary of one). Float sums in another order than the CPU's. One block per row.
struct DistributionStatsParams {
  int64_t rows, vocab;
  const float* logits_ptr;  // [rows, V]
  float* stats_ptr;         // [rows, 2]
};
void DistributionStats(const DistributionStatsParams& p, cudaStream_t stream);

// Sampling as engine/sampler.cc's Sampler does it, with the uniforms drawn by the caller. A row's
// distribution: candidates ordered by (logit descending, index ascending), the first top_k (0: all), softmax
// of logit / temperature over them, the shortest prefix whose mass reaches top_p, renormalised; temperature
// 0 puts all mass on the first candidate. A draw walks the probabilities in index order and takes the first
// token whose cumulative mass exceeds uniform * total (Sampler::Draw). Sums run in another order than the
// CPU's, so a token may differ from the CPU's only where the uniform or the top_p boundary lies within
// rounding of a cumulative mass. Vocabularies up to 2^31.
struct SamplingDims {
  int64_t vocab;
  float temperature;  // >= 0
  int64_t top_k;      // >= 0
  float top_p;        // in (0, 1]
};
// Device bytes of the workspace for `rows` rows of logits.
int64_t SamplingWorkspaceBytes(int64_t rows);

// tokens[r] = the token Sampler::Next draws from logits[r] with uniforms[r]. Two blocks per row in turn (the
// distribution's cut, then the draw).
struct SampleRowsParams {
  int64_t rows;
  SamplingDims dims;
  const float* logits_ptr;     // [rows, V]
  const double* uniforms_ptr;  // [rows], in [0, 1)
  int32_t* tokens_ptr;         // [rows] at tokens_stride
  void* workspace_ptr;         // SamplingWorkspaceBytes(rows)
  int64_t tokens_stride = 1;
  // When set, each row's distribution (Sampler::Distribution's) is written too, rows probs_row_stride apart.
  float* maybe_probs_ptr = nullptr;
  int64_t probs_row_stride = 0;
};
void SampleRows(const SampleRowsParams& p, cudaStream_t stream);

// speculative::AcceptLossless (speculative/speculative.h) on the device: given the verify logits p_0..p_n,
// the n drafts and their distributions q (null: point masses), accepts d_i while uniform < p_{i-1}(d_i) /
// q_{i-1}(d_i) (greedy: while d_i is the argmax), then draws the recovered token from norm(max(0, p - q))
// at the first rejection or the bonus token from p_n. The uniforms are consumed in the order the CPU's
// sampler stream gives them: one per judged draft, then one for the draw (none when greedy).
struct AcceptLosslessParams {
  int64_t drafts;              // n
  SamplingDims dims;
  const float* logits_ptr;     // [n + 1, V]
  const int32_t* drafts_ptr;   // [n]
  const float* maybe_q_ptr;    // [n, V], or null: each draft proposed with certainty
  const double* uniforms_ptr;  // [n + 1]
  int32_t* result_ptr;         // [2]: the number accepted, then the recovered or bonus token
  void* workspace_ptr;         // SamplingWorkspaceBytes(n + 1)
};
void AcceptLossless(const AcceptLosslessParams& p, cudaStream_t stream);

// A whole speculative round's state moves, one launch each for all its sequences (round_states.cu). The
// sequences' recurrent state [L, H, dh, dh] and conv window [L, W, C] (C = 2HD), as SeqDesc holds them.
struct RoundStateDims {
  int32_t layers, heads, head_dim, conv_width, conv_channels;
};
// Before the draft steps: from[b]'s state and window copied into to[b]'s (the drafts refreshed).
void CopyRecurrentStates(const SeqDesc* from, const SeqDesc* to, int64_t rows, const RoundStateDims& dims,
                         cudaStream_t stream);
// After the verify: each sequence's state and window brought back to those after its pending token and its
// accepted drafts, from the verify span's kept history (SeqDesc::maybe_span_states, maybe_span_inputs).
struct RestoreAcceptedParams {
  const SeqDesc* seqs_ptr;  // [rows]: the verify's descriptors (len = drafts + 1, history kept)
  int64_t rows;
  int64_t drafts;                  // k
  const int32_t* span_tokens_ptr;  // [rows, k + 1]: pending, d_1..d_k
  const int32_t* results_ptr;      // sampled [rows, 2] (accepted, next); greedy [rows, k + 1] the verify argmaxes
  bool sampled;
  RoundStateDims dims;
};
void RestoreAccepted(const RestoreAcceptedParams& p, cudaStream_t stream);

// Process-wide switches of kernel variants, each on by default. The backend sets them from its options
// (BackendOptions::cuda, which the CLI fills from ORYX_CUDA_* variables); for measuring what a variant brings.
struct KernelSwitches {
  bool early_loads = true;          // loads of constants before the wait for the previous kernel (common.cuh)
  bool programmatic_launch = true;  // programmatic dependent launch, on a Hopper or later
  bool wide_gemv = true;            // the wide single-row product where its grid fits (matmul.cu)
  bool group_mma = true;            // verify spans of group_mma_min_rows or more rows attend on tensor cores
  int group_mma_min_rows = 3;       // (GroupAttentionMmaTakes)
  int attention_chunk = 256;        // the longest chunk of keys per block of the CUDA-core kernels (<= kAttentionChunk)
  int group_mma_chunk = 1024;       // the same for tensor-core groups (<= kGroupMmaChunk)
  bool split_ragged_gemm = true;    // a cuBLAS product of n outputs, n not a multiple of 64: two products (matmul.cu)
  int fp8_mma_min_rows = 8;         // FP8 products of this many rows (up to kFp8MmaMaxRows) on tensor cores
  // Products of 2-8 rows of bf16 weights by the several-row GEMV instead of cuBLAS: kOn, kOff, or kAuto: for
  // products of at most kMultiRowMaxWeights weights, where cuBLAS's fixed costs outweigh its streaming.
  enum class MultiRow : uint8_t { kAuto, kOn, kOff };
  MultiRow multirow_bf16 = MultiRow::kAuto;
  // bf16 and FP8 products of 2 to this many rows (at most kMmaGemvMaxRows) on the tensor-core GEMV; 0: none.
  int bf16_mma_gemv_max_rows = 32;
  int fp8_mma_gemv_max_rows = 32;
  // Decode steps of at least head_mixer_min_seqs sequences (0: none) and head_dim at least head_mixer_min_dim run
  // the mixer a head per block (DecodeMixerHeadKernel in decode_mixer.cu); others, a head per cluster of dh/32
  // blocks.
  int head_mixer_min_seqs = 2;
  int head_mixer_min_dim = 128;
  // The share of an SM's unified L1 and shared memory (percent of the most shared memory) that the head-per-block
  // mixer asks to be shared memory, set at its first launch; -1: no preference. Left to itself the driver gives
  // it the largest share (for occupancy), and under programmatic launch no SM then drains to give the GEMVs
  // after it their L1 back; 0 asks for the least share that holds one block.
  int head_mixer_carveout = 0;
};
void SetKernelSwitches(const KernelSwitches& switches);
const KernelSwitches& GetKernelSwitches();

// Converts fp32 to bf16 (round to nearest even), n elements.
void FloatToBf16(const float* x, bf16* y, int64_t n, cudaStream_t stream);

// Fills n elements with values uniform in [lo, hi) from a counter-based hash of (seed, index): random
// weights for benchmarks, made on the device.
void FillUniform(float* y, int64_t n, uint32_t seed, float lo, float hi, cudaStream_t stream);
void FillUniform(bf16* y, int64_t n, uint32_t seed, float lo, float hi, cudaStream_t stream);

}  // namespace oryx::kernels::cuda
