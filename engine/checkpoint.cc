// Checkpoint loading (validation against the tensor-name table) and atomic checkpoint writing.
#include "engine/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/tensor_names.h"

namespace oryx {

namespace {

using FileOfFn = std::function<std::string(std::string_view tensor_name)>;

std::string JoinPath(std::string_view dir, std::string_view name) {
  if (!dir.empty() && dir.back() == '/') return Cat(dir, name);
  return Cat(dir, "/", name);
}

// "[3, 1]": the multi-index of flat element `flat` in `shape`, for non-finite reports.
std::string MultiIndex(int64_t flat, std::span<const int64_t> shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] > 0) {
      index[i] = flat % shape[i];
      flat /= shape[i];
    }
  }
  return ShapeToString(index);
}

absl::Status CheckFinite(const TensorView& t, const std::string& file) {
  const int64_t bad = FirstNonFinite(t);
  if (bad < 0) return absl::OkStatus();
  const float value = TensorToFloats(
      TensorView{t.name,
                 t.dtype,
                 {},
                 t.bytes.subspan(static_cast<size_t>(bad) * DTypeSize(t.dtype), DTypeSize(t.dtype))})[0];
  return absl::InvalidArgumentError(Cat(file, ": tensor '", t.name, "': non-finite value ",
                                        std::isnan(value) ? "NaN" : (value > 0 ? "+Inf" : "-Inf"), " (",
                                        DTypeName(t.dtype), ") at element ", bad, " (index ",
                                        MultiIndex(bad, t.shape), ")"));
}

// The checks shared by the loader and the writer; `file_of` names where a tensor came from and
// `source` is where missing tensors should have been.
absl::Status CheckTensors(const ModelConfig& config, std::span<const TensorView> tensors,
                          std::string_view source, const FileOfFn& file_of) {
  std::map<std::string_view, const TensorView*> by_name;
  for (const TensorView& t : tensors) {
    if (!by_name.emplace(t.name, &t).second) {
      return absl::InvalidArgumentError(Cat(source, ": tensor '", t.name, "' given twice"));
    }
  }
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::set<std::string_view> expected;
  std::vector<const TensorSpec*> missing;
  for (const TensorSpec& spec : specs) {
    expected.insert(spec.name);
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) {
      missing.push_back(&spec);
      continue;
    }
    const TensorView& t = *it->second;
    if (!std::equal(t.shape.begin(), t.shape.end(), spec.shape.begin(), spec.shape.end())) {
      return absl::InvalidArgumentError(Cat(
          file_of(t.name), ": tensor '", t.name, "': shape ", ShapeToString({t.shape.begin(), t.shape.end()}),
          " does not match config.json: expected ", ShapeToString(spec.shape), " = ", spec.shape_doc));
    }
    if (t.bytes.size() != static_cast<uint64_t>(t.numel()) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(
          Cat(file_of(t.name), ": tensor '", t.name, "': ", t.bytes.size(), " bytes do not match its shape"));
    }
  }
  std::vector<std::string_view> unexpected;
  for (const auto& [name, t] : by_name) {
    if (!expected.contains(name)) unexpected.push_back(name);
  }
  const std::string hint =
      "; does config.json describe these weights (n_layers, linear_mixer, tie_embeddings)?";
  if (!missing.empty()) {
    std::string more = missing.size() > 1 ? Cat(" (", missing.size(), " missing in all)") : "";
    std::string also = unexpected.empty() ? ""
                                          : Cat("; there are also ", unexpected.size(),
                                                " unexpected tensors, e.g. '", unexpected[0], "'", hint);
    return absl::InvalidArgumentError(Cat(source, ": missing tensor '", missing[0]->name, "' ",
                                          ShapeToString(missing[0]->shape), more, also));
  }
  if (!unexpected.empty()) {
    std::string why = unexpected[0] == kLmHeadWeight && config.tie_embeddings
                          ? " (tie_embeddings is true, so there is no lm_head)"
                          : " (not in the tensor table for this config)";
    return absl::InvalidArgumentError(
        Cat(file_of(unexpected[0]), ": unexpected tensor '", unexpected[0], "'", why));
  }
  for (const TensorView& t : tensors) ORYX_RETURN_IF_ERROR(CheckFinite(t, file_of(t.name)));
  return absl::OkStatus();
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::Status FsyncPath(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(Cat(path, ": cannot open to fsync: ", std::strerror(errno)));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::InternalError(Cat(path, ": fsync failed: ", std::strerror(errno)));
  return absl::OkStatus();
}

// True for the names a checkpoint directory may hold (what WriteCheckpoint is allowed to replace).
bool IsCheckpointFileName(std::string_view name) {
  if (name == kConfigFileName || name == kTokenizerFileName || name == kSafetensorsFileName ||
      name == kSafetensorsIndexFileName) {
    return true;
  }
  // model-00001-of-00002.safetensors
  if (name.size() != ShardFileName(1, 1).size() || !name.starts_with("model-") ||
      !name.ends_with(".safetensors") || name.substr(11, 4) != "-of-") {
    return false;
  }
  for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19}) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  return true;
}

// An existing `dir` may be replaced only if it holds nothing but checkpoint files.
absl::Status CheckReplaceable(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return absl::InternalError(Cat(dir, ": cannot list: ", std::strerror(errno)));
  std::string offending;
  while (struct dirent* entry = ::readdir(d)) {
    std::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    if (!IsCheckpointFileName(name)) {
      offending = std::string(name);
      break;
    }
  }
  ::closedir(d);
  if (!offending.empty()) {
    return absl::FailedPreconditionError(
        Cat(dir, ": exists and holds '", offending,
            "', which is not a checkpoint file; refusing to replace the directory"));
  }
  return absl::OkStatus();
}

