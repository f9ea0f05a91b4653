#include "policies/rule_policies.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <memory>

#include "absl/strings/numbers.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "policies/learned_policy.h"
#include "speculative/speculative.h"
#include "base/rng.h"

namespace oryx::policies {

namespace {
using router::Phase;

bool PrefillBody(const router::RouterContext& c) { return c.phase == Phase::kPrefill && !c.last_prompt_token; }
}  // namespace

router::Decision EntropyRouter::Decide(const router::RouterContext& c) const {
  if (PrefillBody(c)) return {Mode::kLinear};
  if (c.phase == Phase::kPrefill || c.entropy < 0) return {Mode::kAttention};  // nothing measured yet
  return {c.entropy > tau_ ? Mode::kAttention : Mode::kLinear};
}

router::Decision BudgetRouter::Decide(const router::RouterContext& c) const {
  if (PrefillBody(c)) return {Mode::kLinear};
  const double after = static_cast<double>(c.attention_tokens + c.segment_tokens) /
                       static_cast<double>(c.attention_tokens + c.linear_tokens + c.segment_tokens);
  return {after <= fraction_ ? Mode::kAttention : Mode::kLinear};
}

router::Decision MatchRouter::Decide(const router::RouterContext& c) const {
  if (PrefillBody(c)) return {c.match_length >= min_length_ ? Mode::kAttention : Mode::kLinear};
  return {Mode::kAttention};
}

router::Decision TailRouter::Decide(const router::RouterContext& c) const {
  const bool in_tail = c.position + c.segment_tokens > c.prompt_len - 1 - tail_;  // holds one of the last N tokens
  return {PrefillBody(c) && !in_tail ? Mode::kLinear : Mode::kAttention};
}

router::Decision RandomRouter::Decide(const router::RouterContext& c) const {
  const uint64_t h = MixSeed({0x726f757465, c.sequence_hash, static_cast<uint64_t>(c.position)});
  return {Rng(h).UniformDouble() < fraction_ ? Mode::kAttention : Mode::kLinear};
}

absl::StatusOr<std::unique_ptr<router::Router>> MakeRuleRouter(std::string_view policy) {
  const size_t colon = policy.find(':');
  const std::string_view kind = policy.substr(0, colon);
  double value = 0;
  const bool parsed = colon != std::string_view::npos &&
                      absl::SimpleAtod(absl::string_view(policy.data() + colon + 1, policy.size() - colon - 1), &value) &&
                      std::isfinite(value);
  std::unique_ptr<router::Router> r;
  if (kind == "entropy") {
    if (!parsed || value < 0) return absl::InvalidArgumentError(Cat("policy '", policy, "': entropy:TAU needs TAU >= 0 (nats)"));
    r = std::make_unique<EntropyRouter>(value);
  } else if (kind == "match") {
    if (!parsed || value < 1 || value != std::floor(value) || value > 1e6) {
      return absl::InvalidArgumentError(Cat("policy '", policy, "': match:L needs a whole number L >= 1 (tokens)"));
    }
    r = std::make_unique<MatchRouter>(static_cast<int64_t>(value));
  } else if (kind == "tail") {
    if (!parsed || value < 0 || value != std::floor(value) || value > 1e9) {
      return absl::InvalidArgumentError(Cat("policy '", policy, "': tail:N needs a whole number N >= 0 (tokens)"));
    }
    r = std::make_unique<TailRouter>(static_cast<int64_t>(value));
  } else if (kind == "budget" || kind == "random") {
    if (!parsed || value < 0 || value > 1) {
      return absl::InvalidArgumentError(Cat("policy '", policy, "': ", kind, ":FRACTION needs FRACTION in [0, 1]"));
    }
    if (kind == "budget") {
      r = std::make_unique<BudgetRouter>(value);
    } else {
      r = std::make_unique<RandomRouter>(value);
    }
  } else {
    return absl::InvalidArgumentError(Cat("not a rule policy: '", policy, "'"));
  }
  return r;
}

absl::StatusOr<std::unique_ptr<Decoder>> MakeRulePolicy(std::string_view policy) {
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<router::Router> r, MakeRuleRouter(policy));
  router::RouterOptions options;
  // tail:N alone attends to exactly the prompt's last N tokens: a finer tail ends a segment there.
  if (const auto* tail = dynamic_cast<const TailRouter*>(r.get()); tail && tail->tail() < options.segment_len) {
    options.tail_len = tail->tail();
  }
  return std::unique_ptr<Decoder>(new router::RouterDecoder(std::move(r), options));
}

void RegisterPolicies(PolicyRegistry& registry) {
  registry.Register("entropy", "entropy:TAU", MakeRulePolicy);
  registry.Register("budget", "budget:FRACTION", MakeRulePolicy);
  registry.Register("match", "match:L", MakeRulePolicy);
  registry.Register("tail", "tail:N", MakeRulePolicy);
  registry.Register("random", "random:FRACTION", MakeRulePolicy);
  registry.Register("learned", "learned:PATH", MakeLearnedPolicy);
}

void RegisterAllPolicies(PolicyRegistry& registry) {
  speculative::RegisterPolicies(registry);
  RegisterPolicies(registry);
}

absl::Status RegisterServedLearnedPolicies(PolicyRegistry& registry,
                                           const std::vector<std::pair<std::string, std::string>>& files) {
  auto served = std::make_shared<std::map<std::string, std::shared_ptr<const LearnedPolicy>, std::less<>>>();
  for (const auto& [name, file] : files) {
    const bool valid = !name.empty() && std::ranges::all_of(name, [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
    });
    if (!valid) {
      return absl::InvalidArgumentError(Cat("policy name '", name, "': use letters, digits, '-', '_' and '.'"));
    }
    if (served->contains(name) || registry.Has(name)) {
      return absl::InvalidArgumentError(Cat("policy name '", name, "' is taken (a built-in policy or given twice)"));
    }
    absl::StatusOr<PolicyNetwork> net = ReadPolicyFile(file);
    if (!net.ok()) return absl::Status(net.status().code(), Cat("policy ", name, ": ", net.status().message()));
    ORYX_ASSIGN_OR_RETURN(LearnedPolicy policy, LearnedPolicy::Create(std::move(*net)));
    (*served)[name] = std::make_shared<const LearnedPolicy>(std::move(policy));
  }
  std::string names;
  for (const auto& [name, policy] : *served) names += Cat(names.empty() ? "" : ", ", name);
  for (const auto& [name, policy] : *served) {
    registry.Register(name, name, [policy](std::string_view asked) -> absl::StatusOr<std::unique_ptr<Decoder>> {
      return MakeWarningLearnedDecoder(policy, asked);
    });
  }
  registry.Register("learned", names.empty() ? "learned:NAME (none served)" : "learned:NAME",
                    [served, names](std::string_view policy) -> absl::StatusOr<std::unique_ptr<Decoder>> {
                      auto it = served->find(policy.substr(std::string_view("learned:").size()));
                      if (!policy.starts_with("learned:") || it == served->end()) {
                        return absl::InvalidArgumentError(
                            Cat("unknown learned policy '", policy, "': this server serves ",
                                names.empty() ? std::string("none") : names,
                                " (learned policies are files its operator names at start)"));
                      }
                      return MakeWarningLearnedDecoder(it->second, policy);
                    });
  return absl::OkStatus();
}

}  // namespace oryx::policies
