// The corpus pipeline: list documents (Debian packages or a directory), split and order them by hashes
// of their names, train or copy the tokenizer, tokenise into shards, write the manifest; and pack/unpack.
#include "train/corpus.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"
#include "train/data_subprocess.h"
#include "train/sha256.h"
#include "train/shards.h"

namespace oryx {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// --- sources -----------------------------------------------------------------------------------------

// How a source finds its documents. Either the first package ships a source tarball (linux-source),
// unpacked into the work directory, or the documents are files the packages install under `root`.
struct SourceDef {
  CorpusSourceInfo info;
  bool from_tarball = false;
  std::string root;  // installed files: absolute prefix; document ids are relative to it
  std::vector<std::string> suffixes;
  std::vector<std::string> include_prefixes;  // relative path must start with one (empty: any)
  std::vector<std::string> exclude_prefixes;
  std::vector<std::string> exclude_substrings;
};

const std::vector<SourceDef>& SourceDefs() {
  static const auto* defs = new std::vector<SourceDef>{
      {{"kernel-docs", "prose", {"linux-source-6.1"}, "Linux kernel Documentation/ (reStructuredText)"},
       true,
       "",
       {".rst", ".txt"},
       {"Documentation/"},
       {},
       {}},
      {{"kernel-code", "code", {"linux-source-6.1"}, "Linux kernel C sources and headers"},
       true,
       "",
       {".c", ".h"},
       {},
       {"Documentation/"},
       {"/asic_reg/"}},  // asic_reg: generated registers
      {{"python-docs", "prose", {"python3.11-doc"}, "Python 3.11 documentation sources (reST)"},
       false,
       "/usr/share/doc/python3.11/html/_sources/",
       {".rst.txt"},
       {},
       {},
       {}},
      {{"python-stdlib",
        "code",
        {"libpython3.11-minimal", "libpython3.11-stdlib"},
        "Python 3.11 standard library modules"},
       false,
       "/usr/lib/python3.11/",
       {".py"},
       {},
       {},
       {"site-packages/", "dist-packages/"}},
      {{"perl-docs", "prose", {"perl-doc"}, "Perl 5 documentation (POD)"},
       false,
       "/usr/share/perl/",
       {".pod"},
       {},
       {},
       {}},
      {{"git-docs", "prose", {"git-doc"}, "Git documentation (AsciiDoc)"},
       false,
       "/usr/share/doc/git-doc/",
       {".txt"},
       {},
       {},
       {}},
  };
  return *defs;
}

bool AcceptPath(const SourceDef& def, const std::string& rel) {
  bool suffix_ok = false;
  for (const std::string& s : def.suffixes) suffix_ok |= absl::EndsWith(rel, s);
  if (!suffix_ok) return false;
  if (!def.include_prefixes.empty()) {
    bool ok = false;
    for (const std::string& p : def.include_prefixes) ok |= absl::StartsWith(rel, p);
    if (!ok) return false;
  }
  for (const std::string& p : def.exclude_prefixes) {
    if (absl::StartsWith(rel, p)) return false;
  }
  for (const std::string& s : def.exclude_substrings) {
    if (absl::StrContains(rel, s)) return false;
  }
  return true;
}

// --- packages ----------------------------------------------------------------------------------------

// The installed version of `package`, or NotFound.
absl::StatusOr<std::string> InstalledVersion(const std::string& package) {
  std::string out;
  CommandOptions o;
  o.captured_stdout = &out;
  o.quiet_stderr = true;
  absl::Status s = RunCommand({"dpkg-query", "-W", "-f=${Status}\t${Version}", package}, o);
  std::vector<std::string> parts = absl::StrSplit(out, '\t');
  if (!s.ok() || parts.size() != 2 || !absl::EndsWith(parts[0], " installed")) {
    return absl::NotFoundError(absl::StrCat("Debian package ", package, " is not installed"));
  }
  return parts[1];
}

// Installs the missing packages (root only) and returns every package's version.
absl::StatusOr<std::map<std::string, std::string>> EnsurePackages(const std::vector<std::string>& packages,
                                                                  bool install, bool progress) {
  std::vector<std::string> missing;
  for (const std::string& p : packages) {
    if (!InstalledVersion(p).ok()) missing.push_back(p);
  }
  if (!missing.empty()) {
    const std::string list = absl::StrJoin(missing, " ");
    if (!install || ::geteuid() != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("missing Debian package(s): ", list, "; install them with `apt-get install ", list,
                       "` (run as root to let oryx do it, or use --input-dir for your own text)"));
    }
    if (progress) std::cerr << "oryx data: installing " << list << " with apt-get\n";
    std::vector<std::string> argv = {"apt-get", "install", "-y", "--no-install-recommends"};
    argv.insert(argv.end(), missing.begin(), missing.end());
    CommandOptions o;
    o.stdout_to_stderr = true;
    o.extra_env = {"DEBIAN_FRONTEND=noninteractive"};
    if (!RunCommand(argv, o).ok()) {  // stale package lists are the usual cause: refresh once
      ORYX_RETURN_IF_ERROR(RunCommand({"apt-get", "update"}, o));
      absl::Status s = RunCommand(argv, o);
      if (!s.ok())
        return absl::FailedPreconditionError(absl::StrCat("cannot install ", list, ": ", s.message()));
    }
  }
  std::map<std::string, std::string> versions;
  for (const std::string& p : packages) {
    ORYX_ASSIGN_OR_RETURN(versions[p], InstalledVersion(p));
  }
  return versions;
}

