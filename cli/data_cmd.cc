// `oryx data prepare|pack|unpack|verify|text`: build the tokenised training corpus from Debian packages (or a
// directory of text), pack a prefix of it for a GPU machine, unpack it there, and check it.
#include <iostream>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "base/flags.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "engine/tokenizer.h"
#include "train/corpus.h"
#include "train/shards.h"

namespace oryx::cli {
namespace {

constexpr char kUsage[] =
    "usage: oryx data <prepare|pack|unpack|verify|text> [flags]\n\n"
    "  prepare  build a tokenised corpus (uint16 shards + manifest.json) from Debian packages or a "
    "directory\n"
    "  pack     compress the manifest, tokenizer, a train prefix and all of val into one archive\n"
    "  unpack   unpack such an archive into a corpus directory and verify it\n"
    "  verify   check a corpus directory's manifest, shard sizes and SHA-256 checksums\n"
    "  text     write the decoded text of a stretch of a split\n\n"
    "Run 'oryx data <subcommand> --help' for its flags.\n";

// The built-in sources, a line each (name, kind, what it holds, [its Debian packages]) wrapped at 120 columns
// under the description.
std::string SourcesHelp() {
  constexpr size_t kIndent = 26, kWidth = 120;
  std::string s = "Built-in sources (--sources, default all):";
  for (const CorpusSourceInfo& src : BuiltinCorpusSources()) {
    std::string packages;
    for (const std::string& p : src.packages) packages += (packages.empty() ? "" : ", ") + p;
    std::string line = absl::StrFormat("\n  %-16s %-6s", src.name, src.kind);
    size_t column = line.size() - 1;
    for (const absl::string_view word : absl::StrSplit(src.description + " [" + packages + "]", ' ')) {
      if (column + 1 + word.size() > kWidth) {
        line += "\n" + std::string(kIndent, ' ');
        column = kIndent;
      } else {
        line += ' ';
        ++column;
      }
      line.append(word.data(), word.size());
      column += word.size();
    }
    s += line;
  }
  return s;
}

void PrintSplit(const char* name, const CorpusSplitSummary& s) {
  std::cerr << absl::StrFormat("oryx data:   %-5s %9d documents %14d tokens %4d shards\n", name, s.documents,
                               s.tokens, s.shards);
}

int Prepare(const Args& args) {
  PrepareCorpusOptions o;
  std::vector<std::string> sources;
  int64_t vocab = o.vocab_size, threads = o.threads;
  bool no_install = false, quiet = false;
  FlagSet flags(
      "oryx data prepare --out DIR [--sources NAME...] [--input-dir DIR] [--tokenizer FILE | --vocab N]\n"
      "                         [--max-tokens N] [--min-document-bytes N] [--max-code-fraction F] [...]",
      "Builds a training corpus: one document per file, split train/validation by a hash of its name,\n"
      "each tokenised as BOS tokens EOS into uint16 shards, with manifest.json recording package versions,\n"
      "counts and SHA-256 checksums. Missing Debian packages are installed with apt-get when run as root.\n"
      "HTML, info, man pages and .gz files are converted to text once, into the work directory.\n"
      "--min-document-bytes joins each source's files (in path order) into documents of at least N bytes,\n"
      "each file after a line \"==> PATH <==\", for long-context training (81920: documents of 16K tokens\n"
      "and more). --max-code-fraction F leaves out code documents, in document order, that would lift\n"
      "code above F of all tokens (0.7: at most 70% code).\n"
      "Deterministic: the same inputs and flags give byte-identical files.\n\n" +
          SourcesHelp());
  flags.String("out", &o.out_dir, "output corpus directory", /*required=*/true);
  flags.StringList("sources", &sources, "built-in sources to read (names, space- or comma-separated)");
  flags.String("input-dir", &o.input_dir, "read every file under DIR as a document instead of packages");
  flags.String("input-code-dir", &o.input_code_dir,
               "read every file under DIR as a code document (source input-code; with or without --input-dir)");
  flags.String("tokenizer", &o.tokenizer_path, "use this tokenizer model instead of training one");
  flags.Int("vocab", &vocab, "vocabulary size of the trained tokenizer", kMinVocabSize, 65536);
  flags.Int("tokenizer-sentences", &o.tokenizer_sentences, "lines sampled to train the tokenizer", 1);
  flags.Double("val-fraction", &o.val_fraction, "share of documents in the validation split");
  flags.Int("max-tokens", &o.max_tokens, "stop after about N tokens (0: everything)", 0);
  flags.Int("shard-tokens", &o.shard_tokens, "tokens per shard", 1);
  flags.Int("max-document-bytes", &o.max_document_bytes, "skip larger files (not in sources of whole manuals)", 1);
  flags.Int("min-document-bytes", &o.min_document_bytes,
            "join each source's files into documents of at least N bytes (0: one document per file)", 0);
  flags.Double("max-code-fraction", &o.max_code_fraction,
               "leave out code documents that would lift code above this share of the tokens (1: no cap)");
  flags.Int("threads", &threads, "conversion and tokenisation threads (output does not depend on it)", 1, 256);
  flags.String("work-dir", &o.work_dir,
               "where package tarballs are unpacked and documentation is converted [default: OUT/.work]");
  flags.Bool("no-install", &no_install, "never run apt-get; fail if a package is missing");
  flags.Bool("quiet", &quiet, "no progress lines");
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    for (const std::string& s : sources) {
      for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipWhitespace()))
        o.sources.emplace_back(part);
    }
    o.vocab_size = static_cast<int32_t>(vocab);
    o.threads = static_cast<int>(threads);
    o.install_packages = !no_install;
    o.progress = !quiet;
    ORYX_ASSIGN_OR_RETURN(CorpusSummary s, PrepareCorpus(o));
    const int64_t tokens = s.train.tokens + s.val.tokens;
    std::cerr << "oryx data: wrote " << o.out_dir << "/manifest.json\n";
    PrintSplit("train", s.train);
    PrintSplit("val", s.val);
    std::cerr << absl::StrFormat(
        "oryx data:   code %d tokens (%.1f%%), other %d tokens (%.1f%%); left out by --max-code-fraction: "
        "%d documents, %d tokens\n",
        s.code_tokens, 100.0 * s.code_tokens / std::max<int64_t>(1, tokens), tokens - s.code_tokens,
        100.0 * (tokens - s.code_tokens) / std::max<int64_t>(1, tokens), s.code_capped_documents,
        s.code_capped_tokens);
    std::cerr << absl::StrFormat(
        "oryx data: %.1f MB of text -> %d tokens in %.1f s (tokenising %.1f s: %.2f MB/s, %.0f tokens/s)\n",
        s.text_bytes / 1e6, tokens, s.seconds, s.tokenize_seconds, s.text_bytes / 1e6 / s.tokenize_seconds,
        tokens / s.tokenize_seconds);
    return absl::OkStatus();
  });
}

