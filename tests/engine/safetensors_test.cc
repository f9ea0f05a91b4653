// Safetensors tests: one test per kind of bad header, bf16 conversion, the mmap reader, the sharded store
// and its index checks, and the atomic writers (round trips, and a failed write keeps the old file).
#include "engine/safetensors.h"

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"

namespace oryx {
namespace {

using testutil::FileSizeLimit;
using testutil::SafetensorsImage;
using testutil::ScratchDir;

constexpr char kFile[] = "dir/model.safetensors";

absl::Status ParseImage(const std::string& image) {
  return ParseSafetensorsHeader(image, image.size(), kFile).status();
}

// Parses `image`, expects `code`, and returns the message.
std::string ErrorOf(const std::string& image, absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  absl::Status s = ParseImage(image);
  EXPECT_EQ(s.code(), code) << s;
  return std::string(s.message());
}

std::string Floats(std::initializer_list<float> values) {
  return std::string(reinterpret_cast<const char*>(values.begin()), values.size() * sizeof(float));
}

// ---- dtypes ----

TEST(DTypeTest, ParsesSupportedDTypes) {
  EXPECT_EQ(*ParseDType("F32"), DType::kF32);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
}

TEST(DTypeTest, ReportsStandardButUnsupportedDTypes) {
  for (const char* name : {"F16", "F64", "I64", "U8", "BOOL", "F8_E4M3"}) {
    absl::StatusOr<DType> d = ParseDType(name);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kUnimplemented) << name;
    EXPECT_HAS_SUBSTR(d.status().message(), std::string("dtype ") + name + " is not supported");
  }
}

TEST(DTypeTest, ReportsUnknownDTypes) {
  for (const char* name : {"Q4_0", "f32", "", "FLOAT"}) {
    absl::StatusOr<DType> d = ParseDType(name);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_HAS_SUBSTR(d.status().message(), "unknown dtype");
  }
}

TEST(Bf16Test, ConvertsExactValuesBothWays) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f, 1e-30f}) {
    const float rounded = Bf16ToFloat(FloatToBf16(f));
    if (f == 1e-30f) {
      EXPECT_NEAR(rounded, f, 1e-32f);
    } else {
      EXPECT_EQ(rounded, f);
    }
  }
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0xc000), -2.0f);
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  // Just above halfway rounds up.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f))),
            1.0f + std::ldexp(1.0f, -7));
}

TEST(Bf16Test, KeepsSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(inf)), inf);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-inf)), -inf);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low bits must not round to Inf.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::bit_cast<float>(0x7f800001u)))));
  // The largest float rounds up to Inf in bf16.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::max())), inf);
}

// ---- header parsing: the valid cases ----

TEST(HeaderTest, ParsesValidHeaderInFileOrder) {
  const std::string image = SafetensorsImage(
      R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "a": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [8, 12]},
          "__metadata__": {"format": "pt"}})",
      Floats({1, 2}) + std::string(4, '\0'));
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(image, image.size(), kFile);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "b");
  EXPECT_EQ(h->tensors[0].dtype, DType::kF32);
  EXPECT_EQ(h->tensors[0].numel, 2);
  EXPECT_EQ(h->tensors[1].name, "a");
  EXPECT_EQ(h->tensors[1].shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(h->tensors[1].begin, 8u);
  EXPECT_EQ(h->data_start, image.size() - 12);
  EXPECT_EQ(h->data_size, 12u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
}

TEST(HeaderTest, AcceptsEmptyHeaderAndZeroSizedTensors) {
  EXPECT_TRUE(ParseImage(SafetensorsImage("{}", "")).ok());
  EXPECT_TRUE(ParseImage(SafetensorsImage("{}  ", "")).ok());  // space padding
  const std::string image = SafetensorsImage(
      R"({"empty": {"dtype": "F32", "shape": [0, 5], "data_offsets": [4, 4]},
          "scalar": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}})",
      Floats({3}));
  EXPECT_TRUE(ParseImage(image).ok()) << ParseImage(image);
}

// ---- header parsing: one test per kind of bad input ----

TEST(HeaderTest, RejectsTruncatedFile) {
  EXPECT_EQ(ErrorOf(""),
            "dir/model.safetensors: truncated: 0 bytes, but a safetensors file starts with an 8-byte "
            "header length");
  EXPECT_HAS_SUBSTR(ErrorOf(std::string(7, '\0')), "dir/model.safetensors: truncated: 7 bytes");
}

