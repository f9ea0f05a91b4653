// Where the needle tasks get their filler: real text as token ids, at a seeded offset. The trainer backs
// HaystackSource with its corpus shards; InMemoryHaystack serves tests and small evaluations.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace oryx::tasks {

// A source of haystack text. Implementations must be deterministic (the same (n, seed) gives the same
// tokens) and safe to call from several threads at once, since generators and the TaskMixer share one.
// The tokens should be real text; BOS/EOS (document boundaries) are fine, but the needle generators reject
// task markers and out-of-vocab ids in it.
class HaystackSource {
 public:
  virtual ~HaystackSource() = default;
  // Exactly `n` (>= 0) consecutive tokens of text starting at an offset chosen from `seed`.
  virtual absl::StatusOr<std::vector<int32_t>> Tokens(int64_t n, uint64_t seed) const = 0;
};

// A haystack over one token buffer. The offset is uniform over the buffer (from `seed`), and reads wrap
// around to the start, so any n is served (a short buffer repeats: a "passkey"-style repetitive filler).
// Immutable after construction; thread-safe.
class InMemoryHaystack : public HaystackSource {
 public:
  explicit InMemoryHaystack(std::vector<int32_t> tokens) : tokens_(std::move(tokens)) {}
  // FailedPrecondition when the buffer is empty and n > 0; InvalidArgument when n < 0.
  absl::StatusOr<std::vector<int32_t>> Tokens(int64_t n, uint64_t seed) const override;

 private:
  std::vector<int32_t> tokens_;
};

}  // namespace oryx::tasks