int Pack(const Args& args) {
  PackCorpusOptions o;
  FlagSet flags(
      "oryx data pack --corpus DIR --out FILE [--max-tokens N] [--compression xz|gzip]",
      "Packs manifest.json, the tokenizer, the first N train tokens (whole shards, the last one cut)\n"
      "and the whole validation split into one archive with a manifest that describes exactly what\n"
      "it holds. Unpack with `oryx data unpack` or `mkdir DIR && tar -xf FILE -C DIR`.");
  flags.String("corpus", &o.corpus_dir, "prepared corpus directory", /*required=*/true);
  flags.String("out", &o.out_path, "archive to write, e.g. corpus.tar.xz", /*required=*/true);
  flags.Int("max-tokens", &o.max_train_tokens, "train tokens to keep", 0);
  flags.String("compression", &o.compression, "xz (smaller) or gzip (faster)");
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(PackSummary s, PackCorpus(o));
    std::cerr << absl::StrFormat(
        "oryx data: wrote %s: %d train + %d val tokens, %.1f MiB (%.3f bytes/token)\n", o.out_path,
        s.train_tokens, s.val_tokens, s.archive_bytes / 1048576.0,
        static_cast<double>(s.archive_bytes) / std::max<int64_t>(1, s.train_tokens + s.val_tokens));
    return absl::OkStatus();
  });
}