absl::StatusOr<std::vector<std::string>> PackageFiles(const std::string& package) {
  std::string out;
  CommandOptions o;
  o.captured_stdout = &out;
  ORYX_RETURN_IF_ERROR(RunCommand({"dpkg-query", "-L", package}, o));
  return std::vector<std::string>(absl::StrSplit(out, '\n', absl::SkipEmpty()));
}

// --- listing documents -------------------------------------------------------------------------------

struct Document {
  int source = 0;
  std::string id;    // "<source>/<relative path>": what the split and the order are hashed from
  std::string path;  // on disk
  int64_t bytes = 0;
  bool val = false;
  uint64_t order = 0;
};

struct SourceStats {
  int64_t listed_documents = 0;
  int64_t listed_bytes = 0;
  std::map<std::string, int64_t> skipped;  // reason -> documents
  int64_t documents[2] = {0, 0};           // [train, val]
  int64_t tokens[2] = {0, 0};
  int64_t text_bytes = 0;
};

struct Source {
  std::string name;
  std::string kind;
  std::map<std::string, std::string> packages;  // name -> version
  std::vector<Document> documents;
  SourceStats stats;
};

uint64_t Load64(const std::array<uint8_t, 32>& d, int offset) {
  uint64_t x = 0;
  for (int i = 0; i < 8; ++i) x = (x << 8) | d[offset + i];
  return x;
}

// Adds a regular file as a document of source `s` (too-large files are only counted).
void AddDocument(Source* s, int source_index, const std::string& rel, const std::string& path,
                 int64_t max_bytes, double val_fraction) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  s->stats.listed_documents++;
  s->stats.listed_bytes += st.st_size;
  if (st.st_size > max_bytes) {
    s->stats.skipped["too_large"]++;
    return;
  }
  if (st.st_size == 0) {
    s->stats.skipped["empty"]++;
    return;
  }
  Document d;
  d.source = source_index;
  d.id = s->name + "/" + rel;
  d.path = path;
  d.bytes = st.st_size;
  Sha256 h;
  h.Update(d.id);
  const std::array<uint8_t, 32> digest = h.Digest();
  // The first 8 bytes decide the split, the next 8 the order: independent, and stable when other
  // documents are added or removed.
  d.val = static_cast<double>(Load64(digest, 0) >> 11) * 0x1.0p-53 < val_fraction;
  d.order = Load64(digest, 8);
  s->documents.push_back(std::move(d));
}

// Every regular file under `root` (recursively, hidden names skipped), relative paths sorted.
absl::StatusOr<std::vector<std::string>> WalkDirectory(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return absl::NotFoundError(absl::StrCat(root, ": not a directory"));
  std::vector<std::string> rels;
  fs::recursive_directory_iterator it(root, fs::directory_options::none, ec), end;
  if (ec) return absl::NotFoundError(absl::StrCat(root, ": cannot read directory: ", ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) return absl::InternalError(absl::StrCat(root, ": cannot walk: ", ec.message()));
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file() && !it->is_symlink()) {
      rels.push_back(fs::relative(it->path(), root).string());
    }
  }
  std::sort(rels.begin(), rels.end());
  return rels;
}

// Unpacks the source tarball shipped by `package` into the work directory once (a marker file records
// the package version), and returns the tree's root.
absl::StatusOr<std::string> UnpackTarball(const std::string& package, const std::string& version,
                                          const std::string& work_dir, bool progress) {
  ORYX_ASSIGN_OR_RETURN(std::vector<std::string> files, PackageFiles(package));
  std::string tarball;
  for (const std::string& f : files) {
    if (absl::EndsWith(f, ".tar.xz") || absl::EndsWith(f, ".tar.gz") || absl::EndsWith(f, ".tar.bz2"))
      tarball = f;
  }
  if (tarball.empty())
    return absl::NotFoundError(absl::StrCat("package ", package, " ships no source tarball"));
  const std::string dest = absl::StrCat(work_dir, "/", package, "_", version);
  const std::string marker = dest + "/.oryx-unpacked";
  std::string top = fs::path(tarball).filename().string();
  top = top.substr(0, top.find(".tar"));
  if (fs::exists(marker)) return dest + "/" + top;
  if (progress) std::cerr << "oryx data: unpacking " << tarball << " into " << dest << "\n";
  const std::string tmp = dest + ".partial";
  std::error_code ec;
  (void)RemoveTree(tmp);
  fs::create_directories(tmp, ec);
  if (ec) return absl::InternalError(absl::StrCat(tmp, ": cannot create: ", ec.message()));
  // Only what the kernel sources read: Documentation/ and C files (a third of the tarball).
  ORYX_RETURN_IF_ERROR(RunCommand({"tar", "-xf", tarball, "-C", tmp, "--wildcards", "--no-same-owner",
                                   top + "/Documentation/*", "*.c", "*.h"}));
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(tmp + "/.oryx-unpacked", version));
  (void)RemoveTree(dest);
  fs::rename(tmp, dest, ec);
  if (ec) return absl::InternalError(absl::StrCat(dest, ": cannot rename: ", ec.message()));
  return dest + "/" + top;
}

