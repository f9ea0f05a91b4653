// Safetensors header validation, mmap reader, sharded store and atomic writers.
#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/config.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/tensor_names.h"
#include "nlohmann/json.hpp"
#include "engine/json_text.h"

namespace oryx {

namespace {

using Json = nlohmann::json;

absl::Status Invalid(std::string_view file, std::string_view problem) {
  return absl::InvalidArgumentError(Cat(file, ": ", problem));
}

absl::Status TensorError(std::string_view file, std::string_view tensor, std::string_view problem) {
  return absl::InvalidArgumentError(Cat(file, ": tensor '", tensor, "': ", problem));
}

std::string ShortName(std::string_view name) {
  return name.size() > 80 ? Cat(name.substr(0, 80), "...") : std::string(name);
}

uint64_t ReadLittleEndianU64(std::string_view bytes) {
  uint64_t value = 0;
  std::memcpy(&value, bytes.data(), sizeof(value));
  return value;
}

// A non-negative integer that fits in int64 (shape dims, offsets); nullopt-like failure as Status.
absl::StatusOr<uint64_t> ReadNonNegative(const Json& value) {
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return absl::InvalidArgumentError("too large");
    return u;
  }
  if (value.is_number_integer()) return absl::InvalidArgumentError("negative");
  return absl::InvalidArgumentError(Cat("not an integer: ", DescribeJson(value)));
}

absl::StatusOr<TensorInfo> ParseEntry(std::string_view file, const std::string& name, const Json& entry,
                                      uint64_t data_size) {
  const std::string tname = ShortName(name);
  if (name.empty()) return Invalid(file, "a tensor has an empty name");
  if (!entry.is_object()) {
    return TensorError(file, tname, Cat("entry must be an object, got ", DescribeJson(entry)));
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return TensorError(file, tname, Cat("entry has no '", key, "'"));
  }
  if (entry.size() != 3) {
    for (const auto& [key, unused] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        return TensorError(file, tname, Cat("unexpected key '", ShortName(key), "' in entry"));
      }
    }
  }
  TensorInfo info;
  info.name = name;

  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) {
    return TensorError(file, tname, Cat("dtype must be a string, got ", DescribeJson(dtype)));
  }
  absl::StatusOr<DType> parsed_dtype = ParseDType(dtype.get<std::string>());
  if (!parsed_dtype.ok()) {
    return absl::Status(parsed_dtype.status().code(),
                        Cat(file, ": tensor '", tname, "': ", parsed_dtype.status().message()));
  }
  info.dtype = *parsed_dtype;

  const Json& shape = entry["shape"];
  if (!shape.is_array()) {
    return TensorError(file, tname, Cat("shape must be an array, got ", DescribeJson(shape)));
  }
  bool has_zero = false;
  for (const Json& dim : shape) {
    absl::StatusOr<uint64_t> d = ReadNonNegative(dim);
    if (!d.ok()) {
      return TensorError(file, tname, Cat("shape dimension ", d.status().message()));
    }
    info.shape.push_back(static_cast<int64_t>(*d));
    has_zero = has_zero || *d == 0;
  }
  // Element count and byte size, overflow-checked (a zero dimension makes both zero whatever the rest).
  uint64_t numel = 1;
  uint64_t nbytes = 0;
  if (has_zero) {
    numel = 0;
  } else {
    for (int64_t d : info.shape) {
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) ||
          numel > static_cast<uint64_t>(INT64_MAX)) {
        return TensorError(
            file, tname, Cat("shape ", ShapeToString(info.shape), " has more elements than fit in 63 bits"));
      }
    }
  }
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(info.dtype)), &nbytes)) {
    return TensorError(file, tname,
                       Cat("shape ", ShapeToString(info.shape), " is too large to address in bytes"));
  }
  info.numel = static_cast<int64_t>(numel);

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return TensorError(file, tname,
                       Cat("data_offsets must be an array [begin, end], got ", DescribeJson(offsets)));
  }
  absl::StatusOr<uint64_t> begin = ReadNonNegative(offsets[0]);
  absl::StatusOr<uint64_t> end = ReadNonNegative(offsets[1]);
  if (!begin.ok() || !end.ok()) {
    return TensorError(file, tname,
                       Cat("data_offsets must be non-negative integers, got [", DescribeJson(offsets[0]),
                           ", ", DescribeJson(offsets[1]), "]"));
  }
  info.begin = *begin;
  info.end = *end;
  if (info.begin > info.end) {
    return TensorError(file, tname, Cat("data_offsets [", info.begin, ", ", info.end, "] begin after end"));
  }
  if (info.end > data_size) {
    return TensorError(file, tname,
                       Cat("data_offsets [", info.begin, ", ", info.end,
                           "] out of range: the data section is ", data_size, " bytes"));
  }
  if (info.end - info.begin != nbytes) {
    return TensorError(file, tname,
                       Cat("data_offsets [", info.begin, ", ", info.end, "] span ", info.end - info.begin,
                           " bytes but shape ", ShapeToString(info.shape), " of ", DTypeName(info.dtype),
                           " needs ", nbytes));
  }
  return info;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(std::string_view file, const Json& value) {
  if (!value.is_object()) {
    return Invalid(file, Cat("__metadata__ must be an object of strings, got ", DescribeJson(value)));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      return Invalid(
          file, Cat("__metadata__ key '", ShortName(key), "' must map to a string, got ", DescribeJson(v)));
    }
    metadata.emplace(key, v.get<std::string>());
  }
  return metadata;
}