// Writes every file of the checkpoint into the (new, empty) directory `tmp`.
absl::Status WriteContents(const std::string& tmp, const ModelConfig& config,
                           std::span<const TensorView> tensors, uint64_t max_shard_bytes,
                           const std::string& tokenizer_model_path) {
  ORYX_RETURN_IF_ERROR(WriteModelConfig(JoinPath(tmp, kConfigFileName), config));
  ORYX_RETURN_IF_ERROR(WriteShardedSafetensors(tmp, tensors, max_shard_bytes).status());
  if (!tokenizer_model_path.empty()) {
    ORYX_ASSIGN_OR_RETURN(std::string tokenizer, ReadFile(tokenizer_model_path));
    ORYX_RETURN_IF_ERROR(WriteFileAtomic(JoinPath(tmp, kTokenizerFileName), tokenizer));
  }
  return FsyncPath(tmp);
}

// Moves the complete directory `tmp` to `dir`, replacing an existing one (see WriteCheckpoint).
absl::Status SwapIntoPlace(const std::string& tmp, const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) {
    if (::rename(tmp.c_str(), dir.c_str()) != 0) {
      return absl::InternalError(Cat(dir, ": rename from ", tmp, " failed: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    (void)RemoveTree(tmp);  // now the previous checkpoint; best effort
    return absl::OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return absl::InternalError(Cat(dir, ": exchange with ", tmp, " failed: ", std::strerror(errno)));
  }
  const std::string old = Cat(dir, ".old.", ::getpid());
  (void)RemoveTree(old);
  if (::rename(dir.c_str(), old.c_str()) != 0) {
    return absl::InternalError(Cat(dir, ": rename to ", old, " failed: ", std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    absl::Status s = absl::InternalError(Cat(dir, ": rename from ", tmp, " failed: ", std::strerror(errno)));
    ::rename(old.c_str(), dir.c_str());  // put the previous checkpoint back
    return s;
  }
  (void)RemoveTree(old);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TensorView> Checkpoint::Tensor(std::string_view name) const {
  const TensorView* t = store_.Find(name);
  if (t == nullptr) return absl::NotFoundError(Cat(dir_, ": no tensor '", name, "'"));
  return *t;
}

absl::StatusOr<std::vector<float>> Checkpoint::TensorAsFloats(std::string_view name) const {
  ORYX_ASSIGN_OR_RETURN(TensorView t, Tensor(name));
  return TensorToFloats(t);
}

std::string Checkpoint::FileOf(std::string_view name) const {
  return store_.Find(name) == nullptr ? "" : store_.FileOf(name);
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir) {
  if (!IsDirectory(dir)) {
    return absl::NotFoundError(Cat(dir, ": not a checkpoint directory (no such directory)"));
  }
  ORYX_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(JoinPath(dir, kConfigFileName)));
  const std::string tokenizer_path = JoinPath(dir, kTokenizerFileName);
  struct stat st;
  if (::stat(tokenizer_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::NotFoundError(
        Cat(tokenizer_path, ": missing (every checkpoint carries its ", "SentencePiece model)"));
  }
  ORYX_ASSIGN_OR_RETURN(SafetensorsStore store, SafetensorsStore::OpenDirectory(dir));
  const std::vector<TensorView> tensors = store.tensors();
  ORYX_RETURN_IF_ERROR(CheckTensors(config, tensors, dir, [&store](std::string_view name) {
    return store.Find(name) == nullptr ? std::string("?") : store.FileOf(name);
  }));
  return Checkpoint(dir, config, tokenizer_path, std::move(store));
}

absl::Status ValidateCheckpointTensors(const ModelConfig& config, std::span<const TensorView> tensors,
                                       std::string_view source) {
  return CheckTensors(config, tensors, source, [source](std::string_view) { return std::string(source); });
}

absl::Status WriteCheckpoint(const std::string& dir_arg, const ModelConfig& config,
                             std::span<const TensorView> tensors, uint64_t max_shard_bytes,
                             const std::string& tokenizer_model_path) {
  std::string dir = dir_arg;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || dir == "/" || dir == "." || dir == "..") {
    return absl::InvalidArgumentError(Cat("WriteCheckpoint: invalid directory '", dir_arg, "'"));
  }
  ORYX_RETURN_IF_ERROR(ValidateModelConfig(config, JoinPath(dir, kConfigFileName)));
  ORYX_RETURN_IF_ERROR(ValidateCheckpointTensors(config, tensors, Cat("WriteCheckpoint(", dir, ")")));
  if (max_shard_bytes == 0) return absl::InvalidArgumentError("WriteCheckpoint: max_shard_bytes must be > 0");
  std::error_code ec;
  if (std::filesystem::exists(dir, ec)) {
    if (!IsDirectory(dir)) {
      return absl::FailedPreconditionError(Cat(dir, ": exists and is not a directory"));
    }
    ORYX_RETURN_IF_ERROR(CheckReplaceable(dir));
  }

  const std::string tmp = Cat(dir, ".tmp.", ::getpid());
  (void)RemoveTree(tmp);  // a leftover of this process id: never a live checkpoint
  if (::mkdir(tmp.c_str(), 0755) != 0) {
    return absl::InternalError(Cat(tmp, ": cannot create: ", std::strerror(errno)));
  }
  absl::Status s = WriteContents(tmp, config, tensors, max_shard_bytes, tokenizer_model_path);
  if (s.ok()) s = SwapIntoPlace(tmp, dir);
  if (!s.ok()) {
    (void)RemoveTree(tmp);
    return s;
  }
  std::string parent = std::filesystem::path(dir).parent_path().string();
  return FsyncPath(parent.empty() ? "." : parent);
}

}  // namespace oryx
