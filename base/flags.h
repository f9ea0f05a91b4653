// A small declarative flag parser shared by every `oryx` subcommand: `--name value` or `--name=value`,
// typed destinations, required flags, generated --help, and one clear error for anything unknown.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace oryx {

class FlagSet {
 public:
  // `usage` is the one-line synopsis shown first in --help, e.g. "oryx data prepare --out DIR [...]".
  FlagSet(std::string usage, std::string description);

  // Each call registers `--name`; `out` keeps its current value as the default.
  void String(const std::string& name, std::string* out, const std::string& help, bool required = false);
  void Int(const std::string& name, int64_t* out, const std::string& help, int64_t min = INT64_MIN,
           int64_t max = INT64_MAX);
  void Double(const std::string& name, double* out, const std::string& help);
  void Bool(const std::string& name, bool* out, const std::string& help);  // presence sets true
  // Takes every following argument up to the next `--flag`; may also be repeated. The first value given
  // replaces whatever the list held (its default).
  void StringList(const std::string& name, std::vector<std::string>* out, const std::string& help,
                  bool required = false);

  // Parses `args` (the arguments after the subcommand). Positional arguments are an error.
  // After `--help` or `-h` it returns OK with help_requested() true and nothing else checked.
  absl::Status Parse(const std::vector<std::string>& args);
  bool help_requested() const { return help_requested_; }
  bool was_set(const std::string& name) const;
  std::string Help() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool required = false;
    bool takes_value = true;
    bool is_list = false;
    bool seen = false;
    std::function<absl::Status(const std::string&)> set;
  };
  Flag* Find(const std::string& name);

  std::string usage_;
  std::string description_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
};

// The values of a list flag, each item also split at commas: ["a,b", "c"] -> [a, b, c].
std::vector<std::string> SplitList(const std::vector<std::string>& items);
// The same as positive integers; InvalidArgument naming --flag and the bad item otherwise.
absl::StatusOr<std::vector<int64_t>> ParsePositiveInts(const std::vector<std::string>& items, const std::string& flag);

// Prints "oryx: error: <message>" to stderr and returns the exit code for a usage error (2).
int UsageError(const absl::Status& status);
// Prints "oryx: error: <message>" to stderr and returns the exit code for a failed run (1).
int RunError(const absl::Status& status);

// The common shape of a subcommand: parse flags, print help if asked, else run.
int RunWithFlags(FlagSet& flags, const std::vector<std::string>& args,
                 const std::function<absl::Status()>& body);

}  // namespace oryx