// Tensors sorted by position must tile the data section exactly: no overlap, no gap, nothing after.
absl::Status CheckLayout(std::string_view file, std::vector<TensorInfo>& tensors, uint64_t data_size) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;  // end of the data covered so far
  const TensorInfo* last = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.begin < covered) {
      return Invalid(file, Cat("tensors '", ShortName(last->name), "' [", last->begin, ", ", last->end,
                               ") and '", ShortName(t.name), "' [", t.begin, ", ", t.end, ") overlap"));
    }
    if (t.begin > covered) {
      return Invalid(file, Cat("bytes [", covered, ", ", t.begin, ") of the data section ", "before tensor '",
                               ShortName(t.name), "' belong to no tensor (holes are not allowed)"));
    }
    covered = t.end;
    last = &t;
  }
  if (covered != data_size) {
    return Invalid(file, Cat("the last ", data_size - covered, " bytes of the data section ",
                             "belong to no tensor (trailing bytes are not allowed)"));
  }
  return absl::OkStatus();
}


bool IsPlainShardName(std::string_view name) {
  constexpr std::string_view kSuffix = ".safetensors";
  if (name.size() <= kSuffix.size() || name.substr(name.size() - kSuffix.size()) != kSuffix) {
    return false;
  }
  if (name == "." || name == "..") return false;
  return name.find_first_of(std::string_view("/\\\0", 3)) == std::string_view::npos;
}

std::string JoinPath(std::string_view dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return Cat(dir, name);
  return Cat(dir, "/", name);
}

std::string DirName(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

uint64_t DataBytes(std::span<const TensorView> tensors) {
  uint64_t total = 0;
  for (const TensorView& t : tensors) total += t.bytes.size();
  return total;
}

}  // namespace

// ---- dtypes and tensors --------------------------------------------------------------------------------

std::string_view DTypeName(DType dtype) { return dtype == DType::kBF16 ? "BF16" : "F32"; }

size_t DTypeSize(DType dtype) { return dtype == DType::kBF16 ? 2 : 4; }

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  static constexpr std::array<std::string_view, 19> kOtherStandard = {
      "BOOL", "U8",  "I8", "I16",     "U16",     "F16",     "I32",     "U32",     "I64",        "U64",
      "F64",  "C64", "F4", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F8_E4M3FNUZ"};
  for (std::string_view other : kOtherStandard) {
    if (name == other) {
      return absl::UnimplementedError(Cat("dtype ", name, " is not supported (only F32 and BF16)"));
    }
  }
  std::string shown(name.substr(0, 40));
  return absl::InvalidArgumentError(Cat("unknown dtype '", shown, "'"));
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void TensorToFloats(const TensorView& tensor, float* out) {
  const size_t n = tensor.bytes.size() / DTypeSize(tensor.dtype);
  if (tensor.dtype == DType::kF32) {
    if (n > 0) std::memcpy(out, tensor.bytes.data(), n * sizeof(float));
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, tensor.bytes.data() + 2 * i, 2);
      out[i] = Bf16ToFloat(bits);
    }
  }
}

std::vector<float> TensorToFloats(const TensorView& tensor) {
  std::vector<float> out(tensor.bytes.size() / DTypeSize(tensor.dtype));
  TensorToFloats(tensor, out.data());
  return out;
}