int Unpack(const Args& args) {
  std::string archive, out;
  FlagSet flags("oryx data unpack --archive FILE --out DIR",
                "Unpacks an archive made by `oryx data pack` and verifies every checksum.");
  flags.String("archive", &archive, "archive made by `oryx data pack`", /*required=*/true);
  flags.String("out", &out, "corpus directory to create", /*required=*/true);
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    ORYX_RETURN_IF_ERROR(UnpackCorpus(archive, out));
    std::cerr << "oryx data: unpacked and verified " << out << "\n";
    return absl::OkStatus();
  });
}

int Verify(const Args& args) {
  std::string corpus;
  FlagSet flags(
      "oryx data verify --corpus DIR",
      "Checks the manifest, every shard's size and SHA-256, and that all ids are below vocab_size.");
  flags.String("corpus", &corpus, "corpus directory", /*required=*/true);
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(CorpusManifest m, ReadCorpusManifest(corpus));
    for (const auto& [split, info] : m.splits) {
      ORYX_ASSIGN_OR_RETURN(CorpusReader r, CorpusReader::Open(corpus, split, /*verify_checksums=*/true));
      std::cout << absl::StrFormat("%s: %d documents, %d tokens, %d shards: ok\n", split, info.documents,
                                   r.num_tokens(), info.shards.size());
    }
    return absl::OkStatus();
  });
}

int Text(const Args& args) {
  std::string corpus, split = "val", out;
  int64_t offset = 0, tokens = 4096;
  FlagSet flags("oryx data text --corpus DIR [--split val] [--offset N] [--tokens N] --out FILE",
                "Writes the text of a stretch of a corpus split (its tokens decoded; document boundaries\n"
                "become blank lines): to read what the corpus holds, or to carry a piece of it as plain text.");
  flags.String("corpus", &corpus, "corpus directory", /*required=*/true);
  flags.String("split", &split, "train | val");
  flags.Int("offset", &offset, "first token", 0);
  flags.Int("tokens", &tokens, "tokens to decode", 1);
  flags.String("out", &out, "text file to write (atomically)", /*required=*/true);
  return RunWithFlags(flags, args, [&]() -> absl::Status {
    ORYX_ASSIGN_OR_RETURN(CorpusReader r, CorpusReader::Open(corpus, split));
    if (offset + tokens > r.num_tokens()) {
      return absl::InvalidArgumentError(absl::StrFormat("tokens %d..%d are past the %s split's %d", offset,
                                                        offset + tokens - 1, split, r.num_tokens()));
    }
    ORYX_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(r.tokenizer_path()));
    std::vector<int32_t> ids(tokens);
    ORYX_RETURN_IF_ERROR(r.ReadTokens(offset, tokens, ids.data()));
    std::string text;
    std::vector<int32_t> document;
    for (size_t i = 0; i <= ids.size(); ++i) {
      if (i == ids.size() || ids[i] == tok.bos_id() || ids[i] == tok.eos_id()) {
        if (!document.empty()) text += tok.Decode(document) + "\n\n";
        document.clear();
      } else {
        document.push_back(ids[i]);
      }
    }
    return WriteFileAtomic(out, text);
  });
}

}  // namespace

int RunData(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const Args rest(args.begin() + 1, args.end());
  if (args[0] == "prepare") return Prepare(rest);
  if (args[0] == "pack") return Pack(rest);
  if (args[0] == "unpack") return Unpack(rest);
  if (args[0] == "verify") return Verify(rest);
  if (args[0] == "text") return Text(rest);
  std::cerr << "oryx: error: unknown data subcommand '" << args[0] << "' (prepare, pack, unpack, verify, text)\n";
  return 2;
}

}  // namespace oryx::cli
