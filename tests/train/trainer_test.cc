// The trainer end to end on a tiny corpus made from this repository's own sources: it learns, a resumed
// run reproduces the uninterrupted one bit for bit, and bad inputs fail cleanly without losing work.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "base/file_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/train/testing_corpus.h"
#include "train/corpus.h"
#include "train/trainer.h"

namespace oryx::train {
namespace {

namespace fs = std::filesystem;

std::string Root() {
  static const std::string root = [] {
    auto dir = fs::temp_directory_path() / ("oryx_trainer_test_" + std::to_string(getpid()));
    fs::create_directories(dir);
    return dir.string();
  }();
  return root;
}

// A corpus of the repo's engine/ and tasks/ sources, tokenised with vocab 512.
const std::string& Corpus() {
  static const std::string dir = PrepareSourceCorpus(Root());
  return dir;
}

TrainOptions Tiny(const std::string& out) {
  TrainOptions o;
  o.data_dir = Corpus();
  o.out_dir = out;
  ModelConfig& m = o.model;
  m.d_model = 64;
  m.n_layers = 2;
  m.n_heads = 2;
  m.head_dim = 32;
  m.mlp_hidden = 128;
  m.rope_theta = 10000;
  m.tie_embeddings = true;
  m.fragment_len = 16;
  m.attn_fraction = 0.25;
  o.seq_len = 64;
  o.batch_size = 8;
  o.warmup_steps = 10;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.eval_every = 0;
  o.eval_sequences = 8;
  o.log_every = 1;
  o.threads = 1;
  o.device = "cpu";
  return o;
}

std::vector<nlohmann::json> LogLines(const std::string& out, const std::string& event) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(out + "/log.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == event) lines.push_back(j);
  }
  return lines;
}

TEST(Trainer, LowersValidationLossWellBelowUniformInEveryMode) {
  TrainOptions o = Tiny(Root() + "/smoke");
  o.steps = 200;
  o.checkpoint_every = 0;
  ASSERT_TRUE(Train(o).ok());
  auto evals = LogLines(o.out_dir, "eval");
  ASSERT_EQ(evals.size(), 1u);
  const double uniform = std::log(512.0);  // 6.24
  // Measured on this corpus after 200 steps: 3.59 (attention), 3.50 (linear), 3.52 (mixed).
  for (const char* mode : {"val_loss_attention", "val_loss_linear", "val_loss_mixed"}) {
    EXPECT_LT(evals[0][mode].get<double>(), 4.0) << mode << " (uniform: " << uniform << ")";
  }
  EXPECT_TRUE(fs::exists(o.out_dir + "/model/config.json"));
  EXPECT_TRUE(fs::exists(o.out_dir + "/model/tokenizer.model"));
}

TEST(Trainer, ResumedRunReproducesUninterruptedLossesBitForBit) {
  TrainOptions whole = Tiny(Root() + "/whole");
  whole.steps = 12;
  whole.task_fraction = 0.25;  // task sequences are part of the replayed data too
  ASSERT_TRUE(Train(whole).ok());

  TrainOptions first = whole;
  first.out_dir = Root() + "/resumed";
  first.checkpoint_every = 5;
  first.time_limit_s = 1e-9;  // stops after its first step
  ASSERT_TRUE(Train(first).ok());
  TrainOptions second = first;
  second.time_limit_s = 0;
  second.resume = true;
  ASSERT_TRUE(Train(second).ok());

  auto a = LogLines(whole.out_dir, "step"), b = LogLines(first.out_dir, "step");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);  // step 1 from the first run, 2..12 from the resumed one
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << a[i]["step"];
  }
}

// ORYX_PROFILE_TRACE records steps 4..6 as a Chrome trace of the host ops (and on CUDA, the kernels).
TEST(Trainer, ProfileTraceIsAChromeTraceOfTheTrainingOps) {
  TrainOptions o = Tiny(Root() + "/trace");
  o.steps = 7;
  o.save = false;
  const std::string trace = Root() + "/trace.json";
  ASSERT_EQ(setenv("ORYX_PROFILE_TRACE", trace.c_str(), 1), 0);
  const absl::Status status = Train(o);
  unsetenv("ORYX_PROFILE_TRACE");
  ASSERT_TRUE(status.ok()) << status;
  std::ifstream in(trace);
  ASSERT_TRUE(in.good()) << trace;
  const auto json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(json.is_discarded()) << trace << " is not JSON";
  int ops = 0, backward = 0;
  for (const auto& e : json["traceEvents"]) {
    if (e.value("cat", "") != "cpu_op") continue;
    ++ops;
    if (e.value("name", "").find("evaluate_function") != std::string::npos) ++backward;
  }
  EXPECT_GT(ops, 1000) << "too few host ops for three training steps";
  EXPECT_GT(backward, 100) << "no autograd backward in the trace";
}

