// Implementation of the shared flag parser.
#include "base/flags.h"

#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace oryx {

FlagSet::FlagSet(std::string usage, std::string description)
    : usage_(std::move(usage)), description_(std::move(description)) {}

void FlagSet::String(const std::string& name, std::string* out, const std::string& help, bool required) {
  flags_.push_back({name, help, out->empty() ? "" : *out, required, true, false, false,
                    [out](const std::string& v) {
                      *out = v;
                      return absl::OkStatus();
                    }});
}

void FlagSet::Int(const std::string& name, int64_t* out, const std::string& help, int64_t min, int64_t max) {
  flags_.push_back({name, help, absl::StrCat(*out), false, true, false, false,
                    [out, name, min, max](const std::string& v) {
                      int64_t x;
                      if (!absl::SimpleAtoi(v, &x)) {
                        return absl::InvalidArgumentError(
                            absl::StrCat("--", name, " expects an integer, got '", v, "'"));
                      }
                      if (x < min || x > max) {
                        const std::string range = max == std::numeric_limits<int64_t>::max()
                                                      ? absl::StrCat("at least ", min)
                                                      : absl::StrCat("in [", min, ", ", max, "]");
                        return absl::InvalidArgumentError(absl::StrCat("--", name, " must be ", range, ", got ", x));
                      }
                      *out = x;
                      return absl::OkStatus();
                    }});
}

void FlagSet::Double(const std::string& name, double* out, const std::string& help) {
  flags_.push_back({name, help, absl::StrCat(*out), false, true, false, false,
                    [out, name](const std::string& v) {
                      double x;
                      if (!absl::SimpleAtod(v, &x) || !std::isfinite(x)) {
                        return absl::InvalidArgumentError(
                            absl::StrCat("--", name, " expects a finite number, got '", v, "'"));
                      }
                      *out = x;
                      return absl::OkStatus();
                    }});
}

void FlagSet::Bool(const std::string& name, bool* out, const std::string& help) {
  flags_.push_back({name, help, "", false, false, false, false, [out](const std::string&) {
                      *out = true;
                      return absl::OkStatus();
                    }});
}

void FlagSet::StringList(const std::string& name, std::vector<std::string>* out, const std::string& help,
                         bool required) {
  // The first value given replaces the list's default contents; later ones append.
  flags_.push_back({name, help, "", required, true, true, false,
                    [out, fresh = std::make_shared<bool>(true)](const std::string& v) {
                      if (*fresh) out->clear(), *fresh = false;
                      out->push_back(v);
                      return absl::OkStatus();
                    }});
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagSet::was_set(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.seen;
  }
  return false;
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      help_requested_ = true;
      return absl::OkStatus();
    }
  }
  Flag* list_flag = nullptr;  // the list flag still collecting values
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!absl::StartsWith(arg, "--")) {
      if (list_flag != nullptr) {
        if (absl::Status s = list_flag->set(arg); !s.ok()) return s;
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "' (see --help)"));
    }
    list_flag = nullptr;
    std::string name = arg.substr(2);
    std::string value;
    bool has_inline_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline_value = true;
    }
    Flag* flag = Find(name);
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    flag->seen = true;
    if (!flag->takes_value) {
      if (has_inline_value) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
      if (absl::Status s = flag->set(""); !s.ok()) return s;
      continue;
    }
    if (!has_inline_value) {
      if (i + 1 >= args.size() || (absl::StartsWith(args[i + 1], "--") && args[i + 1].size() > 2)) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    if (absl::Status s = flag->set(value); !s.ok()) return s;
    if (flag->is_list) list_flag = flag;
  }
  for (const Flag& f : flags_) {
    if (f.required && !f.seen) {
      return absl::InvalidArgumentError(absl::StrCat("missing required flag --", f.name, " (see --help)"));
    }
  }
  return absl::OkStatus();
}

namespace {

// One flag's row of the help: the flag in a column of kHelpColumn characters (on a line of its own when it is
// wider), then the text wrapped at kHelpWidth with continuation lines under its start. The text's own line
// breaks are kept; the indentation after them is replaced by the column's.
constexpr size_t kHelpColumn = 27, kHelpWidth = 120;

void AppendHelpRow(std::string& out, std::string left, const std::string& text) {
  if (left.size() + 1 > kHelpColumn) {
    absl::StrAppend(&out, left, "\n");
    left.clear();
  }
  left.resize(kHelpColumn, ' ');
  std::string line = left;
  bool line_has_words = false;
  for (absl::string_view paragraph : absl::StrSplit(text, '\n')) {
    if (line_has_words) {
      absl::StrAppend(&out, line, "\n");
      line = std::string(kHelpColumn, ' ');
      line_has_words = false;
    }
    for (absl::string_view word : absl::StrSplit(paragraph, ' ', absl::SkipEmpty())) {
      if (line_has_words && line.size() + 1 + word.size() > kHelpWidth) {
        absl::StrAppend(&out, line, "\n");
        line = std::string(kHelpColumn, ' ');
        line_has_words = false;
      }
      absl::StrAppend(&line, line_has_words ? " " : "", word);
      line_has_words = true;
    }
  }
  absl::StrAppend(&out, line, "\n");
}

}  // namespace

std::string FlagSet::Help() const {
  std::string out = absl::StrCat("usage: ", usage_, "\n\n", description_, "\n\nflags:\n");
  for (const Flag& f : flags_) {
    std::string text = f.help;
    if (f.required) absl::StrAppend(&text, " (required)");
    if (!f.default_text.empty()) absl::StrAppend(&text, " [default: ", f.default_text, "]");
    AppendHelpRow(out, absl::StrCat("  --", f.name, f.takes_value ? (f.is_list ? " V..." : " V") : ""), text);
  }
  AppendHelpRow(out, "  --help", "show this help");
  return out;
}

std::vector<std::string> SplitList(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const std::string& item : items) {
    for (absl::string_view part : absl::StrSplit(item, ',', absl::SkipEmpty())) out.emplace_back(part);
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> ParsePositiveInts(const std::vector<std::string>& items, const std::string& flag) {
  std::vector<int64_t> out;
  for (const std::string& part : SplitList(items)) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " expects positive integers, got '", part, "'"));
    }
    out.push_back(v);
  }
  return out;
}

int UsageError(const absl::Status& status) {
  std::cerr << "oryx: error: " << status.message() << "\n";
  return 2;
}

int RunError(const absl::Status& status) {
  std::cerr << "oryx: error: " << status.message() << "\n";
  return 1;
}

int RunWithFlags(FlagSet& flags, const std::vector<std::string>& args,
                 const std::function<absl::Status()>& body) {
  if (absl::Status s = flags.Parse(args); !s.ok()) return UsageError(s);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return 0;
  }
  if (absl::Status s = body(); !s.ok()) return RunError(s);
  return 0;
}

}  // namespace oryx
