// posix_spawn-based command runner with optional stdout capture.
#include "train/data_subprocess.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

extern char** environ;

namespace oryx {

absl::Status RunCommand(const std::vector<std::string>& argv, const CommandOptions& options) {
  if (argv.empty()) return absl::InvalidArgumentError("RunCommand: empty command");
  const std::string what = absl::StrCat("`", absl::StrJoin(argv, " "), "`");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // extra_env replaces variables of the same name: getenv() would find an inherited one first.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view var(*e);
    bool replaced = false;
    for (const std::string& x : options.extra_env) {
      const size_t eq = x.find('=');
      replaced |= eq != std::string::npos && var.size() > eq && var.substr(0, eq + 1) == x.substr(0, eq + 1);
    }
    if (!replaced) env_strings.push_back(*e);
  }
  for (const std::string& e : options.extra_env) env_strings.push_back(e);
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  int pipe_fds[2] = {-1, -1};
  if (options.captured_stdout != nullptr) {
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
      posix_spawn_file_actions_destroy(&actions);
      return absl::InternalError(absl::StrCat(what, ": pipe failed: ", std::strerror(errno)));
    }
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  } else if (!options.stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, options.stdout_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  } else if (options.stdout_to_stderr) {
    posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  }
  if (options.quiet_stderr) {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (pipe_fds[1] >= 0) ::close(pipe_fds[1]);
  if (rc != 0) {
    if (pipe_fds[0] >= 0) ::close(pipe_fds[0]);
    return absl::FailedPreconditionError(absl::StrCat(what, ": cannot run: ", std::strerror(rc)));
  }
  if (pipe_fds[0] >= 0) {
    char buf[65536];
    ssize_t n;
    while ((n = ::read(pipe_fds[0], buf, sizeof(buf))) != 0) {
      if (n < 0) {
        if (errno == EINTR) continue;
        break;
      }
      options.captured_stdout->append(buf, static_cast<size_t>(n));
    }
    ::close(pipe_fds[0]);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return absl::InternalError(absl::StrCat(what, ": waitpid failed"));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  if (WIFEXITED(status)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " exited with status ", WEXITSTATUS(status)));
  }
  return absl::FailedPreconditionError(absl::StrCat(what, " was killed by signal ", WTERMSIG(status)));
}

}  // namespace oryx
