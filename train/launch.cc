// The job environment and the local launcher: fork + exec of the ranks, then a wait loop in which the first
// rank to fail stops the job.
#include "train/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

extern char** environ;

namespace oryx::train {
namespace {

using Clock = std::chrono::steady_clock;

// The variables that place a process in a job; a rank's environment gets them from the launcher only.
constexpr const char* kJobVariables[] = {"RANK",
                                         "WORLD_SIZE",
                                         "LOCAL_RANK",
                                         "MASTER_ADDR",
                                         "MASTER_PORT",
                                         "LOCAL_WORLD_SIZE",
                                         "TORCHELASTIC_USE_AGENT_STORE",
                                         "TORCHELASTIC_RESTART_COUNT"};

absl::StatusOr<int> IntVariable(const char* name, int min, int max) {
  const char* text = std::getenv(name);
  int value = 0;
  if (text == nullptr || !absl::SimpleAtoi(text, &value) || value < min || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", text == nullptr ? "" : text, ": expected an integer in [", min, ", ", max, "]"));
  }
  return value;
}

// A TCP port of this host's loopback that nothing listens on now (the kernel's pick). Another program could
// take it before rank 0 binds it; rank 0 then fails to start the store, and the job stops with that error.
absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok) return absl::InternalError(absl::StrCat("no free port on 127.0.0.1: ", std::strerror(error)));
  return ntohs(addr.sin_port);
}

std::string HowItEnded(int status) {
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("exited with status ", WEXITSTATUS(status));
}

// SIGTERM to every rank still running, SIGKILL to those still there after grace_s; reaps them all.
void StopRanks(std::vector<pid_t>& pids, double grace_s) {
  for (pid_t pid : pids) {
    if (pid > 0) ::kill(pid, SIGTERM);
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(grace_s);
  for (;;) {
    bool any = false;
    for (pid_t& pid : pids) {
      if (pid > 0 && ::waitpid(pid, nullptr, WNOHANG) == pid) pid = -1;
      any |= pid > 0;
    }
    if (!any) return;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t& pid : pids) {
    if (pid <= 0) continue;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }
}

}  // namespace

absl::StatusOr<std::optional<DistEnv>> DistEnvFromEnvironment() {
  std::vector<std::string> set, missing;
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    (std::getenv(name) != nullptr ? set : missing).push_back(name);
  }
  if (set.empty()) return std::nullopt;
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a distributed run needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment: ",
        absl::StrJoin(set, ", "), (set.size() == 1 ? " is" : " are"), " set, ", absl::StrJoin(missing, ", "),
        (missing.size() == 1 ? " is" : " are"), " not"));
  }
  DistEnv env;
  ORYX_ASSIGN_OR_RETURN(env.world_size, IntVariable("WORLD_SIZE", 1, 1 << 20));
  ORYX_ASSIGN_OR_RETURN(env.rank, IntVariable("RANK", 0, env.world_size - 1));
  ORYX_ASSIGN_OR_RETURN(env.local_rank, IntVariable("LOCAL_RANK", 0, env.world_size - 1));
  ORYX_ASSIGN_OR_RETURN(env.master_port, IntVariable("MASTER_PORT", 1, 65535));
  env.master_addr = std::getenv("MASTER_ADDR");
  if (env.master_addr.empty()) return absl::InvalidArgumentError("MASTER_ADDR is empty: expected rank 0's host");
  if (std::getenv("LOCAL_WORLD_SIZE") != nullptr) {
    ORYX_ASSIGN_OR_RETURN(env.local_world_size, IntVariable("LOCAL_WORLD_SIZE", env.local_rank + 1, env.world_size));
  }
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent != nullptr && std::string(agent) == "True";
  if (std::getenv("TORCHELASTIC_RESTART_COUNT") != nullptr) {
    ORYX_ASSIGN_OR_RETURN(env.restart_count, IntVariable("TORCHELASTIC_RESTART_COUNT", 0, 1 << 30));
  }
  return env;
}

