// Safetensors IO without LibTorch: a header parser that trusts nothing (separate from IO, so it can be
// fuzzed), a read-only memory-mapped reader, an HF-style sharded store, and atomic writers.
// File layout: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mapped_file.h"

namespace oryx {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this code reads it in place");

// The dtypes we read and write. Other standard safetensors dtypes (F64, F16, I64, ... F8_E4M3) are
// recognised by ParseDType and reported as unsupported.
enum class DType { kF32, kBF16 };

std::string_view DTypeName(DType dtype);  // "F32", "BF16"
size_t DTypeSize(DType dtype);            // bytes per element
// "F32" / "BF16"; Unimplemented for another standard dtype, InvalidArgument ("unknown dtype") otherwise.
absl::StatusOr<DType> ParseDType(std::string_view name);

// bf16 <-> f32. FloatToBf16 rounds to nearest even and keeps NaN a (quiet) NaN.
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);

inline constexpr std::string_view kSafetensorsFileName = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFileName = "model.safetensors.index.json";
// HF caps the JSON header at 100 MB; so do we, so a hostile length cannot make us allocate more.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A non-owning view of one tensor: what the reader hands out and what the writers take. The bytes are
// row-major, little-endian, numel() * DTypeSize(dtype) long; they may be unaligned (read with memcpy).
struct TensorView {
  std::string_view name;
  DType dtype = DType::kF32;
  std::span<const int64_t> shape;
  std::span<const std::byte> bytes;

  int64_t numel() const;
};

// The tensor's values as floats (bf16 widened exactly), returned or written to out[0 .. numel()).
std::vector<float> TensorToFloats(const TensorView& tensor);
void TensorToFloats(const TensorView& tensor, float* out);
// Lets the kernel drop the memory pages that hold a memory-mapped tensor's bytes (those wholly inside it):
// for a loader that reads each tensor once, so that its peak memory holds its converted weights and one
// tensor of the file, not the whole file besides. The bytes stay readable (from the file) afterwards.
void DropTensorPages(const TensorView& tensor);
// Index of the first NaN or +-Inf element, or -1 if all are finite.
int64_t FirstNonFinite(const TensorView& tensor);

// An owning tensor, for exporters and tests that build tensors in memory.
struct HostTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;  // numel * DTypeSize(dtype)

  TensorView view() const { return {name, dtype, shape, bytes}; }
};
// Stores `values` in `dtype` (rounding to bf16 if asked). values.size() should equal the shape's element
// count; the writers reject a tensor whose byte size does not match its shape.
HostTensor MakeHostTensor(std::string name, std::vector<int64_t> shape, std::span<const float> values,
                          DType dtype);
std::vector<TensorView> Views(std::span<const HostTensor> tensors);

// ---- Header parsing (pure; no IO) ----------------------------------------------------------------------

// One header entry. begin/end are byte offsets inside the data section (not the file).
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                      // 8 + header length: file offset of the data section
  uint64_t data_size = 0;                       // file size - data_start
  std::vector<TensorInfo> tensors;              // in file order (ascending begin)
  std::map<std::string, std::string> metadata;  // "__metadata__", if present
};

// Parses and validates the header of a safetensors file of `file_size` bytes whose first bytes are
// `bytes` (the whole file, or at least its 8 + N header bytes). Checks: at least 8 bytes; header length
// within the file and under kMaxSafetensorsHeaderBytes; header is a JSON object without duplicate keys;
// each entry is exactly {dtype, shape, data_offsets}; shape of non-negative integers whose byte size does
// not overflow; 0 <= begin <= end <= data_size; end - begin == numel * dtype size; tensors neither overlap
// nor leave gaps, and cover the data section exactly; "__metadata__" maps strings to strings. Errors name
// `file_name` and the tensor (Unimplemented for a known but unsupported dtype, else InvalidArgument).
// Never crashes or throws on any input (this is the fuzz target).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view bytes, uint64_t file_size,
                                                         std::string_view file_name);

// The bytes of a complete file holding `tensors`: length, JSON header padded with spaces to a multiple of
// 8 bytes (so the data section is 8-byte aligned), data in the given order. Errors: duplicate or empty
// names, the name "__metadata__", a byte size that does not match the shape.
absl::StatusOr<std::string> EncodeSafetensors(std::span<const TensorView> tensors,
                                              const std::map<std::string, std::string>& metadata = {});

// ---- Reading -----------------------------------------------------------------------------------------

// One safetensors file, memory-mapped read-only and validated on Open. Move-only; the mapping lives as
// long as the object, and views it hands out point into it. The file must not be modified in place while
// open (our writers replace files by rename, which is safe). Const methods are thread-safe.
class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return map_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  // nullptr if the file has no tensor of that name.
  const TensorInfo* Find(std::string_view name) const;
  TensorView View(const TensorInfo& info) const;

 private:
  SafetensorsFile() = default;

  MappedFile map_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into header_.tensors
};

// model.safetensors.index.json: which shard holds each tensor.
struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name (plain name)
};
// Parses an index: an object with "weight_map" (name -> shard file name) and optional "metadata" (an
// object, otherwise ignored); other keys are rejected. Shard names must be plain file names ending in
// ".safetensors" (no '/', '\\', "..": nothing that could leave the directory).
absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view json, std::string_view source_name);

// All tensors of a model: one safetensors file, or an index and its shards. Move-only; views point into
// the mappings it owns. Const methods are thread-safe.
class SafetensorsStore {
 public:
  // Opens `path`: a .safetensors file, or an index .json whose shards sit beside it. For an index, checks
  // that every mapped tensor is in its shard, no tensor is in two shards, and every shard tensor is mapped.
  static absl::StatusOr<SafetensorsStore> Open(const std::string& path);
  // Opens dir/model.safetensors or dir/model.safetensors.index.json (exactly one must exist).
  static absl::StatusOr<SafetensorsStore> OpenDirectory(const std::string& dir);

  // nullptr if there is no tensor of that name.
  const TensorView* Find(std::string_view name) const;
  // Path of the file that holds `name` (which must exist: call Find first).
  const std::string& FileOf(std::string_view name) const;
  // Every tensor, sorted by name.
  std::vector<TensorView> tensors() const;
  size_t size() const { return tensors_.size(); }
  // The files opened: the single file, or the index followed by the shards.
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  struct Entry {
    TensorView view;
    size_t file = 0;  // index into files_
  };
  absl::Status AddFile(std::unique_ptr<SafetensorsFile> file);

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> paths_;
  std::map<std::string, Entry, std::less<>> tensors_;
};

// ---- Writing -----------------------------------------------------------------------------------------

// Writes one safetensors file atomically (temporary file in the same directory, fsync, rename): on any
// failure `path` keeps its previous contents.
absl::Status WriteSafetensors(const std::string& path, std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata = {});

// "model-00002-of-00005.safetensors" (1-based shard number).
std::string ShardFileName(int shard, int num_shards);

// Writes `tensors` into directory `dir` (which must exist): model.safetensors if their data totals at
// most `max_shard_bytes`, else shards of at most max_shard_bytes of tensor data each (a larger tensor gets
// a shard of its own), in the given order, named ShardFileName(k, N), plus model.safetensors.index.json
// written last. Each file is written atomically; files of another layout already in `dir` are not
// removed, so write into a fresh directory (WriteCheckpoint does). Returns the file names written.
absl::StatusOr<std::vector<std::string>> WriteShardedSafetensors(const std::string& dir,
                                                                 std::span<const TensorView> tensors,
                                                                 uint64_t max_shard_bytes);

}  // namespace oryx
