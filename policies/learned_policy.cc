#include "policies/learned_policy.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>

#include "Eigen/Core"
#include "base/rng.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/json_text.h"
#include "engine/safetensors.h"
#include "router/features.h"

namespace oryx::policies {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

absl::Status CheckLinear(const PolicyNetwork::Linear& l, std::string_view name, int64_t in) {
  if (l.in != in || l.out < 1) return absl::InvalidArgumentError(Cat(name, ": expects ", in, " inputs, has ", l.in));
  if (static_cast<int64_t>(l.weight.size()) != l.out * l.in || static_cast<int64_t>(l.bias.size()) != l.out) {
    return absl::InvalidArgumentError(Cat(name, ": weight or bias size does not match [", l.out, ", ", l.in, "]"));
  }
  for (float v : l.weight) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError(Cat(name, ".weight: not finite"));
  }
  for (float v : l.bias) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError(Cat(name, ".bias: not finite"));
  }
  return absl::OkStatus();
}

// Softmax of logits into probabilities (double).
void Softmax(const Eigen::VectorXf& logits, std::vector<double>* p) {
  const float top = logits.maxCoeff();
  p->resize(logits.size());
  double z = 0;
  for (Eigen::Index i = 0; i < logits.size(); ++i) z += (*p)[i] = std::exp(static_cast<double>(logits[i] - top));
  for (double& v : *p) v /= z;
}

Eigen::VectorXf Apply(const PolicyNetwork::Linear& l, const Eigen::VectorXf& x) {
  Eigen::Map<const RowMatrix> w(l.weight.data(), l.out, l.in);
  return w * x + Eigen::Map<const Eigen::VectorXf>(l.bias.data(), l.out);
}

}  // namespace

int64_t FeatureIndex(std::string_view name) {
  const auto it = std::find(router::kFeatureNames.begin(), router::kFeatureNames.end(), name);
  return it == router::kFeatureNames.end() ? -1 : it - router::kFeatureNames.begin();
}

absl::Status PolicyNetwork::Validate() const {
  const int64_t F = static_cast<int64_t>(features.size());
  for (int64_t i = 0; i < F; ++i) {
    if (FeatureIndex(features[i]) < 0) {
      return absl::InvalidArgumentError(Cat("feature ", i, " of the policy, '", features[i],
                                            "', is not one this build computes (feature version ",
                                            router::kFeatureVersion, ")"));
    }
    if (std::find(features.begin(), features.begin() + i, features[i]) != features.begin() + i) {
      return absl::InvalidArgumentError(Cat("feature '", features[i], "' is listed twice"));
    }
  }
  if (segment_len < 1) return absl::InvalidArgumentError(Cat("segment_len ", segment_len, " must be >= 1"));
  if (tail_len < 0 || (tail_len > 0 && tail_len >= segment_len)) {
    return absl::InvalidArgumentError(Cat("tail_len ", tail_len, " must be 0 or below segment_len ", segment_len));
  }
  for (int64_t k : draft_lengths) {
    if (k < 0 || k > 64) return absl::InvalidArgumentError(Cat("draft length ", k, " outside [0, 64]"));
  }
  if (static_cast<int64_t>(input_mean.size()) != F || static_cast<int64_t>(input_inv_std.size()) != F) {
    return absl::InvalidArgumentError(Cat("input.mean and input.inv_std must have ", F, " values"));
  }
  for (int64_t i = 0; i < F; ++i) {
    if (!std::isfinite(input_mean[i]) || !std::isfinite(input_inv_std[i])) {
      return absl::InvalidArgumentError(Cat("input normalisation of feature '", features[i], "' is not finite"));
    }
  }
  int64_t width = F;
  for (size_t i = 0; i < hidden.size(); ++i) {
    ORYX_RETURN_IF_ERROR(CheckLinear(hidden[i], Cat("hidden.", i), width));
    width = hidden[i].out;
  }
  ORYX_RETURN_IF_ERROR(CheckLinear(mode_head, "mode", width));
  if (mode_head.out != 2) return absl::InvalidArgumentError(Cat("mode head has ", mode_head.out, " outputs, not 2"));
  if (draft_lengths.size() >= 2) {
    ORYX_RETURN_IF_ERROR(CheckLinear(draft_head, "draft", width));
    if (draft_head.out != static_cast<int64_t>(draft_lengths.size())) {
      return absl::InvalidArgumentError(
          Cat("draft head has ", draft_head.out, " outputs for ", draft_lengths.size(), " draft lengths"));
    }
  } else if (!draft_head.weight.empty()) {
    return absl::InvalidArgumentError("a draft head without at least two draft_lengths");
  }
  return absl::OkStatus();
}