absl::Status ListPackageSource(const SourceDef& def, int index, const PrepareCorpusOptions& o,
                               const std::string& work_dir, Source* s) {
  if (def.from_tarball) {
    const std::string& pkg = def.info.packages[0];
    ORYX_ASSIGN_OR_RETURN(std::string root, UnpackTarball(pkg, s->packages.at(pkg), work_dir, o.progress));
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> rels, WalkDirectory(root));
    for (const std::string& rel : rels) {
      if (AcceptPath(def, rel))
        AddDocument(s, index, rel, root + "/" + rel, o.max_document_bytes, o.val_fraction);
    }
    return absl::OkStatus();
  }
  std::vector<std::string> paths;
  for (const std::string& pkg : def.info.packages) {
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> files, PackageFiles(pkg));
    paths.insert(paths.end(), files.begin(), files.end());
  }
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  for (const std::string& path : paths) {
    if (!absl::StartsWith(path, def.root)) continue;
    const std::string rel = path.substr(def.root.size());
    if (AcceptPath(def, rel)) AddDocument(s, index, rel, path, o.max_document_bytes, o.val_fraction);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Source>> ListSources(const PrepareCorpusOptions& o, const std::string& work_dir) {
  std::vector<Source> sources;
  if (!o.input_dir.empty()) {
    Source s;
    s.name = "input";
    s.kind = "text";
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> rels, WalkDirectory(o.input_dir));
    for (const std::string& rel : rels) {
      AddDocument(&s, 0, rel, o.input_dir + "/" + rel, o.max_document_bytes, o.val_fraction);
    }
    sources.push_back(std::move(s));
    return sources;
  }
  std::vector<const SourceDef*> chosen;
  for (const SourceDef& def : SourceDefs()) {
    if (o.sources.empty() ||
        std::find(o.sources.begin(), o.sources.end(), def.info.name) != o.sources.end()) {
      chosen.push_back(&def);
    }
  }
  std::vector<std::string> packages;
  for (const SourceDef* def : chosen)
    packages.insert(packages.end(), def->info.packages.begin(), def->info.packages.end());
  std::sort(packages.begin(), packages.end());
  packages.erase(std::unique(packages.begin(), packages.end()), packages.end());
  ORYX_ASSIGN_OR_RETURN(auto versions, EnsurePackages(packages, o.install_packages, o.progress));
  for (const SourceDef* def : chosen) {
    Source s;
    s.name = def->info.name;
    s.kind = def->info.kind;
    for (const std::string& p : def->info.packages) s.packages[p] = versions.at(p);
    ORYX_RETURN_IF_ERROR(ListPackageSource(*def, static_cast<int>(sources.size()), o, work_dir, &s));
    if (o.progress) {
      std::cerr << absl::StrFormat("oryx data: %-14s %7d documents, %8.1f MB\n", s.name, s.documents.size(),
                                   s.stats.listed_bytes / 1e6);
    }
    sources.push_back(std::move(s));
  }
  return sources;
}