int64_t FirstNonFinite(const TensorView& tensor) {
  const std::byte* p = tensor.bytes.data();
  if (tensor.dtype == DType::kF32) {
    const size_t n = tensor.bytes.size() / 4;
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + 4 * i, 4);
      if ((bits & 0x7f800000u) == 0x7f800000u) return static_cast<int64_t>(i);
    }
  } else {
    const size_t n = tensor.bytes.size() / 2;
    for (size_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, p + 2 * i, 2);
      if ((bits & 0x7f80u) == 0x7f80u) return static_cast<int64_t>(i);
    }
  }
  return -1;
}

HostTensor MakeHostTensor(std::string name, std::vector<int64_t> shape, std::span<const float> values,
                          DType dtype) {
  HostTensor t{std::move(name), dtype, std::move(shape), {}};
  t.bytes.resize(values.size() * DTypeSize(dtype));
  if (dtype == DType::kF32) {
    if (!t.bytes.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  } else {
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t bits = FloatToBf16(values[i]);
      std::memcpy(t.bytes.data() + 2 * i, &bits, 2);
    }
  }
  return t;
}

std::vector<TensorView> Views(std::span<const HostTensor> tensors) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const HostTensor& t : tensors) views.push_back(t.view());
  return views;
}

// ---- header ---------------------------------------------------------------------------------------------

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view bytes, uint64_t file_size,
                                                         std::string_view file_name) {
  if (file_size < 8 || bytes.size() < 8) {
    return Invalid(file_name, Cat("truncated: ", std::min<uint64_t>(file_size, bytes.size()),
                                  " bytes, but a safetensors file starts with an 8-byte "
                                  "header length"));
  }
  const uint64_t header_len = ReadLittleEndianU64(bytes);
  if (header_len > file_size - 8) {
    return Invalid(file_name, Cat("header length ", header_len, " extends beyond the end of the file (",
                                  file_size, " bytes)"));
  }
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return Invalid(file_name, Cat("header length ", header_len, " exceeds the limit of ",
                                  kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (bytes.size() < 8 + header_len) {
    return Invalid(file_name, Cat("only ", bytes.size(), " of the first ", 8 + header_len,
                                  " bytes (length + header) were read"));
  }
  SafetensorsHeader header;
  header.data_start = 8 + header_len;
  header.data_size = file_size - header.data_start;

  const std::string source = Cat(file_name, ": header");
  ORYX_ASSIGN_OR_RETURN(Json json, ParseJsonStrict(bytes.substr(8, header_len), source));
  if (!json.is_object()) {
    return Invalid(file_name, Cat("header must be a JSON object, got ", DescribeJson(json)));
  }
  for (const auto& [name, entry] : json.items()) {
    if (name == "__metadata__") {
      ORYX_ASSIGN_OR_RETURN(header.metadata, ParseMetadata(file_name, entry));
      continue;
    }
    ORYX_ASSIGN_OR_RETURN(TensorInfo info, ParseEntry(file_name, name, entry, header.data_size));
    header.tensors.push_back(std::move(info));
  }
  ORYX_RETURN_IF_ERROR(CheckLayout(file_name, header.tensors, header.data_size));
  return header;
}

namespace {

// The first 8 + N bytes of a file holding `tensors` in order: length, then the JSON header padded with
// spaces to a multiple of 8. Validates names and byte sizes.
absl::StatusOr<std::string> EncodeHeader(std::span<const TensorView> tensors,
                                         const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();  // keys sorted by name; offsets follow the given order
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorView& t : tensors) {
    const std::string name(t.name);
    if (name.empty() || name == "__metadata__") {
      return absl::InvalidArgumentError(Cat("invalid tensor name '", name, "'"));
    }
    if (header.contains(name)) {
      return absl::InvalidArgumentError(Cat("tensor '", name, "' given twice"));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(Cat("tensor '", name, "': negative dim"));
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) numel = UINT64_MAX;
    }
    if (numel > t.bytes.size() || t.bytes.size() != numel * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(
          Cat("tensor '", name, "': ", t.bytes.size(), " bytes do not match shape ",
              ShapeToString({t.shape.begin(), t.shape.end()}), " of ", DTypeName(t.dtype)));
    }
    header[name] = {{"dtype", DTypeName(t.dtype)},
                    {"shape", std::vector<int64_t>(t.shape.begin(), t.shape.end())},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string json = JsonText(header);
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t len = json.size();
  std::memcpy(out.data(), &len, 8);
  out += json;
  return out;
}

}  // namespace

absl::StatusOr<std::string> EncodeSafetensors(std::span<const TensorView> tensors,
                                              const std::map<std::string, std::string>& metadata) {
  ORYX_ASSIGN_OR_RETURN(std::string out, EncodeHeader(tensors, metadata));
  for (const TensorView& t : tensors) {
    out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  return out;
}

// ---- SafetensorsFile --------------------------------------------------------------------------------------

void DropTensorPages(const TensorView& tensor) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(tensor.bytes.data());
  const uintptr_t first = (begin + page - 1) / page * page, last = (begin + tensor.bytes.size()) / page * page;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile file;
  ORYX_ASSIGN_OR_RETURN(file.map_, MappedFile::Open(path));
  ORYX_ASSIGN_OR_RETURN(file.header_, ParseSafetensorsHeader(file.map_.bytes(), file.map_.size(), path));
  for (size_t i = 0; i < file.header_.tensors.size(); ++i) {
    file.by_name_.emplace(file.header_.tensors[i].name, i);
  }
  return file;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

TensorView SafetensorsFile::View(const TensorInfo& info) const {
  const std::byte* data = map_.data() + header_.data_start + info.begin;
  return TensorView{info.name, info.dtype, info.shape, {data, info.end - info.begin}};
}

// ---- index and store ----------------------------------------------------------------------------------

absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view json_text,
                                                       std::string_view source_name) {
  ORYX_ASSIGN_OR_RETURN(Json json, ParseJsonStrict(json_text, source_name));
  if (!json.is_object()) {
    return Invalid(source_name, Cat("must be a JSON object, got ", DescribeJson(json)));
  }
  for (const auto& [key, value] : json.items()) {
    if (key == "metadata") {
      if (!value.is_object()) {
        return Invalid(source_name, Cat("'metadata' must be an object, got ", DescribeJson(value)));
      }
    } else if (key != "weight_map") {
      return Invalid(source_name, Cat("unexpected key '", ShortName(key), "'"));
    }
  }
  auto map_it = json.find("weight_map");
  if (map_it == json.end()) return Invalid(source_name, "no 'weight_map'");
  if (!map_it->is_object()) {
    return Invalid(source_name, Cat("'weight_map' must be an object, got ", DescribeJson(*map_it)));
  }
  SafetensorsIndex index;
  for (const auto& [name, shard] : map_it->items()) {
    if (!shard.is_string()) {
      return TensorError(source_name, ShortName(name),
                         Cat("shard must be a file name, got ", DescribeJson(shard)));
    }
    std::string shard_name = shard.get<std::string>();
    if (!IsPlainShardName(shard_name)) {
      return TensorError(
          source_name, ShortName(name),
          Cat("shard '", ShortName(shard_name), "' is not a plain *.safetensors file name in the directory"));
    }
    index.weight_map.emplace(name, std::move(shard_name));
  }
  return index;
}

absl::Status SafetensorsStore::AddFile(std::unique_ptr<SafetensorsFile> file) {
  const size_t file_index = files_.size();
  for (const TensorInfo& info : file->header().tensors) {
    auto [it, inserted] = tensors_.emplace(info.name, Entry{file->View(info), file_index});
    if (!inserted) {
      return TensorError(
          file->path(), ShortName(info.name),
          Cat("also present in ", files_[it->second.file]->path(), " (a tensor may be in only one shard)"));
    }
  }
  paths_.push_back(file->path());
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsStore> SafetensorsStore::Open(const std::string& path) {
  SafetensorsStore store;
  if (!EndsWith(path, ".json")) {
    ORYX_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
    ORYX_RETURN_IF_ERROR(store.AddFile(std::make_unique<SafetensorsFile>(std::move(file))));
    return store;
  }
  ORYX_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  ORYX_ASSIGN_OR_RETURN(SafetensorsIndex index, ParseSafetensorsIndex(text, path));
  store.paths_.push_back(path);
  std::map<std::string, size_t> shard_file;  // shard name -> index into files_
  for (const auto& [name, shard] : index.weight_map) {
    if (shard_file.contains(shard)) continue;
    const std::string shard_path = JoinPath(DirName(path), shard);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(shard_path);
    if (!file.ok()) {
      if (absl::IsNotFound(file.status())) {
        return absl::NotFoundError(Cat(path, ": shard '", shard, "' (holding tensor '", ShortName(name),
                                       "') not found: ", shard_path));
      }
      return file.status();
    }
    shard_file.emplace(shard, store.files_.size());
    ORYX_RETURN_IF_ERROR(store.AddFile(std::make_unique<SafetensorsFile>(*std::move(file))));
  }
  // The map and the shards must agree exactly.
  for (const auto& [name, shard] : index.weight_map) {
    auto it = store.tensors_.find(name);
    if (it == store.tensors_.end() ||
        store.files_[it->second.file]->path() != store.files_[shard_file.at(shard)]->path()) {
      std::string where = it == store.tensors_.end()
                              ? "it is in no shard"
                              : Cat("it is in ", store.files_[it->second.file]->path());
      return TensorError(path, ShortName(name),
                         Cat("mapped to shard '", shard, "' but not found there (", where, ")"));
    }
  }
  for (const auto& [name, entry] : store.tensors_) {
    if (!index.weight_map.contains(name)) {
      return TensorError(
          path, ShortName(name),
          Cat("present in shard ", store.files_[entry.file]->path(), " but missing from the weight_map"));
    }
  }
  return store;
}

absl::StatusOr<SafetensorsStore> SafetensorsStore::OpenDirectory(const std::string& dir) {
  const std::string single = JoinPath(dir, kSafetensorsFileName);
  const std::string index = JoinPath(dir, kSafetensorsIndexFileName);
  const bool has_single = ::access(single.c_str(), F_OK) == 0;
  const bool has_index = ::access(index.c_str(), F_OK) == 0;
  if (has_single && has_index) {
    return Invalid(dir, Cat("both ", kSafetensorsFileName, " and ", kSafetensorsIndexFileName,
                            " are present; which one holds the weights is ambiguous"));
  }
  if (!has_single && !has_index) {
    return absl::NotFoundError(
        Cat(dir, ": no weights: neither ", kSafetensorsFileName, " nor ", kSafetensorsIndexFileName));
  }
  return Open(has_single ? single : index);
}

const TensorView* SafetensorsStore::Find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second.view;
}

const std::string& SafetensorsStore::FileOf(std::string_view name) const {
  return files_[tensors_.find(name)->second.file]->path();
}

std::vector<TensorView> SafetensorsStore::tensors() const {
  std::vector<TensorView> out;
  out.reserve(tensors_.size());
  for (const auto& [name, entry] : tensors_) out.push_back(entry.view);
  return out;
}

// ---- writers ----------------------------------------------------------------------------------------------

absl::Status WriteSafetensors(const std::string& path, std::span<const TensorView> tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> header = EncodeHeader(tensors, metadata);
  if (!header.ok()) return Invalid(path, std::string(header.status().message()));
  ORYX_ASSIGN_OR_RETURN(AtomicFileWriter writer, AtomicFileWriter::Open(path));
  ORYX_RETURN_IF_ERROR(writer.Append(*header));
  for (const TensorView& t : tensors) {
    ORYX_RETURN_IF_ERROR(writer.Append({reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size()}));
  }
  return writer.Commit();
}

std::string ShardFileName(int shard, int num_shards) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", shard, num_shards);
  return buf;
}

absl::StatusOr<std::vector<std::string>> WriteShardedSafetensors(const std::string& dir,
                                                                 std::span<const TensorView> tensors,
                                                                 uint64_t max_shard_bytes) {
  if (max_shard_bytes == 0) return absl::InvalidArgumentError("max_shard_bytes must be > 0");
  // Validate everything (names, sizes) before writing any shard.
  ORYX_RETURN_IF_ERROR(EncodeHeader(tensors, {}).status());
  if (DataBytes(tensors) <= max_shard_bytes) {
    ORYX_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, kSafetensorsFileName), tensors));
    return std::vector<std::string>{std::string(kSafetensorsFileName)};
  }
  // Greedy packing in the given order.
  std::vector<std::span<const TensorView>> shards;
  size_t start = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = tensors[i].bytes.size();
    if (i > start && bytes + n > max_shard_bytes) {
      shards.push_back(tensors.subspan(start, i - start));
      start = i;
      bytes = 0;
    }
    bytes += n;
  }
  shards.push_back(tensors.subspan(start));

  const int num_shards = static_cast<int>(shards.size());
  std::vector<std::string> written;
  Json weight_map = Json::object();
  for (int k = 0; k < num_shards; ++k) {
    const std::string name = ShardFileName(k + 1, num_shards);
    for (const TensorView& t : shards[k]) weight_map[std::string(t.name)] = name;
    ORYX_RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, name), shards[k]));
    written.push_back(name);
  }
  nlohmann::ordered_json index = {{"metadata", {{"total_size", DataBytes(tensors)}}},
                                  {"weight_map", std::move(weight_map)}};
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(JoinPath(dir, kSafetensorsIndexFileName), JsonText(index, 2) + "\n"));
  written.push_back(std::string(kSafetensorsIndexFileName));
  return written;
}

}  // namespace oryx
