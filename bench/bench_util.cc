// Machine description, git revision and timestamps for benchmark JSON.
#include "bench/bench_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <thread>

namespace oryx::bench {

nlohmann::json MachineInfo() {
  nlohmann::json info;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown";
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  info["cpu"] = model;
  info["cores"] = std::thread::hardware_concurrency();
  info["host_memory_gib"] =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / (1024.0 * 1024 * 1024);
  return info;
}

// The commit measured: ORYX_GIT_REVISION when set (for a copy of the tree whose git metadata is not its own),
// else HEAD, with "-modified" when tracked files differ from it.
std::string GitRevision() {
  if (const char* env = std::getenv("ORYX_GIT_REVISION"); env != nullptr && *env != '\0') return env;
  std::array<char, 64> buf{};
  FILE* pipe = popen("git rev-parse --short HEAD 2>/dev/null", "r");
  if (pipe == nullptr) return "unknown";
  std::string rev;
  if (fgets(buf.data(), buf.size(), pipe) != nullptr) rev = buf.data();
  pclose(pipe);
  while (!rev.empty() && (rev.back() == '\n' || rev.back() == '\r')) rev.pop_back();
  if (rev.empty()) return "unknown";
  // `git diff --quiet HEAD` exits 1 when tracked files differ from HEAD.
  const int diff = std::system("git diff --quiet HEAD -- 2>/dev/null");
  if (diff != -1 && WIFEXITED(diff) && WEXITSTATUS(diff) == 1) rev += "-modified";
  return rev;
}

std::string UtcTimestamp() {
  std::time_t now = std::time(nullptr);
  std::array<char, 32> buf{};
  std::strftime(buf.data(), buf.size(), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf.data();
}

double Median(std::vector<double> samples) {
  if (samples.empty()) return 0.0;
  std::sort(samples.begin(), samples.end());
  const size_t mid = samples.size() / 2;
  return samples.size() % 2 ? samples[mid] : 0.5 * (samples[mid - 1] + samples[mid]);
}

nlohmann::json Provenance() {
  return {{"machine", MachineInfo()}, {"git", GitRevision()}, {"time", UtcTimestamp()}};
}

}  // namespace oryx::bench
