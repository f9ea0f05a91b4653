// Corpus pipeline tests on generated --input-dir corpora: SHA-256 vectors, determinism, manifest counts
// against shard contents, the document-level split, reader windows, pack/unpack, and clean errors.
#include "train/corpus.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include "engine/file_util.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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
}

}  // namespace
}  // namespace oryx
