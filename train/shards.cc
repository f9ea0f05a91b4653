// Corpus manifest parsing, memory-mapped shard reading, and the deterministic shuffle.
#include "train/shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "train/corpus.h"
#include "train/sha256.h"

namespace oryx {

static_assert(std::endian::native == std::endian::little, "shards are little-endian uint16");

namespace {

using json = nlohmann::json;

// Typed field access with errors that name the manifest and the field.
class ManifestFields {
 public:
  explicit ManifestFields(std::string path) : path_(std::move(path)) {}

  absl::Status Error(const std::string& field, const std::string& what) const {
    return absl::DataLossError(absl::StrCat(path_, ": ", field, ": ", what));
  }
  absl::StatusOr<const json*> Get(const json& obj, const std::string& key, const std::string& field,
                                  json::value_t type) const {
    if (!obj.is_object() || !obj.contains(key)) return Error(field, "missing");
    const json& v = obj.at(key);
    const bool ok = type == json::value_t::number_integer ? v.is_number_integer() : v.type() == type;
    if (!ok) return Error(field, absl::StrCat("has the wrong type (", v.type_name(), ")"));
    return &v;
  }
  absl::StatusOr<int64_t> Int(const json& obj, const std::string& key, const std::string& field,
                              int64_t min) const {
    ORYX_ASSIGN_OR_RETURN(const json* v, Get(obj, key, field, json::value_t::number_integer));
    const int64_t x = v->get<int64_t>();
    if (x < min) return Error(field, absl::StrCat("must be >= ", min, ", got ", x));
    return x;
  }
  absl::StatusOr<std::string> String(const json& obj, const std::string& key,
                                     const std::string& field) const {
    ORYX_ASSIGN_OR_RETURN(const json* v, Get(obj, key, field, json::value_t::string));
    return v->get<std::string>();
  }

 private:
  std::string path_;
};

// A file name that stays inside the corpus directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

absl::StatusOr<CorpusSplitInfo> ParseSplit(const ManifestFields& f, const json& j, const std::string& name) {
  const std::string field = "splits." + name;
  CorpusSplitInfo split;
  ORYX_ASSIGN_OR_RETURN(split.documents, f.Int(j, "documents", field + ".documents", 0));
  ORYX_ASSIGN_OR_RETURN(split.tokens, f.Int(j, "tokens", field + ".tokens", 0));
  ORYX_ASSIGN_OR_RETURN(const json* shards, f.Get(j, "shards", field + ".shards", json::value_t::array));
  int64_t sum = 0;
  for (size_t i = 0; i < shards->size(); ++i) {
    const std::string sf = absl::StrCat(field, ".shards[", i, "]");
    CorpusShardInfo shard;
    ORYX_ASSIGN_OR_RETURN(shard.file, f.String((*shards)[i], "file", sf + ".file"));
    ORYX_ASSIGN_OR_RETURN(shard.tokens, f.Int((*shards)[i], "tokens", sf + ".tokens", 0));
    ORYX_ASSIGN_OR_RETURN(shard.sha256, f.String((*shards)[i], "sha256", sf + ".sha256"));
    if (!IsPlainFileName(shard.file)) return f.Error(sf + ".file", "must be a plain file name");
    if (shard.sha256.size() != 64) return f.Error(sf + ".sha256", "must be 64 hex digits");
    sum += shard.tokens;
    split.shards.push_back(std::move(shard));
  }
  if (sum != split.tokens) {
    return f.Error(field, absl::StrCat("tokens is ", split.tokens, " but its shards hold ", sum));
  }
  return split;
}


}  // namespace

absl::StatusOr<CorpusManifest> ReadCorpusManifest(const std::string& corpus_dir) {
  const std::string path = corpus_dir + "/manifest.json";
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    return absl::NotFoundError(
        absl::StrCat(path, ": no corpus manifest (prepare the corpus with `oryx data prepare`)"));
  }
  const ManifestFields f(path);
  CorpusManifest m;
  m.json = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (m.json.is_discarded()) return f.Error("manifest", "not valid JSON");
  if (!m.json.is_object()) return f.Error("manifest", "must be a JSON object");
  ORYX_ASSIGN_OR_RETURN(int64_t version, f.Int(m.json, "format_version", "format_version", 1));
  if (version != kCorpusFormatVersion) {
    return f.Error("format_version",
                   absl::StrCat("is ", version, ", this build reads ", kCorpusFormatVersion));
  }
  ORYX_ASSIGN_OR_RETURN(std::string dtype, f.String(m.json, "token_dtype", "token_dtype"));
  if (dtype != "uint16") return f.Error("token_dtype", "must be \"uint16\", got \"" + dtype + "\"");
  ORYX_ASSIGN_OR_RETURN(const json* tok, f.Get(m.json, "tokenizer", "tokenizer", json::value_t::object));
  ORYX_ASSIGN_OR_RETURN(m.tokenizer_file, f.String(*tok, "file", "tokenizer.file"));
  if (!IsPlainFileName(m.tokenizer_file)) return f.Error("tokenizer.file", "must be a plain file name");
  ORYX_ASSIGN_OR_RETURN(m.tokenizer_sha256, f.String(*tok, "sha256", "tokenizer.sha256"));
  ORYX_ASSIGN_OR_RETURN(int64_t vocab, f.Int(*tok, "vocab_size", "tokenizer.vocab_size", 1));
  if (vocab > 65536) return f.Error("tokenizer.vocab_size", "exceeds 65536, too large for uint16 shards");
  m.vocab_size = static_cast<int32_t>(vocab);
  ORYX_ASSIGN_OR_RETURN(int64_t bos, f.Int(*tok, "bos_id", "tokenizer.bos_id", 0));
  ORYX_ASSIGN_OR_RETURN(int64_t eos, f.Int(*tok, "eos_id", "tokenizer.eos_id", 0));
  m.bos_id = static_cast<int32_t>(bos);
  m.eos_id = static_cast<int32_t>(eos);
  ORYX_ASSIGN_OR_RETURN(const json* splits, f.Get(m.json, "splits", "splits", json::value_t::object));
  for (const auto& [name, value] : splits->items()) {
    ORYX_ASSIGN_OR_RETURN(m.splits[name], ParseSplit(f, value, name));
  }
  return m;
}

