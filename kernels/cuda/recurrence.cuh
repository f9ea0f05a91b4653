// What the recurrence's two files share (recurrent.cu: the token-by-token kernel and Recurrent;
// chunked_scan.cu: the chunked scans of long spans). Not part of the ops' interface.
#pragma once

#include "kernels/cuda/ops_cuda.h"

namespace oryx::kernels::cuda::recurrence {

// Blocks per (..., head, kLanes value features), threads kLanes x kGroups.
inline constexpr int kLanes = 32, kGroups = 8;

// Whether the chunked scan (not RecurrentKernel) runs this sequence's span.
__device__ __forceinline__ bool TakesChunkedScan(const RecurrentParams& p, const SeqDesc& s) {
  return p.chunked_min_len > 0 && s.maybe_span_states == nullptr && s.len >= p.chunked_min_len;
}

// Launches the chunked scan of the spans that take it (p.scan_chunks > 0); `grid` is RecurrentKernel's
// (sequences, heads, value slices of kLanes).
void LaunchChunkedScan(const RecurrentParams& p, dim3 grid, cudaStream_t stream);

}  // namespace oryx::kernels::cuda::recurrence
