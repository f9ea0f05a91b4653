// Rule-based routing policies (DESIGN.md §7) on the router, by name:
//   entropy:TAU       the prompt in linear mode except its last token; while generating, a token runs in
//                     attention mode when the distribution it was sampled from had entropy above TAU nats
//                     (the model is unsure), else in linear mode. TAU >= 0.
//   budget:FRACTION   the prompt in linear mode except its last token; then attention wherever it keeps the
//                     sequence's share of attention-mode tokens at or below FRACTION, in [0, 1].
//   match:L           the prompt in linear mode except its last token and the segments holding a run of at
//                     least L tokens that occurred earlier in the prompt (a question repeating a needle's key,
//                     a passage repeating earlier text: where attention can retrieve); generation in attention
//                     mode. L >= 1.
//   tail:N            the prompt in linear mode except the segments holding its last N tokens (and its last
//                     token); generation in attention mode. Where a continuation or a question begins, attention
//                     over the prompt's last tokens is what the linear prefill lacks most. Alone it attends to
//                     exactly those N tokens (N below the default segment, cut with a tail of N); inside
//                     `oryx train-router`, to the segments of its --segment-len and --segment-tail that hold them.
//   random:FRACTION   every segment (and generated token) in attention mode with probability FRACTION, from a
//                     fixed hash of the prompt and the position: the baseline a router must beat at a matched
//                     attention fraction.
//   learned:PATH      a learned policy file (policies/learned_policy.h).
// (attention, linear, prefill-linear and periodic:N are the engine's built-ins; speculative[:K] is in
// speculative/.)
#pragma once

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "router/router.h"

namespace oryx::policies {

class EntropyRouter final : public router::Router {
 public:
  explicit EntropyRouter(double tau) : tau_(tau) {}
  router::Decision Decide(const router::RouterContext& c) const override;
  bool reads_earlier_match() const override { return false; }

 private:
  double tau_;
};

class BudgetRouter final : public router::Router {
 public:
  explicit BudgetRouter(double fraction) : fraction_(fraction) {}
  router::Decision Decide(const router::RouterContext& c) const override;
  bool reads_earlier_match() const override { return false; }
  bool reads_entropy() const override { return false; }

 private:
  double fraction_;
};

class MatchRouter final : public router::Router {
 public:
  explicit MatchRouter(int64_t min_length) : min_length_(min_length) {}
  router::Decision Decide(const router::RouterContext& c) const override;
  bool reads_entropy() const override { return false; }

 private:
  int64_t min_length_;
};

class TailRouter final : public router::Router {
 public:
  explicit TailRouter(int64_t tail) : tail_(tail) {}
  router::Decision Decide(const router::RouterContext& c) const override;
  int64_t tail() const { return tail_; }
  bool reads_earlier_match() const override { return false; }
  bool reads_entropy() const override { return false; }

 private:
  int64_t tail_;
};

class RandomRouter final : public router::Router {
 public:
  explicit RandomRouter(double fraction) : fraction_(fraction) {}
  router::Decision Decide(const router::RouterContext& c) const override;
  bool reads_earlier_match() const override { return false; }
  bool reads_entropy() const override { return false; }

 private:
  double fraction_;
};

// Parses entropy:TAU, budget:FRACTION, match:L, tail:N and random:FRACTION; InvalidArgument naming the policy for
// anything else.
absl::StatusOr<std::unique_ptr<router::Router>> MakeRuleRouter(std::string_view policy);
// The same rule as a decoder (router::RouterDecoder), for the policy registry.
absl::StatusOr<std::unique_ptr<Decoder>> MakeRulePolicy(std::string_view policy);
void RegisterPolicies(PolicyRegistry& registry);
// Every policy `oryx generate` and `oryx serve` take: speculative/'s (speculative[:K], speculative:ngram[:K])
// and these, beside the engine's built-in ones.
void RegisterAllPolicies(PolicyRegistry& registry);

// A server's learned policies: files its operator named at start (NAME -> FILE), each loaded once here (a bad
// file is an error naming it). Requests then name them, as NAME or learned:NAME; learned: with anything else is
// an unknown policy, so a request never makes the server open a path, and no error tells a client anything
// about the server's files. Names are letters, digits, '-', '_' and '.', and not already a policy's.
absl::Status RegisterServedLearnedPolicies(PolicyRegistry& registry,
                                           const std::vector<std::pair<std::string, std::string>>& files);

}  // namespace oryx::policies
