// LoadBackend (engine/backend.h): a checkpoint onto the device the options name.
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/backend.h"
#include "engine/cpu_backend.h"
#ifdef ORYX_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif

namespace oryx {

absl::StatusOr<std::unique_ptr<Backend>> LoadBackend(const std::string& model_dir, const BackendOptions& options) {
  if (options.device == "cpu") {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> cpu, CpuBackend::Load(model_dir, options.threads));
    return std::unique_ptr<Backend>(std::move(cpu));
  }
  if (options.device == "cuda") {
#ifdef ORYX_HAVE_CUDA
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> cuda, CudaBackend::Load(model_dir));
    cuda->set_runs_rounds(options.device_rounds);
    return std::unique_ptr<Backend>(std::move(cuda));
#else
    return absl::UnimplementedError("device 'cuda': this build has no CUDA backend (configure with ORYX_CUDA=ON)");
#endif
  }
  return absl::InvalidArgumentError(Cat("unknown device '", options.device, "' (cpu, cuda)"));
}

}  // namespace oryx