// --- CorpusReader ----------------------------------------------------------------------------------

absl::StatusOr<CorpusReader> CorpusReader::Open(const std::string& corpus_dir, const std::string& split,
                                                bool verify_checksums) {
  CorpusReader r;
  r.dir_ = corpus_dir;
  r.split_ = split;
  ORYX_ASSIGN_OR_RETURN(r.manifest_, ReadCorpusManifest(corpus_dir));
  auto it = r.manifest_.splits.find(split);
  if (it == r.manifest_.splits.end()) {
    return absl::NotFoundError(absl::StrCat(corpus_dir, "/manifest.json: no split named '", split, "'"));
  }
  for (const CorpusShardInfo& info : it->second.shards) {
    const std::string path = corpus_dir + "/" + info.file;
    MappedShard shard;
    ORYX_ASSIGN_OR_RETURN(shard.file, MappedFile::Open(path));
    if (static_cast<int64_t>(shard.file.size()) != info.tokens * 2) {
      return absl::DataLossError(absl::StrCat(path, ": shard is ", shard.file.size(), " bytes, the manifest says ",
                                              info.tokens, " tokens (", info.tokens * 2, " bytes)"));
    }
    shard.file.AdviseRandomAccess();
    shard.data = reinterpret_cast<const uint16_t*>(shard.file.data());
    shard.tokens = info.tokens;
    shard.first_token = r.total_tokens_;
    r.total_tokens_ += info.tokens;
    r.shards_.push_back(std::move(shard));
  }
  if (verify_checksums) ORYX_RETURN_IF_ERROR(r.VerifyChecksums());
  return r;
}

int64_t CorpusReader::NumSequences(int64_t seq_len) const {
  if (seq_len <= 0 || total_tokens_ < 2) return 0;
  return (total_tokens_ - 1) / seq_len;
}

absl::Status CorpusReader::ReadTokens(int64_t start, int64_t count, int32_t* out) const {
  if (start < 0 || count < 0 || start > total_tokens_ - count) {
    return absl::OutOfRangeError(absl::StrCat(dir_, " split ", split_, ": tokens [", start, ", ",
                                              start + count, ") outside [0, ", total_tokens_, ")"));
  }
  // The last shard whose first token is <= start.
  auto it = std::upper_bound(shards_.begin(), shards_.end(), start,
                             [](int64_t s, const MappedShard& shard) { return s < shard.first_token; });
  size_t i = static_cast<size_t>(it - shards_.begin()) - 1;
  while (count > 0) {
    const MappedShard& shard = shards_[i++];
    const int64_t offset = start - shard.first_token;
    const int64_t n = std::min(count, shard.tokens - offset);
    for (int64_t k = 0; k < n; ++k) out[k] = shard.data[offset + k];
    out += n, start += n, count -= n;
  }
  return absl::OkStatus();
}

absl::Status CorpusReader::ReadSequence(int64_t index, int64_t seq_len, int32_t* out) const {
  if (seq_len <= 0)
    return absl::InvalidArgumentError(absl::StrCat("seq_len must be positive, got ", seq_len));
  const int64_t n = NumSequences(seq_len);
  if (index < 0 || index >= n) {
    return absl::OutOfRangeError(absl::StrCat(dir_, " split ", split_, ": sequence ", index, " of length ",
                                              seq_len, " outside [0, ", n, ")"));
  }
  return ReadTokens(index * seq_len, seq_len + 1, out);
}

absl::Status CorpusReader::VerifyChecksums() const {
  const CorpusSplitInfo& split = manifest_.splits.at(split_);
  for (size_t i = 0; i < shards_.size(); ++i) {
    const MappedShard& shard = shards_[i];
    const std::string path = dir_ + "/" + split.shards[i].file;
    Sha256 hasher;
    hasher.Update(shard.data, static_cast<size_t>(shard.tokens) * 2);
    if (hasher.HexDigest() != split.shards[i].sha256) {
      return absl::DataLossError(absl::StrCat(path, ": SHA-256 does not match the manifest (corrupt shard)"));
    }
    for (int64_t k = 0; k < shard.tokens; ++k) {
      if (shard.data[k] >= manifest_.vocab_size) {
        return absl::DataLossError(absl::StrCat(path, ": token ", k, " is ", shard.data[k],
                                                ", not below vocab_size ", manifest_.vocab_size));
      }
    }
  }
  return absl::OkStatus();
}

// --- shuffle -----------------------------------------------------------------------------------------

namespace {
uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

std::vector<int64_t> ShuffledOrder(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(epoch + 1));
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates with a 128-bit multiply for an unbiased-enough draw
    const uint64_t r = SplitMix64(&state);
    const int64_t j =
        static_cast<int64_t>((static_cast<unsigned __int128>(r) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(order[i], order[j]);
  }
  return order;
}

}  // namespace oryx
