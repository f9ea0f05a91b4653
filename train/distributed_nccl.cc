// The CUDA piece of data-parallel training: the GPU a rank trains on, and LibTorch's ProcessGroupNCCL. Built
// with LibTorch's CUDA part (ORYX_TORCH_CUDA) and NCCL's header (ORYX_HAVE_NCCL, the nccl.h of the NCCL that
// the torch wheel depends on); without them, NCCL is reported missing and a CUDA rank cannot start.
#include "absl/strings/str_cat.h"
#include "train/distributed.h"

#ifdef ORYX_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif
#ifdef ORYX_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace oryx::train {

bool HaveNccl() {
#ifdef ORYX_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

absl::Status UseCudaDevice(int index) {
#ifdef ORYX_TORCH_CUDA
  const int visible = c10::cuda::device_count();
  if (index < 0 || index >= visible) {
    return absl::FailedPreconditionError(absl::StrCat("LOCAL_RANK ", index, " trains on cuda:", index, ", but ",
                                                      visible, " CUDA device(s) are visible"));
  }
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError("a CUDA rank needs LibTorch's CUDA part, which this build lacks");
#endif
}

c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout) {
#ifdef ORYX_HAVE_NCCL
  // The communicator is made at the first collective, on the current device (UseCudaDevice); the timeout
  // bounds every collective (ProcessGroupNCCL's watchdog ends the process when one exceeds it).
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  TORCH_CHECK(false, "this build has no NCCL");
#endif
}

}  // namespace oryx::train
