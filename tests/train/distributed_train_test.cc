// Data-parallel `oryx train` end to end, over Gloo on the CPU: the oryx-torch binary run as a job of two
// ranks (--nproc, or processes given the torchrun-style environment) on a tiny model and corpus. Two ranks
// train exactly as one process accumulating both ranks' micro-batches, a checkpoint of two ranks resumes
// on one, and a rank that dies ends the job with an error inside the timeout, after which --resume goes on.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/file_util.h"
#include "engine/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/train/testing_corpus.h"

extern char** environ;

namespace oryx {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

std::string Root() {
  static const std::string root = [] {
    auto dir = fs::temp_directory_path() / ("oryx_distributed_test_" + std::to_string(getpid()));
    fs::create_directories(dir);
    return dir.string();
  }();
  return root;
}

const std::string& Corpus() {
  static const std::string dir = train::PrepareSourceCorpus(Root());
  return dir;
}

std::string OryxTorch() {
  const char* bin = std::getenv("ORYX_BINARY_DIR");
  EXPECT_NE(bin, nullptr) << "ORYX_BINARY_DIR is not set (run through ctest)";
  return std::string(bin) + "/bin/oryx-torch";
}

// `oryx-torch train` with a tiny model (133K parameters), one thread per rank, and `extra`.
std::vector<std::string> TrainArgs(const std::string& out, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {OryxTorch(), "train", "--data", Corpus(), "--out", out};
  std::istringstream flags(
      "--d-model 64 --layers 2 --heads 2 --head-dim 32 --mlp-hidden 128 --fragment-len 16 --seq-len 64 --warmup 10 "
      "--eval-every 0 --eval-sequences 1 --log-every 1 --threads 1 --device cpu --allow-short-documents "
      "--dist-timeout 20");
  for (std::string word; flags >> word;) args.push_back(word);
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// A child process with its stderr in a file.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::vector<std::string>& env, const std::string& stderr_path)
      : stderr_path_(stderr_path) {
    std::vector<std::string> words = argv, vars;
    for (char** e = environ; *e != nullptr; ++e) vars.emplace_back(*e);
    vars.insert(vars.end(), env.begin(), env.end());
    std::vector<char*> argp, envp;
    for (auto& w : words) argp.push_back(w.data());
    for (auto& v : vars) envp.push_back(v.data());
    argp.push_back(nullptr);
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    EXPECT_EQ(posix_spawn(&pid_, argp[0], &actions, nullptr, argp.data(), envp.data()), 0) << argv[0];
    posix_spawn_file_actions_destroy(&actions);
  }
  ~Process() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }
  // The wait status once it has ended, or nullopt if it runs on after `seconds` (then it is killed).
  std::optional<int> Wait(double seconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    while (!status_) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = status;
      } else if (Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        pid_ = -1;
        return std::nullopt;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return status_;
  }
  std::string Stderr() const {
    std::ifstream in(stderr_path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  std::string stderr_path_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

// Runs to the end (at most two minutes); the exit code, or -1 when killed or timed out.
int RunToEnd(const std::vector<std::string>& argv, const std::string& stderr_path,
             const std::vector<std::string>& env = {}) {
  Process p(argv, env, stderr_path);
  const std::optional<int> status = p.Wait(120);
  const int code = status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  if (code != 0) ADD_FAILURE() << argv[1] << " exited with " << code << ":\n" << p.Stderr();
  return code;
}

std::vector<Json> LogLines(const std::string& out, const std::string& event) {
  std::vector<Json> lines;
  std::ifstream in(out + "/log.jsonl");
  for (std::string line; std::getline(in, line);) {
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j["event"] == event) lines.push_back(j);
  }
  return lines;
}

// The largest |a - b| over the tensors of two checkpoints' model.safetensors (which must name the same ones).
double MaxWeightDifference(const std::string& a_dir, const std::string& b_dir) {
  auto a = SafetensorsFile::Open(a_dir + "/checkpoint/model/model.safetensors");
  auto b = SafetensorsFile::Open(b_dir + "/checkpoint/model/model.safetensors");
  EXPECT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(b.ok()) << b.status();
  if (!a.ok() || !b.ok()) return INFINITY;
  EXPECT_EQ(a->header().tensors.size(), b->header().tensors.size());
  double worst = 0;
  for (const TensorInfo& info : a->header().tensors) {
    const TensorInfo* other = b->Find(info.name);
    EXPECT_NE(other, nullptr) << info.name;
    if (other == nullptr) return INFINITY;
    const std::vector<float> x = TensorToFloats(a->View(info)), y = TensorToFloats(b->View(*other));
    EXPECT_EQ(x.size(), y.size()) << info.name;
    for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) worst = std::max(worst, std::fabs(double(x[i]) - y[i]));
  }
  return worst;
}

// Two ranks x micro-batch 4: the reference run for the tests below (20 steps).
const std::string& TwoRankRun() {
  static const std::string out = [] {
    const std::string dir = Root() + "/two_ranks";
    RunToEnd(TrainArgs(dir, {"--nproc", "2", "--batch", "4", "--accum", "1", "--steps", "20"}), dir + ".err");
    return dir;
  }();
  return out;
}

TEST(DistributedTrain, TwoRanksTrainAsOneProcessAccumulatingBothMicroBatches) {
  const std::string two = TwoRankRun(), one = Root() + "/one_rank_accum2";
  ASSERT_EQ(RunToEnd(TrainArgs(one, {"--batch", "4", "--accum", "2", "--steps", "20"}), one + ".err"), 0);
  const auto a = LogLines(two, "step"), b = LogLines(one, "step");
  ASSERT_EQ(a.size(), 20u) << "one progress line per step, from rank 0 alone";
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-6) << "step " << a[i]["step"];
  }
  EXPECT_LE(MaxWeightDifference(two, one), 1e-6);
  const auto start = LogLines(two, "start");
  ASSERT_EQ(start.size(), 1u);
  EXPECT_EQ(start[0]["world_size"], 2);
  EXPECT_EQ(start[0]["dist_backend"], "gloo");
  // The data of a step is both ranks' (not one rank's twice): one rank alone, accumulating nothing, differs.
  const std::string alone = Root() + "/one_rank_accum1";
  ASSERT_EQ(RunToEnd(TrainArgs(alone, {"--batch", "4", "--accum", "1", "--steps", "20"}), alone + ".err"), 0);
  EXPECT_GT(MaxWeightDifference(two, alone), 1e-3);
}

