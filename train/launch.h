// Where a process sits in a data-parallel training job, and the launcher behind `oryx train --nproc N`.
// LibTorch-free: the command line reads the environment and starts ranks before any LibTorch work.
//
// A job is described torchrun-style, one process per rank: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT (rank 0 serves the rendezvous store at MASTER_ADDR:MASTER_PORT). `--nproc N` sets them for N
// processes on this host; torchrun (or a cluster's launcher) sets them across hosts.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace oryx::train {

struct DistEnv {
  int rank = 0;  // 0 .. world_size - 1; rank 0 writes the checkpoints and the log
  int world_size = 1;
  int local_rank = 0;        // index among the ranks on this host: the CUDA device it trains on
  int local_world_size = 0;  // ranks on this host (LOCAL_WORLD_SIZE; 0: not given)
  std::string master_addr;   // host of the rendezvous store
  int master_port = 0;
  // torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE),
  // so rank 0 joins it rather than starting one; TORCHELASTIC_RESTART_COUNT keeps restarts' keys apart.
  bool agent_store = false;
  int restart_count = 0;
};

// The job this process belongs to, from the environment: nullopt when none of RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT is set (one process, no job). InvalidArgument naming the variables
// when only some are set or a value is malformed or out of range.
absl::StatusOr<std::optional<DistEnv>> DistEnvFromEnvironment();

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> argv;  // what every rank runs; argv[0] is the executable's path
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port of this host
  double grace_s = 5;   // after a failure: SIGTERM to the others, SIGKILL to those still there after this
};

// Runs `argv` as ranks 0 .. nproc-1 of a job on this host (each with the job's environment besides this
// process's own) and waits for all of them. OK when every rank exits with 0. When one exits with another
// status or is killed, the others are stopped at once and the error names that rank and how it ended.
// The ranks die with this process (PR_SET_PDEATHSIG), so none is left behind if it is killed.
absl::Status LaunchLocalRanks(const LaunchOptions& options);

}  // namespace oryx::train
