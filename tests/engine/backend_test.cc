// The CPU backend's own guarantees, on random tiny checkpoints (no LibTorch): a batch of ragged spans gives
// each sequence the logits it gets alone; Truncate and Clone bring back exactly an earlier state; a draft
// sequence runs linear mode like the full one; and the decode loop allocates nothing.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <random>

#include "engine/cpu_backend.h"
#include "engine/sampler.h"
#include "engine/tensor_names.h"
#include "kernels/ops.h"
#include "gtest/gtest.h"
#include "tests/engine/testing_checkpoint.h"

// Counts heap allocations while `g_count_allocations` is set (for the no-allocation-per-token test).
static std::atomic<bool> g_count_allocations{false};
static std::atomic<int64_t> g_allocations{0};
void* operator new(size_t n) {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
// The kernels' buffers are 64-byte aligned (kernels/aligned_vector.h): counted the same way.
void* operator new(size_t n, std::align_val_t alignment) {
  if (g_count_allocations.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  const size_t a = static_cast<size_t>(alignment);
  if (void* p = std::aligned_alloc(a, ((n == 0 ? 1 : n) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }

namespace oryx {
namespace {

constexpr int32_t kVocab = 32;  // TinyConfig's

struct Tokens {
  std::vector<int32_t> tokens;
  std::vector<Mode> modes;
};

Tokens RandomTokens(std::mt19937& rng, int64_t n) {
  Tokens r;
  for (int64_t i = 0; i < n; ++i) {
    r.tokens.push_back(static_cast<int32_t>(rng() % kVocab));
    r.modes.push_back(rng() % 2 ? Mode::kAttention : Mode::kLinear);
  }
  return r;
}

// What the fixtures share: a CPU backend on a random tiny checkpoint, and the logits of a span.
class BackendFixture {
 protected:
  void Load(const ModelConfig& config, const std::string& name, uint32_t seed) {
    testutil::WriteTinyCheckpoint(scratch_.Join(name), config, testutil::RandomTensors(config, DType::kF32, seed));
    auto b = CpuBackend::Load(scratch_.Join(name), /*threads=*/2);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  // Logits of every token of `run` forwarded in one span on `seq`.
  std::vector<float> Logits(SequenceState& seq, const Tokens& run, bool keep_states = false) {
    std::vector<float> out;
    ForwardItem item{&seq, run.tokens, run.modes, LogitsRows::kAll, &out, keep_states};
    EXPECT_TRUE(backend_->Forward(std::span(&item, 1)).ok());
    return out;
  }
  testutil::ScratchDir scratch_;
  std::unique_ptr<CpuBackend> backend_;
};

class BackendTest : public ::testing::TestWithParam<LinearMixer>, protected BackendFixture {
 protected:
  void SetUp() override { Load(testutil::TinyConfig(GetParam()), "m", 7); }
};

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, float tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float worst = 0.f;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst, tol) << what;
}

// Packed projection weights give the fp32 backend's logits, up to fp32 summation order, on a model whose
// projections are exactly what the packing keeps: bf16 values (a bf16 checkpoint) for bf16; for int8, each row
// already a multiple of its scale (every projection row quantised and dequantised before the checkpoint is
// written). Over a 20-token span (widened weights and GEMM) and a decode step after it (dot products over the
// packed rows). A wrong scale, row or panel offset moves logits by O(1); the orders of the sums by ~1e-6.
TEST_P(BackendTest, PackedWeightsGiveTheFp32LogitsOfWhatTheyHold) {
  const ModelConfig config = testutil::TinyConfig(GetParam());
  testutil::WriteTinyCheckpoint(scratch_.Join("bf16"), config, testutil::RandomTensors(config, DType::kBF16, 7));
  std::vector<HostTensor> tensors = testutil::RandomTensors(config, DType::kF32, 7);
  std::vector<std::string> projections = {std::string(kEmbedWeight), std::string(kLmHeadWeight)};
  for (int64_t il = 0; il < config.n_layers; ++il) {
    std::vector<std::string_view> suffixes = InProjLayout::For(config).tensors;
    suffixes.insert(suffixes.end(), {kOProj, kMlpGate, kMlpUp, kMlpDown});
    for (std::string_view suffix : suffixes) projections.push_back(LayerTensorName(il, suffix));
  }
  for (HostTensor& t : tensors) {
    if (std::find(projections.begin(), projections.end(), t.name) == projections.end()) continue;
    const int64_t rows = t.shape[0], cols = static_cast<int64_t>(t.bytes.size() / sizeof(float)) / rows;
    auto* w = reinterpret_cast<float*>(t.bytes.data());
    std::vector<int8_t> q(rows * cols);
    std::vector<float> scale(rows);
    kernels::cpu::PackWeights(w, rows, cols, kernels::WeightFormat::kInt8, q.data(), scale.data());
    for (int64_t e = 0; e < rows * cols; ++e) w[e] = q[e] * scale[e / cols];
  }
  testutil::WriteTinyCheckpoint(scratch_.Join("int8"), config, tensors);
  std::mt19937 rng(41);
  const Tokens prompt = RandomTokens(rng, 20), step = RandomTokens(rng, 1);
  auto run = [&](const std::string& dir, kernels::WeightFormat format) {
    auto backend = CpuBackend::Load(scratch_.Join(dir), /*threads=*/2, format);
    EXPECT_TRUE(backend.ok()) << backend.status();
    SequenceState seq = (*backend)->NewSequence();
    std::vector<float> logits, next;
    ForwardItem item{&seq, prompt.tokens, prompt.modes, LogitsRows::kAll, &logits, false};
    EXPECT_TRUE((*backend)->Forward(std::span(&item, 1)).ok());
    ForwardItem one{&seq, step.tokens, step.modes, LogitsRows::kAll, &next, false};
    EXPECT_TRUE((*backend)->Forward(std::span(&one, 1)).ok());
    logits.insert(logits.end(), next.begin(), next.end());
    return logits;
  };
  for (auto [dir, format] : {std::pair{"bf16", kernels::WeightFormat::kBf16}, {"int8", kernels::WeightFormat::kInt8}}) {
    SCOPED_TRACE(dir);
    const std::vector<float> want = run(dir, kernels::WeightFormat::kF32), got = run(dir, format);
    ASSERT_EQ(got.size(), want.size());
    float scale = 0.f, worst = 0.f;
    for (size_t i = 0; i < got.size(); ++i) {
      scale = std::max(scale, std::abs(want[i]));
      worst = std::max(worst, std::abs(got[i] - want[i]));
    }
    EXPECT_LE(worst, 1e-4f * scale);
  }
  // w8a8 quantises the activations too, so it is near the fp32 logits, not equal to them: over the 20-token
  // span (the GEMM path over quantised rows) and the decode step (integer dot products) the mean difference is
  // within 2% of the logits' scale (random weights make outliers that real ones do not: default_model_test
  // holds the bundled model's perplexity under w8a8 to 0.5% of fp32's), and they are not the int8 logits (a
  // w8a8 that fell back to int8 would be).
  const std::vector<float> want = run("int8", kernels::WeightFormat::kF32),
                           w8a8 = run("int8", kernels::WeightFormat::kW8A8),
                           int8 = run("int8", kernels::WeightFormat::kInt8);
  float scale = 0.f, from_int8 = 0.f;
  double mean = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    mean += std::abs(w8a8[i] - want[i]) / static_cast<double>(want.size());
    from_int8 = std::max(from_int8, std::abs(w8a8[i] - int8[i]));
  }
  EXPECT_LE(mean, 0.02 * scale);
  EXPECT_GT(from_int8, 1e-4f * scale);
}

TEST_P(BackendTest, BatchOfRaggedSpansGivesEachSequenceItsOwnLogits) {
  std::mt19937 rng(3);
  const std::vector<int64_t> prefix = {0, 5, 17, 2}, span = {9, 1, 4, 13};
  std::vector<SequenceState> alone, batched;
  std::vector<Tokens> spans;
  for (size_t b = 0; b < prefix.size(); ++b) {
    alone.push_back(backend_->NewSequence());
    batched.push_back(backend_->NewSequence());
    if (prefix[b] > 0) {
      Tokens p = RandomTokens(rng, prefix[b]);
      Logits(alone[b], p);
      Logits(batched[b], p);
    }
    spans.push_back(RandomTokens(rng, span[b]));
  }
  std::vector<std::vector<float>> out(prefix.size());
  std::vector<ForwardItem> items;
  for (size_t b = 0; b < prefix.size(); ++b) {
    items.push_back({&batched[b], spans[b].tokens, spans[b].modes, b == 1 ? LogitsRows::kLast : LogitsRows::kAll,
                     &out[b], false});
  }
  ASSERT_TRUE(backend_->Forward(items).ok());
  for (size_t b = 0; b < prefix.size(); ++b) {
    std::vector<float> want = Logits(alone[b], spans[b]);
    if (b == 1) want.erase(want.begin(), want.end() - kVocab);
    ExpectNear(out[b], want, 1e-5f, "sequence " + std::to_string(b));
    EXPECT_EQ(batched[b].position(), prefix[b] + span[b]);
  }
}

// A token drawn by the backend (ForwardItem::sampler) is the one the same sampler draws from the returned
// logits, greedy and sampled, with a sequence of the batch running a verify-like span that returns its logits or not.
TEST_P(BackendTest, BackendDrawsTheTokenTheSamplerDrawsFromTheLogits) {
  for (const bool one_returns_logits : {false, true}) {
    for (const SamplingParams& params : {SamplingParams{}, SamplingParams{.temperature = 0.9f, .top_k = 12, .seed = 5}}) {
      SCOPED_TRACE(std::string(params.greedy() ? "greedy" : "sampled") + (one_returns_logits ? ", one returns logits" : ""));
      testutil::ExpectBackendDrawsAreTheSamplersDraws(*backend_, params, one_returns_logits);
      if (!one_returns_logits) testutil::ExpectBackendDrawsAreTheSamplersDraws(*backend_, params, false, 1);
    }
  }
}

TEST_P(BackendTest, TruncateInsideAKeptSpanEqualsNeverHavingRunThePastTokens) {
  std::mt19937 rng(11);
  const Tokens prompt = RandomTokens(rng, 6), span = RandomTokens(rng, 5), next = RandomTokens(rng, 3);
  for (int64_t keep = 0; keep <= 5; ++keep) {
    SequenceState seq = backend_->NewSequence();
    Logits(seq, prompt);
    Logits(seq, span, /*keep_states=*/true);
    ASSERT_TRUE(seq.Truncate(6 + keep).ok());
    EXPECT_EQ(seq.position(), 6 + keep);
    SequenceState fresh = backend_->NewSequence();
    Logits(fresh, prompt);
    if (keep > 0) {
      Tokens head{{span.tokens.begin(), span.tokens.begin() + keep}, {span.modes.begin(), span.modes.begin() + keep}};
      Logits(fresh, head);
    }
    // Same state => same logits for any continuation, in both modes.
    ExpectNear(Logits(seq, next), Logits(fresh, next), 1e-5f, "kept " + std::to_string(keep));
  }
}

TEST_P(BackendTest, TruncateOutsideTheKeptSpanIsAnError) {
  std::mt19937 rng(2);
  SequenceState seq = backend_->NewSequence();
  Logits(seq, RandomTokens(rng, 4));
  EXPECT_EQ(seq.Truncate(2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seq.Truncate(5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(seq.Truncate(4).ok());
  Logits(seq, RandomTokens(rng, 3), true);
  EXPECT_EQ(seq.Truncate(3).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seq.position(), 7);
}

TEST_P(BackendTest, CloneIsASnapshotThatRestoresExactly) {
  std::mt19937 rng(5);
  SequenceState seq = backend_->NewSequence();
  Logits(seq, RandomTokens(rng, 7));
  SequenceState snap = seq.Clone();
  const Tokens more = RandomTokens(rng, 4), probe = RandomTokens(rng, 2);
  const std::vector<float> first = Logits(seq, more);
  seq = std::move(snap);
  EXPECT_EQ(seq.position(), 7);
  EXPECT_EQ(Logits(seq, more), first);  // the same computation on the same state: bit-identical
}

// The host KV cache is paged (blocks of SequenceState::kv_block_tokens positions). On a model with a longer
// context: spans that cross block boundaries, clones that share blocks and then write into the shared one
// (copy on write), and a rollback into a block a clone holds, each give the logits of a fresh sequence fed
// the same tokens in one span.
// The paged cache's guarantees hold in both KV formats: a bf16 cache rounds each key and value once, when it
// is written, so that every way of reaching a state (spans, clones, rollback, pool reuse, block sizes) reads
// the same rounded values.
class PagedKvTest : public ::testing::TestWithParam<std::tuple<LinearMixer, kernels::KvFormat>>,
                    protected BackendFixture {
 protected:
  void SetUp() override {
    ModelConfig config = testutil::TinyConfig(std::get<0>(GetParam()));
    config.max_position = 512;
    ASSERT_NO_FATAL_FAILURE(Load(config, "long", 9));
    ASSERT_TRUE(backend_->SetKvFormat(std::get<1>(GetParam())).ok());
  }
  static Tokens Cat(const Tokens& a, const Tokens& b) {
    Tokens r = a;
    r.tokens.insert(r.tokens.end(), b.tokens.begin(), b.tokens.end());
    r.modes.insert(r.modes.end(), b.modes.begin(), b.modes.end());
    return r;
  }
  // The logits of `probe` after `history`, on a fresh sequence that forwarded the history in one span.
  std::vector<float> Fresh(const Tokens& history, const Tokens& probe) {
    SequenceState seq = backend_->NewSequence();
    Logits(seq, history);
    return Logits(seq, probe);
  }
};

TEST_P(PagedKvTest, SpansAcrossBlocksClonesAndRollbackIntoSharedBlocks) {
  std::mt19937 rng(23);
  SequenceState probe_seq = backend_->NewSequence();
  const int64_t bt = probe_seq.kv_block_tokens();
  ASSERT_LE(3 * bt, 512) << "the test wants three blocks inside the context";
  const Tokens a = RandomTokens(rng, bt + bt / 2), b = RandomTokens(rng, bt / 2 + 3), c = RandomTokens(rng, 7);
  const Tokens probe = RandomTokens(rng, 3);

  // Spans of 37 tokens across the block boundary against one span.
  SequenceState pieces = backend_->NewSequence();
  for (size_t i = 0; i < a.tokens.size(); i += 37) {
    const size_t n = std::min<size_t>(37, a.tokens.size() - i);
    Logits(pieces, Tokens{{a.tokens.begin() + i, a.tokens.begin() + i + n}, {a.modes.begin() + i, a.modes.begin() + i + n}});
  }
  SequenceState whole = backend_->NewSequence();
  Logits(whole, a);
  ExpectNear(Logits(pieces, probe), Logits(whole, probe), 1e-5f, "pieces against one span");

  // A clone shares the blocks (the full first and the partly filled second); a copy shares none.
  SequenceState seq = backend_->NewSequence();
  Logits(seq, a);
  SequenceState clone = seq.Clone();
  EXPECT_EQ(seq.kv_shared_blocks(), 2);
  absl::StatusOr<SequenceState> copy = seq.TryCopy();
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->kv_shared_blocks(), 0);
  ExpectNear(Logits(*copy, probe), Fresh(a, probe), 1e-5f, "a copy");
  // Both then write into the shared second block.
  Logits(seq, b);
  Logits(clone, c);
  ExpectNear(Logits(seq, probe), Fresh(Cat(a, b), probe), 1e-5f, "original after the clone");
  ExpectNear(Logits(clone, probe), Fresh(Cat(a, c), probe), 1e-5f, "clone after the original wrote");
  EXPECT_EQ(seq.kv_shared_blocks(), 1);  // the first block; each wrote its own copy of the second

  // A rollback into a block the clone holds, then new tokens there: the clone's cache is untouched.
  SequenceState base = backend_->NewSequence();
  Logits(base, a);
  Logits(base, b, /*keep_states=*/true);
  SequenceState kept = base.Clone();
  const int64_t keep = 2;
  ASSERT_TRUE(base.Truncate(static_cast<int64_t>(a.tokens.size()) + keep).ok());
  Logits(base, c);
  const Tokens b_head{{b.tokens.begin(), b.tokens.begin() + keep}, {b.modes.begin(), b.modes.begin() + keep}};
  ExpectNear(Logits(base, probe), Fresh(Cat(Cat(a, b_head), c), probe), 1e-5f, "rolled back and rewritten");
  ExpectNear(Logits(kept, probe), Fresh(Cat(a, b), probe), 1e-5f, "the clone of the rolled-back sequence");
}

// The backend's sequences take their blocks from one pool, sized at start by ReserveKv: the reserved memory is
// there before any sequence, sequences use it without the pool growing, a sequence's blocks go back for the
// next one, and sequences that take turns in the pool give the logits of a sequence alone.
TEST_P(PagedKvTest, SequencesShareOnePoolSizedAtStart) {
  std::mt19937 rng(29);
  const int64_t bt = backend_->NewSequence().kv_block_tokens();
  const int64_t block_bytes = backend_->KvBytes(bt);
  EXPECT_EQ(backend_->KvPoolBytes(), 0);  // no block has memory yet
  ASSERT_TRUE(backend_->ReserveKv(10 * block_bytes - 1).ok());
  EXPECT_EQ(backend_->KvPoolBytes(), 10 * block_bytes);
  const Tokens a = RandomTokens(rng, 2 * bt + 5), b = RandomTokens(rng, bt + 1), probe = RandomTokens(rng, 2);
  const std::vector<float> alone = Fresh(a, probe);
  {
    // Three blocks and two: the reservation holds them.
    SequenceState first = backend_->NewSequence(), second = backend_->NewSequence();
    for (int64_t i = 0; i < 2 * bt + 5; i += bt / 2) {  // interleaved, so that their blocks alternate in the pool
      const int64_t n = std::min<int64_t>(bt / 2, 2 * bt + 5 - i);
      Logits(first, Tokens{{a.tokens.begin() + i, a.tokens.begin() + i + n}, {a.modes.begin() + i, a.modes.begin() + i + n}});
      if (i < bt + 1) {
        const int64_t m = std::min<int64_t>(bt / 2, bt + 1 - i);
        Logits(second, Tokens{{b.tokens.begin() + i, b.tokens.begin() + i + m}, {b.modes.begin() + i, b.modes.begin() + i + m}});
      }
    }
    ExpectNear(Logits(first, probe), alone, 1e-5f, "a sequence whose blocks alternate with another's");
    EXPECT_EQ(backend_->KvPoolBytes(), 10 * block_bytes);
  }
  // Past the reservation the pool grows, and what it holds stays for the next sequences.
  std::vector<SequenceState> many;
  for (int i = 0; i < 5; ++i) {
    many.push_back(backend_->NewSequence());
    Logits(many.back(), a);
  }
  EXPECT_EQ(backend_->KvPoolBytes(), 15 * block_bytes);
  many.clear();
  SequenceState again = backend_->NewSequence();
  Logits(again, a);
  EXPECT_EQ(backend_->KvPoolBytes(), 15 * block_bytes);
  ExpectNear(Logits(again, probe), alone, 1e-5f, "a sequence in blocks others used before");
}

// Any block size gives the same logits (the attention reads each block's run of keys apart): 16, 37 and
// 128 positions against the default, over spans that cross several blocks; the size cannot change under a
// sequence that holds blocks.
TEST_P(PagedKvTest, BlockSizesGiveTheSameLogits) {
  std::mt19937 rng(31);
  const Tokens a = RandomTokens(rng, 150), b = RandomTokens(rng, 40), probe = RandomTokens(rng, 1);
  auto run = [&] {
    SequenceState seq = backend_->NewSequence();
    Logits(seq, a);
    Logits(seq, b);
    return Logits(seq, probe);
  };
  const std::vector<float> want = run();
  for (int64_t bt : {16, 37, 128}) {
    ASSERT_TRUE(backend_->SetKvBlockTokens(bt).ok());
    EXPECT_EQ(backend_->NewSequence().kv_block_tokens(), bt);
    EXPECT_EQ(backend_->KvBytes(bt + 1), 2 * backend_->KvBytes(bt));
    ExpectNear(run(), want, 1e-5f, "blocks of " + std::to_string(bt));
  }
  SequenceState holder = backend_->NewSequence();
  Logits(holder, a);
  EXPECT_EQ(backend_->SetKvBlockTokens(64).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend_->SetKvBlockTokens(0).code(), absl::StatusCode::kInvalidArgument);
}

// A bf16 or int8 cache gives logits near the fp32 cache's, and not the same ones (a setting that still ran
// fp32 would). bf16 rounds keys and values to 8 bits of mantissa (a relative error of at most 2^-9 each);
// int8 rounds each head's row to a step of max |x| / 127 (an error of at most 1/254 of the row's largest).
// The KvBytes of a position shrink accordingly (int8 rows carry a 4-byte scale per head); the format cannot
// change under a sequence that holds blocks.
class RoundedKvTest : public PagedKvTest {};

TEST_P(RoundedKvTest, NearTheFp32CacheInFewerBytes) {
  const kernels::KvFormat format = std::get<1>(GetParam());
  std::mt19937 rng(37);
  Tokens a = RandomTokens(rng, 150), probe = RandomTokens(rng, 4);
  for (Mode& m : probe.modes) m = Mode::kAttention;
  auto run = [&] {
    SequenceState seq = backend_->NewSequence();
    Logits(seq, a);
    return Logits(seq, probe);
  };
  const std::vector<float> rounded = run();
  const int64_t rounded_bytes = backend_->KvBytes(64);
  {  // a sequence with an fp32 cache of its own is refused, not read in the wrong format
    SequenceState foreign(backend_->config());
    std::vector<float> out;
    ForwardItem item{&foreign, probe.tokens, probe.modes, LogitsRows::kAll, &out, false};
    EXPECT_EQ(backend_->Forward(std::span(&item, 1)).code(), absl::StatusCode::kInvalidArgument);
  }
  ASSERT_TRUE(backend_->SetKvFormat(kernels::KvFormat::kF32).ok());
  const std::vector<float> f32 = run();
  const ModelConfig& c = backend_->config();
  EXPECT_EQ(backend_->KvBytes(64) * kernels::KvHeadRowElements(format, c.head_dim) * kernels::KvElementBytes(format),
            rounded_bytes * c.head_dim * 4);
  ASSERT_EQ(rounded.size(), f32.size());
  float scale = 0.f, worst = 0.f;
  for (size_t i = 0; i < f32.size(); ++i) {
    scale = std::max(scale, std::abs(f32[i]));
    worst = std::max(worst, std::abs(rounded[i] - f32[i]));
  }
  EXPECT_LE(worst, (format == kernels::KvFormat::kInt8 ? 3e-2f : 1e-2f) * scale);
  EXPECT_GT(worst, 1e-6f * scale) << "the rounded cache gave the fp32 cache's logits exactly";
  SequenceState holder = backend_->NewSequence();
  Logits(holder, a);
  EXPECT_EQ(backend_->SetKvFormat(format).code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(MixersAndKvFormats, PagedKvTest,
                         ::testing::Combine(::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn),
                                            ::testing::Values(kernels::KvFormat::kF32, kernels::KvFormat::kBf16,
                                                              kernels::KvFormat::kInt8)));
INSTANTIATE_TEST_SUITE_P(MixersAndKvFormats, RoundedKvTest,
                         ::testing::Combine(::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn),
                                            ::testing::Values(kernels::KvFormat::kBf16, kernels::KvFormat::kInt8)));

// The same batch on the same states gives the same bits however the states' buffers happen to lie in
// memory: a sequence rebuilt after other allocations moved the heap, forwarded again, matches exactly.
TEST_P(BackendTest, SameBatchOnTheSameStatesGivesTheSameBitsWhereverTheBuffersLie) {
  std::mt19937 rng(11);
  const Tokens prompt = RandomTokens(rng, 13), span = RandomTokens(rng, 5);
  std::vector<float> first;
  std::vector<std::vector<float>> ballast;  // shifts where the next run's buffers land
  for (int run = 0; run < 6; ++run) {
    ballast.emplace_back(1 + 3 * run);
    SequenceState seq = backend_->NewSequence();
    std::vector<float> out = Logits(seq, prompt);
    out = Logits(seq, span);
    if (run == 0) {
      first = out;
    } else {
      EXPECT_EQ(out, first) << "run " << run;
    }
  }
}

// The number of threads does not change a bit either: every product is split into fixed panels, and every
// (sequence, head) part runs whole on one thread.
TEST_P(BackendTest, ThreadCountDoesNotChangeTheBits) {
  std::mt19937 rng(13);
  const Tokens prompt = RandomTokens(rng, 21), span = RandomTokens(rng, 4);
  // Wider than TinyConfig, so that every product spans several panels (vocab 300, MLP 256).
  ModelConfig config = testutil::TinyConfig(GetParam());
  config.d_model = 64;
  config.n_heads = 2;
  config.head_dim = 32;
  config.mlp_hidden = 256;
  config.vocab_size = 300;
  testutil::WriteTinyCheckpoint(scratch_.Join("wide"), config, testutil::RandomTensors(config, DType::kF32, 9));
  std::vector<float> want;
  for (const int threads : {1, 2, 3, 5}) {
    auto b = CpuBackend::Load(scratch_.Join("wide"), threads);
    ASSERT_TRUE(b.ok()) << b.status();
    SequenceState seq = (*b)->NewSequence();
    std::vector<float> out;
    for (const Tokens* run : {&prompt, &span}) {
      ForwardItem item{&seq, run->tokens, run->modes, LogitsRows::kAll, &out, false};
      ASSERT_TRUE((*b)->Forward(std::span(&item, 1)).ok());
    }
    if (want.empty()) {
      want = out;
    } else {
      EXPECT_EQ(out, want) << threads << " threads";
    }
  }
}

// How much a sequence's logits move when the batch around it changes. The guarantee is the one above (same
// batch, same bits); a different batch may change the last bits (a wide batch takes the GEMM path, a narrow
// one a dot product per row) but never more than rounding. Prints whether the bits stayed the same, for
// the README's statement.
TEST_P(BackendTest, BatchAroundASequenceChangesItsLogitsOnlyByRounding) {
  std::mt19937 rng(12);
  const Tokens prompt = RandomTokens(rng, 6), step = RandomTokens(rng, 1);
  std::vector<Tokens> others;
  for (int i = 0; i < 15; ++i) others.push_back(RandomTokens(rng, 1 + i % 3));
  std::vector<float> alone;
  for (const int n_others : {0, 1, 3, 7, 15}) {
    std::vector<SequenceState> seqs;
    for (int i = 0; i <= n_others; ++i) seqs.push_back(backend_->NewSequence());
    Logits(seqs[0], prompt);
    std::vector<std::vector<float>> out(n_others + 1);
    std::vector<ForwardItem> items = {{&seqs[0], step.tokens, step.modes, LogitsRows::kAll, &out[0], false}};
    for (int i = 1; i <= n_others; ++i) {
      items.push_back({&seqs[i], others[i - 1].tokens, others[i - 1].modes, LogitsRows::kLast, &out[i], false});
    }
    ASSERT_TRUE(backend_->Forward(items).ok());
    if (n_others == 0) {
      alone = out[0];
      continue;
    }
    float worst = 0.f;
    for (size_t i = 0; i < alone.size(); ++i) worst = std::max(worst, std::abs(out[0][i] - alone[i]));
    std::printf("[batch composition] %s, %d other sequences: logits %s (max |difference| %.3g)\n",
                GetParam() == LinearMixer::kMamba2 ? "mamba2" : "gdn", n_others,
                out[0] == alone ? "bit-identical" : "differ in rounding", worst);
    EXPECT_LE(worst, 1e-5f) << n_others << " other sequences";
  }
}

// A forward whose every token attends leaves out the input projection's q_linear rows (an attending token's
// linear output is unused, and the recurrent state never reads q). On a config whose projection blocks fill
// whole panels (HD = 64, where the backend can skip them), a sequence's all-attention steps give the logits
// they give in a batch with a linear token, which computes q_linear, up to the rounding that batching
// brings (the test above): k, v, the gates or q_attn taken from the wrong rows would move them by O(1). And
// its next linear step, which reads the recurrent state those steps wrote, agrees too.
TEST_P(BackendTest, AllAttentionStepsSkipQLinearWithoutChangingTheLogits) {
  ModelConfig config = testutil::TinyConfig(GetParam());
  config.d_model = 64, config.n_heads = 2, config.head_dim = 32, config.mlp_hidden = 128;
  ASSERT_NO_FATAL_FAILURE(Load(config, "wide", 13));
  std::mt19937 rng(14);
  Tokens prompt = RandomTokens(rng, 7), steps = RandomTokens(rng, 3), linear_step = RandomTokens(rng, 1);
  steps.modes.assign(steps.modes.size(), Mode::kAttention);
  linear_step.modes.assign(1, Mode::kLinear);
  SequenceState alone = backend_->NewSequence(), batched = backend_->NewSequence(), other = backend_->NewSequence();
  Logits(alone, prompt);
  Logits(batched, prompt);
  Logits(other, prompt);
  for (size_t t = 0; t < steps.tokens.size(); ++t) {
    const Tokens step{{steps.tokens[t]}, {Mode::kAttention}};
    const std::vector<float> skipped = Logits(alone, step);
    std::vector<float> computed, unused;
    std::vector<ForwardItem> items = {
        {&batched, step.tokens, step.modes, LogitsRows::kAll, &computed, false},
        {&other, linear_step.tokens, linear_step.modes, LogitsRows::kAll, &unused, false}};
    ASSERT_TRUE(backend_->Forward(items).ok());
    ExpectNear(skipped, computed, 1e-5f, "attention step " + std::to_string(t));
  }
  ExpectNear(Logits(alone, linear_step), Logits(batched, linear_step), 1e-5f, "the linear step after them");
}

TEST_P(BackendTest, DraftSequenceRunsLinearModeLikeTheFullSequenceAndRefusesAttention) {
  std::mt19937 rng(8);
  SequenceState seq = backend_->NewSequence();
  Logits(seq, RandomTokens(rng, 9));
  SequenceState draft = seq.MakeDraft();
  EXPECT_FALSE(draft.has_kv());
  EXPECT_EQ(draft.kv_bytes(), 0);
  Tokens lin = RandomTokens(rng, 3);
  lin.modes.assign(3, Mode::kLinear);
  ExpectNear(Logits(draft, lin), Logits(seq, lin), 1e-6f, "draft vs full");
  Tokens attn = lin;
  attn.modes[1] = Mode::kAttention;
  std::vector<float> out;
  ForwardItem item{&draft, attn.tokens, attn.modes, LogitsRows::kLast, &out, false};
  EXPECT_EQ(backend_->Forward(std::span(&item, 1)).code(), absl::StatusCode::kInvalidArgument);
  // Refreshing the draft from the full sequence brings its state back in line.
  draft.CopyRecurrentFrom(seq);
  EXPECT_EQ(draft.position(), seq.position());
  ExpectNear(Logits(draft, lin), Logits(seq, lin), 1e-6f, "after CopyRecurrentFrom");
}

TEST_P(BackendTest, ReservedDecodeLoopAllocatesNothingAndKvHoldsItsReservedBlocks) {
  const ModelConfig& c = backend_->config();
  SequenceState seq = backend_->NewSequence();
  const int64_t total = 40, bt = seq.kv_block_tokens();
  const int64_t reserved = (total + bt - 1) / bt * bt;  // whole blocks
  ASSERT_TRUE(seq.Reserve(total).ok());
  EXPECT_EQ(seq.kv_bytes(), reserved * 2 * c.qk_dim() * c.n_layers * static_cast<int64_t>(sizeof(float)));
  std::vector<float> logits;
  std::vector<int32_t> prompt(8, 3);
  std::vector<Mode> modes(8, Mode::kAttention);
  ASSERT_TRUE(backend_->Forward(seq, prompt, modes, false, &logits).ok());
  int32_t token = 1;
  Mode mode = Mode::kAttention;
  ASSERT_TRUE(backend_->Forward(seq, std::span(&token, 1), std::span(&mode, 1), false, &logits).ok());  // warm-up
  g_allocations = 0;
  g_count_allocations = true;
  bool ok = true;
  for (int i = 0; i < 20 && ok; ++i) {
    mode = i % 3 ? Mode::kAttention : Mode::kLinear;
    ok = backend_->Forward(seq, std::span(&token, 1), std::span(&mode, 1), false, &logits).ok();
  }
  g_count_allocations = false;
  ASSERT_TRUE(ok);
  EXPECT_EQ(g_allocations.load(), 0);
  EXPECT_EQ(seq.kv_bytes(), reserved * 2 * c.qk_dim() * c.n_layers * static_cast<int64_t>(sizeof(float)));
}

TEST_P(BackendTest, BadBatchesAreErrorsThatTouchNoSequence) {
  SequenceState a = backend_->NewSequence(), b = backend_->NewSequence();
  std::vector<int32_t> ok = {1, 2}, bad = {1, kVocab};
  std::vector<Mode> modes(2, Mode::kAttention);
  std::vector<float> la, lb;
  std::vector<ForwardItem> items = {{&a, ok, modes, LogitsRows::kLast, &la, false},
                                    {&b, bad, modes, LogitsRows::kLast, &lb, false}};
  EXPECT_EQ(backend_->Forward(items).code(), absl::StatusCode::kInvalidArgument);
  items[1] = {&a, ok, modes, LogitsRows::kLast, &lb, false};
  EXPECT_EQ(backend_->Forward(items).code(), absl::StatusCode::kInvalidArgument);  // a twice
  items[1] = {&b, ok, modes, LogitsRows::kLast, nullptr, false};
  EXPECT_EQ(backend_->Forward(items).code(), absl::StatusCode::kInvalidArgument);  // nowhere for logits
  Sampler sampler(SamplingParams{});
  int32_t next = -1;
  items[1] = {&b, ok, modes, LogitsRows::kAll, nullptr, false, &sampler, &next};
  EXPECT_EQ(backend_->Forward(items).code(), absl::StatusCode::kInvalidArgument);  // a draw needs kLast
  items[1] = {&b, ok, modes, LogitsRows::kLast, nullptr, false, &sampler, nullptr};
  EXPECT_EQ(backend_->Forward(items).code(), absl::StatusCode::kInvalidArgument);  // nowhere for the token
  EXPECT_EQ(next, -1);
  EXPECT_EQ(a.position(), 0);
  EXPECT_EQ(b.position(), 0);
}

INSTANTIATE_TEST_SUITE_P(Mixers, BackendTest, ::testing::Values(LinearMixer::kMamba2, LinearMixer::kGdn),
                         [](const auto& info) { return std::string(LinearMixerName(info.param)); });

}  // namespace
}  // namespace oryx