TEST(HeaderTest, RejectsHeaderLengthBeyondFile) {
  std::string image = SafetensorsImage("{}", "");
  image[0] = 100;  // claims 100 header bytes; the file has 2 after the length
  EXPECT_EQ(ErrorOf(image),
            "dir/model.safetensors: header length 100 extends beyond the end of the file (10 bytes)");
  std::string huge(8, '\xff');  // 2^64 - 1: must not overflow 8 + N
  EXPECT_HAS_SUBSTR(ErrorOf(huge), "extends beyond the end of the file");
}

TEST(HeaderTest, RejectsHeaderThatIsNotJson) {
  EXPECT_HAS_SUBSTR(ErrorOf(SafetensorsImage("{\"a\": ", "")),
                    "dir/model.safetensors: header: not valid JSON");
  EXPECT_HAS_SUBSTR(ErrorOf(SafetensorsImage("\xff\xfe{}", "")), "header: not valid JSON");
}

TEST(HeaderTest, RejectsHeaderThatIsNotAnObject) {
  EXPECT_EQ(ErrorOf(SafetensorsImage("[1, 2]", "")),
            "dir/model.safetensors: header must be a JSON object, got an array");
}

TEST(HeaderTest, RejectsEntryWithMissingOrExtraKeys) {
  EXPECT_EQ(ErrorOf(SafetensorsImage(R"({"w": {"dtype": "F32", "shape": [1]}})", Floats({1}))),
            "dir/model.safetensors: tensor 'w': entry has no 'data_offsets'");
  EXPECT_EQ(ErrorOf(SafetensorsImage(
                R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}})", Floats({1}))),
            "dir/model.safetensors: tensor 'w': unexpected key 'extra' in entry");
  EXPECT_EQ(ErrorOf(SafetensorsImage(R"({"w": 3})", "")),
            "dir/model.safetensors: tensor 'w': entry must be an object, got 3");
}

TEST(HeaderTest, RejectsBadShapes) {
  auto with_shape = [](const std::string& shape) {
    return SafetensorsImage(R"({"w": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": [0, 4]}})",
                            Floats({1}));
  };
  EXPECT_HAS_SUBSTR(ErrorOf(with_shape("[-1]")), "tensor 'w': shape dimension negative");
  EXPECT_HAS_SUBSTR(ErrorOf(with_shape("[1.5]")), "tensor 'w': shape dimension not an integer");
  EXPECT_HAS_SUBSTR(ErrorOf(with_shape("[\"1\"]")), "tensor 'w': shape dimension not an integer");
  EXPECT_HAS_SUBSTR(ErrorOf(with_shape("1")), "tensor 'w': shape must be an array, got 1");
  EXPECT_HAS_SUBSTR(ErrorOf(with_shape("[18446744073709551615]")), "shape dimension too large");
}

TEST(HeaderTest, RejectsShapeWhoseSizeOverflows) {
  const std::string image = SafetensorsImage(
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})", Floats({1}));
  EXPECT_HAS_SUBSTR(ErrorOf(image), "tensor 'w': shape [4294967296, 4294967296] has more elements");
  const std::string bytes_overflow = SafetensorsImage(
      R"({"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 4]}})", Floats({1}));
  EXPECT_HAS_SUBSTR(ErrorOf(bytes_overflow), "is too large to address in bytes");
}