// --- reading documents -------------------------------------------------------------------------------

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, int64_t expected) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string data(static_cast<size_t>(expected), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t n = ::read(fd, data.data() + got, data.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got != data.size()) return absl::DataLossError(absl::StrCat(path, ": changed size while reading"));
  return data;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const auto trail = [&](size_t k) { return k < s.size() && (b(k) & 0xC0) == 0x80; };
  while (i < s.size()) {
    const uint8_t c = b(i);
    if (c < 0x80) {
      ++i;
    } else if (c >= 0xC2 && c <= 0xDF && trail(i + 1)) {
      i += 2;
    } else if (c >= 0xE0 && c <= 0xEF && trail(i + 1) && trail(i + 2) && !(c == 0xE0 && b(i + 1) < 0xA0) &&
               !(c == 0xED && b(i + 1) >= 0xA0)) {
      i += 3;
    } else if (c >= 0xF0 && c <= 0xF4 && trail(i + 1) && trail(i + 2) && trail(i + 3) &&
               !(c == 0xF0 && b(i + 1) < 0x90) && !(c == 0xF4 && b(i + 1) >= 0x90)) {
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

// Why a document is left out, or "" to keep it. Text is never altered: only whole files are dropped.
std::string SkipReason(std::string_view text, bool is_code) {
  if (text.find('\0') != std::string_view::npos) return "binary";
  if (!IsValidUtf8(text)) return "invalid_utf8";
  if (!is_code) return "";
  std::string head(text.substr(0, 2048));
  absl::AsciiStrToLower(&head);
  for (const char* marker : {"do not edit", "automatically generated", "autogenerated", "auto-generated"}) {
    if (absl::StrContains(head, marker)) return "generated";
  }
  int64_t hex_literals = 0;
  for (size_t p = text.find("0x"); p != std::string_view::npos; p = text.find("0x", p + 2)) ++hex_literals;
  if (hex_literals * 24 > static_cast<int64_t>(text.size())) return "data_table";
  return "";
}

// --- tokenizer ---------------------------------------------------------------------------------------

// Training lines for the tokenizer from the train split. Each kind of source (prose, code) gets an equal
// share, split between its sources in proportion to the square root of their sizes, so that prose is
// not drowned by kernel C; quotas are filled with whole documents in corpus order, lines of <= 4 KB.
absl::StatusOr<std::vector<std::string>> SampleTokenizerLines(const std::vector<Source>& sources,
                                                              const std::vector<const Document*>& order,
                                                              int64_t total) {
  std::map<std::string, double> kind_weight;  // kind -> sum of its sources' weights
  std::vector<double> weight(sources.size());
  for (size_t s = 0; s < sources.size(); ++s) {
    weight[s] = std::sqrt(static_cast<double>(sources[s].stats.listed_bytes));
    kind_weight[sources[s].kind] += weight[s];
  }
  std::vector<int64_t> quota(sources.size()), taken(sources.size(), 0);
  for (size_t s = 0; s < sources.size(); ++s) {
    const double share = weight[s] / std::max(kind_weight[sources[s].kind], 1.0) / kind_weight.size();
    quota[s] = static_cast<int64_t>(std::ceil(total * share));
  }
  std::vector<std::string> lines;
  for (const Document* d : order) {
    if (d->val || taken[d->source] >= quota[d->source]) continue;
    ORYX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(d->path, d->bytes));
    if (!SkipReason(text, sources[d->source].kind == "code").empty()) continue;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      if (line.size() > 4096 || taken[d->source] >= quota[d->source]) continue;
      lines.emplace_back(line);
      taken[d->source]++;
    }
  }
  return lines;
}

// --- shards ------------------------------------------------------------------------------------------

// Writes one split as shards of at most `shard_tokens` uint16 ids, each atomically, with its SHA-256.
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string prefix, int64_t shard_tokens)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens) {}

  absl::Status Append(const std::vector<int32_t>& tokens) {
    size_t i = 0;
    while (i < tokens.size()) {
      if (!writer_.has_value()) ORYX_RETURN_IF_ERROR(OpenShard());
      const size_t n = std::min<size_t>(tokens.size() - i, shard_tokens_ - in_shard_);
      buffer_.resize(n * 2);
      for (size_t k = 0; k < n; ++k) {
        const uint16_t t = static_cast<uint16_t>(tokens[i + k]);
        buffer_[2 * k] = static_cast<char>(t & 0xFF);
        buffer_[2 * k + 1] = static_cast<char>(t >> 8);
      }
      ORYX_RETURN_IF_ERROR(writer_->Append(buffer_));
      hasher_.Update(buffer_);
      in_shard_ += static_cast<int64_t>(n);
      i += n;
      if (in_shard_ == shard_tokens_) ORYX_RETURN_IF_ERROR(CloseShard());
    }
    return absl::OkStatus();
  }

  absl::Status Finish() { return writer_.has_value() ? CloseShard() : absl::OkStatus(); }
  const std::vector<CorpusShardInfo>& shards() const { return shards_; }

 private:
  absl::Status OpenShard() {
    const std::string name = absl::StrFormat("%s-%05d.bin", prefix_, shards_.size());
    ORYX_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::Open(dir_ + "/" + name));
    writer_.emplace(std::move(w));
    hasher_ = Sha256();
    in_shard_ = 0;
    shards_.push_back({name, 0, ""});
    return absl::OkStatus();
  }
  absl::Status CloseShard() {
    ORYX_RETURN_IF_ERROR(writer_->Commit());
    writer_.reset();
    shards_.back().tokens = in_shard_;
    shards_.back().sha256 = hasher_.HexDigest();
    return absl::OkStatus();
  }

  std::string dir_;
  std::string prefix_;
  int64_t shard_tokens_;
  std::optional<AtomicFileWriter> writer_;
  Sha256 hasher_;
  int64_t in_shard_ = 0;
  std::string buffer_;
  std::vector<CorpusShardInfo> shards_;
};

