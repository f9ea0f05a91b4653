// Learned routing policies (DESIGN.md §7): a small MLP over the router's features (router/features.h),
// evaluated with Eigen, no LibTorch. `oryx train-router` trains it; `learned:PATH` runs it.
//
// The policy file is one safetensors file. Its "__metadata__" holds, under "oryx.router_policy", a JSON
// object: {"format": "oryx-router-policy", "version": 1, "feature_version": 1, "features": [names, in
// order], "activation": "tanh", "segment_len": N, "tail_len": T, "draft_lengths": [k, ...], "training": {...}}
// ("tail_len" may be absent: 0, a file written before it; "training" is provenance, whose "lengths", the
// prompt lengths it was trained on, LongestTrainedPrompt reads). Its F32
// tensors (F = number of features, h_i = width of hidden layer i, h = the last width):
//   input.mean [F], input.inv_std [F]          x = (features - mean) * inv_std
//   hidden.<i>.weight [h_i, h_(i-1)], hidden.<i>.bias [h_i]   x = tanh(W x + b), i = 0, 1, ...
//   mode.weight [2, h], mode.bias [2]          logits of (linear, attention)
//   draft.weight [n, h], draft.bias [n]        logits over draft_lengths (present when n >= 2)
// The draft head is read only for decode decisions in attention mode; draft length 0 means no speculation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"
#include "router/router.h"

namespace oryx::policies {

inline constexpr std::string_view kPolicyFormat = "oryx-router-policy";
inline constexpr int kPolicyVersion = 1;
inline constexpr std::string_view kPolicyMetadataKey = "oryx.router_policy";
// Policy files of feature versions kOldestFeatureVersion to router::kFeatureVersion load: every version since
// adds features and changes none, so an older file's network reads the features it names.
inline constexpr int kOldestFeatureVersion = 2;

// The position of a feature in router::kFeatureNames, or -1.
int64_t FeatureIndex(std::string_view name);

// The network as plain data: what the trainer exports and the file holds.
struct PolicyNetwork {
  struct Linear {
    int64_t out = 0, in = 0;
    std::vector<float> weight;  // [out, in] row-major
    std::vector<float> bias;    // [out]
  };
  // The features it reads, in its input order: this build's router::kFeatureNames when trained by it; a file
  // of an earlier feature version lists the ones it was trained on (version 2: all but the last two).
  std::vector<std::string> features;
  int64_t segment_len = 128;           // the prefill segment length it was trained with
  int64_t tail_len = 0;                // and its finer tail (router::PrefillSegmentTokens; 0: none)
  std::vector<int64_t> draft_lengths;  // the draft head's choices (empty or one entry: never speculates)
  std::vector<float> input_mean, input_inv_std;
  std::vector<Linear> hidden;
  Linear mode_head, draft_head;
  nlohmann::json training = nlohmann::json::object();  // provenance (lambda, steps, data), free-form

  // Shapes, sizes, finiteness and the feature list: InvalidArgument naming what is wrong.
  absl::Status Validate() const;
  // The longest prompt it was trained on (training's "lengths"), where the file records them.
  std::optional<int64_t> LongestTrainedPrompt() const;
};

// A network with the given hidden widths, small random weights (seeded) and identity normalisation.
PolicyNetwork RandomPolicyNetwork(std::span<const int64_t> hidden, std::span<const int64_t> draft_lengths,
                                  int64_t segment_len, uint64_t seed);

// Reads and validates a policy file: InvalidArgument (naming the file and the problem) for a file that is not
// a policy, a format version other than this build's, a feature version it does not read, a feature it does
// not compute (or one listed twice), or tensors that are missing, extra,
// misshapen or not finite.
absl::StatusOr<PolicyNetwork> ReadPolicyFile(const std::string& path);
// Writes atomically (the previous file stays intact on failure).
absl::Status WritePolicyFile(const std::string& path, const PolicyNetwork& network);

// The network's forward pass.
class LearnedPolicy {
 public:
  static absl::StatusOr<LearnedPolicy> Create(PolicyNetwork network);  // validates
  const PolicyNetwork& network() const { return net_; }

  struct Output {
    double p_attention = 0;           // probability of attention mode
    std::vector<double> draft_probs;  // over network().draft_lengths (empty without a draft head)
  };
  // `features`: the router::kNumFeatures values router::Featurize writes (the network reads its own).
  void Evaluate(std::span<const float> features, Output* out) const;

 private:
  explicit LearnedPolicy(PolicyNetwork net);
  PolicyNetwork net_;
  std::vector<int> inputs_;  // of each of net_.features, its place in router::kFeatureNames
};

// Routes with a LearnedPolicy. By default greedily: attention when p_attention >= 0.5, and the most likely
// draft length. For training, it can instead sample its decisions (a pure function of the seed, the
// sequence, the phase and the position, so replayed prefill decisions repeat) and report each one.
class LearnedRouter final : public router::Router {
 public:
  using Trace = std::function<void(const router::RouterContext&, const router::Decision&)>;
  // exploration e: a sampling router draws attention with probability e/2 + (1 - e) p_attention.
  explicit LearnedRouter(std::shared_ptr<const LearnedPolicy> policy, std::optional<uint64_t> sample_seed = {},
                         Trace trace = {}, double exploration = 0);
  router::Decision Decide(const router::RouterContext& c) const override;
  int64_t max_draft_length() const override;

 private:
  std::shared_ptr<const LearnedPolicy> policy_;
  std::optional<uint64_t> sample_seed_;
  Trace trace_;
  double exploration_;
};

// A decoder routed by `policy` with its segment length.
std::unique_ptr<Decoder> MakeLearnedDecoder(std::shared_ptr<const LearnedPolicy> policy,
                                            std::optional<uint64_t> sample_seed = {},
                                            LearnedRouter::Trace trace = {});
// The same, for users: it warns once, on stderr, when a prompt is more than twice as long as the longest the
// policy was trained on (naming it `name`). Its position and length features are then outside what it saw,
// and its decisions an extrapolation (a policy trained on 1K prompts attended every token at 16K).
std::unique_ptr<Decoder> MakeWarningLearnedDecoder(std::shared_ptr<const LearnedPolicy> policy, std::string_view name);
// Parses learned:PATH and loads the file (a decoder of MakeWarningLearnedDecoder).
absl::StatusOr<std::unique_ptr<Decoder>> MakeLearnedPolicy(std::string_view policy);

}  // namespace oryx::policies