TEST(HeaderTest, RejectsOffsetsOutOfRange) {
  const std::string image =
      SafetensorsImage(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", Floats({1}));
  EXPECT_EQ(ErrorOf(image),
            "dir/model.safetensors: tensor 'w': data_offsets [0, 8] out of range: the data section "
            "is 4 bytes");
}

TEST(HeaderTest, RejectsMalformedOffsets) {
  auto with_offsets = [](const std::string& offsets) {
    return SafetensorsImage(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": )" + offsets + "}}", "");
  };
  EXPECT_HAS_SUBSTR(ErrorOf(with_offsets("[4, 0]")), "tensor 'w': data_offsets [4, 0] begin after end");
  EXPECT_HAS_SUBSTR(ErrorOf(with_offsets("[0]")), "tensor 'w': data_offsets must be an array");
  EXPECT_HAS_SUBSTR(ErrorOf(with_offsets("[0, -4]")), "data_offsets must be non-negative integers");
  EXPECT_HAS_SUBSTR(ErrorOf(with_offsets("[0, 0.5]")), "data_offsets must be non-negative integers");
}

TEST(HeaderTest, RejectsSpanThatDoesNotMatchShapeAndDType) {
  const std::string image = SafetensorsImage(
      R"({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 16]}})", std::string(16, '\0'));
  EXPECT_EQ(ErrorOf(image),
            "dir/model.safetensors: tensor 'w': data_offsets [0, 16] span 16 bytes but shape [2, 2] "
            "of BF16 needs 8");
}

TEST(HeaderTest, RejectsOverlappingTensors) {
  const std::string image = SafetensorsImage(
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
      Floats({1, 2, 3}));
  EXPECT_EQ(ErrorOf(image), "dir/model.safetensors: tensors 'a' [0, 8) and 'b' [4, 12) overlap");
}

TEST(HeaderTest, RejectsHolesAndTrailingBytes) {
  const std::string hole =
      SafetensorsImage(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", Floats({1, 2}));
  EXPECT_HAS_SUBSTR(ErrorOf(hole), "bytes [0, 4) of the data section before tensor 'a' belong to no");
  const std::string trailing =
      SafetensorsImage(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", Floats({1, 2}));
  EXPECT_HAS_SUBSTR(ErrorOf(trailing), "the last 4 bytes of the data section belong to no tensor");
}

TEST(HeaderTest, RejectsUnknownDType) {
  const std::string image =
      SafetensorsImage(R"({"w": {"dtype": "Q4_K", "shape": [1], "data_offsets": [0, 4]}})", Floats({1}));
  EXPECT_EQ(ErrorOf(image), "dir/model.safetensors: tensor 'w': unknown dtype 'Q4_K'");
}

TEST(HeaderTest, ReportsUnsupportedDType) {
  const std::string image =
      SafetensorsImage(R"({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})", Floats({1}));
  EXPECT_EQ(ErrorOf(image, absl::StatusCode::kUnimplemented),
            "dir/model.safetensors: tensor 'w': dtype F16 is not supported (only F32 and BF16)");
}

TEST(HeaderTest, RejectsDuplicateTensorNames) {
  const std::string image = SafetensorsImage(
      R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
          "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
      Floats({1, 2}));
  EXPECT_EQ(ErrorOf(image), "dir/model.safetensors: header: duplicate key 'w'");
}

TEST(HeaderTest, RejectsBadMetadata) {
  EXPECT_HAS_SUBSTR(ErrorOf(SafetensorsImage(R"({"__metadata__": {"step": 3}})", "")),
                    "dir/model.safetensors: __metadata__ key 'step' must map to a string, got 3");
  EXPECT_HAS_SUBSTR(ErrorOf(SafetensorsImage(R"({"__metadata__": [1]})", "")),
                    "__metadata__ must be an object of strings");
}

TEST(HeaderTest, HandlesPartialBytesAndHugeHeaderLength) {
  // Only the length was read although the file is long enough: an error, not an out-of-bounds read.
  const std::string image = SafetensorsImage("{}", "");
  absl::Status s = ParseSafetensorsHeader(std::string_view(image).substr(0, 8), image.size(), kFile).status();
  EXPECT_HAS_SUBSTR(s.message(), "only 8 of the first 10 bytes");
  // A header length over the 100 MB cap is refused before anything is allocated.
  std::string big(8, '\0');
  const uint64_t len = kMaxSafetensorsHeaderBytes + 1;
  std::memcpy(big.data(), &len, 8);
  s = ParseSafetensorsHeader(big, len + 8, kFile).status();
  EXPECT_HAS_SUBSTR(s.message(), "exceeds the limit of 100000000 bytes");
}

// ---- encoding, writing and reading back ----

std::vector<HostTensor> SomeTensors(DType dtype) {
  std::vector<HostTensor> t;
  t.push_back(MakeHostTensor("x.weight", {2, 3}, std::vector<float>{1, -2, 3.5, 0.25, -0.125, 7}, dtype));
  t.push_back(MakeHostTensor("bias", {3}, std::vector<float>{0.5, 0, -1}, dtype));
  t.push_back(MakeHostTensor("empty", {0, 4}, std::vector<float>{}, dtype));
  return t;
}

void ExpectSameTensors(const std::vector<HostTensor>& expected, const SafetensorsStore& store) {
  ASSERT_EQ(store.size(), expected.size());
  for (const HostTensor& t : expected) {
    const TensorView* v = store.Find(t.name);
    ASSERT_NE(v, nullptr) << t.name;
    EXPECT_EQ(v->dtype, t.dtype) << t.name;
    EXPECT_EQ(std::vector<int64_t>(v->shape.begin(), v->shape.end()), t.shape) << t.name;
    ASSERT_EQ(v->bytes.size(), t.bytes.size()) << t.name;
    EXPECT_TRUE(std::equal(v->bytes.begin(), v->bytes.end(), t.bytes.begin())) << t.name;
    EXPECT_EQ(TensorToFloats(*v), TensorToFloats(t.view())) << t.name;
  }
}

TEST(WriterTest, EncodedHeaderIsPaddedAndParses) {
  const std::vector<HostTensor> tensors = SomeTensors(DType::kF32);
  absl::StatusOr<std::string> image = EncodeSafetensors(Views(tensors), {{"producer", "oryx"}});
  ASSERT_TRUE(image.ok()) << image.status();
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(*image, image->size(), "mem");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->data_start % 8, 0u);
  EXPECT_EQ(image->substr(h->data_start - 1, 1), " ");  // padded with spaces (here at least one)
  EXPECT_EQ(h->metadata.at("producer"), "oryx");
  EXPECT_EQ(h->tensors.size(), 3u);
}

TEST(WriterTest, RoundTripsF32AndBf16) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    ScratchDir dir;
    const std::vector<HostTensor> tensors = SomeTensors(dtype);
    ASSERT_TRUE(WriteSafetensors(dir.Join("m.safetensors"), Views(tensors)).ok());
    absl::StatusOr<SafetensorsStore> store = SafetensorsStore::Open(dir.Join("m.safetensors"));
    ASSERT_TRUE(store.ok()) << store.status();
    ExpectSameTensors(tensors, *store);
  }
}

