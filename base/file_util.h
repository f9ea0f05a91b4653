// File helpers used at the edges: whole-file reads and atomic writes (temporary file, fsync, rename),
// so that an interrupted write leaves the previous good file intact.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace oryx {

// Reads the whole file; errors name the path.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes `contents` to `path` atomically: writes `path.tmp.<pid>` in the same directory, flushes it to
// disk, then renames it over `path`. On failure the temporary file is removed and `path` is untouched.
absl::Status WriteFileAtomic(const std::string& path, std::string_view contents);

// Removes `path` and everything under it (like `rm -rf`); OK if it does not exist; errors name the path.
absl::Status RemoveTree(const std::string& path);

// An atomic writer for large outputs produced in pieces. Append() any number of times, then Commit();
// destroying it without Commit() discards the temporary file.
class AtomicFileWriter {
 public:
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) = delete;
  ~AtomicFileWriter();

  absl::Status Append(std::string_view bytes);
  absl::Status Commit();
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp_path, int fd)
      : path_(std::move(path)), tmp_path_(std::move(tmp_path)), fd_(fd) {}
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint64_t bytes_written_ = 0;
};

}  // namespace oryx
