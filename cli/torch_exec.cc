#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace oryx::cli {

int ExecTorchBinary(const std::string& command, const Args& args) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path torch = ec ? std::filesystem::path("oryx-torch") : self.parent_path() / "oryx-torch";
  if (ec || !std::filesystem::exists(torch)) {
    std::cerr << "oryx: error: '" << command << "' needs LibTorch, and this build has no oryx-torch beside oryx "
              << "(configure with -DORYX_TORCH=ON and build the oryx-torch target)\n";
    return 1;
  }
  std::vector<std::string> words = {torch.string(), command};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::cout.flush();
  ::execv(argv[0], argv.data());
  std::cerr << "oryx: error: could not run " << torch.string() << ": " << std::strerror(errno) << "\n";
  return 1;
}

bool HasFlagValue(const Args& args, const std::string& name, const std::string& value) {
  const std::string flag = "--" + name;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag + "=" + value) return true;
    if (args[i] == flag && i + 1 < args.size() && args[i + 1] == value) return true;
  }
  return false;
}

}  // namespace oryx::cli
