// Memory-bandwidth probes: copy and read-reduce over large buffers. Every roofline in bench/ divides the
// bytes a step must move by the bandwidth these measure on the same machine.
//
// One declaration, two implementations: kernels/cpu/stream.cc (Eigen) and kernels/cuda/stream.cu.
#pragma once

#include <cstdint>

namespace oryx::kernels {

struct StreamParams {
  int64_t n;            // number of fp32 elements
  const float* x_ptr;   // [n] input
  float* y_ptr;         // [n] output (copy); unused by StreamSum
  float* sum_ptr;       // [1] output of StreamSum (host memory for CPU, device memory for CUDA)
};

namespace cpu {
void StreamCopy(const StreamParams& p);  // y = x, parallel over cores when OpenMP is on
void StreamSum(const StreamParams& p);   // *sum = sum(x)
// The slow, obviously correct references.
void StreamCopyReference(const StreamParams& p);
void StreamSumReference(const StreamParams& p);
}  // namespace cpu

namespace cuda {
// `stream` is a cudaStream_t (kept opaque so callers need no CUDA headers); nullptr = default stream.
void StreamCopy(const StreamParams& p, void* stream);
void StreamSum(const StreamParams& p, void* stream);
// Number of CUDA devices visible, 0 when there is no driver or no device (never throws or aborts).
int DeviceCount();
}  // namespace cuda

}  // namespace oryx::kernels
