// Tokenizer tests: exact round trip on any bytes, the special-token layout, deterministic training, and
// clean errors for bad model files. The tokenizer is trained here on a small fixture (vocab 512).
#include "engine/tokenizer.h"

#define absl oryx_sentencepiece_absl  // see engine/tokenizer.cc
#include <sentencepiece_trainer.h>
#undef absl

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <unordered_map>

#include "base/file_util.h"
#include "gtest/gtest.h"

namespace oryx {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

std::string SourceDir() {
  const char* dir = std::getenv("ORYX_SOURCE_DIR");
  return dir != nullptr ? dir : ".";
}

std::string FixturePath() { return SourceDir() + "/tests/data/tokenizer_corpus.txt"; }

fs::path TempDir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("oryx_tokenizer_test_" + std::to_string(getpid())) / name;
  fs::create_directories(dir);
  return dir;
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_path_ = new std::string((TempDir("model") / "tok.model").string());
    TokenizerTrainOptions o;
    o.input_files = {FixturePath()};
    o.vocab_size = 512;
    o.out_path = *model_path_;
    absl::Status s = TrainTokenizer(o);
    ASSERT_TRUE(s.ok()) << s;
    absl::StatusOr<Tokenizer> tok = Tokenizer::Load(*model_path_);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = new Tokenizer(std::move(*tok));
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete model_path_;
    fs::remove_all(fs::temp_directory_path() / ("oryx_tokenizer_test_" + std::to_string(getpid())));
  }

  static void ExpectRoundTrip(const std::string& s) {
    std::vector<int32_t> ids = tok_->Encode(s);
    for (int32_t id : ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, tok_->vocab_size());
      ASSERT_FALSE(tok_->IsSpecial(id)) << "Encode produced special id " << id;
    }
    ASSERT_EQ(tok_->Decode(ids), s);
  }

  static Tokenizer* tok_;
  static std::string* model_path_;
};

Tokenizer* TokenizerTest::tok_ = nullptr;
std::string* TokenizerTest::model_path_ = nullptr;

TEST_F(TokenizerTest, SpecialIds) {
  EXPECT_EQ(tok_->pad_id(), 0);
  EXPECT_EQ(tok_->unk_id(), 1);
  EXPECT_EQ(tok_->bos_id(), 2);
  EXPECT_EQ(tok_->eos_id(), 3);
  EXPECT_EQ(tok_->vocab_size(), 512);
  EXPECT_EQ(tok_->IdToPiece(0), "<pad>");
  EXPECT_EQ(tok_->IdToPiece(2), "<s>");
  EXPECT_EQ(tok_->IdToPiece(3), "</s>");
  EXPECT_EQ(tok_->IdToPiece(kNewlineId), "\n");
  EXPECT_EQ(tok_->IdToPiece(kTabId), "\t");
  EXPECT_EQ(tok_->IdToPiece(kFirstByteId), "<0x00>");
  EXPECT_EQ(tok_->IdToPiece(kFirstByteId + 255), "<0xFF>");
  EXPECT_EQ(tok_->IdToPiece(-1), "");
  EXPECT_EQ(tok_->IdToPiece(512), "");
  for (size_t i = 0; i < kTaskTokenNames.size(); ++i) {
    absl::StatusOr<int32_t> id = tok_->TaskTokenId(kTaskTokenNames[i]);
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, kFirstTaskTokenId + static_cast<int32_t>(i));
    EXPECT_TRUE(tok_->IsSpecial(*id));
    EXPECT_EQ(tok_->Decode(std::vector<int32_t>{*id}), kTaskTokenNames[i]);
  }
  EXPECT_EQ(tok_->TaskTokenId("<|nope|>").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TokenizerTest, EncodeAddsNoBosEosAndNewlineAndTabAreOneToken) {
  EXPECT_TRUE(tok_->Encode("").empty());
  EXPECT_EQ(tok_->Decode(std::vector<int32_t>{}), "");
  EXPECT_EQ(tok_->Encode("\n"), std::vector<int32_t>{kNewlineId});
  EXPECT_EQ(tok_->Encode("\n\n"), (std::vector<int32_t>{kNewlineId, kNewlineId}));
  EXPECT_EQ(tok_->Encode("\t"), std::vector<int32_t>{kTabId});
  EXPECT_EQ(tok_->Encode("\n\t\t"), (std::vector<int32_t>{kNewlineId, kTabId, kTabId}));
  std::vector<int32_t> ids = tok_->Encode("the\nmodel");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kNewlineId), 1);
  EXPECT_NE(ids.front(), tok_->bos_id());
  EXPECT_NE(ids.back(), tok_->eos_id());
  // Special ids decode to nothing; out-of-range ids to U+2047.
  EXPECT_EQ(tok_->Decode(std::vector<int32_t>{2, 0, 3}), "");
  EXPECT_EQ(tok_->Decode(std::vector<int32_t>{-5, 100000}), "\u2047\u2047");
}