TEST(WriterTest, Bf16StoresRoundedValues) {
  const float v = 1.0f + std::ldexp(1.0f, -10);  // not representable in bf16
  HostTensor t = MakeHostTensor("t", {1}, std::vector<float>{v}, DType::kBF16);
  EXPECT_EQ(TensorToFloats(t.view())[0], 1.0f);
}

TEST(WriterTest, RejectsBadTensors) {
  ScratchDir dir;
  std::vector<HostTensor> dup = SomeTensors(DType::kF32);
  dup.push_back(dup[0]);
  EXPECT_HAS_SUBSTR(WriteSafetensors(dir.Join("a.safetensors"), Views(dup)).message(),
                    "tensor 'x.weight' given twice");
  std::vector<HostTensor> wrong = SomeTensors(DType::kF32);
  wrong[1].shape = {4};
  EXPECT_HAS_SUBSTR(WriteSafetensors(dir.Join("a.safetensors"), Views(wrong)).message(),
                    "tensor 'bias': 12 bytes do not match shape [4] of F32");
  EXPECT_FALSE(std::filesystem::exists(dir.Join("a.safetensors")));
}

TEST(WriterTest, FailsCleanlyIntoMissingDirectory) {
  ScratchDir dir;
  absl::Status s = WriteSafetensors(dir.Join("no/such/dir/m.safetensors"), Views(SomeTensors(DType::kF32)));
  EXPECT_FALSE(s.ok());
  EXPECT_HAS_SUBSTR(s.message(), "no/such/dir/m.safetensors");
}


TEST(WriterTest, FailedWriteLeavesOldFileIntact) {
  ScratchDir dir;
  const std::string path = dir.Join("m.safetensors");
  const std::vector<HostTensor> old_tensors = SomeTensors(DType::kF32);
  ASSERT_TRUE(WriteSafetensors(path, Views(old_tensors)).ok());
  const std::string old_bytes = testutil::ReadRawFile(path);

  std::vector<float> big(4096, 1.0f);
  std::vector<HostTensor> new_tensors = {MakeHostTensor("big", {4096}, big, DType::kF32)};
  absl::Status s;
  {
    FileSizeLimit limit(1024);
    s = WriteSafetensors(path, Views(new_tensors));
  }
  EXPECT_FALSE(s.ok());
  EXPECT_HAS_SUBSTR(s.message(), "write failed");
  EXPECT_EQ(testutil::ReadRawFile(path), old_bytes);
  // No temporary file is left behind.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) files += entry.exists();
  EXPECT_EQ(files, 1);
}

// ---- the reader ----

TEST(ReaderTest, ReportsMissingEmptyAndNonRegularFiles) {
  ScratchDir dir;
  EXPECT_EQ(SafetensorsFile::Open(dir.Join("none.safetensors")).status().code(), absl::StatusCode::kNotFound);
  testutil::WriteRawFile(dir.Join("empty.safetensors"), "");
  EXPECT_HAS_SUBSTR(SafetensorsFile::Open(dir.Join("empty.safetensors")).status().message(),
                    "empty.safetensors: truncated: 0 bytes");
  EXPECT_HAS_SUBSTR(SafetensorsFile::Open(dir.path()).status().message(), "not a regular file");
}

