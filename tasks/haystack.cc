// InMemoryHaystack: a seeded, wrapping window over a token buffer.
#include "tasks/haystack.h"

#include <algorithm>

#include "absl/status/status.h"
#include "base/rng.h"
#include "base/str_cat.h"

namespace oryx::tasks {

absl::StatusOr<std::vector<int32_t>> InMemoryHaystack::Tokens(int64_t n, uint64_t seed) const {
  if (n < 0) return absl::InvalidArgumentError(Cat("haystack: asked for ", n, " tokens"));
  std::vector<int32_t> out;
  if (n == 0) return out;
  if (tokens_.empty()) return absl::FailedPreconditionError("haystack: the in-memory buffer is empty");
  Rng rng(seed);
  const size_t size = tokens_.size();
  size_t pos = static_cast<size_t>(rng.UniformInt(size));
  out.reserve(n);
  while (static_cast<int64_t>(out.size()) < n) {
    const size_t take = std::min<size_t>(size - pos, static_cast<size_t>(n) - out.size());
    out.insert(out.end(), tokens_.begin() + pos, tokens_.begin() + pos + take);
    pos = 0;
  }
  return out;
}

}  // namespace oryx::tasks