absl::Status LaunchLocalRanks(const LaunchOptions& o) {
  if (o.nproc < 1) return absl::InvalidArgumentError(absl::StrCat("--nproc must be at least 1, got ", o.nproc));
  if (o.argv.empty()) return absl::InvalidArgumentError("no command to launch");
  int port = o.master_port;
  if (port == 0) {
    ORYX_ASSIGN_OR_RETURN(port, FreeLoopbackPort());
  }

  // Everything exec needs is built before the first fork: between fork and exec only async-signal-safe
  // calls are allowed.
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    bool job = false;
    for (const char* name : kJobVariables) job |= absl::StartsWith(*e, absl::StrCat(name, "="));
    if (!job) inherited.emplace_back(*e);
  }
  std::vector<std::vector<std::string>> envs(o.nproc, inherited);
  for (int r = 0; r < o.nproc; ++r) {
    for (std::string v : {absl::StrCat("RANK=", r), absl::StrCat("LOCAL_RANK=", r),
                          absl::StrCat("WORLD_SIZE=", o.nproc), absl::StrCat("LOCAL_WORLD_SIZE=", o.nproc),
                          absl::StrCat("MASTER_ADDR=", o.master_addr), absl::StrCat("MASTER_PORT=", port)}) {
      envs[r].push_back(std::move(v));
    }
  }
  std::vector<std::string> argv_words = o.argv;
  std::vector<char*> argv;
  for (std::string& w : argv_words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::vector<std::vector<char*>> envps(o.nproc);
  for (int r = 0; r < o.nproc; ++r) {
    for (std::string& v : envs[r]) envps[r].push_back(v.data());
    envps[r].push_back(nullptr);
  }

  std::fprintf(stderr, "starting %d ranks on this host (rendezvous at %s:%d)\n", o.nproc, o.master_addr.c_str(), port);
  std::fflush(stderr);
  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids(o.nproc, -1);
  for (int r = 0; r < o.nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(1);  // the launcher died before prctl took effect
      ::execve(argv[0], argv.data(), envps[r].data());
      static const char kMessage[] = "oryx: error: a rank could not exec the oryx-torch binary\n";
      (void)!::write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
      ::_exit(127);
    }
    if (pid < 0) {
      const int error = errno;
      StopRanks(pids, o.grace_s);
      return absl::InternalError(absl::StrCat("could not start rank ", r, ": fork: ", std::strerror(error)));
    }
    pids[r] = pid;
  }

  // The first rank to end badly stops the job. Others may have ended by then too (a rank that lost its
  // peer fails soon after it): they are reported with it, a killed rank first, as the likelier cause.
  std::vector<std::pair<bool, std::string>> failed;  // (killed by a signal, what happened)
  auto reaped = [&](pid_t pid, int status) {
    int rank = 0;
    while (rank < o.nproc && pids[rank] != pid) ++rank;
    if (rank == o.nproc) return;  // not a rank
    pids[rank] = -1;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
    failed.emplace_back(WIFSIGNALED(status),
                        absl::StrCat("rank ", rank, " of ", o.nproc, " (pid ", pid, ") ", HowItEnded(status),
                                     WIFSIGNALED(status) ? "" : " (its error is above)"));
  };
  auto running = [&] { return std::count_if(pids.begin(), pids.end(), [](pid_t p) { return p > 0; }); };
  while (running() > 0 && failed.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      StopRanks(pids, o.grace_s);
      return absl::InternalError(absl::StrCat("waiting for the ranks: ", std::strerror(errno)));
    }
    reaped(pid, status);
  }
  if (failed.empty()) return absl::OkStatus();
  int status = 0;
  for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) reaped(pid, status);
  const auto others = running();
  StopRanks(pids, o.grace_s);
  std::stable_sort(failed.begin(), failed.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> what;
  for (const auto& [killed, text] : failed) what.push_back(text);
  return absl::AbortedError(
      absl::StrCat(absl::StrJoin(what, "; "),
                   others > 0 ? absl::StrCat("; stopped the other ", others, " rank", others == 1 ? "" : "s") : "",
                   failed[0].first ? ". The run continues from its last checkpoint with --resume" : ""));
}

}  // namespace oryx::train