TEST_F(TokenizerTest, TaskTokenTextIsPlainText) {
  // The string "<|key|>" in a document is characters, never the task token.
  std::vector<int32_t> ids = tok_->Encode("<|key|> x <|sep|>");
  EXPECT_GT(ids.size(), 2u);
  ExpectRoundTrip("<|key|> x <|sep|> <s></s><pad><unk><0x41>");
}

TEST_F(TokenizerTest, RoundTripUtf8) {
  const std::vector<std::string> cases = {
      " ",
      "   leading spaces",
      "trailing spaces   ",
      "  multiple   inner    spaces  ",
      "\ttab\t\tand\tnewlines\n\n\nend\n",
      "\r\nwindows line\r\n",
      "注意力机制和线性递归共享参数。",
      "東京は日本の首都です 안녕하세요",
      "emoji 🙂🚀✅ and a family 👨‍👩‍👧 and a flag 🇯🇵",
      "combining A\u030A vs \u00C5, fullwidth \uFF46\uFF55\uFF4C\uFF4C, ligature \uFB01",
      "literal \u2581 lower one eighth block and \u2581\u2581",
      "a\0b"s,
      std::string(1, '\0'),
      "\u00A0no-break\u3000ideographic space\u200Bzero width",
      "def f(x):\n    return x + 1\n",
      "\x7f\x01\x1b[0m control characters",
      "\U0010FFFF max code point, \uFFFD replacement, \uFEFF bom",
  };
  for (const std::string& s : cases) ExpectRoundTrip(s);
  std::string fixture = *ReadFile(FixturePath());
  ExpectRoundTrip(fixture);
  EXPECT_LT(tok_->Encode(fixture).size(), fixture.size() * 3 / 5)
      << "BPE should compress its own training text";
}

TEST_F(TokenizerTest, RoundTripInvalidUtf8) {
  const std::vector<std::string> cases = {
      "\xff",
      "\xfe\xff",
      "\xc3",
      "abc\xc3",
      "\xc3(",
      "\xa0\xa1",
      "\xe2\x82",
      "\xe2\x28\xa1",
      "\xf0\x90\x28\xbc",
      "\xf0\x28\x8c\x28",
      "\xc0\xaf",
      "\xe0\x80\xaf",      // overlong
      "\xed\xa0\x80",      // surrogate
      "\xf4\x90\x80\x80",  // above U+10FFFF
      "\xf8\x88\x80\x80\x80",
      "ok \x80 mixed \xbf text \xc3\xa9 \xe9 done",
  };
  for (const std::string& s : cases) ExpectRoundTrip(s);
}

