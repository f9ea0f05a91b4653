// libFuzzer target: the bytes are config.json text. Besides "never crashes", an accepted config must
// survive ToJson -> ParseModelConfig unchanged and yield a tensor table with sane shapes.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/config.h"
#include "engine/tensor_names.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<oryx::ModelConfig> config = oryx::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) return 0;
  absl::StatusOr<oryx::ModelConfig> again = oryx::ParseModelConfig(oryx::ToJson(*config), "again");
  if (!again.ok() || !(*again == *config)) __builtin_trap();
  if (config->n_layers <= 4) {  // keep each run fast; the table is linear in n_layers
    for (const oryx::TensorSpec& spec : oryx::ExpectedTensors(*config)) {
      int64_t numel = 1;
      for (int64_t d : spec.shape) {
        if (d <= 0 || __builtin_mul_overflow(numel, d, &numel)) __builtin_trap();
      }
    }
  }
  return 0;
}
