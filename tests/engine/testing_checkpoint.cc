// Test helpers for checkpoint IO (see testing_checkpoint.h).
#include "tests/engine/testing_checkpoint.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/checkpoint.h"
#include "engine/cpu_backend.h"
#include "engine/sampler.h"
#include "engine/tensor_names.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"

namespace oryx::testutil {

std::string WriteTinyModelWithTokenizer(const ScratchDir& dir, uint32_t seed, int64_t max_position) {
  const char* src = std::getenv("ORYX_SOURCE_DIR");
  TokenizerTrainOptions t;
  t.input_files = {std::string(src != nullptr ? src : ".") + "/tests/data/tokenizer_corpus.txt"};
  t.vocab_size = 512;
  t.out_path = dir.Join("tok.model");
  const absl::Status trained = TrainTokenizer(t);
  EXPECT_TRUE(trained.ok()) << trained;
  ModelConfig c = TinyConfig(LinearMixer::kMamba2);
  c.vocab_size = 512;
  c.max_position = max_position;
  std::vector<HostTensor> tensors = RandomTensors(c, DType::kF32, seed);
  const absl::Status written = WriteCheckpoint(dir.Join("model"), c, Views(tensors), kDefaultMaxShardBytes, t.out_path);
  EXPECT_TRUE(written.ok()) << written;
  return dir.Join("model");
}

ModelConfig TinyConfig(LinearMixer mixer, bool tie_embeddings) {
  ModelConfig c;
  c.vocab_size = 32;
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.head_dim = 4;
  c.linear_mixer = mixer;
  c.conv_width = 4;
  c.conv_activation = mixer == LinearMixer::kGdn ? ConvActivation::kSilu : ConvActivation::kIdentity;
  c.mlp_hidden = 16;
  c.rope_theta = 10000;
  c.norm_eps = 1e-5;
  c.tie_embeddings = tie_embeddings;
  c.max_position = 64;
  c.fragment_len = 16;
  c.attn_fraction = 0.25;
  c.bos_id = 1;
  c.eos_id = 2;
  c.pad_id = 0;
  return c;
}

std::vector<HostTensor> RandomTensors(const ModelConfig& config, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<HostTensor> tensors;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    int64_t numel = 1;
    for (int64_t d : spec.shape) numel *= d;
    std::vector<float> values(numel);
    for (float& v : values) v = uniform(rng);
    tensors.push_back(MakeHostTensor(spec.name, spec.shape, values, dtype));
  }
  return tensors;
}

ScratchDir::ScratchDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "oryx_ckpt_test_XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) std::abort();
  path_ = pattern;
}

// RemoveTree, not std::filesystem::remove_all: binaries that link the torch wheel get its own copy of the
// latter, which crashes on non-empty directories.
ScratchDir::~ScratchDir() { (void)RemoveTree(path_); }

std::string ScratchDir::Join(std::string_view name) const { return path_ + "/" + std::string(name); }

void WriteRawFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) ADD_FAILURE() << "cannot write " << path;
}

std::string ReadRawFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string SafetensorsImage(std::string_view header_json, std::string_view data) {
  std::string out(8, '\0');
  const uint64_t len = header_json.size();
  std::memcpy(out.data(), &len, 8);
  out.append(header_json);
  out.append(data);
  return out;
}

void WriteTinyCheckpoint(const std::string& dir, const ModelConfig& config,
                         const std::vector<HostTensor>& tensors, uint64_t max_shard_bytes) {
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  const std::string tokenizer = base + ".tokenizer.model";
  WriteRawFile(tokenizer, "not a real sentencepiece model");
  std::vector<TensorView> views = Views(tensors);
  absl::Status s = WriteCheckpoint(dir, config, views, max_shard_bytes, tokenizer);
  std::remove(tokenizer.c_str());
  ASSERT_TRUE(s.ok()) << s;
}

std::vector<HostTensor> ReadAllTensors(const std::string& safetensors_path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(safetensors_path);
  if (!file.ok()) {
    ADD_FAILURE() << file.status();
    return {};
  }
  std::vector<HostTensor> tensors;
  for (const TensorInfo& info : file->header().tensors) {
    TensorView v = file->View(info);
    tensors.push_back(HostTensor{info.name, info.dtype, info.shape, {v.bytes.begin(), v.bytes.end()}});
  }
  return tensors;
}

