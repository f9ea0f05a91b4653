// A whole file mapped read-only into memory: what the safetensors reader and the corpus shard reader read
// through. Move-only; the mapping lives as long as the object. The file must not be modified in place while
// mapped (the project's writers replace files by rename, which is safe).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace oryx {

class MappedFile {
 public:
  // NotFound when there is no such file, PermissionDenied when it cannot be opened, InvalidArgument when it
  // is not a regular file, Internal when the mapping fails; each message starts with the path. An empty
  // file maps to no bytes.
  static absl::StatusOr<MappedFile> Open(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  ~MappedFile();

  const std::string& path() const { return path_; }
  const std::byte* data() const { return static_cast<const std::byte*>(map_); }
  size_t size() const { return size_; }
  std::string_view bytes() const { return {static_cast<const char*>(map_), size_}; }
  // Tells the kernel that reads will jump around (no read-ahead).
  void AdviseRandomAccess() const;

 private:
  void Unmap();
  std::string path_;
  void* map_ = nullptr;  // nullptr for an empty file
  size_t size_ = 0;
};

}  // namespace oryx
