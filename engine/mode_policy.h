// The simple mode policies of the generation API, by name (DESIGN.md §7 built-ins that need no router):
//   attention        every token in attention mode
//   linear           every token in linear mode
//   prefill-linear   the prompt in linear mode except its last token; that token and every generated token
//                    in attention mode ("linear prefill, attention generation")
//   periodic:N       every N-th token of the sequence (positions N-1, 2N-1, ...) in attention mode, the rest
//                    linear (N >= 1; periodic:1 is attention)
// A policy decides a token's mode from its position and the prompt's length only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/backend.h"

namespace oryx {

class ModePolicy {
 public:
  // InvalidArgument naming the known policies for anything else.
  static absl::StatusOr<ModePolicy> Parse(std::string_view name);
  const std::string& name() const { return name_; }
  // The mode of the token at `position` in a sequence whose prompt is `prompt_len` tokens.
  Mode ModeAt(int64_t position, int64_t prompt_len) const;

 private:
  enum class Kind { kAttention, kLinear, kPrefillLinear, kPeriodic };
  Kind kind_ = Kind::kAttention;
  int64_t period_ = 1;
  std::string name_;
};

}  // namespace oryx