TEST_F(TokenizerTest, RoundTripRandomBytesAndCodePoints) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) c = static_cast<char>(rng() & 0xFF);
    ExpectRoundTrip(s);
  }
  // Random valid UTF-8 from mixed ranges, with whitespace mixed in.
  const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x09, 0x0D},    {0x20, 0x7E},     {0x20, 0x20},       {0x80, 0x7FF},
      {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, 0x10FFFF}};
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    const int n = rng() % 40;
    for (int i = 0; i < n; ++i) {
      const auto [lo, hi] = ranges[rng() % ranges.size()];
      const uint32_t cp = lo + rng() % (hi - lo + 1);
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else if (cp < 0x800) {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        s += static_cast<char>(0xE0 | (cp >> 12));
        s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      } else {
        s += static_cast<char>(0xF0 | (cp >> 18));
        s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
    }
    ExpectRoundTrip(s);
  }
}

TEST_F(TokenizerTest, TrainingIsDeterministic) {
  std::string first = *ReadFile(*model_path_);
  TokenizerTrainOptions o;
  o.input_files = {FixturePath()};
  o.vocab_size = 512;
  o.out_path = (TempDir("again") / "tok.model").string();
  ASSERT_TRUE(TrainTokenizer(o).ok());
  EXPECT_EQ(*ReadFile(o.out_path), first);
}

TEST_F(TokenizerTest, MaxSentencesSamplesLines) {
  TokenizerTrainOptions o;
  o.input_files = {FixturePath(), FixturePath()};
  o.vocab_size = 400;
  o.max_sentences = 20;
  o.out_path = (TempDir("sampled") / "tok.model").string();
  absl::Status s = TrainTokenizer(o);
  ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(o.out_path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_LE(tok->vocab_size(), 400);
  const std::string text = "sampled \xff tokenizer\t\u00e9\n";
  EXPECT_EQ(tok->Decode(tok->Encode(text)), text);
}

TEST_F(TokenizerTest, TrainingErrors) {
  TokenizerTrainOptions o;
  o.input_files = {"/nonexistent/input.txt"};
  o.out_path = (TempDir("err") / "tok.model").string();
  absl::Status s = TrainTokenizer(o);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent/input.txt"), std::string::npos) << s;
  o.input_files = {FixturePath()};
  o.vocab_size = 100;  // below the special and byte pieces
  EXPECT_EQ(TrainTokenizer(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(TokenizerTest, BadModelFilesGiveCleanErrors) {
  const fs::path dir = TempDir("bad");
  absl::StatusOr<Tokenizer> missing = Tokenizer::Load((dir / "missing.model").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("missing.model"), std::string::npos);

  const std::string good = *ReadFile(*model_path_);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"empty.model", ""},
      {"garbage.model", "this is not a protobuf \xff\xff\xff\xff\x01\x02"},
      {"truncated.model", good.substr(0, good.size() / 3)},
      {"text.model", *ReadFile(FixturePath())},
  };
  for (const auto& [name, bytes] : bad) {
    const std::string path = (dir / name).string();
    ASSERT_TRUE(WriteFileAtomic(path, bytes).ok());
    absl::StatusOr<Tokenizer> tok = Tokenizer::Load(path);
    EXPECT_FALSE(tok.ok()) << name;
    EXPECT_NE(tok.status().message().find(name), std::string::npos) << tok.status();
  }
}

TEST_F(TokenizerTest, RejectsPlainSentencePieceModel) {
  // A default SentencePiece model (NFKC, dummy prefix, no byte fallback) breaks the round trip.
  const std::string prefix = (TempDir("plain") / "plain").string();
  std::unordered_map<std::string, std::string> kw = {{"input", FixturePath()},
                                                     {"model_prefix", prefix},
                                                     {"vocab_size", "200"},
                                                     {"model_type", "bpe"},
                                                     {"minloglevel", "2"}};
  ASSERT_TRUE(sentencepiece::SentencePieceTrainer::Train(kw).ok());
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(prefix + ".model");
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("not an Oryx tokenizer"), std::string::npos) << tok.status();
}

}  // namespace
}  // namespace oryx
