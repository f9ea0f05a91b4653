// cuBLAS, loaded when first used rather than when the program starts.
//
// Linking libcublas costs every process that links it about 0.1 s and 220 MB of memory at start (the loader
// maps and relocates libcublasLt's kernel tables), even `oryx --help` and a CPU-only generation. So nothing
// links it: these definitions of the few cuBLAS entry points the CUDA code calls open the library with
// dlopen on the first call and forward to it. A machine without cuBLAS gets CUBLAS_STATUS_NOT_INITIALIZED
// from cublasCreate (with a message naming the library), which the CUDA backend reports as an error.
#include <cublas_v2.h>
#include <dlfcn.h>

#include <cstdio>

namespace {

constexpr const char* kLibraries[] = {"libcublas.so.13", "libcublas.so"};

void* Library() {
  static void* handle = [] {
    for (const char* name : kLibraries) {
      if (void* h = ::dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
    }
    std::fprintf(stderr, "oryx: cannot load cuBLAS (%s): %s\n", kLibraries[0], ::dlerror());
    return static_cast<void*>(nullptr);
  }();
  return handle;
}

// The library's own definition of `name`, or null.
void* Symbol(const char* name) {
  void* h = Library();
  return h == nullptr ? nullptr : ::dlsym(h, name);
}

}  // namespace

// Each forwards to the library's function of the same name, resolved once.
#define ORYX_CUBLAS_FORWARD(name, params, args)                                \
  cublasStatus_t CUBLASWINAPI name params {                                    \
    using Fn = cublasStatus_t(CUBLASWINAPI*) params;                           \
    static const Fn real = reinterpret_cast<Fn>(Symbol(#name));                \
    return real == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : real args;         \
  }

extern "C" {

ORYX_CUBLAS_FORWARD(cublasCreate_v2, (cublasHandle_t * handle), (handle))
ORYX_CUBLAS_FORWARD(cublasDestroy_v2, (cublasHandle_t handle), (handle))
ORYX_CUBLAS_FORWARD(cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream), (handle, stream))
ORYX_CUBLAS_FORWARD(cublasGetStream_v2, (cublasHandle_t handle, cudaStream_t* stream), (handle, stream))
ORYX_CUBLAS_FORWARD(cublasSetWorkspace_v2, (cublasHandle_t handle, void* workspace, size_t bytes),
                    (handle, workspace, bytes))
ORYX_CUBLAS_FORWARD(cublasGemmEx,
                    (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                     const void* alpha, const void* a, cudaDataType a_type, int lda, const void* b,
                     cudaDataType b_type, int ldb, const void* beta, void* c, cudaDataType c_type, int ldc,
                     cublasComputeType_t compute, cublasGemmAlgo_t algo),
                    (handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc,
                     compute, algo))

const char* CUBLASWINAPI cublasGetStatusString(cublasStatus_t status) {
  using Fn = const char*(CUBLASWINAPI*)(cublasStatus_t);
  static const Fn real = reinterpret_cast<Fn>(Symbol("cublasGetStatusString"));
  return real == nullptr ? "cuBLAS could not be loaded" : real(status);
}

}  // extern "C"