std::unique_ptr<Backend> TinyBackend(const ScratchDir& scratch, LinearMixer mixer, uint32_t seed,
                                     int64_t max_position) {
  ModelConfig config = TinyConfig(mixer);
  if (max_position > 0) config.max_position = max_position;
  // "m<seed>": tests load the same checkpoint into a second backend from there.
  const std::string dir = scratch.Join(max_position > 0 ? Cat("m", seed, "-", max_position) : Cat("m", seed));
  WriteTinyCheckpoint(dir, config, RandomTensors(config, DType::kF32, seed));
  auto backend = CpuBackend::Load(dir, /*threads=*/1);
  if (!backend.ok()) {
    ADD_FAILURE() << backend.status();
    std::abort();
  }
  return std::move(*backend);
}

Engine TinyEngine(const ScratchDir& scratch, LinearMixer mixer, uint32_t seed) {
  return Engine(TinyBackend(scratch, mixer, seed), std::nullopt);
}

void ExpectBackendDrawsAreTheSamplersDraws(Backend& backend, const SamplingParams& params, bool one_returns_logits,
                                           int sequences) {
  ASSERT_TRUE(sequences >= 1 && sequences <= 3 && (!one_returns_logits || sequences == 3)) << sequences;
  const int n = sequences;
  const int64_t V = backend.config().vocab_size;
  std::vector<SequenceState> drawn, host;
  std::vector<Sampler> drawn_samplers, host_samplers;
  std::vector<int32_t> drawn_next = {1, 2, 3}, host_next = {1, 2, 3};
  drawn_next.resize(n), host_next.resize(n);
  for (int b = 0; b < n; ++b) {
    drawn.push_back(backend.NewSequence());
    host.push_back(backend.NewSequence());
    SamplingParams p = params;
    p.seed += b;
    drawn_samplers.emplace_back(p);
    host_samplers.emplace_back(p);
  }
  std::vector<std::vector<float>> logits(n);
  std::vector<float> returned;  // the middle sequence's logits, when it returns them beside the others' draws
  std::vector<LogitStats> stats(n);
  int64_t not_argmax = 0;
  for (int step = 0; step < 10; ++step) {
    const std::vector<Mode> modes = {step % 2 ? Mode::kLinear : Mode::kAttention, Mode::kLinear, Mode::kAttention};
    // The middle sequence, returning logits, runs a verify-like span: two tokens, both rows, states kept.
    const std::array<int32_t, 2> middle_span = {drawn_next[std::min(1, n - 1)], 5};
    const std::array<Mode, 2> middle_modes = {Mode::kAttention, Mode::kAttention};
    std::vector<ForwardItem> by_backend, by_host;
    for (int i = 0; i < n; ++i) {
      if (one_returns_logits && i == 1) {
        by_backend.push_back({&drawn[i], middle_span, middle_modes, LogitsRows::kAll, &returned, true});
        by_host.push_back({&host[i], middle_span, middle_modes, LogitsRows::kAll, &logits[i], true});
        continue;
      }
      by_backend.push_back({&drawn[i], std::span(&drawn_next[i], 1), std::span(&modes[i], 1), LogitsRows::kLast,
                            nullptr, false, &drawn_samplers[i], &drawn_next[i], &stats[i]});
      by_host.push_back({&host[i], std::span(&host_next[i], 1), std::span(&modes[i], 1), LogitsRows::kLast, &logits[i],
                         false});
    }
    ASSERT_TRUE(backend.Forward(by_backend).ok());
    ASSERT_TRUE(backend.Forward(by_host).ok());
    for (int i = 0; i < n; ++i) {
      if (one_returns_logits && i == 1) {  // the same rows as a batch that returns every row's logits
        ASSERT_EQ(logits[i].size(), static_cast<size_t>(2 * V));
        ASSERT_EQ(returned.size(), logits[i].size()) << "step " << step;
        float worst = 0.f;
        for (size_t j = 0; j < returned.size(); ++j) worst = std::max(worst, std::abs(returned[j] - logits[i][j]));
        EXPECT_LE(worst, 1e-5f) << "step " << step << ": the middle sequence's logits differ";
        const std::span<const float> last(logits[i].data() + V, V);
        drawn_next[i] = drawn_samplers[i].Next(std::span(returned.data() + V, V));
        host_next[i] = host_samplers[i].Next(last);
        continue;
      }
      ASSERT_EQ(logits[i].size(), static_cast<size_t>(V));
      // The statistics beside the draw: the host's of the same logits.
      const LogitStats want = LogitStatsOf(logits[i]);
      EXPECT_NEAR(stats[i].entropy, want.entropy, 1e-4 * std::max(1.0, want.entropy)) << "step " << step;
      EXPECT_NEAR(stats[i].margin, want.margin, 1e-5 * std::max(1.0, want.margin)) << "step " << step;
      stats[i] = {};
      host_next[i] = host_samplers[i].Next(logits[i]);
      not_argmax += host_next[i] != std::max_element(logits[i].begin(), logits[i].end()) - logits[i].begin();
    }
    ASSERT_EQ(drawn_next, host_next) << "step " << step;
  }
  for (int i = 0; i < n; ++i) EXPECT_EQ(drawn_samplers[i].Uniform(), host_samplers[i].Uniform()) << "streams apart";
  if (!params.greedy()) {
    EXPECT_GT(not_argmax, 0) << "sampling drew only argmaxes: nothing was compared";
  }
}