TEST(DistributedTrain, OneRankResumesATwoRankCheckpointWithTheSameLosses) {
  const std::string two = TwoRankRun(), resumed = Root() + "/resumed_on_one";
  // Two ranks stop after their first step (the time limit) with a checkpoint; one rank goes on.
  ASSERT_EQ(RunToEnd(TrainArgs(resumed, {"--nproc", "2", "--batch", "4", "--steps", "20", "--time-limit", "1e-9"}),
                     resumed + ".err"),
            0);
  ASSERT_EQ(LogLines(resumed, "step").size(), 1u);
  ASSERT_EQ(
      RunToEnd(TrainArgs(resumed, {"--batch", "4", "--accum", "2", "--steps", "20", "--resume"}), resumed + ".err2"),
      0);
  const auto a = LogLines(two, "step"), b = LogLines(resumed, "step");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-6) << "step " << a[i]["step"];
  }
  EXPECT_LE(MaxWeightDifference(two, resumed), 1e-6);
  // A split of the step that changes its data is refused: 1 rank x 1 micro-batch is not 2 x 1.
  const std::string refused = Root() + "/resumed_on_one.refused";
  Process p(TrainArgs(resumed, {"--batch", "4", "--accum", "1", "--steps", "20", "--resume"}), {}, refused);
  const std::optional<int> status = p.Wait(60);
  ASSERT_TRUE(status && WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  EXPECT_NE(p.Stderr().find("--accum x ranks"), std::string::npos) << p.Stderr();
}

// The pids of `parent`'s children whose environment has `variable`.
std::vector<pid_t> ChildrenWith(pid_t parent, const std::string& variable) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(line.substr(paren + 2));
    char state;
    pid_t ppid = 0;
    fields >> state >> ppid;
    if (ppid != parent) continue;
    std::ifstream env(e.path() / "environ");
    for (std::string v; std::getline(env, v, '\0');) {
      if (v == variable) pids.push_back(std::stoi(name));
    }
  }
  return pids;
}

// Waits until OUT/log.jsonl has `count` lines of `event` (at most a minute).
bool WaitForLog(const std::string& out, const std::string& event, size_t count) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    if (LogLines(out, event).size() >= count) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

