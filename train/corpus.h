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
//                        sha256}]}}, kinds {prose|code|text: {documents, tokens}, code_fraction,
//                        code_capped {documents, tokens}}, options, stopped_early; written last, so a
//                        corpus directory without it is incomplete (train/shards.h reads it)
//   tokenizer.model      the SentencePiece model the shards were made with (engine/tokenizer.h)
//   train-00000.bin ...  shards: little-endian uint16 token ids, each document as BOS tokens... EOS,
//   val-00000.bin ...    documents concatenated in a fixed pseudo-random order, split across shards
//                        only by size (a document may continue in the next shard)
// Everything is written atomically; the same inputs and options give byte-identical files.
//
// A document is one file, or with min_document_bytes a run of consecutive files of one source (long
// documents for long-context training). Sources in HTML, Texinfo info, man page roff or gzip form are
// converted to plain text once, into the work directory.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
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
// kernel-docs, kernel-code, python-docs, python-stdlib, perl-docs, git-docs, and the prose of Debian
// main's manuals: man-pages, info-manuals, vim-docs, postgres-docs, sqlite-docs, erlang-docs, rust-books,
// nodejs-docs, llvm-docs, python-lib-docs, debian-docs, libreoffice-help, java-api-docs.
const std::vector<CorpusSourceInfo>& BuiltinCorpusSources();

struct PrepareCorpusOptions {
  std::string out_dir;                      // created if missing
  std::vector<std::string> sources;         // built-in source names; empty = all of them
  std::string input_dir;                    // if set: every regular file under it (recursively, hidden names
                                            // skipped) is a document of one source "input"; no packages read
  std::string input_code_dir;               // the same for a source "input-code" of kind "code" (with or
                                            // without input_dir): own code, under max_code_fraction
  std::string tokenizer_path;               // an existing tokenizer; empty = train one on the train split
  int32_t vocab_size = 8192;                // when training the tokenizer
  int64_t tokenizer_sentences = 1'000'000;  // lines sampled (per-source quotas) to train the tokenizer
  double val_fraction = 0.005;              // share of documents in the validation split
  int64_t max_tokens = 0;                   // stop after the document that reaches this many tokens; 0 = all
  int64_t shard_tokens = 1 << 24;           // tokens per shard (the last one of a split is shorter)
  int64_t max_document_bytes = 512 << 10;   // larger files are skipped (mostly generated tables), except in
                                            // the sources of whole manuals (info-manuals, rust-books, ...)
  int64_t min_document_bytes = 0;           // > 0: a source's files are concatenated in path order into
                                            // documents of at least this many bytes (a short last run joins
                                            // the one before), each file after a line "==> PATH <==" and a
                                            // blank line; 0: one document per file
  double max_code_fraction = 1;             // a code document is left out when keeping it would lift code
                                            // above this share of all tokens so far (in document order)
  int threads = 1;                          // conversion and tokenisation threads; the output does not
                                            // depend on it
  bool install_packages = true;             // `apt-get install` missing packages when running as root
  std::string work_dir;                     // where package archives are unpacked and documentation is
                                            // converted to text; default <out_dir>/.work
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
  int64_t code_tokens = 0;            // tokens of documents from code sources (both splits)
  int64_t code_capped_documents = 0;  // code documents left out by max_code_fraction
  int64_t code_capped_tokens = 0;
  double seconds = 0;      // wall time of the whole run
  double tokenize_seconds = 0;
};

// Builds the corpus in options.out_dir. Errors name the package, file or option at fault.
absl::StatusOr<CorpusSummary> PrepareCorpus(const PrepareCorpusOptions& options);

// Plain text of the documentation formats that prose sources hold (exposed for tests). HTML: the head,
// scripts, styles and navigation dropped; blocks become lines, headings "#" lines, list items "- " or
// "N. " lines, table cells joined by " | "; <pre> kept verbatim; character references decoded.
std::string HtmlToText(std::string_view html);
// A Texinfo info file: its nodes' text without the node header lines, the preamble and the tag tables.
std::string InfoToText(std::string_view info);
// One file's text as a corpus source reads it: a .gz file is decompressed (gzip -dc); then with format
// "man" it is rendered by man-db (`man -l`; a page that only sources another with `.so` gives ""), or
// else by its name: .html/.htm through HtmlToText, .info or .info-N through InfoToText, others as they are.
absl::StatusOr<std::string> ConvertDocumentFile(const std::string& path, const std::string& format);

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
