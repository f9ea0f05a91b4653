// The router's features: a RouterContext as the fixed-length vector of numbers a learned policy reads.
// The names, their order and kFeatureVersion are part of the policy file format (policies/learned_policy.h):
// a policy file lists the names it was trained on, and loading checks them against these.
#pragma once

#include <array>
#include <span>
#include <string_view>

#include "router/router.h"

namespace oryx::router {

inline constexpr int kFeatureVersion = 3;

// Unknown statistics (entropy, margin, acceptance before they are measured) read as 0 with their *_known
// flag 0. Counts and lengths enter as log(1 + x). The batch size is deliberately not a feature: a mode is
// a per-sequence choice, and a policy trained at one batch size would read another as a new situation.
inline constexpr std::array<std::string_view, 20> kFeatureNames = {
    "decode",                    // 0 prefill, 1 decode
    "log_position",              // the segment's first token
    "prompt_fraction",           // position / prompt_len, capped at 1
    "log_tokens_to_prompt_end",  // prompt tokens after this segment (0 while decoding)
    "log_prompt_len",
    "log_segment_tokens",
    "last_prompt_token",
    "attention_fraction",  // of the tokens forwarded so far
    "log_tokens_since_attention",
    "entropy_known",
    "entropy",  // nats, of the last sampling distribution
    "margin",   // top-1 minus top-2 logit, capped at 20
    "repeated_ngram",
    "log_cost_ratio",  // log(predicted attention step / predicted linear step); 0 without a cost model
    "acceptance_known",
    "acceptance",               // recent speculative acceptance rate
    "log_match_length",         // the longest earlier match ending at the decision's tokens (version 2)
    "log_match_distance",       // how far back it first occurred
    "log_prompt_end_match",     // the longest earlier match ending in the prompt's last 32 tokens (version 3)
    "log_prompt_end_distance",  // how far back it first occurred
};
inline constexpr int kNumFeatures = static_cast<int>(kFeatureNames.size());

// Writes the kNumFeatures features of `c` into out[0 .. kNumFeatures).
void Featurize(const RouterContext& c, std::span<float> out);

}  // namespace oryx::router