json ShardsJson(const std::vector<CorpusShardInfo>& shards) {
  json a = json::array();
  for (const CorpusShardInfo& s : shards)
    a.push_back({{"file", s.file}, {"tokens", s.tokens}, {"sha256", s.sha256}});
  return a;
}

// --- progress ----------------------------------------------------------------------------------------

class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled), start_(Clock::now()), last_(start_) {}
  double Seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  void Update(int64_t docs, int64_t tokens, int64_t bytes, bool force = false) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::seconds(5)) return;
    last_ = now;
    const double s = std::max(Seconds(), 1e-9);
    std::cerr << absl::StrFormat(
        "oryx data: %9d docs %10.2fM tokens %9.1f MB  %6.2f MB/s  %8.0f tokens/s  %5.0f s\n", docs,
        tokens / 1e6, bytes / 1e6, bytes / 1e6 / s, tokens / s, s);
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_;
  Clock::time_point start_;
  Clock::time_point last_;
};

// --- tokenising ----------------------------------------------------------------------------------------

struct Batch {
  std::vector<const Document*> docs;
  std::vector<std::string> texts;
  std::vector<std::string> skip;             // reason, or "" when kept
  std::vector<std::vector<int32_t>> tokens;  // BOS ... EOS
};

void TokenizeBatch(const Tokenizer& tok, const std::vector<Source>& sources, Batch* b, int threads) {
  const size_t n = b->docs.size();
  b->skip.assign(n, "");
  b->tokens.assign(n, {});
  auto work = [&](size_t first) {
    for (size_t i = first; i < n; i += threads) {
      b->skip[i] = SkipReason(b->texts[i], sources[b->docs[i]->source].kind == "code");
      if (!b->skip[i].empty()) continue;
      std::vector<int32_t>& t = b->tokens[i];
      t.reserve(b->texts[i].size() / 3 + 2);
      t.push_back(kBosId);
      tok.EncodeAppend(b->texts[i], &t);
      t.push_back(kEosId);
    }
  };
  if (threads <= 1) {
    work(0);
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, static_cast<size_t>(t));
  for (std::thread& th : pool) th.join();
}

struct TokenizeResult {
  std::vector<CorpusShardInfo> shards[2];
  int64_t documents[2] = {0, 0};
  int64_t tokens[2] = {0, 0};
  int64_t text_bytes = 0;
  bool stopped_early = false;
};

absl::StatusOr<TokenizeResult> TokenizeAll(const Tokenizer& tok, std::vector<Source>& sources,
                                           const std::vector<const Document*>& order,
                                           const PrepareCorpusOptions& o) {
  ShardWriter writers[2] = {ShardWriter(o.out_dir, "train", o.shard_tokens),
                            ShardWriter(o.out_dir, "val", o.shard_tokens)};
  TokenizeResult r;
  Progress progress(o.progress);
  constexpr int64_t kBatchBytes = 8 << 20;
  size_t next = 0;
  while (next < order.size() && !r.stopped_early) {
    Batch b;
    int64_t batch_bytes = 0;
    while (next < order.size() && batch_bytes < kBatchBytes && b.docs.size() < 4096) {
      const Document* d = order[next++];
      ORYX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(d->path, d->bytes));
      batch_bytes += d->bytes;
      b.docs.push_back(d);
      b.texts.push_back(std::move(text));
    }
    TokenizeBatch(tok, sources, &b, o.threads);
    for (size_t i = 0; i < b.docs.size(); ++i) {
      SourceStats& st = sources[b.docs[i]->source].stats;
      if (!b.skip[i].empty()) {
        st.skipped[b.skip[i]]++;
        continue;
      }
      const int split = b.docs[i]->val ? 1 : 0;
      ORYX_RETURN_IF_ERROR(writers[split].Append(b.tokens[i]));
      const int64_t n = static_cast<int64_t>(b.tokens[i].size());
      st.documents[split]++;
      st.tokens[split] += n;
      st.text_bytes += b.docs[i]->bytes;
      r.documents[split]++;
      r.tokens[split] += n;
      r.text_bytes += b.docs[i]->bytes;
      if (o.max_tokens > 0 && r.tokens[0] + r.tokens[1] >= o.max_tokens) {
        r.stopped_early = next < order.size() || i + 1 < b.docs.size();
        break;
      }
    }
    progress.Update(r.documents[0] + r.documents[1], r.tokens[0] + r.tokens[1], r.text_bytes);
  }
  progress.Update(r.documents[0] + r.documents[1], r.tokens[0] + r.tokens[1], r.text_bytes, /*force=*/true);
  for (int split = 0; split < 2; ++split) {
    ORYX_RETURN_IF_ERROR(writers[split].Finish());
    r.shards[split] = writers[split].shards();
  }
  return r;
}

