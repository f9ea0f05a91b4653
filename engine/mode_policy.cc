#include "engine/mode_policy.h"

#include "absl/strings/numbers.h"
#include "base/str_cat.h"

namespace oryx {

absl::StatusOr<ModePolicy> ModePolicy::Parse(std::string_view name) {
  ModePolicy p;
  p.name_ = std::string(name);
  if (name == "attention") {
    p.kind_ = Kind::kAttention;
  } else if (name == "linear") {
    p.kind_ = Kind::kLinear;
  } else if (name == "prefill-linear") {
    p.kind_ = Kind::kPrefillLinear;
  } else if (name.starts_with("periodic:")) {
    p.kind_ = Kind::kPeriodic;
    if (!absl::SimpleAtoi(absl::string_view(name.data() + 9, name.size() - 9), &p.period_) || p.period_ < 1) {
      return absl::InvalidArgumentError(Cat("policy '", name, "': periodic:N needs an integer N >= 1"));
    }
  } else {
    return absl::InvalidArgumentError(Cat("unknown policy '", name, "' (attention, linear, prefill-linear, periodic:N)"));
  }
  return p;
}

Mode ModePolicy::ModeAt(int64_t position, int64_t prompt_len) const {
  switch (kind_) {
    case Kind::kAttention:
      return Mode::kAttention;
    case Kind::kLinear:
      return Mode::kLinear;
    case Kind::kPrefillLinear:
      return position < prompt_len - 1 ? Mode::kLinear : Mode::kAttention;
    case Kind::kPeriodic:
      return position % period_ == period_ - 1 ? Mode::kAttention : Mode::kLinear;
  }
  return Mode::kAttention;
}

}  // namespace oryx
