// One checking macro for every CUDA runtime and cuBLAS call: reports the file, line and error, then
// aborts. Used inside kernels/ and backends; errors at the edges become absl::Status before this.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace oryx::kernels::cuda {

inline void CudaCheck(cudaError_t error, const char* file, int line) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "[CUDA error] %s at %s:%d\n", cudaGetErrorString(error), file, line);
    std::abort();
  }
}

inline void CublasCheck(cublasStatus_t status, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "[cuBLAS error] %s at %s:%d\n", cublasGetStatusString(status), file, line);
    std::abort();
  }
}

}  // namespace oryx::kernels::cuda

#define ORYX_CUDA_CHECK(expr) ::oryx::kernels::cuda::CudaCheck((expr), __FILE__, __LINE__)
#define ORYX_CUBLAS_CHECK(expr) ::oryx::kernels::cuda::CublasCheck((expr), __FILE__, __LINE__)