// --- manifest ----------------------------------------------------------------------------------------

json SourcesJson(const std::vector<Source>& sources) {
  json a = json::array();
  for (const Source& s : sources) {
    json packages = json::array();
    for (const auto& [name, version] : s.packages) packages.push_back({{"name", name}, {"version", version}});
    json skipped = json::object();
    for (const auto& [reason, n] : s.stats.skipped) skipped[reason] = n;
    a.push_back({{"name", s.name},
                 {"kind", s.kind},
                 {"packages", packages},
                 {"files_listed", s.stats.listed_documents},
                 {"bytes_listed", s.stats.listed_bytes},
                 {"skipped", skipped},
                 {"text_bytes", s.stats.text_bytes},
                 {"train", {{"documents", s.stats.documents[0]}, {"tokens", s.stats.tokens[0]}}},
                 {"val", {{"documents", s.stats.documents[1]}, {"tokens", s.stats.tokens[1]}}}});
  }
  return a;
}

// Removes shards of an earlier run that the new manifest does not list.
void RemoveStaleShards(const std::string& dir, const TokenizeResult& r) {
  std::vector<std::string> keep;
  for (const auto& split : r.shards) {
    for (const CorpusShardInfo& s : split) keep.push_back(s.file);
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool shard =
        (absl::StartsWith(name, "train-") || absl::StartsWith(name, "val-")) && absl::EndsWith(name, ".bin");
    if (shard && std::find(keep.begin(), keep.end(), name) == keep.end()) fs::remove(entry.path(), ec);
  }
}

absl::Status CheckOptions(const PrepareCorpusOptions& o) {
  if (o.out_dir.empty()) return absl::InvalidArgumentError("no output directory (--out)");
  if (!(o.val_fraction >= 0 && o.val_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--val-fraction must be in [0, 1), got ", o.val_fraction));
  }
  if (o.shard_tokens <= 0) return absl::InvalidArgumentError("--shard-tokens must be positive");
  if (o.max_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  if (o.threads < 1 || o.threads > 256) return absl::InvalidArgumentError("--threads must be in [1, 256]");
  if (!o.input_dir.empty() && !o.sources.empty()) {
    return absl::InvalidArgumentError("--sources and --input-dir exclude each other");
  }
  for (const std::string& name : o.sources) {
    bool known = false;
    for (const SourceDef& def : SourceDefs()) known |= def.info.name == name;
    if (!known) {
      std::string names;
      for (const SourceDef& def : SourceDefs()) absl::StrAppend(&names, " ", def.info.name);
      return absl::InvalidArgumentError(absl::StrCat("unknown source '", name, "' (known:", names, ")"));
    }
  }
  if (o.tokenizer_path.empty() && (o.vocab_size < kMinVocabSize || o.vocab_size > 65536)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab must be in [", kMinVocabSize, ", 65536] (uint16 shards), got ", o.vocab_size));
  }
  return absl::OkStatus();
}

// Copies the given tokenizer, or trains one, into the corpus; returns it loaded.
absl::StatusOr<Tokenizer> PrepareTokenizer(const PrepareCorpusOptions& o, const std::vector<Source>& sources,
                                           const std::vector<const Document*>& order, json* info) {
  const std::string dest = o.out_dir + "/tokenizer.model";
  std::string model;
  if (!o.tokenizer_path.empty()) {
    ORYX_ASSIGN_OR_RETURN(model, ReadFile(o.tokenizer_path));
    (*info)["trained_by_prepare"] = false;
  } else {
    const auto start = std::chrono::steady_clock::now();
    ORYX_ASSIGN_OR_RETURN(std::vector<std::string> lines,
                          SampleTokenizerLines(sources, order, o.tokenizer_sentences));
    if (o.progress) {
      std::cerr << "oryx data: training the tokenizer (BPE, vocab " << o.vocab_size << ") on " << lines.size()
                << " lines\n";
    }
    ORYX_ASSIGN_OR_RETURN(model, TrainTokenizerFromSentences(lines, o.vocab_size));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (o.progress) std::cerr << absl::StrFormat("oryx data: tokenizer trained in %.1f s\n", secs);
    (*info)["trained_by_prepare"] = true;
    (*info)["training_lines"] = lines.size();
  }
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok,
                        Tokenizer::FromBytes(model, o.tokenizer_path.empty() ? dest : o.tokenizer_path));
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(dest, model));
  (*info)["file"] = "tokenizer.model";
  (*info)["sha256"] = Sha256Hex(model);
  (*info)["vocab_size"] = tok.vocab_size();
  (*info)["bos_id"] = tok.bos_id();
  (*info)["eos_id"] = tok.eos_id();
  (*info)["pad_id"] = tok.pad_id();
  return tok;
}

}  // namespace