std::optional<int64_t> PolicyNetwork::LongestTrainedPrompt() const {
  const auto it = training.find("lengths");
  if (it == training.end() || !it->is_array() || it->empty()) return std::nullopt;
  int64_t longest = 0;
  for (const nlohmann::json& length : *it) {
    if (!length.is_number_integer()) return std::nullopt;
    longest = std::max(longest, length.get<int64_t>());
  }
  return longest;
}

PolicyNetwork RandomPolicyNetwork(std::span<const int64_t> hidden, std::span<const int64_t> draft_lengths,
                                  int64_t segment_len, uint64_t seed) {
  Rng rng(seed);
  auto linear = [&](int64_t out, int64_t in) {
    PolicyNetwork::Linear l{out, in, std::vector<float>(out * in), std::vector<float>(out, 0.0f)};
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    for (float& w : l.weight) w = static_cast<float>((2 * rng.UniformDouble() - 1) * bound);
    return l;
  };
  PolicyNetwork n;
  n.features.assign(router::kFeatureNames.begin(), router::kFeatureNames.end());
  n.segment_len = segment_len;
  n.draft_lengths.assign(draft_lengths.begin(), draft_lengths.end());
  n.input_mean.assign(router::kNumFeatures, 0.0f);
  n.input_inv_std.assign(router::kNumFeatures, 1.0f);
  int64_t width = router::kNumFeatures;
  for (int64_t h : hidden) {
    n.hidden.push_back(linear(h, width));
    width = h;
  }
  n.mode_head = linear(2, width);
  if (n.draft_lengths.size() >= 2) n.draft_head = linear(static_cast<int64_t>(n.draft_lengths.size()), width);
  return n;
}

// ---------------------------------------------------------------------------------------------------------
// The file

absl::Status WritePolicyFile(const std::string& path, const PolicyNetwork& n) {
  ORYX_RETURN_IF_ERROR(n.Validate());
  std::vector<HostTensor> tensors;
  auto add = [&](std::string name, std::vector<int64_t> shape, const std::vector<float>& values) {
    tensors.push_back(MakeHostTensor(std::move(name), std::move(shape), values, DType::kF32));
  };
  const int64_t F = router::kNumFeatures;
  add("input.mean", {F}, n.input_mean);
  add("input.inv_std", {F}, n.input_inv_std);
  auto add_linear = [&](const std::string& name, const PolicyNetwork::Linear& l) {
    add(name + ".weight", {l.out, l.in}, l.weight);
    add(name + ".bias", {l.out}, l.bias);
  };
  for (size_t i = 0; i < n.hidden.size(); ++i) add_linear(Cat("hidden.", i), n.hidden[i]);
  add_linear("mode", n.mode_head);
  if (n.draft_lengths.size() >= 2) add_linear("draft", n.draft_head);
  const nlohmann::json meta = {{"format", kPolicyFormat},
                               {"version", kPolicyVersion},
                               {"feature_version", router::kFeatureVersion},
                               {"features", n.features},
                               {"activation", "tanh"},
                               {"segment_len", n.segment_len},
                               {"tail_len", n.tail_len},
                               {"draft_lengths", n.draft_lengths},
                               {"training", n.training}};
  return WriteSafetensors(path, Views(tensors), {{std::string(kPolicyMetadataKey), JsonText(meta)}});
}

