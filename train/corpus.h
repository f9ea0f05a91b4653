// Builds the Oryx training corpus: real text from Debian packages (documentation prose and source code)
// or from a directory of text files, split train/validation by document, tokenised into uint16 shards
// and described by manifest.json (provenance, counts, SHA-256 of every shard). Also packs a prefix of a
// corpus into one compressed archive small enough to travel to a GPU machine, and unpacks it.
//
// Corpus directory layout (format_version 1):
//   manifest.json        format_version, token_dtype "uint16", tokenizer {file, sha256, vocab_size,
//                        bos_id, eos_id, pad_id}, sources [{name, kind, packages [{name, version}],
//                        files_listed, skipped {reason: files}, text_bytes, train|val {documents,
//                        tokens}}], splits {train|val: {documents, tokens, shards [{file, tokens,
//                        sha256}]}}, options, stopped_early; written last, so a corpus directory
//                        without it is incomplete (train/shards.h reads it)
//   tokenizer.model      the SentencePiece model the shards were made with (engine/tokenizer.h)
//   train-00000.bin ...  shards: little-endian uint16 token ids, each document as BOS tokens... EOS,
//   val-00000.bin ...    documents concatenated in a fixed pseudo-random order, split across shards
//                        only by size (a document may continue in the next shard)
// Everything is written atomically; the same inputs and options give byte-identical files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace oryx {

inline constexpr int kCorpusFormatVersion = 1;

// A built-in source of documents (one file = one document).
struct CorpusSourceInfo {
  std::string name;                   // e.g. "kernel-docs"
  std::string kind;                   // "prose" or "code"
  std::vector<std::string> packages;  // the Debian packages it reads
  std::string description;
};
// kernel-docs, kernel-code, python-docs, python-stdlib, perl-docs, git-docs.
const std::vector<CorpusSourceInfo>& BuiltinCorpusSources();

struct PrepareCorpusOptions {
  std::string out_dir;                      // created if missing
  std::vector<std::string> sources;         // built-in source names; empty = all of them
  std::string input_dir;                    // if set: every regular file under it (recursively, hidden names
                                            // skipped) is a document of one source "input"; no packages read
  std::string tokenizer_path;               // an existing tokenizer; empty = train one on the train split
  int32_t vocab_size = 8192;                // when training the tokenizer
  int64_t tokenizer_sentences = 1'000'000;  // lines sampled (per-source quotas) to train the tokenizer
  double val_fraction = 0.005;              // share of documents in the validation split
  int64_t max_tokens = 0;                   // stop after the document that reaches this many tokens; 0 = all
  int64_t shard_tokens = 1 << 24;           // tokens per shard (the last one of a split is shorter)
  int64_t max_document_bytes = 512 << 10;   // larger files are skipped (mostly generated tables)
  int threads = 1;                          // tokenisation threads; the output does not depend on it
  bool install_packages = true;             // `apt-get install` missing packages when running as root
  std::string work_dir;                     // where package archives are unpacked; default <out_dir>/.work
  bool progress = true;                     // progress lines on stderr
};

struct CorpusSplitSummary {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t shards = 0;
};

struct CorpusSummary {
  CorpusSplitSummary train;
  CorpusSplitSummary val;
  int64_t text_bytes = 0;  // bytes of the documents that were tokenised
  double seconds = 0;      // wall time of the whole run
  double tokenize_seconds = 0;
};

// Builds the corpus in options.out_dir. Errors name the package, file or option at fault.
absl::StatusOr<CorpusSummary> PrepareCorpus(const PrepareCorpusOptions& options);

struct PackCorpusOptions {
  std::string corpus_dir;
  std::string out_path;                    // the archive, e.g. corpus.tar.xz (written atomically)
  int64_t max_train_tokens = 100'000'000;  // train prefix kept (the last shard is cut); all of val is kept
  std::string compression = "xz";          // "xz" or "gzip", run through tar
};

struct PackSummary {
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  int64_t archive_bytes = 0;
};

// Packs manifest, tokenizer, a prefix of the train split and the whole validation split into one
// archive; the archive unpacks (UnpackCorpus, or `tar -xf ARCHIVE -C DIR`) into a valid corpus
// directory whose manifest describes exactly what it holds.
absl::StatusOr<PackSummary> PackCorpus(const PackCorpusOptions& options);

// Unpacks an archive made by PackCorpus into `out_dir` and verifies every shard's checksum.
absl::Status UnpackCorpus(const std::string& archive_path, const std::string& out_dir);

}  // namespace oryx