const std::vector<CorpusSourceInfo>& BuiltinCorpusSources() {
  static const auto* infos = [] {
    auto* v = new std::vector<CorpusSourceInfo>;
    for (const SourceDef& d : SourceDefs()) v->push_back(d.info);
    return v;
  }();
  return *infos;
}

absl::StatusOr<CorpusSummary> PrepareCorpus(const PrepareCorpusOptions& o) {
  ORYX_RETURN_IF_ERROR(CheckOptions(o));
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(o.out_dir, ": cannot create: ", ec.message()));
  const std::string work_dir = o.work_dir.empty() ? o.out_dir + "/.work" : o.work_dir;

  ORYX_ASSIGN_OR_RETURN(std::vector<Source> sources, ListSources(o, work_dir));
  std::vector<const Document*> order;
  for (const Source& s : sources) {
    for (const Document& d : s.documents) order.push_back(&d);
  }
  if (order.empty()) return absl::NotFoundError("no documents found in the chosen sources");
  std::sort(order.begin(), order.end(), [](const Document* a, const Document* b) {
    return a->order != b->order ? a->order < b->order : a->id < b->id;
  });

  json tokenizer_info;
  ORYX_ASSIGN_OR_RETURN(Tokenizer tok, PrepareTokenizer(o, sources, order, &tokenizer_info));
  if (tok.vocab_size() > 65536) return absl::InvalidArgumentError("tokenizer vocabulary exceeds 65536");

  const auto tokenize_start = std::chrono::steady_clock::now();
  ORYX_ASSIGN_OR_RETURN(TokenizeResult r, TokenizeAll(tok, sources, order, o));
  const auto end = std::chrono::steady_clock::now();

  json manifest = {
      {"format_version", kCorpusFormatVersion},
      {"kind", "oryx-corpus"},
      {"token_dtype", "uint16"},
      {"byte_order", "little"},
      {"document_layout", "BOS tokens EOS, documents concatenated; shards split only by size"},
      {"tokenizer", tokenizer_info},
      {"document_order", "ascending SHA-256(\"<source>/<path>\") bytes 8..15"},
      {"split_rule", "validation when SHA-256(\"<source>/<path>\") bytes 0..7 / 2^64 < val_fraction"},
      {"options",
       {{"val_fraction", o.val_fraction},
        {"max_tokens", o.max_tokens},
        {"shard_tokens", o.shard_tokens},
        {"max_document_bytes", o.max_document_bytes},
        {"tokenizer_sentences", o.tokenizer_sentences},
        {"input_dir", o.input_dir.empty() ? json(nullptr) : json(o.input_dir)}}},
      {"stopped_early", r.stopped_early},
      {"documents_available", order.size()},
      {"sources", SourcesJson(sources)},
      {"splits",
       {{"train",
         {{"documents", r.documents[0]}, {"tokens", r.tokens[0]}, {"shards", ShardsJson(r.shards[0])}}},
        {"val",
         {{"documents", r.documents[1]}, {"tokens", r.tokens[1]}, {"shards", ShardsJson(r.shards[1])}}}}},
  };
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(o.out_dir + "/manifest.json", manifest.dump(2) + "\n"));
  RemoveStaleShards(o.out_dir, r);

  CorpusSummary summary;
  summary.train = {r.documents[0], r.tokens[0], static_cast<int64_t>(r.shards[0].size())};
  summary.val = {r.documents[1], r.tokens[1], static_cast<int64_t>(r.shards[1].size())};
  summary.text_bytes = r.text_bytes;
  summary.seconds = std::chrono::duration<double>(end - start).count();
  summary.tokenize_seconds = std::chrono::duration<double>(end - tokenize_start).count();
  return summary;
}

// --- pack / unpack -----------------------------------------------------------------------------------

namespace {

// Writes the first `tokens` ids of a shard as a new shard file; returns its info and counts BOS ids.
absl::StatusOr<CorpusShardInfo> WriteShardPrefix(const CorpusReader& reader, int64_t first_token,
                                                 int64_t tokens, const std::string& path, int32_t bos,
                                                 int64_t* documents) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  ORYX_RETURN_IF_ERROR(reader.ReadTokens(first_token, tokens, ids.data()));
  std::string bytes(ids.size() * 2, '\0');
  for (size_t k = 0; k < ids.size(); ++k) {
    bytes[2 * k] = static_cast<char>(ids[k] & 0xFF);
    bytes[2 * k + 1] = static_cast<char>(ids[k] >> 8);
    *documents += ids[k] == bos;
  }
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(path, bytes));
  return CorpusShardInfo{fs::path(path).filename().string(), tokens, Sha256Hex(bytes)};
}