absl::StatusOr<PolicyNetwork> ReadPolicyFile(const std::string& path) {
  auto fail = [&](const absl::Status& s) {
    return absl::InvalidArgumentError(Cat("policy file ", path, ": ", s.message()));
  };
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) return fail(file.status());
  const auto& metadata = file->header().metadata;
  const auto it = metadata.find(std::string(kPolicyMetadataKey));
  if (it == metadata.end()) return fail(absl::InvalidArgumentError(Cat("no '", kPolicyMetadataKey, "' metadata: not a router policy")));
  PolicyNetwork n;
  try {
    const nlohmann::json meta = nlohmann::json::parse(it->second);
    if (meta.at("format").get<std::string>() != kPolicyFormat) {
      return fail(absl::InvalidArgumentError(Cat("format is '", meta.at("format").get<std::string>(), "', not '", kPolicyFormat, "'")));
    }
    if (const int v = meta.at("version").get<int>(); v != kPolicyVersion) {
      return fail(absl::InvalidArgumentError(Cat("format version ", v, "; this build reads version ", kPolicyVersion)));
    }
    if (const int v = meta.at("feature_version").get<int>(); v < kOldestFeatureVersion || v > router::kFeatureVersion) {
      return fail(absl::InvalidArgumentError(Cat("feature version ", v, "; this build reads versions ",
                                                 kOldestFeatureVersion, " to ", router::kFeatureVersion)));
    }
    if (meta.at("activation").get<std::string>() != "tanh") {
      return fail(absl::InvalidArgumentError(Cat("activation '", meta.at("activation").get<std::string>(), "' (only tanh)")));
    }
    n.features = meta.at("features").get<std::vector<std::string>>();
    n.segment_len = meta.at("segment_len").get<int64_t>();
    n.tail_len = meta.value("tail_len", int64_t{0});
    n.draft_lengths = meta.at("draft_lengths").get<std::vector<int64_t>>();
    if (meta.contains("training")) n.training = meta.at("training");
  } catch (const nlohmann::json::exception& e) {
    return fail(absl::InvalidArgumentError(Cat("bad metadata JSON: ", e.what())));
  }
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> tensors;
  for (const TensorInfo& info : file->header().tensors) {
    if (info.dtype != DType::kF32) return fail(absl::InvalidArgumentError(Cat("tensor ", info.name, " is not F32")));
    tensors[info.name] = {info.shape, TensorToFloats(file->View(info))};
  }
  auto take = [&](const std::string& name, std::vector<int64_t>* shape) -> absl::StatusOr<std::vector<float>> {
    auto t = tensors.find(name);
    if (t == tensors.end()) return absl::InvalidArgumentError(Cat("missing tensor ", name));
    *shape = t->second.first;
    std::vector<float> v = std::move(t->second.second);
    tensors.erase(t);
    return v;
  };
  auto take_linear = [&](const std::string& name) -> absl::StatusOr<PolicyNetwork::Linear> {
    std::vector<int64_t> ws, bs;
    PolicyNetwork::Linear l;
    ORYX_ASSIGN_OR_RETURN(l.weight, take(name + ".weight", &ws));
    ORYX_ASSIGN_OR_RETURN(l.bias, take(name + ".bias", &bs));
    if (ws.size() != 2 || bs.size() != 1 || bs[0] != ws[0]) {
      return absl::InvalidArgumentError(Cat(name, ": weight must be [out, in] and bias [out]"));
    }
    l.out = ws[0], l.in = ws[1];
    return l;
  };
  absl::Status s = [&]() -> absl::Status {
    std::vector<int64_t> shape;
    ORYX_ASSIGN_OR_RETURN(n.input_mean, take("input.mean", &shape));
    ORYX_ASSIGN_OR_RETURN(n.input_inv_std, take("input.inv_std", &shape));
    for (int i = 0; tensors.count(Cat("hidden.", i, ".weight")); ++i) {
      ORYX_ASSIGN_OR_RETURN(PolicyNetwork::Linear l, take_linear(Cat("hidden.", i)));
      n.hidden.push_back(std::move(l));
    }
    ORYX_ASSIGN_OR_RETURN(n.mode_head, take_linear("mode"));
    if (n.draft_lengths.size() >= 2) {
      ORYX_ASSIGN_OR_RETURN(n.draft_head, take_linear("draft"));
    }
    if (!tensors.empty()) return absl::InvalidArgumentError(Cat("unexpected tensor ", tensors.begin()->first));
    return n.Validate();
  }();
  if (!s.ok()) return fail(s);
  return n;
}

// ---------------------------------------------------------------------------------------------------------
// Evaluation

absl::StatusOr<LearnedPolicy> LearnedPolicy::Create(PolicyNetwork network) {
  ORYX_RETURN_IF_ERROR(network.Validate());
  return LearnedPolicy(std::move(network));
}

LearnedPolicy::LearnedPolicy(PolicyNetwork net) : net_(std::move(net)) {
  for (const std::string& name : net_.features) inputs_.push_back(static_cast<int>(FeatureIndex(name)));
}

void LearnedPolicy::Evaluate(std::span<const float> features, Output* out) const {
  const int64_t F = static_cast<int64_t>(inputs_.size());
  Eigen::VectorXf x(F);
  for (int64_t i = 0; i < F; ++i) x[i] = features[inputs_[i]];
  x = (x - Eigen::Map<const Eigen::VectorXf>(net_.input_mean.data(), F))
          .cwiseProduct(Eigen::Map<const Eigen::VectorXf>(net_.input_inv_std.data(), F));
  for (const PolicyNetwork::Linear& l : net_.hidden) x = Apply(l, x).array().tanh().matrix();
  std::vector<double> mode;
  Softmax(Apply(net_.mode_head, x), &mode);
  out->p_attention = mode[static_cast<int>(Mode::kAttention)];
  if (net_.draft_lengths.size() >= 2) {
    Softmax(Apply(net_.draft_head, x), &out->draft_probs);
  } else {
    out->draft_probs.clear();
  }
}

