// oryx::Cat: absl::StrCat that also accepts std::string_view. Debian's Abseil is built with its own
// absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), which StrCat's AlphaNum takes but
// std::string_view is not; this converts such arguments and forwards everything else unchanged.
#pragma once

#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace oryx {

namespace str_cat_internal {
inline absl::string_view Arg(std::string_view s) { return {s.data(), s.size()}; }
template <typename T>
const T& Arg(const T& v) {
  return v;
}
}  // namespace str_cat_internal

template <typename... Args>
std::string Cat(const Args&... args) {
  return absl::StrCat(str_cat_internal::Arg(args)...);
}

}  // namespace oryx
