// Corpus pipeline tests on generated --input-dir corpora: SHA-256 vectors, determinism, manifest counts
// against shard contents, the document-level split, reader windows, pack/unpack, and clean errors; files
// joined into long documents and the code cap; the HTML, info, gzip and man page conversions on fixtures.
#include "train/corpus.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include "base/file_util.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "train/data_subprocess.h"
#include "train/sha256.h"
#include "train/shards.h"

namespace oryx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path TestRoot() { return fs::temp_directory_path() / ("oryx_corpus_test_" + std::to_string(getpid())); }

fs::path FreshDir(const std::string& name) {
  fs::path dir = TestRoot() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Writes `n` distinct documents of generated text (with tabs, newlines and some non-ASCII) under `dir`,
// half of them in a subdirectory, plus files that must be skipped. Returns the kept texts by name.
std::map<std::string, std::string> MakeInputDir(const fs::path& dir, int n) {
  static const char* kWords[] = {"the",  "model",  "state",     "token",  "attention", "linear", "kernel",
                                 "page", "buffer", "retrieval", "memory", "shared",    "mode",   "switch",
                                 "café", "数据",   "return",    "struct", "int",       "x",      "->",
                                 "{",    "}",      ";",         "(",      ")"};
  std::mt19937 rng(42);
  std::map<std::string, std::string> docs;
  fs::create_directories(dir / "sub");
  for (int i = 0; i < n; ++i) {
    std::string text = "Document " + std::to_string(i) + ".\n";
    const int words = 20 + static_cast<int>(rng() % 200);
    for (int w = 0; w < words; ++w) {
      text += kWords[rng() % std::size(kWords)];
      const uint32_t r = rng() % 12;
      text += r == 0 ? "\n" : r == 1 ? "\n\t" : r == 2 ? "  " : " ";
    }
    const std::string name = (i % 2 ? "sub/doc" : "doc") + std::to_string(i) + ".txt";
    std::ofstream(dir / name, std::ios::binary) << text;
    docs[name] = text;
  }
  std::ofstream(dir / "binary.dat", std::ios::binary) << std::string("abc\0def", 7);
  std::ofstream(dir / "latin1.txt", std::ios::binary) << "caf\xe9 au lait\n";
  std::ofstream(dir / "empty.txt", std::ios::binary) << "";
  fs::create_directories(dir / ".hidden");
  std::ofstream(dir / ".hidden" / "secret.txt") << "never read\n";
  return docs;
}

std::string SourceDir() {
  const char* dir = std::getenv("ORYX_SOURCE_DIR");
  return dir != nullptr ? dir : ".";
}

std::vector<uint16_t> ReadShard(const fs::path& path) {
  std::string bytes = *ReadFile(path.string());
  std::vector<uint16_t> ids(bytes.size() / 2);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * i]) |
                                   (static_cast<uint8_t>(bytes[2 * i + 1]) << 8));
  }
  return ids;
}

// All tokens of a split, in order, straight from the shard files listed in the manifest.
std::vector<int32_t> SplitTokens(const fs::path& corpus, const json& manifest, const std::string& split) {
  std::vector<int32_t> out;
  for (const json& shard : manifest["splits"][split]["shards"]) {
    for (uint16_t t : ReadShard(corpus / shard["file"].get<std::string>())) out.push_back(t);
  }
  return out;
}

// Cuts a token stream into documents (BOS ... EOS) and decodes each.
std::vector<std::string> Documents(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<std::string> docs;
  size_t i = 0;
  while (i < ids.size()) {
    EXPECT_EQ(ids[i], kBosId) << "document does not start with BOS at " << i;
    size_t end = i + 1;
    while (end < ids.size() && ids[end] != kEosId) ++end;
    EXPECT_LT(end, ids.size()) << "document without EOS";
    docs.push_back(tok.Decode(std::span<const int32_t>(ids.data() + i + 1, end - i - 1)));
    i = end + 1;
  }
  return docs;
}

class CorpusTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fs::create_directories(TestRoot());
    tokenizer_path_ = new std::string((TestRoot() / "tok.model").string());
    TokenizerTrainOptions t;
    t.input_files = {SourceDir() + "/tests/data/tokenizer_corpus.txt"};
    t.vocab_size = 512;
    t.out_path = *tokenizer_path_;
    absl::Status s = TrainTokenizer(t);
    ASSERT_TRUE(s.ok()) << s;
    input_dir_ = new fs::path(TestRoot() / "input");
    docs_ = new std::map<std::string, std::string>(MakeInputDir(*input_dir_, 60));
  }
  static void TearDownTestSuite() {
    fs::remove_all(TestRoot());
    delete tokenizer_path_;
    delete input_dir_;
    delete docs_;
  }

  static PrepareCorpusOptions Options(const fs::path& out) {
    PrepareCorpusOptions o;
    o.out_dir = out.string();
    o.input_dir = input_dir_->string();
    o.tokenizer_path = *tokenizer_path_;
    o.val_fraction = 0.25;
    o.shard_tokens = 700;  // several shards per split
    o.progress = false;
    return o;
  }

  static fs::path Prepare(const std::string& name) {
    const fs::path out = FreshDir(name);
    absl::StatusOr<CorpusSummary> s = PrepareCorpus(Options(out));
    EXPECT_TRUE(s.ok()) << s.status();
    return out;
  }

  static std::string* tokenizer_path_;
  static fs::path* input_dir_;
  static std::map<std::string, std::string>* docs_;
};

std::string* CorpusTest::tokenizer_path_ = nullptr;
fs::path* CorpusTest::input_dir_ = nullptr;
std::map<std::string, std::string>* CorpusTest::docs_ = nullptr;