LearnedRouter::LearnedRouter(std::shared_ptr<const LearnedPolicy> policy, std::optional<uint64_t> sample_seed,
                             Trace trace, double exploration)
    : policy_(std::move(policy)), sample_seed_(sample_seed), trace_(std::move(trace)), exploration_(exploration) {}

int64_t LearnedRouter::max_draft_length() const {
  int64_t k = 0;
  for (int64_t d : policy_->network().draft_lengths) k = std::max(k, d);
  return policy_->network().draft_lengths.size() >= 2 ? k : 0;
}

router::Decision LearnedRouter::Decide(const router::RouterContext& c) const {
  float features[router::kNumFeatures];
  router::Featurize(c, features);
  LearnedPolicy::Output out;
  policy_->Evaluate(features, &out);
  router::Decision d;
  const auto& lengths = policy_->network().draft_lengths;
  if (sample_seed_) {
    Rng rng(MixSeed({*sample_seed_, c.sequence_hash, static_cast<uint64_t>(c.phase),
                                   static_cast<uint64_t>(c.position)}));
    const double p = exploration_ / 2 + (1 - exploration_) * out.p_attention;
    d.mode = rng.UniformDouble() < p ? Mode::kAttention : Mode::kLinear;
    if (!out.draft_probs.empty()) {
      double u = rng.UniformDouble();
      size_t i = 0;
      while (i + 1 < out.draft_probs.size() && u >= out.draft_probs[i]) u -= out.draft_probs[i++];
      d.draft_length = lengths[i];
    }
  } else {
    d.mode = out.p_attention >= 0.5 ? Mode::kAttention : Mode::kLinear;
    if (!out.draft_probs.empty()) {
      d.draft_length = lengths[std::max_element(out.draft_probs.begin(), out.draft_probs.end()) - out.draft_probs.begin()];
    }
  }
  if (c.phase == router::Phase::kPrefill || d.mode == Mode::kLinear) d.draft_length = 0;
  if (trace_) trace_(c, d);
  return d;
}

std::unique_ptr<Decoder> MakeLearnedDecoder(std::shared_ptr<const LearnedPolicy> policy,
                                            std::optional<uint64_t> sample_seed, LearnedRouter::Trace trace) {
  router::RouterOptions options;
  options.segment_len = policy->network().segment_len;
  options.tail_len = policy->network().tail_len;
  return std::make_unique<router::RouterDecoder>(
      std::make_unique<LearnedRouter>(std::move(policy), sample_seed, std::move(trace)), std::move(options));
}

std::unique_ptr<Decoder> MakeWarningLearnedDecoder(std::shared_ptr<const LearnedPolicy> policy, std::string_view name) {
  const std::optional<int64_t> trained = policy->network().LongestTrainedPrompt();
  LearnedRouter::Trace warn;
  if (trained) {
    warn = [name = std::string(name), trained = *trained, warned = std::make_shared<std::atomic<bool>>(false)](
               const router::RouterContext& c, const router::Decision&) {
      if (c.prompt_len <= 2 * trained || warned->exchange(true)) return;
      std::fprintf(stderr,
                   "oryx: warning: policy %s was trained on prompts of up to %lld tokens; this one has %lld, and "
                   "its decisions on prompts this long are an extrapolation (train-router --lengths covers them)\n",
                   name.c_str(), static_cast<long long>(trained), static_cast<long long>(c.prompt_len));
    };
  }
  return MakeLearnedDecoder(std::move(policy), std::nullopt, std::move(warn));
}

absl::StatusOr<std::unique_ptr<Decoder>> MakeLearnedPolicy(std::string_view policy) {
  if (!policy.starts_with("learned:") || policy.size() == std::string_view("learned:").size()) {
    return absl::InvalidArgumentError(Cat("policy '", policy, "': learned:PATH needs the path of a policy file"));
  }
  ORYX_ASSIGN_OR_RETURN(PolicyNetwork net, ReadPolicyFile(std::string(policy.substr(8))));
  ORYX_ASSIGN_OR_RETURN(LearnedPolicy p, LearnedPolicy::Create(std::move(net)));
  return MakeWarningLearnedDecoder(std::make_shared<const LearnedPolicy>(std::move(p)), policy);
}

}  // namespace oryx::policies