absl::Status HostRoundsBackend::SpeculativeRound(std::span<const RoundItem> items, int64_t k) {
  ++rounds;
  const int64_t V = config().vocab_size;
  std::vector<float> logits;
  for (const RoundItem& it : items) {
    if (!it.sampler->params().greedy()) return absl::UnimplementedError("greedy rounds only");
    RoundResult& r = *it.result;
    r.drafts.clear();
    r.cut = false;  // (the decoder cuts the sequence)
    it.draft->CopyRecurrentFrom(*it.seq);
    int32_t x = it.pending;
    for (int64_t j = 0; j < k; ++j) {
      const Mode linear = Mode::kLinear;
      ORYX_RETURN_IF_ERROR(inner_->Forward(*it.draft, std::span(&x, 1), std::span(&linear, 1), false, &logits));
      x = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      r.drafts.push_back(x);
    }
    std::vector<int32_t> span = {it.pending};
    span.insert(span.end(), r.drafts.begin(), r.drafts.end());
    const std::vector<Mode> modes(span.size(), Mode::kAttention);
    const ForwardItem verify{it.seq, span, modes, LogitsRows::kAll, &logits, /*keep_states=*/true};
    ORYX_RETURN_IF_ERROR(inner_->Forward(std::span(&verify, 1)));
    r.targets.clear();
    for (int64_t row = 0; row <= k; ++row) {
      const auto first = logits.begin() + row * V;
      r.targets.push_back(static_cast<int32_t>(std::max_element(first, first + V) - first));
    }
  }
  return absl::OkStatus();
}

// Runs `batch` to its end, adding the requests one every `every` steps while the earlier ones decode, and
// calling after_step after each step; the results in the requests' order (empty after a failed step).
std::vector<GenerateResult> RunJoining(GenerationBatch& batch, const std::vector<GenerateRequest>& qs, size_t every,
                                       const std::function<void(size_t step)>& after_step) {
  std::vector<GenerateResult> got(qs.size());
  for (size_t next = 0, step = 0; batch.active() > 0 || next < qs.size(); ++step) {
    if (next < qs.size() && step % every == 0) {
      EXPECT_TRUE(batch.Add(qs[next++]).ok());
    }
    const absl::Status status = batch.Step();
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) return {};
    after_step(step);
    for (auto& [id, r] : batch.TakeFinished()) got[id] = std::move(r);
  }
  return got;
}

GenerateResult ExpectSpeculativeLogprobsAreAttentions(Engine& engine, GenerateRequest q, const std::string& speculative,
                                                      double tolerance) {
  q.policy = "attention";
  auto want = engine.Generate(q);
  q.policy = speculative;
  auto got = engine.Generate(q);
  EXPECT_TRUE(want.ok() && got.ok());
  if (!want.ok() || !got.ok()) return {};
  EXPECT_EQ(got->tokens, want->tokens);
  EXPECT_GT(got->stats.spec->drafted, 0);
  EXPECT_EQ(got->logprobs.size(), got->tokens.size());
  EXPECT_EQ(got->logprobs.size(), want->logprobs.size());
  for (size_t i = 0; i < want->logprobs.size() && i < got->logprobs.size(); ++i) {
    EXPECT_NEAR(*got->logprobs[i].logprob, *want->logprobs[i].logprob, tolerance) << "token " << i;
    EXPECT_LE(*got->logprobs[i].logprob, 0.0);
    EXPECT_EQ(got->logprobs[i].top.size(), static_cast<size_t>(q.logprobs));
    for (size_t k = 1; k < got->logprobs[i].top.size(); ++k) {
      EXPECT_GE(got->logprobs[i].top[k - 1].second, got->logprobs[i].top[k].second);
    }
  }
  EXPECT_EQ(got->prompt_logprobs.size(), want->prompt_logprobs.size());
  for (size_t i = 1; i < want->prompt_logprobs.size() && i < got->prompt_logprobs.size(); ++i) {
    EXPECT_NEAR(*got->prompt_logprobs[i].logprob, *want->prompt_logprobs[i].logprob, tolerance) << "prompt token " << i;
  }
  return *got;
}

}  // namespace oryx::testutil
