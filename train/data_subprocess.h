// Runs an external program (dpkg-query, apt-get, tar, xz, gzip, man) without a shell, for the corpus
// pipeline.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace oryx {

struct CommandOptions {
  std::string* captured_stdout = nullptr;  // if set, the child's stdout is collected here
  std::string stdout_path;                 // else if set, the child's stdout goes to this file
  bool stdout_to_stderr = false;           // else if true, the child's stdout goes to our stderr
  bool quiet_stderr = false;               // send the child's stderr to /dev/null
  std::vector<std::string> extra_env;      // "NAME=value" set in the child's environment (replacing NAME)
};

// Runs argv[0] (looked up in PATH) with argv and waits. Errors name the program and its exit status.
absl::Status RunCommand(const std::vector<std::string>& argv, const CommandOptions& options = {});

}  // namespace oryx