TEST(ReaderTest, ViewsSurviveMove) {
  ScratchDir dir;
  const std::vector<HostTensor> tensors = SomeTensors(DType::kF32);
  ASSERT_TRUE(WriteSafetensors(dir.Join("m.safetensors"), Views(tensors)).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(dir.Join("m.safetensors"));
  ASSERT_TRUE(file.ok());
  SafetensorsFile moved = *std::move(file);
  const TensorInfo* info = moved.Find("bias");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(TensorToFloats(moved.View(*info)), (std::vector<float>{0.5, 0, -1}));
  EXPECT_EQ(moved.Find("nope"), nullptr);
}

// ---- sharded store ----

TEST(ShardTest, FitsInOneFile) {
  ScratchDir dir;
  const std::vector<HostTensor> tensors = SomeTensors(DType::kF32);
  absl::StatusOr<std::vector<std::string>> files =
      WriteShardedSafetensors(dir.path(), Views(tensors), 1 << 20);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ(*files, std::vector<std::string>{"model.safetensors"});
  absl::StatusOr<SafetensorsStore> store = SafetensorsStore::OpenDirectory(dir.path());
  ASSERT_TRUE(store.ok()) << store.status();
  ExpectSameTensors(tensors, *store);
}

TEST(ShardTest, SplitsAndRoundTrips) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    ScratchDir dir;
    const std::vector<HostTensor> tensors = SomeTensors(dtype);
    // x.weight alone exceeds nothing; bias would push the first shard past the limit.
    const uint64_t limit = tensors[0].bytes.size();
    absl::StatusOr<std::vector<std::string>> files =
        WriteShardedSafetensors(dir.path(), Views(tensors), limit);
    ASSERT_TRUE(files.ok()) << files.status();
    EXPECT_EQ(*files,
              (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors", "model.safetensors.index.json"}));
    absl::StatusOr<SafetensorsStore> store = SafetensorsStore::OpenDirectory(dir.path());
    ASSERT_TRUE(store.ok()) << store.status();
    ExpectSameTensors(tensors, *store);
    EXPECT_HAS_SUBSTR(store->FileOf("bias"), "model-00002-of-00002.safetensors");
  }
}

TEST(ShardTest, OversizedTensorGetsItsOwnShard) {
  ScratchDir dir;
  const std::vector<HostTensor> tensors = SomeTensors(DType::kF32);
  absl::StatusOr<std::vector<std::string>> files = WriteShardedSafetensors(dir.path(), Views(tensors), 1);
  ASSERT_TRUE(files.ok()) << files.status();
  // Every tensor exceeds (or, for the empty one, follows one that filled) the 1-byte limit.
  EXPECT_EQ(*files,
            (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  absl::StatusOr<SafetensorsStore> store = SafetensorsStore::OpenDirectory(dir.path());
  ASSERT_TRUE(store.ok()) << store.status();
  ExpectSameTensors(tensors, *store);
}

// A directory with two shards (a: tensor "a", b: tensor "b") and an index that the test then edits.
class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = {MakeHostTensor("a", {2}, std::vector<float>{1, 2}, DType::kF32)};
    b_ = {MakeHostTensor("b", {1}, std::vector<float>{3}, DType::kF32)};
    ASSERT_TRUE(WriteSafetensors(dir_.Join("s1.safetensors"), Views(a_)).ok());
    ASSERT_TRUE(WriteSafetensors(dir_.Join("s2.safetensors"), Views(b_)).ok());
  }
  absl::Status OpenWithIndex(const std::string& json) {
    testutil::WriteRawFile(dir_.Join("model.safetensors.index.json"), json);
    return SafetensorsStore::OpenDirectory(dir_.path()).status();
  }
  ScratchDir dir_;
  std::vector<HostTensor> a_, b_;
};

TEST_F(IndexTest, AcceptsConsistentIndex) {
  EXPECT_TRUE(OpenWithIndex(R"({"metadata": {"total_size": 12},
      "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})")
                  .ok());
}

TEST_F(IndexTest, RejectsMissingShard) {
  absl::Status s = OpenWithIndex(R"({"weight_map": {"a": "s1.safetensors", "b": "s9.safetensors"}})");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(s.message(),
                    "model.safetensors.index.json: shard 's9.safetensors' (holding "
                    "tensor 'b') not found");
}

TEST_F(IndexTest, RejectsTensorMappedToWrongShard) {
  absl::Status s = OpenWithIndex(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  EXPECT_HAS_SUBSTR(s.message(),
                    "index.json: tensor 'b': mapped to shard 's1.safetensors' but not "
                    "found there (it is in no shard)");
  // With both shards opened, the message says where the tensor really is.
  ASSERT_TRUE(WriteSafetensors(dir_.Join("s3.safetensors"), {}).ok());
  s = OpenWithIndex(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors",
                                       "c": "s3.safetensors"}})");
  EXPECT_HAS_SUBSTR(s.message(), "tensor 'c': mapped to shard 's3.safetensors' but not found there");
}

