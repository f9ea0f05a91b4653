// Reads a prepared corpus (train/corpus.h) for training: the manifest, checked; the shards of one split,
// memory-mapped; fixed-length next-token windows by index; and a deterministic shuffled order.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mapped_file.h"
#include "nlohmann/json.hpp"

namespace oryx {

struct CorpusShardInfo {
  std::string file;    // name inside the corpus directory, e.g. "train-00000.bin"
  int64_t tokens = 0;  // uint16 token ids in it (file size = 2 * tokens)
  std::string sha256;  // hex SHA-256 of the file
};

struct CorpusSplitInfo {
  int64_t documents = 0;
  int64_t tokens = 0;
  std::vector<CorpusShardInfo> shards;
};

// manifest.json, parsed and checked for internal consistency (not against the files).
struct CorpusManifest {
  nlohmann::json json;         // the whole document, for fields not broken out below
  std::string tokenizer_file;  // relative to the corpus directory
  std::string tokenizer_sha256;
  int32_t vocab_size = 0;
  int32_t bos_id = 0;
  int32_t eos_id = 0;
  std::map<std::string, CorpusSplitInfo> splits;  // "train", "val"
};

// Parses `corpus_dir`/manifest.json. Errors name the file and the field.
absl::StatusOr<CorpusManifest> ReadCorpusManifest(const std::string& corpus_dir);

// One split of a corpus as a single stream of tokens. Open() checks the manifest and that every shard
// exists with the size it states; with verify_checksums it also reads every shard, checks its SHA-256
// and that all ids are below vocab_size. Move-only; const methods are safe from several threads.
class CorpusReader {
 public:
  static absl::StatusOr<CorpusReader> Open(const std::string& corpus_dir, const std::string& split,
                                           bool verify_checksums = false);
  CorpusReader(CorpusReader&&) noexcept = default;
  CorpusReader& operator=(CorpusReader&&) noexcept = default;

  int64_t num_tokens() const { return total_tokens_; }
  int32_t vocab_size() const { return manifest_.vocab_size; }
  const CorpusManifest& manifest() const { return manifest_; }
  std::string tokenizer_path() const { return dir_ + "/" + manifest_.tokenizer_file; }

  // Number of next-token training windows of length seq_len: window i covers tokens
  // [i*seq_len, i*seq_len + seq_len] (seq_len + 1 tokens: inputs are the first seq_len, targets the
  // last seq_len), so consecutive windows share one token and together cover the split once.
  int64_t NumSequences(int64_t seq_len) const;
  // Writes window `index` (seq_len + 1 ids) to out[0..seq_len]. OutOfRange past NumSequences(seq_len).
  absl::Status ReadSequence(int64_t index, int64_t seq_len, int32_t* out) const;
  // Writes tokens [start, start + count) of the split (across shard boundaries) to `out`.
  absl::Status ReadTokens(int64_t start, int64_t count, int32_t* out) const;
  // Re-reads every shard and checks its SHA-256 and token ids.
  absl::Status VerifyChecksums() const;

 private:
  struct MappedShard {
    MappedFile file;
    const uint16_t* data = nullptr;  // [tokens] in `file`, little-endian on disk
    int64_t tokens = 0;
    int64_t first_token = 0;  // index of data[0] in the split
  };
  CorpusReader() = default;

  std::string dir_;
  std::string split_;
  CorpusManifest manifest_;
  std::vector<MappedShard> shards_;
  int64_t total_tokens_ = 0;
};

// A permutation of [0, n) that depends only on (n, seed, epoch): the same on every platform and run.
std::vector<int64_t> ShuffledOrder(int64_t n, uint64_t seed, int64_t epoch = 0);

}  // namespace oryx