TEST(Sha256Test, StandardVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces to exercise the buffering.
  Sha256 h;
  const std::string chunk(997, 'a');
  size_t left = 1'000'000;
  while (left > 0) {
    const size_t n = std::min(left, chunk.size());
    h.Update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(h.HexDigest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_F(CorpusTest, SameInputsGiveIdenticalBytes) {
  const fs::path a = Prepare("det_a");
  PrepareCorpusOptions o = Options(FreshDir("det_b"));
  o.threads = 3;  // the thread count must not change the output
  ASSERT_TRUE(PrepareCorpus(o).ok());
  const fs::path b = o.out_dir;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(a)) {
    if (e.is_regular_file()) names.push_back(e.path().filename().string());
  }
  EXPECT_GT(names.size(), 4u);
  for (const std::string& name : names) {
    EXPECT_EQ(*ReadFile((a / name).string()), *ReadFile((b / name).string())) << name;
  }
}

TEST_F(CorpusTest, ManifestMatchesShardsAndDocumentsRoundTrip) {
  const fs::path out = Prepare("manifest");
  const json m = json::parse(*ReadFile((out / "manifest.json").string()));
  EXPECT_EQ(m["format_version"], kCorpusFormatVersion);
  EXPECT_EQ(m["token_dtype"], "uint16");
  EXPECT_EQ(m["tokenizer"]["sha256"], Sha256Hex(*ReadFile((out / "tokenizer.model").string())));
  EXPECT_EQ(m["tokenizer"]["vocab_size"], 512);
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load((out / "tokenizer.model").string());
  ASSERT_TRUE(tok.ok()) << tok.status();

  std::map<std::string, std::vector<std::string>> texts;
  for (const std::string split : {"train", "val"}) {
    int64_t sum = 0;
    for (const json& shard : m["splits"][split]["shards"]) {
      const fs::path file = out / shard["file"].get<std::string>();
      EXPECT_EQ(static_cast<int64_t>(fs::file_size(file)), 2 * shard["tokens"].get<int64_t>());
      EXPECT_LE(shard["tokens"].get<int64_t>(), 700);
      EXPECT_EQ(shard["sha256"], Sha256Hex(*ReadFile(file.string())));
      sum += shard["tokens"].get<int64_t>();
    }
    EXPECT_GT(m["splits"][split]["shards"].size(), 1u) << split;
    EXPECT_EQ(m["splits"][split]["tokens"], sum);
    texts[split] = Documents(*tok, SplitTokens(out, m, split));
    EXPECT_EQ(m["splits"][split]["documents"], texts[split].size());
  }
  // Train and validation are disjoint by document and together hold exactly the valid input files.
  std::multiset<std::string> all(texts["train"].begin(), texts["train"].end());
  all.insert(texts["val"].begin(), texts["val"].end());
  std::multiset<std::string> expected;
  for (const auto& [name, text] : *docs_) expected.insert(text);
  EXPECT_EQ(all, expected);
  EXPECT_FALSE(texts["val"].empty());
  EXPECT_GT(texts["train"].size(), texts["val"].size());
  for (const std::string& v : texts["val"]) {
    EXPECT_EQ(std::count(texts["train"].begin(), texts["train"].end(), v), 0);
  }
  // The skipped files are counted by reason; hidden files are never listed.
  const json& src = m["sources"][0];
  EXPECT_EQ(src["name"], "input");
  EXPECT_EQ(src["skipped"]["binary"], 1);
  EXPECT_EQ(src["skipped"]["invalid_utf8"], 1);
  EXPECT_EQ(src["skipped"]["empty"], 1);
  EXPECT_EQ(src["files_listed"], 63);
}

TEST_F(CorpusTest, ReaderReturnsTheRightWindows) {
  const fs::path out = Prepare("reader");
  const json m = json::parse(*ReadFile((out / "manifest.json").string()));
  const std::vector<int32_t> stream = SplitTokens(out, m, "train");
  absl::StatusOr<CorpusReader> r = CorpusReader::Open(out.string(), "train", /*verify_checksums=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_tokens(), static_cast<int64_t>(stream.size()));
  EXPECT_EQ(r->vocab_size(), 512);
  EXPECT_EQ(r->tokenizer_path(), (out / "tokenizer.model").string());
  for (int64_t seq_len : {1, 7, 64, 699, 700, 701}) {
    const int64_t n = r->NumSequences(seq_len);
    EXPECT_EQ(n, (r->num_tokens() - 1) / seq_len);
    std::vector<int32_t> window(seq_len + 1);
    for (int64_t i : {int64_t{0}, n / 2, n - 1}) {
      ASSERT_TRUE(r->ReadSequence(i, seq_len, window.data()).ok());
      EXPECT_TRUE(std::equal(window.begin(), window.end(), stream.begin() + i * seq_len))
          << seq_len << " " << i;
    }
    EXPECT_EQ(r->ReadSequence(n, seq_len, window.data()).code(), absl::StatusCode::kOutOfRange);
    EXPECT_EQ(r->ReadSequence(-1, seq_len, window.data()).code(), absl::StatusCode::kOutOfRange);
  }
  // Reads that cross shard boundaries.
  std::vector<int32_t> span(1500);
  ASSERT_TRUE(r->ReadTokens(650, 1500, span.data()).ok());
  EXPECT_TRUE(std::equal(span.begin(), span.end(), stream.begin() + 650));
  EXPECT_FALSE(r->ReadTokens(r->num_tokens() - 10, 11, span.data()).ok());
  // Moving keeps the mapping valid.
  CorpusReader moved = std::move(*r);
  ASSERT_TRUE(moved.ReadTokens(0, 10, span.data()).ok());
  EXPECT_TRUE(std::equal(span.begin(), span.begin() + 10, stream.begin()));
}

TEST(ShuffledOrderTest, IsADeterministicPermutation) {
  const std::vector<int64_t> a = ShuffledOrder(1000, 7);
  EXPECT_EQ(a, ShuffledOrder(1000, 7));
  EXPECT_NE(a, ShuffledOrder(1000, 8));
  EXPECT_NE(a, ShuffledOrder(1000, 7, /*epoch=*/1));
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_TRUE(ShuffledOrder(0, 1).empty());
}

TEST_F(CorpusTest, MaxTokensStopsAtADocumentBoundary) {
  PrepareCorpusOptions o = Options(FreshDir("max_tokens"));
  o.max_tokens = 1000;
  absl::StatusOr<CorpusSummary> s = PrepareCorpus(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const int64_t total = s->train.tokens + s->val.tokens;
  EXPECT_GE(total, 1000);
  EXPECT_LT(total, 1000 + 1000);
  const json m = json::parse(*ReadFile(o.out_dir + "/manifest.json"));
  EXPECT_TRUE(m["stopped_early"].get<bool>());
}

TEST_F(CorpusTest, TrainsItsOwnTokenizerWhenNoneIsGiven) {
  PrepareCorpusOptions o = Options(FreshDir("own_tokenizer"));
  o.tokenizer_path.clear();
  o.vocab_size = 400;
  absl::StatusOr<CorpusSummary> s = PrepareCorpus(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const json m = json::parse(*ReadFile(o.out_dir + "/manifest.json"));
  EXPECT_TRUE(m["tokenizer"]["trained_by_prepare"].get<bool>());
  EXPECT_LE(m["tokenizer"]["vocab_size"].get<int>(), 400);
  EXPECT_TRUE(CorpusReader::Open(o.out_dir, "val", /*verify_checksums=*/true).ok());
}

TEST_F(CorpusTest, PackAndUnpack) {
  const fs::path out = Prepare("pack_src");
  PackCorpusOptions p;
  p.corpus_dir = out.string();
  p.out_path = (TestRoot() / "packed.tar.xz").string();
  p.max_train_tokens = 1000;  // one whole shard of 700 and part of the next
  absl::StatusOr<PackSummary> s = PackCorpus(p);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train_tokens, 1000);
  EXPECT_GT(s->archive_bytes, 0);
  const fs::path unpacked = TestRoot() / "unpacked";
  absl::Status u = UnpackCorpus(p.out_path, unpacked.string());
  ASSERT_TRUE(u.ok()) << u;

  absl::StatusOr<CorpusReader> full = CorpusReader::Open(out.string(), "train");
  absl::StatusOr<CorpusReader> part = CorpusReader::Open(unpacked.string(), "train", true);
  ASSERT_TRUE(full.ok() && part.ok());
  ASSERT_EQ(part->num_tokens(), 1000);
  std::vector<int32_t> a(1000), b(1000);
  ASSERT_TRUE(full->ReadTokens(0, 1000, a.data()).ok());
  ASSERT_TRUE(part->ReadTokens(0, 1000, b.data()).ok());
  EXPECT_EQ(a, b);
  const json m = json::parse(*ReadFile((unpacked / "manifest.json").string()));
  EXPECT_EQ(m["packed"]["max_train_tokens"], 1000);
  EXPECT_EQ(*ReadFile((unpacked / "val-00000.bin").string()), *ReadFile((out / "val-00000.bin").string()));
  EXPECT_FALSE(UnpackCorpus((TestRoot() / "missing.tar.xz").string(), (TestRoot() / "u2").string()).ok());
}

TEST_F(CorpusTest, DamagedCorporaGiveCleanErrors) {
  const fs::path out = Prepare("damaged");
  const json m = json::parse(*ReadFile((out / "manifest.json").string()));
  const std::string shard = m["splits"]["train"]["shards"][1]["file"];

  // A flipped byte: the sizes still match, the checksum does not.
  std::string bytes = *ReadFile((out / shard).string());
  bytes[10] ^= 0x01;
  ASSERT_TRUE(WriteFileAtomic((out / shard).string(), bytes).ok());
  EXPECT_TRUE(CorpusReader::Open(out.string(), "train").ok());
  absl::StatusOr<CorpusReader> r = CorpusReader::Open(out.string(), "train", /*verify_checksums=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find(shard), std::string::npos) << r.status();

  // A truncated shard: the size check catches it on open.
  ASSERT_TRUE(WriteFileAtomic((out / shard).string(), bytes.substr(0, bytes.size() - 2)).ok());
  r = CorpusReader::Open(out.string(), "train");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(shard), std::string::npos) << r.status();

  // A missing shard, an unknown split, a damaged or missing manifest.
  fs::remove(out / shard);
  EXPECT_FALSE(CorpusReader::Open(out.string(), "train").ok());
  EXPECT_EQ(CorpusReader::Open(out.string(), "test").status().code(), absl::StatusCode::kNotFound);
  json bad = m;
  bad["splits"]["val"]["tokens"] = 1;
  ASSERT_TRUE(WriteFileAtomic((out / "manifest.json").string(), bad.dump()).ok());
  r = CorpusReader::Open(out.string(), "val");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("splits.val"), std::string::npos) << r.status();
  bad = m;
  bad["splits"]["val"]["shards"][0]["file"] = "../escape.bin";
  ASSERT_TRUE(WriteFileAtomic((out / "manifest.json").string(), bad.dump()).ok());
  EXPECT_FALSE(CorpusReader::Open(out.string(), "val").ok());
  bad = m;
  bad["format_version"] = 99;
  ASSERT_TRUE(WriteFileAtomic((out / "manifest.json").string(), bad.dump()).ok());
  EXPECT_FALSE(CorpusReader::Open(out.string(), "val").ok());
  ASSERT_TRUE(WriteFileAtomic((out / "manifest.json").string(), "{\"format_version\": 1, ").ok());
  r = CorpusReader::Open(out.string(), "val");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("manifest.json"), std::string::npos) << r.status();
  fs::remove(out / "manifest.json");
  r = CorpusReader::Open(out.string(), "val");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("manifest.json"), std::string::npos) << r.status();
}

// --- long documents and the code cap ------------------------------------------------------------------

// The documents that min_document_bytes makes of the input directory: its files in path order (including
// the two that are skipped for their content, which count towards a run's size), in runs of at least
// `min_bytes`, a short last run joined to the one before; each kept file after its title line.
std::multiset<std::string> ExpectedRuns(const std::map<std::string, std::string>& kept, int64_t min_bytes) {
  std::map<std::string, std::string> files = kept;
  files["binary.dat"] = std::string("abc\0def", 7);
  files["latin1.txt"] = "caf\xe9 au lait\n";
  std::vector<std::vector<std::string>> runs;
  int64_t run_bytes = 0;
  for (const auto& [name, text] : files) {
    if (runs.empty() || run_bytes >= min_bytes) {
      runs.emplace_back();
      run_bytes = 0;
    }
    runs.back().push_back(name);
    run_bytes += static_cast<int64_t>(text.size());
  }
  if (runs.size() > 1 && run_bytes < min_bytes) {
    for (const std::string& name : runs.back()) runs[runs.size() - 2].push_back(name);
    runs.pop_back();
  }
  std::multiset<std::string> docs;
  for (const std::vector<std::string>& run : runs) {
    std::string doc;
    for (const std::string& name : run) {
      if (kept.count(name) == 0) continue;
      if (!doc.empty()) doc += doc.back() == '\n' ? "\n" : "\n\n";
      doc += "==> " + name + " <==\n\n" + kept.at(name);
    }
    if (!doc.empty()) docs.insert(doc);
  }
  return docs;
}

TEST_F(CorpusTest, MinDocumentBytesJoinsFilesInPathOrder) {
  PrepareCorpusOptions o = Options(FreshDir("joined"));
  o.min_document_bytes = 3000;
  absl::StatusOr<CorpusSummary> s = PrepareCorpus(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const json m = json::parse(*ReadFile(o.out_dir + "/manifest.json"));
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(o.out_dir + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::multiset<std::string> got;
  for (const std::string split : {"train", "val"}) {
    for (const std::string& doc : Documents(*tok, SplitTokens(o.out_dir, m, split))) {
      EXPECT_GE(doc.size(), 3000u) << doc.substr(0, 40);
      got.insert(doc);
    }
  }
  const std::multiset<std::string> expected = ExpectedRuns(*docs_, 3000);
  EXPECT_EQ(got, expected);
  EXPECT_GT(expected.size(), 3u);
  EXPECT_LT(expected.size(), docs_->size() / 4);
  EXPECT_EQ(m["options"]["min_document_bytes"], 3000);
  // Bad files are left out one by one (counted as files), not with the run they are in.
  const json& src = m["sources"][0];
  EXPECT_EQ(src["skipped"]["binary"], 1);
  EXPECT_EQ(src["skipped"]["invalid_utf8"], 1);
  EXPECT_EQ(src["skipped"]["empty"], 1);

  // Deterministic, whatever the thread count; the rule is unchanged by a larger threshold's runs.
  PrepareCorpusOptions again = o;
  again.out_dir = FreshDir("joined_again").string();
  again.threads = 3;
  ASSERT_TRUE(PrepareCorpus(again).ok());
  for (const auto& e : fs::directory_iterator(o.out_dir)) {
    if (!e.is_regular_file()) continue;
    const std::string name = e.path().filename().string();
    EXPECT_EQ(*ReadFile(o.out_dir + "/" + name), *ReadFile(again.out_dir + "/" + name)) << name;
  }
  // One document when the threshold exceeds the whole source.
  again.out_dir = FreshDir("joined_one").string();
  again.min_document_bytes = int64_t{1} << 40;
  ASSERT_TRUE(PrepareCorpus(again).ok());
  const json one = json::parse(*ReadFile(again.out_dir + "/manifest.json"));
  EXPECT_EQ(one["splits"]["train"]["documents"].get<int64_t>() + one["splits"]["val"]["documents"].get<int64_t>(),
            1);
}

// A directory of small C-like files, `n` of them.
void MakeCodeDir(const fs::path& dir, int n) {
  fs::create_directories(dir);
  for (int i = 0; i < n; ++i) {
    std::string text = "#include <linux/types.h>\n\n";
    for (int f = 0; f <= i % 8; ++f) {
      text += "static int f" + std::to_string(i) + "_" + std::to_string(f) + "(int x)\n{\n\treturn x + " +
              std::to_string(f) + ";\n}\n\n";
    }
    std::ofstream(dir / ("file" + std::to_string(i) + ".c"), std::ios::binary) << text;
  }
}

TEST_F(CorpusTest, MaxCodeFractionCapsCodeInDocumentOrder) {
  const fs::path code_dir = TestRoot() / "code";
  MakeCodeDir(code_dir, 160);
  auto run = [&](const std::string& name, double fraction, int threads) {
    PrepareCorpusOptions o = Options(FreshDir(name));
    o.input_code_dir = code_dir.string();
    o.max_code_fraction = fraction;
    o.threads = threads;
    absl::StatusOr<CorpusSummary> s = PrepareCorpus(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::make_pair(*s, json::parse(*ReadFile(o.out_dir + "/manifest.json")));
  };
  const auto [all, all_m] = run("cap_none", 1.0, 1);
  const int64_t all_tokens = all.train.tokens + all.val.tokens;
  ASSERT_GT(all.code_tokens, 0.4 * all_tokens);  // uncapped, well above the cap below
  EXPECT_EQ(all.code_capped_documents, 0);
  EXPECT_EQ(all_m["kinds"]["code"]["tokens"], all.code_tokens);
  EXPECT_EQ(all_m["kinds"]["text"]["tokens"], all_tokens - all.code_tokens);
  EXPECT_EQ(all_m["sources"][1]["name"], "input-code");
  EXPECT_EQ(all_m["sources"][1]["kind"], "code");

  const auto [capped, m] = run("cap_30", 0.3, 1);
  const int64_t tokens = capped.train.tokens + capped.val.tokens;
  EXPECT_LE(capped.code_tokens, 0.3 * tokens);
  EXPECT_GE(capped.code_tokens, 0.3 * tokens - 200);  // the cap binds: code up to a document below it
  EXPECT_GT(capped.code_capped_documents, 0);
  EXPECT_EQ(capped.code_capped_tokens, all.code_tokens - capped.code_tokens);
  EXPECT_EQ(tokens - capped.code_tokens, all_tokens - all.code_tokens);  // every non-code token is kept
  EXPECT_EQ(m["sources"][1]["skipped"]["code_cap"], capped.code_capped_documents);
  EXPECT_EQ(m["kinds"]["code_capped"]["documents"], capped.code_capped_documents);
  EXPECT_NEAR(m["kinds"]["code_fraction"].get<double>(), static_cast<double>(capped.code_tokens) / tokens, 1e-12);
  EXPECT_EQ(m["options"]["max_code_fraction"], 0.3);

  // Deterministic whatever the thread count; a cap of 0 keeps no code.
  const auto [again, again_m] = run("cap_30_threads", 0.3, 3);
  EXPECT_EQ(again_m["splits"], m["splits"]);
  const auto [none, none_m] = run("cap_0", 0.0, 1);
  EXPECT_EQ(none.code_tokens, 0);
  EXPECT_EQ(none.train.tokens + none.val.tokens, all_tokens - all.code_tokens);
}

// --- converting documentation formats ----------------------------------------------------------------

// A fresh directory of its own for a conversion test (the corpus tests' root is gone by then).
fs::path ConvertDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("oryx_convert_test_" + std::to_string(getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(ConvertTest, HtmlToTextKeepsTheTextAndItsStructure) {
  const std::string html =
      "<!DOCTYPE html>\n<html><head><title>Page</title><style>p { color: red; }</style>\n"
      "<script>var s = '</div>';</script></head>\n"
      "<body><nav><a href='/'>Home</a> | <a href='/next'>Next</a></nav>\n"
      "<div class=\"sphinxsidebar\" role=\"navigation\"><ul><li>Contents</li></ul></div>\n"
      "<h1>The  <div class=x>Title</div></h1>\n"
      "<p>Some   text,\n  across lines &amp; with <b>bold</b> &lt;tags&gt; &#8212; &#x41;&nbsp;B &unknown; a&b.</p>"
      "<!-- a comment <p>not text</p> -->\n"
      "<pre>\nint main() {\n    return 0; // &lt;ok&gt;\n}\n</pre>\n"
      "<ul><li><p>first</p></li><li>second<br>line</li></ul>\n"
      "<ol><li>one</li><li>two</li></ol>\n"
      "<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>2</td></tr></table>\n"
      "<dl><dt>term</dt><dd>its definition</dd></dl>\n"
      "<p>x < y</p></body></html>\n";
  EXPECT_EQ(HtmlToText(html),
            "# The Title\n"
            "\n"
            "Some text, across lines & with bold <tags> \u2014 A B &unknown; a&b.\n"
            "\n"
            "int main() {\n"
            "    return 0; // <ok>\n"
            "}\n"
            "\n"
            "- first\n"  // a paragraph in an item ends with a blank line, as in a loose Markdown list
            "\n"
            "- second\n"
            "line\n"
            "\n"
            "1. one\n"
            "2. two\n"
            "\n"
            "a | b\n"
            "1 | 2\n"
            "\n"
            "term\n"
            "    its definition\n"
            "\n"
            "x < y\n");
  EXPECT_EQ(HtmlToText(""), "");
  EXPECT_EQ(HtmlToText("<p>unclosed <b>tags"), "unclosed tags\n");
}

TEST(ConvertTest, InfoToTextDropsNodeHeadersAndTables) {
  const std::string info = std::string(
      "This is tiny.info, produced by makeinfo version 6.8 from tiny.texi.\n\n"
      "INFO-DIR-SECTION Test\nSTART-INFO-DIR-ENTRY\n* Tiny: (tiny).\nEND-INFO-DIR-ENTRY\n\n"
      "\x1f\nFile: tiny.info,  Node: Top,  Next: Index,  Up: (dir)\n\n"
      "Tiny\n****\n\nThis manual is tiny.\n\n"
      "\x1f\nFile: tiny.info,  Node: Index,  Prev: Top,  Up: Top\n\nIndex\n*****\n\n") +
      std::string("\0\b[index\0\b]\n* Menu:\n\n* tiny:     Top.     (line 6)\n\n", 52) +
      "\x1f\nTag Table:\nNode: Top94\nNode: Index189\n\x1f\nEnd Tag Table\n\n"
      "\x1f\nLocal Variables:\ncoding: utf-8\nEnd:\n";
  EXPECT_EQ(InfoToText(info),
            "Tiny\n****\n\nThis manual is tiny.\n\nIndex\n*****\n\n* Menu:\n\n* tiny:     Top.     (line 6)\n");
}

TEST(ConvertTest, ConvertDocumentFileDecompressesAndPicksTheConverter) {
  const fs::path dir = ConvertDir("convert");
  const std::string html = "<html><body><h2>Hello</h2><p>World &amp; all</p></body></html>\n";
  const std::string info = "banner\n\x1f\nFile: a.info,  Node: Top,  Up: (dir)\n\nText of the node.\n";
  std::ofstream(dir / "page.html") << html;
  std::ofstream(dir / "manual.info-2") << info;
  std::ofstream(dir / "notes.txt") << "  plain <p>text</p>  \n";
  std::ofstream(dir / "packed.html") << html;
  ASSERT_TRUE(RunCommand({"gzip", "-n", (dir / "packed.html").string()}).ok());
  EXPECT_EQ(*ConvertDocumentFile((dir / "page.html").string(), ""), "## Hello\n\nWorld & all\n");
  EXPECT_EQ(*ConvertDocumentFile((dir / "packed.html.gz").string(), ""), "## Hello\n\nWorld & all\n");
  EXPECT_EQ(*ConvertDocumentFile((dir / "manual.info-2").string(), ""), "Text of the node.\n");
  EXPECT_EQ(*ConvertDocumentFile((dir / "notes.txt").string(), ""), "  plain <p>text</p>  \n");
  EXPECT_FALSE(ConvertDocumentFile((dir / "missing.html").string(), "").ok());
  EXPECT_FALSE(ConvertDocumentFile((dir / "notes.txt").string(), "pdf").ok());
  fs::remove_all(dir);
}

TEST(ConvertTest, ManPagesAreRenderedAsPlainText) {
  if (std::system("command -v man >/dev/null 2>&1") != 0) GTEST_SKIP() << "man-db is not installed";
  const fs::path dir = ConvertDir("man");
  std::ofstream(dir / "tiny.7") << ".TH TINY 7 2024-01-01 \"Oryx\" \"Oryx Test Manual\"\n"
                                   ".SH NAME\ntiny \\- a tiny page\n"
                                   ".SH DESCRIPTION\nThis page has\n.B bold\nwords, and a\n.I term\nlist:\n"
                                   ".TP\n.B one\nThe first item.\n";
  std::ofstream(dir / "alias.7") << ".\\\" a page that only sources another\n.so man7/tiny.7\n";
  ASSERT_TRUE(RunCommand({"gzip", "-n", "-k", (dir / "tiny.7").string()}).ok());
  absl::StatusOr<std::string> text = ConvertDocumentFile((dir / "tiny.7").string(), "man");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("NAME\n       tiny - a tiny page\n"), std::string::npos) << *text;
  EXPECT_NE(text->find("This page has bold words, and a term list:"), std::string::npos) << *text;
  EXPECT_NE(text->find("one    The first item."), std::string::npos) << *text;
  EXPECT_EQ(text->find('\b'), std::string::npos);  // no overstrike
  EXPECT_EQ(text->find('\x1b'), std::string::npos);  // no escape sequences
  EXPECT_EQ(*ConvertDocumentFile((dir / "tiny.7.gz").string(), "man"), *text);
  EXPECT_EQ(*ConvertDocumentFile((dir / "alias.7").string(), "man"), "");
  fs::remove_all(dir);
}

TEST_F(CorpusTest, BadOptionsGiveCleanErrors) {
  PrepareCorpusOptions o = Options(FreshDir("bad_options"));
  o.val_fraction = 1.5;
  EXPECT_EQ(PrepareCorpus(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(FreshDir("bad_options"));
  o.input_dir = (TestRoot() / "no_such_dir").string();
  absl::StatusOr<CorpusSummary> s = PrepareCorpus(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("no_such_dir"), std::string::npos) << s.status();
  o = Options(FreshDir("bad_options"));
  o.input_dir = FreshDir("empty_input").string();
  EXPECT_FALSE(PrepareCorpus(o).ok());
  o = Options(FreshDir("bad_options"));
  o.input_dir.clear();
  o.sources = {"no-such-source"};
  s = PrepareCorpus(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("no-such-source"), std::string::npos) << s.status();
  o = Options(FreshDir("bad_options"));
  o.tokenizer_path = (TestRoot() / "missing.model").string();
  EXPECT_FALSE(PrepareCorpus(o).ok());
  o = Options(FreshDir("bad_options"));
  o.min_document_bytes = -1;
  EXPECT_EQ(PrepareCorpus(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(FreshDir("bad_options"));
  o.max_code_fraction = 1.5;
  s = PrepareCorpus(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("--max-code-fraction"), std::string::npos) << s.status();
}

}  // namespace
}  // namespace oryx
