// The state moves of a whole speculative round (engine/cuda_backend.cc SpeculativeRound), each one launch for
// all of the round's sequences so that they sit inside the round's graph: the drafts refreshed from their
// sequences before the draft steps, and the sequences rolled back to their accepted drafts after the verify.
// Launched one copy at a time, the same moves took four API calls per sequence around every round.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSequence = 16;  // each block strides over a sequence's floats

__global__ void __launch_bounds__(kThreads)
    CopyRecurrentKernel(const SeqDesc* from, const SeqDesc* to, RoundStateDims d) {
  const SeqDesc& src = from[blockIdx.x];
  const SeqDesc& dst = to[blockIdx.x];
  const int64_t state = int64_t(d.layers) * d.heads * d.head_dim * d.head_dim;
  const int64_t conv = int64_t(d.layers) * d.conv_width * d.conv_channels;
  const int64_t stride = int64_t(gridDim.y) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; i < state + conv; i += stride) {
    if (i < state) {
      dst.state[i] = src.state[i];
    } else {
      dst.conv[i - state] = src.conv[i - state];
    }
  }
}

// The drafts a round accepted: sampled, the device's verdict (results [B, 2]: accepted, next); greedy, the
// leading drafts equal to the verify rows' argmaxes (results [B, S]), as AcceptGreedy (engine/backend.h) counts.
__device__ int Accepted(const RestoreAcceptedParams& p, int64_t b) {
  if (p.sampled) return p.results_ptr[2 * b];
  const int64_t S = p.drafts + 1;
  int accepted = 0;
  while (accepted < p.drafts && p.span_tokens_ptr[b * S + 1 + accepted] == p.results_ptr[b * S + accepted]) {
    ++accepted;
  }
  return accepted;
}

// Sequence b's state and window set to those after j = 1 + accepted tokens of its kept span (CudaSequence::
// RestoreSpan(j)): state row r of [L * H] from span_states [r, T + 1, dh * dh] at j; layer l's window from
// span_inputs [l, W + T, C] at rows j .. j + W - 1.
__global__ void __launch_bounds__(kThreads) RestoreAcceptedKernel(RestoreAcceptedParams p) {
  const SeqDesc& s = p.seqs_ptr[blockIdx.x];
  const RoundStateDims& d = p.dims;
  const int64_t j = 1 + Accepted(p, blockIdx.x), T = s.len;
  const int64_t dd = int64_t(d.head_dim) * d.head_dim, window = int64_t(d.conv_width) * d.conv_channels;
  const int64_t state = int64_t(d.layers) * d.heads * dd, conv = int64_t(d.layers) * window;
  const int64_t stride = int64_t(gridDim.y) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; i < state + conv; i += stride) {
    if (i < state) {
      const int64_t r = i / dd, e = i % dd;
      s.state[i] = s.maybe_span_states[(r * (T + 1) + j) * dd + e];
    } else {
      const int64_t l = (i - state) / window, e = (i - state) % window;
      s.conv[i - state] = s.maybe_span_inputs[l * (d.conv_width + T) * d.conv_channels + j * d.conv_channels + e];
    }
  }
}

}  // namespace

void CopyRecurrentStates(const SeqDesc* from, const SeqDesc* to, int64_t rows, const RoundStateDims& dims,
                         cudaStream_t stream) {
  if (rows == 0) return;
  CopyRecurrentKernel<<<dim3(static_cast<unsigned>(rows), kBlocksPerSequence), kThreads, 0, stream>>>(from, to, dims);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

void RestoreAccepted(const RestoreAcceptedParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  RestoreAcceptedKernel<<<dim3(static_cast<unsigned>(p.rows), kBlocksPerSequence), kThreads, 0, stream>>>(p);
  ORYX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace oryx::kernels::cuda
