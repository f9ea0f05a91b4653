// The trainer's fused CUDA ops as autograd functions (kernels in train/cuda_train_kernels.cu).
#pragma once

#include <torch/torch.h>

namespace oryx::train {

// Whether this build has them (LibTorch with CUDA and the project's CUDA kernels).
bool HaveCudaTrainOps();

// The shared k/v causal depthwise convolution, in the [B, T, C] layout of the projections (no transposes,
// no padded copy): out[b, t, c] = bias[c] + sum_j weight[c, j] x[b, t - (w-1) + j, c]. x on the GPU in bf16,
// fp32 or fp64, its last dimension contiguous; weight [C, w] and bias [C] fp32 (fp64 for fp64 x).
// Differentiable in all three. Equal to torch::conv1d on the left-padded, transposed input.
torch::Tensor CausalDepthwiseConv(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// RMSNorm over the last dimension, x * rsqrt(mean(x^2) + eps) * weight, in one kernel each way (LibTorch's
// ops take five forward and as many backward). x fp32 (or fp64) on the GPU, weight of x's dtype; the output
// in x's dtype, or bf16 with bf16_out (what autocast would cast it to for a product). Differentiable in x
// and weight.
torch::Tensor FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool bf16_out);

// RoPE of x [B, T, H, dh] (bf16, fp32 or fp64 on the GPU, last dimension contiguous) with cos, sin
// [T, dh/2] fp32: the first and second halves of each head rotated as pairs, as ApplyRope in train/model.cc.
// Returns a packed tensor. Differentiable in x (the backward rotates back).
torch::Tensor FusedRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// SiLU(gate) * x in one kernel each way (the SwiGLU and the mixer's output gate). gate and x of one shape
// and dtype (bf16, fp32 or fp64) on the GPU, each with a unit last stride and rows that can be walked at one
// stride (a split of a wider tensor is taken as is); the output is packed. Differentiable in both.
torch::Tensor FusedSiluMul(const torch::Tensor& gate, const torch::Tensor& x);

// The two mixers' outputs per token, as train/model.cc combines them, in one kernel each way:
//   where(is_attn [B, T], attn, lin + skip[h] * v)  over [B, T, H, dh]
// attn and is_attn undefined when no token runs attention; skip [H] undefined without the skip term (GDN).
// attn and v bf16 or fp32 with lin and skip fp32, or all fp64, on the GPU; any strides with a packed last
// dimension (lin may be ScanChunked's head-major view, v a split of the conv output). Returns a packed
// tensor of lin's dtype. Differentiable in attn, lin, v and skip.
torch::Tensor CombineMixers(const torch::Tensor& attn, const torch::Tensor& lin, const torch::Tensor& v,
                            const torch::Tensor& skip, const torch::Tensor& is_attn);

// The Mamba-2 chunked scan's operands in its chunk layout (train/linear_mixers.cc), in one kernel each way:
// from q, k, v [B, T, H, dh] (any strides with a packed last dimension) and dt, to_end [B, H, N, C]
// (N C >= T), the packed [B, H, N, C, dh] tensors
//   q, k, dt * v, to_end * k      in dt's dtype, zero at the padded steps t >= T.
// q, k, v of one dtype, bf16 or fp32 with dt and to_end fp32, or all fp64, on the GPU; dh a power of two
// from 4 to 128 (ChunkPrepareAvailable). Differentiable in all five.
bool ChunkPrepareAvailable(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& dt);
std::vector<torch::Tensor> ChunkPrepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& dt, const torch::Tensor& to_end);

// The chunked scan's output inside each chunk (train/linear_mixers.cc) as one kernel each way: q, k, u
// [..., C, dh], g [..., C] (cumulative log decay within the chunk), s0 [..., dh, dh] (state entering it):
//   out[t] = exp(g_t) s0^T q_t + sum_{s<=t} exp(g_t - g_s) (q_t . k_s) u_s
// Differentiable in all five. ChunkOutputAvailable says whether a kernel exists for q's device, dtype
// and (C, dh): fp32 (64, 64), and fp64 (16, 8) for tests.
bool ChunkOutputAvailable(const torch::Tensor& q);
torch::Tensor ChunkOutput(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& u,
                          const torch::Tensor& g, const torch::Tensor& s0);

// GDN's chunk-to-chunk state passing, one kernel each way (the math: train/cuda_train_kernels.h), for
// ScanChunked's autograd function, which has a LibTorch form of both for other shapes and devices. All
// packed, of one dtype: x [B, H, N, C, 2 dh] ([U0 W] per chunk), k_end [B, H, N, C, dh], decay [B, H, N],
// initial [B, H, dh, dh] or undefined (zero). Available as ChunkOutputAvailable(k_end).
// -> {s0 [B, H, N, dh, dh], u [B, H, N, C, dh], final state [B, H, dh, dh]}
std::vector<torch::Tensor> GdnStatesKernelForward(const torch::Tensor& x, const torch::Tensor& k_end,
                                                  const torch::Tensor& decay, const torch::Tensor& initial);
// From the outputs' gradients (each may be undefined) -> {ds_next (the gradient of the state after each
// chunk), du (u's whole gradient), dinitial (undefined unless want_initial)}.
std::vector<torch::Tensor> GdnStatesKernelBackward(const torch::Tensor& x, const torch::Tensor& k_end,
                                                   const torch::Tensor& decay, const torch::Tensor& gs0,
                                                   const torch::Tensor& gu, const torch::Tensor& gfinal,
                                                   bool want_initial);

// GDN's UT-transform matrix per chunk, one kernel each way: from k [..., C, dh], g [..., C] (cumulative log
// decay within the chunk) and beta [..., C], all of one dtype on the GPU,
//   L[t][s] = beta_t exp(g_t - g_s) (k_t . k_s) for s < t, else 0          ([..., C, C])
// Differentiable in all three. Available as ChunkOutputAvailable(k).
torch::Tensor GdnMatrix(const torch::Tensor& k, const torch::Tensor& g, const torch::Tensor& beta);

// GDN's UT transform per chunk, one kernel each way: x = (I + L)^-1 [sv, diag(f) k] ([..., C, 2 dh]) from
// l [..., C, C] (only its strictly lower triangle is read; the rest takes no gradient), sv and k
// [..., C, dh] and f [..., C], all of one dtype on the GPU. The right-hand side is built as the kernel
// reads it. Differentiable in all four. Available as ChunkOutputAvailable(k).
torch::Tensor GdnSolve(const torch::Tensor& l, const torch::Tensor& sv, const torch::Tensor& k, const torch::Tensor& f);

}  // namespace oryx::train