TEST(Trainer, ResumeFromACheckpointOfAnotherConfigIsRefused) {
  TrainOptions o = Tiny(Root() + "/other_config");
  o.steps = 2;
  ASSERT_TRUE(Train(o).ok());
  o.resume = true;
  o.steps = 4;
  o.model.n_layers = 3;
  absl::Status s = Train(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("another config (n_layers: checkpoint 2, this run 3)"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("d_model"), std::string::npos) << "fields that agree are not listed: " << s;
}

// An optional field the checkpoint has and this run lacks (config.json writes it only when set) is named too.
TEST(Trainer, ResumeWithoutTheCheckpointsQueryScaleNamesIt) {
  TrainOptions o = Tiny(Root() + "/other_scale");
  o.steps = 2;
  o.model.attn_log_scale_base = 16;
  ASSERT_TRUE(Train(o).ok());
  o.resume = true;
  o.steps = 4;
  o.model.attn_log_scale_base = 0;
  absl::Status s = Train(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("another config (attn_log_scale_base: checkpoint 16, this run (none))"), std::string::npos)
      << s;
}

// A later stage may train a model with another attention share or fragment length (they record how it was
// trained), or with another RoPE base, context or query scale, but not change its shape.
TEST(Trainer, InitFromTakesAnotherTrainingMixOrPositionsButNotAnotherShape) {
  TrainOptions first = Tiny(Root() + "/init_first");
  first.steps = 2;
  ASSERT_TRUE(Train(first).ok());

  TrainOptions later = Tiny(Root() + "/init_later");
  later.steps = 2;
  later.init_from = first.out_dir + "/model";
  later.model.attn_fraction = 1.0;
  later.model.fragment_len = 32;
  later.model.rope_theta = 4 * first.model.rope_theta;
  later.model.max_position = 256;  // (first: the seq_len, 64)
  later.model.attn_log_scale_base = 16;
  absl::Status s = Train(later);
  ASSERT_TRUE(s.ok()) << s;
  std::ifstream in(later.out_dir + "/model/config.json");
  const auto config = nlohmann::json::parse(in);
  EXPECT_EQ(config["attn_fraction"].get<double>(), 1.0);
  EXPECT_EQ(config["fragment_len"].get<int64_t>(), 32);
  EXPECT_EQ(config["rope_theta"].get<double>(), 4 * first.model.rope_theta);
  EXPECT_EQ(config["max_position"].get<int64_t>(), 256);
  EXPECT_EQ(config["attn_log_scale_base"].get<int64_t>(), 16);
  EXPECT_FALSE(
      nlohmann::json::parse(std::ifstream(first.out_dir + "/model/config.json")).contains("attn_log_scale_base"));

  TrainOptions other = Tiny(Root() + "/init_other");
  other.steps = 2;
  other.init_from = first.out_dir + "/model";
  other.model.n_layers = 3;
  s = Train(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("another config (n_layers: checkpoint 2, this run 3)"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("d_model"), std::string::npos) << "fields that agree are not listed: " << s;
}

TEST(Trainer, ResumeWithAnotherTaskMixIsRefused) {
  TrainOptions o = Tiny(Root() + "/other_mix");
  o.steps = 2;
  ASSERT_TRUE(Train(o).ok());
  o.resume = true;
  o.steps = 4;
  o.task_weights = "copy=1";  // the data would change under the checkpoint
  absl::Status s = Train(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("task_weights"), std::string::npos) << s;
  o.task_weights.clear();
  o.copy_answer_length = 64;
  s = Train(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("copy_lengths"), std::string::npos) << s;
}

TEST(Trainer, StartingOverAnExistingCheckpointWithoutResumeIsRefused) {
  TrainOptions o = Tiny(Root() + "/no_overwrite");
  o.steps = 1;
  ASSERT_TRUE(Train(o).ok());
  absl::Status s = Train(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("--resume"), std::string::npos) << s;
}

TEST(Trainer, DataDirectoryWithoutShardsIsAClearError) {
  const std::string empty = Root() + "/empty_data";
  fs::create_directories(empty);
  TrainOptions o = Tiny(Root() + "/no_data");
  o.data_dir = empty;
  absl::Status s = Train(o);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("manifest.json"), std::string::npos) << s;
}

TEST(Trainer, NonFiniteLossStopsAndKeepsTheLastGoodCheckpoint) {
  TrainOptions o = Tiny(Root() + "/nan");
  o.steps = 50;
  o.warmup_steps = 0;
  o.lr = 1e30;  // the first update throws every weight to ~1e30: the loss overflows
  o.checkpoint_every = 1;
  absl::Status s = Train(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("Last good checkpoint"), std::string::npos) << s;
  std::ifstream in(o.out_dir + "/checkpoint/state.json");
  auto state = nlohmann::json::parse(in);
  EXPECT_GE(state["step"].get<int64_t>(), 1);
  EXPECT_LT(state["step"].get<int64_t>(), 50);
}

TEST(Trainer, ContradictoryOptionsAreRejected) {
  TrainOptions o = Tiny(Root() + "/bad");
  o.seq_len = 1000;
  o.model.max_position = 128;
  EXPECT_EQ(Train(o).code(), absl::StatusCode::kInvalidArgument);
  o = Tiny(Root() + "/bad2");
  o.model.attn_fraction = 1.5;
  EXPECT_FALSE(Train(o).ok());
}

// A window far longer than the corpus's documents is refused before anything is written, unless asked for.
TEST(Trainer, WindowsMuchLongerThanTheDocumentsAreRefused) {
  TrainOptions o = Tiny(Root() + "/short-docs");
  o.seq_len = 16384;
  o.model.max_position = 16384;
  const absl::Status s = Train(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("--min-document-bytes"), std::string::npos) << s;
  EXPECT_FALSE(fs::exists(o.out_dir + "/checkpoint"));
}

// Removes the temporary corpus and runs when the test binary ends.
class CleanupEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { (void)RemoveTree(Root()); }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new CleanupEnvironment);

}  // namespace
}  // namespace oryx::train
