// LoadBackend (engine/backend.h): a checkpoint onto the device the options name.
#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/backend.h"
#include "engine/cpu_backend.h"
#ifdef ORYX_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif

namespace oryx {

CudaSwitches CudaSwitches::FromEnvironment() {
  auto on = [](const char* name) {
    const char* env = std::getenv(name);
    return env == nullptr || env[0] != '0';
  };
  // An integer switch, clamped to [lo, hi]; left at its default when unset.
  auto clamped = [](const char* name, int lo, int hi, int* value) {
    if (const char* env = std::getenv(name); env != nullptr) *value = std::clamp(std::atoi(env), lo, hi);
  };
  CudaSwitches s;
  s.fused_gemv = on("ORYX_CUDA_FUSED");
  s.decode_mixer = on("ORYX_CUDA_DECODE_MIXER");
  s.split_norms = on("ORYX_CUDA_SPLIT_NORMS");
  s.mixer_norm = on("ORYX_CUDA_MIXER_NORM");
  s.skip_q_linear = on("ORYX_CUDA_SKIP_Q_LINEAR");
  s.chunked_scan = on("ORYX_CUDA_CHUNKED_SCAN");
  s.tiled_attention = on("ORYX_CUDA_TILED_ATTENTION");
  s.group_mma = on("ORYX_CUDA_GROUP_MMA");
  s.wide_gemv = on("ORYX_CUDA_GEMV_WIDE");
  s.early_loads = on("ORYX_CUDA_EARLY_LOADS");
  s.programmatic_launch = on("ORYX_CUDA_PDL");
  s.split_ragged_gemm = on("ORYX_CUDA_SPLIT_GEMM");
  s.round_padding = on("ORYX_CUDA_ROUND_PADDING");
  s.mixed_draws = on("ORYX_CUDA_MIXED_DRAWS");
  if (const char* env = std::getenv("ORYX_CUDA_MULTIROW"); env != nullptr) {  // 0, 1, or auto (the default)
    s.multirow_bf16 = std::string_view(env) == "auto" ? -1 : env[0] == '0' ? 0 : 1;
  }
  clamped("ORYX_CUDA_FUSED_ROWS", 1, 8, &s.fused_rows);
  if (const char* env = std::getenv("ORYX_CUDA_GEMV_ROWS"); env != nullptr) s.gemv_rows_per_warp = std::atoi(env);
  if (const char* env = std::getenv("ORYX_CUDA_GRAPH_AFTER"); env != nullptr) {
    s.graph_after = std::max(1, std::atoi(env));
  }
  clamped("ORYX_CUDA_GROUP_MMA_ROWS", 2, 17, &s.group_mma_min_rows);
  clamped("ORYX_CUDA_ATTN_CHUNK", 32, 512, &s.attention_chunk);
  clamped("ORYX_CUDA_MMA_CHUNK", 32, 1024, &s.group_mma_chunk);
  clamped("ORYX_CUDA_FP8_MMA_ROWS", 1, 129, &s.fp8_mma_min_rows);  // 129: never
  clamped("ORYX_CUDA_BF16_MMA_ROWS", 0, 32, &s.bf16_mma_gemv_rows);
  clamped("ORYX_CUDA_FP8_GEMV_ROWS", 0, 32, &s.fp8_mma_gemv_rows);
  clamped("ORYX_CUDA_HEAD_MIXER_SEQS", 0, 1 << 20, &s.head_mixer_seqs);
  clamped("ORYX_CUDA_HEAD_MIXER_DIM", 1, 1 << 20, &s.head_mixer_dim);
  clamped("ORYX_CUDA_HEAD_MIXER_CARVEOUT", -1, 100, &s.head_mixer_carveout);
  clamped("ORYX_CUDA_MIXER_PREFETCH", 0, 64, &s.mixer_prefetch_mib);
  clamped("ORYX_CUDA_DOWN_PREFETCH", 0, 64, &s.down_prefetch_mib);
  clamped("ORYX_CUDA_PREFILL_ROWS", 0, 65536, &s.prefill_rows);
  clamped("ORYX_CUDA_PREFILL_SPAN", 256, 65536, &s.prefill_span);
  const char* profile = std::getenv("ORYX_CUDA_PROFILE");
  s.profile = profile != nullptr && profile[0] == '1';
  return s;
}

absl::StatusOr<kernels::WeightFormat> ParseWeightFormat(std::string_view name) {
  if (name == "f32") return kernels::WeightFormat::kF32;
  if (name == "bf16") return kernels::WeightFormat::kBf16;
  if (name == "int8") return kernels::WeightFormat::kInt8;
  if (name == "w8a8") return kernels::WeightFormat::kW8A8;
  if (name == "fp8") return kernels::WeightFormat::kFp8;
  return absl::InvalidArgumentError(Cat("unknown weight format '", name, "' (f32, bf16, int8, w8a8, fp8)"));
}

absl::StatusOr<kernels::KvFormat> ParseKvFormat(std::string_view name) {
  if (name == "f32") return kernels::KvFormat::kF32;
  if (name == "bf16") return kernels::KvFormat::kBf16;
  if (name == "int8") return kernels::KvFormat::kInt8;
  return absl::InvalidArgumentError(Cat("unknown KV cache type '", name, "' (f32, bf16, int8)"));
}

absl::StatusOr<std::unique_ptr<Backend>> LoadBackend(const std::string& model_dir, const BackendOptions& options) {
  ORYX_ASSIGN_OR_RETURN(const kernels::WeightFormat format, ParseWeightFormat(options.weights));
  if (!options.kv_dtype.empty()) ORYX_RETURN_IF_ERROR(ParseKvFormat(options.kv_dtype).status());
  if (options.device == "cpu") {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> cpu, CpuBackend::Load(model_dir, options.threads, format));
    if (!options.kv_dtype.empty()) ORYX_RETURN_IF_ERROR(cpu->SetKvFormat(*ParseKvFormat(options.kv_dtype)));
    return std::unique_ptr<Backend>(std::move(cpu));
  }
  if (options.device == "cuda") {
    if (!options.kv_dtype.empty() && options.kv_dtype != "bf16") {
      return absl::InvalidArgumentError(
          Cat("KV cache type '", options.kv_dtype, "': the CUDA backend's KV cache is bf16"));
    }
    if (kernels::IsInt8(format)) {
      return absl::InvalidArgumentError(
          Cat("weights '", options.weights, "': the CUDA backend runs bf16 (f32 or bf16) or fp8 weights"));
    }
#ifdef ORYX_HAVE_CUDA
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> cuda, CudaBackend::Load(model_dir, options.cuda, format));
    cuda->set_runs_rounds(options.device_rounds);
    return std::unique_ptr<Backend>(std::move(cuda));
#else
    return absl::UnimplementedError("device 'cuda': this build has no CUDA backend (configure with ORYX_CUDA=ON)");
#endif
  }
  return absl::InvalidArgumentError(Cat("unknown device '", options.device, "' (cpu, cuda)"));
}

}  // namespace oryx