TEST_F(IndexTest, RejectsTensorInTwoShards) {
  ASSERT_TRUE(WriteSafetensors(dir_.Join("s3.safetensors"), Views(a_)).ok());
  absl::Status s = OpenWithIndex(
      R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s3.safetensors"}})");
  EXPECT_HAS_SUBSTR(s.message(), "s3.safetensors: tensor 'a': also present in ");
  EXPECT_HAS_SUBSTR(s.message(), "s1.safetensors (a tensor may be in only one shard)");
}

TEST_F(IndexTest, RejectsShardTensorMissingFromMap) {
  ASSERT_TRUE(
      WriteSafetensors(dir_.Join("s3.safetensors"), Views(std::vector<HostTensor>{a_[0], b_[0]})).ok());
  std::vector<HostTensor> ab = {a_[0], b_[0]};
  ab[1].name = "extra";
  ASSERT_TRUE(WriteSafetensors(dir_.Join("s3.safetensors"), Views(ab)).ok());
  absl::Status s = OpenWithIndex(R"({"weight_map": {"a": "s3.safetensors"}})");
  EXPECT_HAS_SUBSTR(s.message(), "index.json: tensor 'extra': present in shard ");
  EXPECT_HAS_SUBSTR(s.message(), "but missing from the weight_map");
}

TEST_F(IndexTest, RejectsPathsEscapingTheDirectory) {
  for (const char* shard :
       {"../s1.safetensors", "/etc/s1.safetensors", "sub/s1.safetensors", "..", "s1.bin", ".safetensors"}) {
    absl::Status s = OpenWithIndex(std::string(R"({"weight_map": {"a": ")") + shard + "\"}}");
    EXPECT_HAS_SUBSTR(
        s.message(), "tensor 'a': shard '" + std::string(shard) + "' is not a plain *.safetensors file name");
  }
}

TEST_F(IndexTest, RejectsMalformedIndex) {
  EXPECT_HAS_SUBSTR(OpenWithIndex("{").message(), "model.safetensors.index.json: not valid JSON");
  EXPECT_HAS_SUBSTR(OpenWithIndex("[]").message(), "must be a JSON object");
  EXPECT_HAS_SUBSTR(OpenWithIndex("{}").message(), "no 'weight_map'");
  EXPECT_HAS_SUBSTR(OpenWithIndex(R"({"weight_map": []})").message(), "'weight_map' must be an object");
  EXPECT_HAS_SUBSTR(OpenWithIndex(R"({"weight_map": {"a": 1}})").message(),
                    "tensor 'a': shard must be a file name, got 1");
  EXPECT_HAS_SUBSTR(OpenWithIndex(R"({"weight_map": {}, "extra": 1})").message(), "unexpected key 'extra'");
  EXPECT_HAS_SUBSTR(
      OpenWithIndex(R"({"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}})").message(),
      "duplicate key 'a'");
}

TEST_F(IndexTest, RejectsAmbiguousOrMissingWeights) {
  ASSERT_TRUE(WriteSafetensors(dir_.Join("model.safetensors"), Views(a_)).ok());
  absl::Status s = OpenWithIndex(R"({"weight_map": {"a": "s1.safetensors"}})");
  EXPECT_HAS_SUBSTR(s.message(), "both model.safetensors and model.safetensors.index.json");
  ScratchDir empty;
  EXPECT_EQ(SafetensorsStore::OpenDirectory(empty.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(IndexTest, ReportsBadShardContents) {
  testutil::WriteRawFile(dir_.Join("s2.safetensors"), "garbage");
  absl::Status s = OpenWithIndex(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  EXPECT_HAS_SUBSTR(s.message(), "s2.safetensors: truncated: 7 bytes");
}

}  // namespace
}  // namespace oryx