TEST(DistributedTrain, AKilledRankEndsTheJobAndResumeContinuesFromTheLastCheckpoint) {
  const std::string out = Root() + "/killed";
  Process job(TrainArgs(out, {"--nproc", "2", "--batch", "4", "--steps", "100000", "--checkpoint-every", "5"}), {},
              out + ".err");
  ASSERT_TRUE(WaitForLog(out, "checkpoint", 2)) << job.Stderr();
  const std::vector<pid_t> rank1 = ChildrenWith(job.pid(), "RANK=1");
  ASSERT_EQ(rank1.size(), 1u);
  ASSERT_EQ(::kill(rank1[0], SIGKILL), 0);
  const auto killed = Clock::now();
  const std::optional<int> status = job.Wait(60);
  const double seconds = std::chrono::duration<double>(Clock::now() - killed).count();
  ASSERT_TRUE(status.has_value());
  EXPECT_LT(seconds, 20) << "the job outlived the 20 s timeout";
  ASSERT_TRUE(WIFEXITED(*status)) << "the job was killed by signal " << WTERMSIG(*status) << "\n" << job.Stderr();
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  EXPECT_NE(job.Stderr().find("rank 1 of 2 (pid " + std::to_string(rank1[0]) + ") was killed by signal 9"),
            std::string::npos)
      << job.Stderr();
  EXPECT_TRUE(ChildrenWith(job.pid(), "RANK=0").empty()) << "rank 0 outlived the job";

  std::ifstream state_file(out + "/checkpoint/state.json");
  const int64_t saved = Json::parse(state_file)["step"].get<int64_t>();
  ASSERT_GE(saved, 10);
  ASSERT_EQ(saved % 5, 0);
  const std::string steps = std::to_string(saved + 3);
  ASSERT_EQ(RunToEnd(TrainArgs(out, {"--batch", "4", "--accum", "2", "--steps", steps, "--resume"}), out + ".resume"),
            0);
  const auto starts = LogLines(out, "start");
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[1]["start_step"].get<int64_t>(), saved);
  EXPECT_EQ(LogLines(out, "step").back()["step"].get<int64_t>(), saved + 3);
}

// Whether process `pid` ignores signal `sig` (the SigIgn mask of /proc/PID/status).
bool IgnoresSignal(pid_t pid, int sig) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigIgn:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  }
  ADD_FAILURE() << "no SigIgn line in /proc/" << pid << "/status";
  return false;
}

// A free TCP port of the loopback, for a job started without --nproc.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Ranks started as torchrun starts them, with no launcher to stop the others: c10d itself must notice.
TEST(DistributedTrain, WithoutALauncherTheSurvivorOfAKilledRankStopsWithinTheTimeout) {
  const std::string out = Root() + "/no_launcher", port = std::to_string(FreePort());
  auto env = [&](int rank) {
    return std::vector<std::string>{"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank),
                                    "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port};
  };
  const auto args = TrainArgs(out, {"--batch", "4", "--steps", "100000", "--checkpoint-every", "0"});
  Process rank0(args, env(0), out + ".rank0"), rank1(args, env(1), out + ".rank1");
  ASSERT_TRUE(WaitForLog(out, "step", 3)) << rank0.Stderr() << rank1.Stderr();
  // Gloo writes with writev, which cannot suppress SIGPIPE: a rank that has not ignored it dies by that
  // signal, instead of reporting the error, when it writes to the killed peer before reading from it.
  EXPECT_TRUE(IgnoresSignal(rank0.pid(), SIGPIPE)) << "rank 0 would die by SIGPIPE when its peer goes away";
  ASSERT_EQ(::kill(rank1.pid(), SIGKILL), 0);
  const auto killed = Clock::now();
  const std::optional<int> status = rank0.Wait(60);
  const double seconds = std::chrono::duration<double>(Clock::now() - killed).count();
  ASSERT_TRUE(status.has_value());
  EXPECT_LT(seconds, 20) << "rank 0 outlived the 20 s timeout";
  ASSERT_TRUE(WIFEXITED(*status)) << "rank 0 was killed by signal " << WTERMSIG(*status) << "\n" << rank0.Stderr();
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  EXPECT_NE(rank0.Stderr().find("oryx: error: rank 0 of 2: a collective operation failed"), std::string::npos)
      << rank0.Stderr();
}

class CleanupEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { (void)RemoveTree(Root()); }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new CleanupEnvironment);

}  // namespace
}  // namespace oryx