absl::Status CopyInto(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot copy ", from, " to ", to, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PackSummary> PackCorpus(const PackCorpusOptions& o) {
  if (o.compression != "xz" && o.compression != "gzip") {
    return absl::InvalidArgumentError(absl::StrCat("--compression must be xz or gzip, got ", o.compression));
  }
  if (o.max_train_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  ORYX_ASSIGN_OR_RETURN(CorpusReader train,
                        CorpusReader::Open(o.corpus_dir, "train", /*verify_checksums=*/true));
  ORYX_ASSIGN_OR_RETURN(CorpusReader val, CorpusReader::Open(o.corpus_dir, "val", /*verify_checksums=*/true));
  const CorpusManifest& m = train.manifest();
  const std::string staging = o.out_path + ".staging";
  std::error_code ec;
  (void)RemoveTree(staging);
  fs::create_directories(staging, ec);
  if (ec) return absl::InternalError(absl::StrCat(staging, ": cannot create: ", ec.message()));

  ORYX_RETURN_IF_ERROR(CopyInto(o.corpus_dir + "/" + m.tokenizer_file, staging + "/" + m.tokenizer_file));
  for (const CorpusShardInfo& s : m.splits.at("val").shards) {
    ORYX_RETURN_IF_ERROR(CopyInto(o.corpus_dir + "/" + s.file, staging + "/" + s.file));
  }
  // The train prefix: whole shards, then the first part of the next one.
  std::vector<CorpusShardInfo> kept;
  int64_t kept_tokens = 0, kept_documents = 0, first = 0;
  for (const CorpusShardInfo& s : m.splits.at("train").shards) {
    const int64_t take = std::min(s.tokens, o.max_train_tokens - kept_tokens);
    if (take <= 0) break;
    ORYX_ASSIGN_OR_RETURN(CorpusShardInfo info, WriteShardPrefix(train, first, take, staging + "/" + s.file,
                                                                 m.bos_id, &kept_documents));
    kept.push_back(info);
    kept_tokens += take;
    first += s.tokens;
  }
  json manifest = m.json;
  manifest["splits"]["train"] = {
      {"documents", kept_documents}, {"tokens", kept_tokens}, {"shards", ShardsJson(kept)}};
  manifest["packed"] = {
      {"from_train_tokens", m.splits.at("train").tokens},
      {"from_train_documents", m.splits.at("train").documents},
      {"max_train_tokens", o.max_train_tokens},
      {"note", "train is a prefix of the full corpus's train split; documents counts BOS ids"}};
  ORYX_RETURN_IF_ERROR(WriteFileAtomic(staging + "/manifest.json", manifest.dump(2) + "\n"));

  // A reproducible tar (sorted names, fixed owner and time), compressed single-threaded.
  const std::string tar_path = o.out_path + ".tmp.tar";
  ORYX_RETURN_IF_ERROR(RunCommand({"tar", "-C", staging, "--sort=name", "--owner=0", "--group=0",
                                   "--numeric-owner", "--mtime=@0", "-cf", tar_path, "."}));
  CommandOptions c;
  c.stdout_path = o.out_path + ".tmp";
  if (o.compression == "xz") {
    ORYX_RETURN_IF_ERROR(RunCommand({"xz", "-9", "-T1", "-c", tar_path}, c));
  } else {
    ORYX_RETURN_IF_ERROR(RunCommand({"gzip", "-9", "-n", "-c", tar_path}, c));
  }
  fs::rename(c.stdout_path, o.out_path, ec);
  if (ec) return absl::InternalError(absl::StrCat(o.out_path, ": cannot rename: ", ec.message()));
  fs::remove(tar_path, ec);
  (void)RemoveTree(staging);

  PackSummary summary;
  summary.train_tokens = kept_tokens;
  summary.val_tokens = val.num_tokens();
  summary.archive_bytes = static_cast<int64_t>(fs::file_size(o.out_path, ec));
  return summary;
}

absl::Status UnpackCorpus(const std::string& archive_path, const std::string& out_dir) {
  std::error_code ec;
  if (!fs::is_regular_file(archive_path, ec))
    return absl::NotFoundError(absl::StrCat(archive_path, ": no such archive"));
  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));
  ORYX_RETURN_IF_ERROR(RunCommand({"tar", "-xf", archive_path, "-C", out_dir, "--no-same-owner"}));
  ORYX_ASSIGN_OR_RETURN(CorpusManifest m, ReadCorpusManifest(out_dir));
  for (const auto& [split, info] : m.splits) {
    ORYX_RETURN_IF_ERROR(CorpusReader::Open(out_dir, split, /*verify_checksums=*/true).status());
  }
  ORYX_ASSIGN_OR_RETURN(std::string tok, ReadFile(out_dir + "/" + m.tokenizer_file));
  if (Sha256Hex(tok) != m.tokenizer_sha256) {
    return absl::DataLossError(
        absl::StrCat(out_dir, "/", m.tokenizer_file, ": SHA-256 does not match the manifest"));
  }
  return absl::OkStatus();
}

}  // namespace oryx
