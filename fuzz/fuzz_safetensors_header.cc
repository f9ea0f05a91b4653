// libFuzzer target: the bytes are a whole safetensors file image, fed to the header parser. Besides
// "never crashes", checks the parser's promises on every accepted header.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/safetensors.h"

namespace {

// Crashes (so libFuzzer reports it) if an accepted header breaks a documented guarantee.
void CheckAccepted(const oryx::SafetensorsHeader& header, uint64_t file_size) {
  if (header.data_start + header.data_size != file_size) __builtin_trap();
  uint64_t covered = 0;
  for (const oryx::TensorInfo& t : header.tensors) {
    // File order, no overlap, no hole, spans matching shape x dtype.
    if (t.begin != covered || t.end < t.begin || t.end > header.data_size) __builtin_trap();
    if (t.end - t.begin != static_cast<uint64_t>(t.numel) * oryx::DTypeSize(t.dtype)) __builtin_trap();
    covered = t.end;
  }
  if (covered != header.data_size) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<oryx::SafetensorsHeader> header =
      oryx::ParseSafetensorsHeader(bytes, size, "fuzz.safetensors");
  if (header.ok()) CheckAccepted(*header, size);
  // A header length beyond the bytes actually given must be an error, not an out-of-bounds read.
  if (size > 8) (void)oryx::ParseSafetensorsHeader(bytes.substr(0, size / 2), size, "fuzz.safetensors");
  return 0;
}
