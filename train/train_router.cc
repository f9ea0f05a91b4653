#include "train/train_router.h"

#include <torch/torch.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>

#include "engine/engine.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "absl/strings/str_join.h"
#include "policies/learned_policy.h"
#include "policies/rule_policies.h"
#include "policies/task_episodes.h"
#include "router/cost_model.h"
#include "router/features.h"
#include "base/rng.h"
#include "tasks/task_mix.h"
#include "train/pareto.h"
#include "train/router_labels.h"
#include "train/shards.h"
#include "train/task_data.h"
#include "engine/json_text.h"

namespace oryx::policies {

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }
constexpr int64_t F = router::kNumFeatures;

// ---- Episodes ------------------------------------------------------------------------------------------

// One episode's input. Generated episodes (needle tasks, text): `prompt` routed, then `answer.size()` tokens
// generated greedily and compared with `answer`: position by position for a needle's answer; for text
// (whose answer is the all-attention continuation, filled in by EpisodeRunner::FillReferences) the share
// that agrees before the first difference, since after it a continuation is a different text and a
// position-by-position match would be noise. Teacher-forced episodes (MQAR): `task`.
struct Example {
  std::string name;  // the task's name
  bool teacher_forced = false;
  bool prefix_quality = false;
  tasks::TaskExample task;
  std::vector<int32_t> prompt, answer;
  int64_t generate = 0;  // tokens to generate
};

// One decision of an episode: what the router saw, what it chose and what it cost (in the run's cost unit).
struct Step {
  std::vector<float> features;
  Mode mode = Mode::kLinear;
  int64_t draft_index = -1;  // index into the draft lengths, for decode decisions in attention mode
  double cost = 0;
};
// Decisions by (phase, position): replayed prefill decisions land on the same key.
using StepKey = std::pair<int, int64_t>;
StepKey KeyOf(const router::RouterContext& c) { return {static_cast<int>(c.phase), c.position}; }

// A lambda as a seed word (its bits), so that what a lambda draws does not depend on its place in --lambda.
uint64_t LambdaKey(double lambda) { return std::bit_cast<uint64_t>(lambda); }

struct Episode {
  std::map<StepKey, Step> steps;
  std::vector<int32_t> output;  // generated episodes: the tokens generated
  bool correct = false;         // the answer exactly
  double quality = 0;           // the share of answer tokens right (partial credit; see Example)
  double attention_fraction = 0;
  double cost = 0;              // relative to all-attention (the run's cost kind)
  int64_t drafted = 0, accepted = 0;
  double Reward(double lambda) const { return quality - lambda * cost; }
};

// A router whose decisions come from a function of the context.
class FunctionRouter final : public router::Router {
 public:
  using Fn = std::function<router::Decision(const router::RouterContext&)>;
  FunctionRouter(Fn fn, int64_t max_draft) : fn_(std::move(fn)), max_draft_(max_draft) {}
  router::Decision Decide(const router::RouterContext& c) const override { return fn_(c); }
  int64_t max_draft_length() const override { return max_draft_; }

 private:
  Fn fn_;
  int64_t max_draft_;
};

enum class CostKind { kAttention, kTime, kBytes };

// What forwards cost: a decision's own cost, and a whole episode's when run all in attention mode (the
// normaliser). Attention cost counts attention tokens; time and bytes cost each forward's span.
class Costs {
 public:
  Costs(CostKind kind, const ModelConfig& config, std::optional<router::CostModel> model, int64_t segment_len,
        int64_t tail_len)
      : kind_(kind), config_(config), model_(std::move(model)), segment_len_(segment_len), tail_len_(tail_len) {}

  CostKind kind() const { return kind_; }
  // Time and bytes only (an attention-share cost is the episode's share, counted by the engine).
  double Decision(const router::RouterContext& c, const router::Decision& d) const {
    if (kind_ == CostKind::kAttention) return 0;
    if (d.draft_length <= 0) return Span({1, c.segment_tokens, c.position, d.mode});
    double s = Span({1, d.draft_length + 1, c.position, Mode::kAttention, /*all_logits=*/true});  // the verify span
    for (int64_t i = 0; i < d.draft_length; ++i) s += Span({1, 1, c.position + i, Mode::kLinear});
    return s;
  }
  // An episode of a `prompt_len`-token prompt routed in segments, then `generated` tokens (the first
  // predicted by the prompt's last token), all in attention mode without speculation.
  double AllAttention(int64_t prompt_len, int64_t generated) const {
    double s = 0;
    for (int64_t start = 0; start < prompt_len;) {
      const int64_t n = router::PrefillSegmentTokens(start, prompt_len, segment_len_, tail_len_);
      s += Span({1, n, start, Mode::kAttention});
      start += n;
    }
    for (int64_t g = 1; g < generated; ++g) s += Span({1, 1, prompt_len + g - 1, Mode::kAttention});
    return s;
  }

 private:
  double Span(const router::SpanShape& shape) const {
    return kind_ == CostKind::kTime ? model_->PredictSeconds(shape) : router::SpanBytes(config_, shape);
  }
  CostKind kind_;
  ModelConfig config_;
  std::optional<router::CostModel> model_;
  int64_t segment_len_, tail_len_;
};

// Runs episodes through the engine with a router per episode whose every decision is recorded.
class EpisodeRunner {
 public:
  EpisodeRunner(Engine* engine, int64_t segment_len, int64_t tail_len, const Costs* costs,
                std::vector<int64_t> draft_lengths)
      : engine_(engine),
        segment_len_(segment_len),
        tail_len_(tail_len),
        costs_(costs),
        draft_lengths_(std::move(draft_lengths)) {}

  int64_t max_draft() const {
    return draft_lengths_.empty() ? 0 : *std::max_element(draft_lengths_.begin(), draft_lengths_.end());
  }
  int64_t DraftIndex(int64_t length) const {
    const auto it = std::find(draft_lengths_.begin(), draft_lengths_.end(), length);
    return it == draft_lengths_.end() ? -1 : it - draft_lengths_.begin();
  }

  // make_router(i, trace) builds episode i's router around the trace it must call on every decision.
  using MakeRouter = std::function<std::unique_ptr<router::Router>(size_t i, LearnedRouter::Trace trace)>;

  absl::StatusOr<std::vector<Episode>> Run(const std::vector<const Example*>& examples, const MakeRouter& make_router) {
    std::vector<Episode> episodes(examples.size());
    std::vector<size_t> generated, forced;
    for (size_t i = 0; i < examples.size(); ++i) (examples[i]->teacher_forced ? forced : generated).push_back(i);
    ORYX_RETURN_IF_ERROR(RunGenerated(examples, generated, make_router, episodes));
    ORYX_RETURN_IF_ERROR(RunTeacherForced(examples, forced, make_router, episodes));
    for (size_t i = 0; i < examples.size(); ++i) {
      Episode& e = episodes[i];
      const Example& x = *examples[i];
      if (costs_->kind() == CostKind::kAttention) {
        e.cost = e.attention_fraction;  // verify spans included
        continue;
      }
      double cost = 0;
      for (const auto& [key, s] : e.steps) cost += s.cost;
      const int64_t prompt_len = x.teacher_forced ? static_cast<int64_t>(x.task.ids.size()) - 1
                                                  : static_cast<int64_t>(x.prompt.size());
      e.cost = cost / costs_->AllAttention(prompt_len, x.teacher_forced ? 0 : x.generate);
    }
    return episodes;
  }

  // Sets the answer of every text example without one: its all-attention greedy continuation.
  absl::Status FillReferences(std::vector<Example>& examples) {
    std::vector<Example*> todo;
    for (Example& x : examples) {
      if (!x.teacher_forced && x.answer.empty()) todo.push_back(&x);
    }
    if (todo.empty()) return absl::OkStatus();
    ORYX_ASSIGN_OR_RETURN(std::vector<Episode> runs, Run({todo.begin(), todo.end()}, [](size_t, LearnedRouter::Trace) {
      return std::make_unique<FunctionRouter>([](const router::RouterContext&) { return router::Decision{}; }, 0);
    }));
    for (size_t i = 0; i < todo.size(); ++i) todo[i]->answer = std::move(runs[i].output);
    return absl::OkStatus();
  }

 private:
  LearnedRouter::Trace TraceInto(Episode* e) const {
    return [this, e](const router::RouterContext& c, const router::Decision& d) {
      Step s{std::vector<float>(F), d.mode, -1, costs_->Decision(c, d)};
      if (c.phase == router::Phase::kDecode && d.mode == Mode::kAttention) s.draft_index = DraftIndex(d.draft_length);
      router::Featurize(c, s.features);
      e->steps[KeyOf(c)] = std::move(s);
    };
  }
  std::unique_ptr<Decoder> MakeDecoder(std::shared_ptr<router::Router> r) const {
    // The decoder owns a router; this one forwards to the shared episode router.
    struct Forward final : router::Router {
      std::shared_ptr<router::Router> inner;
      router::Decision Decide(const router::RouterContext& c) const override { return inner->Decide(c); }
      int64_t max_draft_length() const override { return inner->max_draft_length(); }
    };
    auto f = std::make_unique<Forward>();
    f->inner = std::move(r);
    router::RouterOptions ro;
    ro.segment_len = segment_len_;
    ro.tail_len = tail_len_;
    return std::make_unique<router::RouterDecoder>(std::move(f), ro);
  }

  absl::Status RunGenerated(const std::vector<const Example*>& examples, std::span<const size_t> which,
                            const MakeRouter& make_router, std::vector<Episode>& episodes) {
    constexpr size_t kGroup = 64;  // requests per Generate call (bounds the KV memory)
    for (size_t begin = 0; begin < which.size(); begin += kGroup) {
      const size_t end = std::min(which.size(), begin + kGroup);
      std::vector<GenerateRequest> requests(end - begin);
      for (size_t j = begin; j < end; ++j) {
        const size_t i = which[j];
        GenerateRequest& q = requests[j - begin];
        q.prompt_tokens = examples[i]->prompt;
        q.max_tokens = examples[i]->generate;
        q.stop_at_eos = false;
        q.policy = Cat("episode-", j - begin);
        std::shared_ptr<router::Router> r = make_router(i, TraceInto(&episodes[i]));
        engine_->policies().Register(q.policy, "episode", [this, r](std::string_view) {
          return absl::StatusOr<std::unique_ptr<Decoder>>(MakeDecoder(r));
        });
      }
      ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> results, engine_->Generate(requests));
      for (size_t j = begin; j < end; ++j) {
        GenerateResult& r = results[j - begin];
        Episode& e = episodes[which[j]];
        const std::vector<int32_t>& answer = examples[which[j]]->answer;
        e.correct = r.tokens == answer;
        int64_t right = 0;
        if (examples[which[j]]->prefix_quality) {
          while (right < static_cast<int64_t>(std::min(answer.size(), r.tokens.size())) && r.tokens[right] == answer[right]) ++right;
        } else {
          for (size_t t = 0; t < answer.size() && t < r.tokens.size(); ++t) right += r.tokens[t] == answer[t];
        }
        e.quality = answer.empty() ? 0.0 : static_cast<double>(right) / static_cast<double>(answer.size());
        e.attention_fraction = r.stats.attention_fraction();
        if (r.stats.spec) e.drafted = r.stats.spec->drafted, e.accepted = r.stats.spec->accepted;
        e.output = std::move(r.tokens);
      }
    }
    return absl::OkStatus();
  }

  absl::Status RunTeacherForced(const std::vector<const Example*>& examples, std::span<const size_t> which,
                                const MakeRouter& make_router, std::vector<Episode>& episodes) {
    std::vector<const tasks::TaskExample*> subset;
    std::vector<std::vector<Mode>> modes;
    for (size_t i : which) {
      const std::vector<int32_t>& ids = examples[i]->task.ids;
      subset.push_back(&examples[i]->task);
      modes.emplace_back(ids.size() - 1);
      MakeDecoder(make_router(i, TraceInto(&episodes[i])))
          ->PrefillModes(std::span(ids.data(), ids.size() - 1), 0, modes.back());
    }
    ORYX_ASSIGN_OR_RETURN(std::vector<AnswerScore> scores, ScoreTeacherForced(engine_->backend(), subset, modes));
    for (size_t j = 0; j < which.size(); ++j) {
      Episode& e = episodes[which[j]];
      e.correct = scores[j].right == scores[j].asked;
      e.quality = static_cast<double>(scores[j].right) / static_cast<double>(scores[j].asked);
      e.attention_fraction = static_cast<double>(std::count(modes[j].begin(), modes[j].end(), Mode::kAttention)) /
                             static_cast<double>(modes[j].size());
    }
    return absl::OkStatus();
  }

  Engine* engine_;
  int64_t segment_len_, tail_len_;
  const Costs* costs_;
  std::vector<int64_t> draft_lengths_;
};

// The counterfactual bases: prefill-linear (the prompt linear, its last token and the answer in attention
// mode, drafting `draft` tokens per round when > 0), all-linear and all-attention. Each finds what one
// flipped decision is worth next to it: a text continuation agrees with the all-attention one only when
// most of the prompt ran in attention, which no single flip away from the first two shows. With
// TrainRouterOptions::warm_tail, also the rule tail:N (N = the tail length): what each decision
// is worth next to a prompt whose last segment attends.
enum class Base { kPrefillLinear, kLinear, kAttention, kTail };
constexpr int kBases = 4;

// The decode counterfactuals past all-attention and all-linear decoding: the entropy:TAU rule, prefill-linear
// whose answer attends only where the last distribution had more than tau nats of entropy. Each example's
// decode decisions are labelled with its best variant's, so that the warm start can learn token-by-token
// decode choices, which one flip of the whole answer cannot show.
constexpr double kDecodeEntropyTaus[] = {0.5, 1, 2, 4};
constexpr size_t kDecodeVariants = std::size(kDecodeEntropyTaus);
router::Decision BaseDecision(Base base, const router::RouterContext& c, int64_t draft = 0, int64_t tail = 0) {
  if (base == Base::kTail) return policies::TailRouter(tail).Decide(c);
  const bool attend = base == Base::kAttention ||
                      (base == Base::kPrefillLinear && (c.phase == router::Phase::kDecode || c.last_prompt_token));
  return {attend ? Mode::kAttention : Mode::kLinear, attend && c.phase == router::Phase::kDecode ? draft : 0};
}

// ---- The network in LibTorch, the same function as LearnedPolicy ---------------------------------------

struct NetImpl : torch::nn::Module {
  NetImpl(const std::vector<int64_t>& widths, int64_t draft_choices) {
    int64_t in = F;
    for (size_t i = 0; i < widths.size(); ++i) {
      hidden.push_back(register_module(Cat("hidden", i), torch::nn::Linear(in, widths[i])));
      in = widths[i];
    }
    mode = register_module("mode", torch::nn::Linear(in, 2));
    if (draft_choices >= 2) draft = register_module("draft", torch::nn::Linear(in, draft_choices));
    mean = register_buffer("mean", torch::zeros({F}));
    inv_std = register_buffer("inv_std", torch::ones({F}));
  }
  // [N, F] -> mode logits [N, 2] (linear, attention) and draft-length logits [N, n] (undefined without a
  // draft head).
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    x = (x - mean) * inv_std;
    for (auto& l : hidden) x = torch::tanh(l->forward(x));
    return {mode->forward(x), draft ? draft->forward(x) : torch::Tensor()};
  }
  std::vector<torch::nn::Linear> hidden;
  torch::nn::Linear mode{nullptr}, draft{nullptr};
  torch::Tensor mean, inv_std;
};
TORCH_MODULE(Net);

std::vector<float> Floats(const torch::Tensor& t) {
  torch::Tensor c = t.detach().to(torch::kFloat32).contiguous().cpu();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

PolicyNetwork Export(Net& net, const TrainRouterOptions& o) {
  PolicyNetwork n;
  n.features.assign(router::kFeatureNames.begin(), router::kFeatureNames.end());
  n.segment_len = o.segment_len;
  n.tail_len = o.tail_len;
  n.input_mean = Floats(net->mean);
  n.input_inv_std = Floats(net->inv_std);
  auto linear = [](torch::nn::Linear& l) {
    return PolicyNetwork::Linear{l->weight.size(0), l->weight.size(1), Floats(l->weight), Floats(l->bias)};
  };
  for (auto& l : net->hidden) n.hidden.push_back(linear(l));
  n.mode_head = linear(net->mode);
  if (net->draft) {
    n.draft_lengths = o.draft_lengths;
    n.draft_head = linear(net->draft);
  }
  return n;
}

// A network as the routers that share it read it.
absl::StatusOr<std::shared_ptr<const LearnedPolicy>> SharedPolicy(PolicyNetwork network) {
  ORYX_ASSIGN_OR_RETURN(LearnedPolicy policy, LearnedPolicy::Create(std::move(network)));
  return std::make_shared<const LearnedPolicy>(std::move(policy));
}

// Features [N, F], chosen modes [N] and draft indices [N] (-1 where the draft head was not asked).
void Stack(const std::vector<const Step*>& steps, torch::Tensor* x, torch::Tensor* a, torch::Tensor* k = nullptr) {
  std::vector<float> flat;
  std::vector<int64_t> modes, drafts;
  for (const Step* s : steps) {
    flat.insert(flat.end(), s->features.begin(), s->features.end());
    modes.push_back(static_cast<int64_t>(s->mode));
    drafts.push_back(s->draft_index);
  }
  const int64_t n = static_cast<int64_t>(steps.size());
  *x = torch::from_blob(flat.data(), {n, F}, torch::kFloat32).clone();
  *a = torch::tensor(modes, torch::kInt64);
  if (k) *k = torch::tensor(drafts, torch::kInt64);
}

// Weighted cross-entropy sum(w * CE(logits, y)) over the rows where y >= 0 (w sums to 1 over them).
torch::Tensor WeightedCrossEntropy(const torch::Tensor& logits, const torch::Tensor& y, const torch::Tensor& w) {
  const torch::Tensor valid = y >= 0;
  const torch::Tensor ce = torch::nn::functional::cross_entropy(
      logits, y.clamp_min(0), torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (w * ce * valid.to(torch::kFloat32)).sum();
}

// ---- Labels --------------------------------------------------------------------------------------------

// Supervised labels for the network, each weighted by its stake in reward units at one lambda: mode labels
// (flipped prefill decisions and decode decisions) and draft-length labels, from the warm start's
// counterfactuals.
struct Labels {
  std::vector<const Step*> steps;  // mode head (into the episodes labelled)
  std::vector<int64_t> modes;      // 1: attention
  std::vector<float> weights;
  std::vector<bool> in_decode;  // the label of a decode decision, else of a prefill flip
  std::vector<const Step*> draft_steps;
  std::vector<int64_t> drafts;
  std::vector<float> draft_weights;

  // A decision of `base` against `flipped`, the same episode with that decision flipped: attention where
  // attention's reward is higher, weighted by the margin |gain - lambda * cost|. A decision that helps one
  // example in five by a third of its answer then outweighs the four where it changes nothing (whose weight
  // is only its small cost), so the classifier follows the expected gain rather than the majority of examples.
  void AddFlip(const Episode& base, const Episode& flipped, StepKey key, double lambda) {
    const Step& s = base.steps.at(key);
    const double gain = flipped.Reward(lambda) - base.Reward(lambda);
    const double margin = s.mode == Mode::kAttention ? -gain : gain;  // attention's reward over linear's
    steps.push_back(&s);
    modes.push_back(margin > 0 ? 1 : 0);
    weights.push_back(static_cast<float>(std::abs(margin)));
    in_decode.push_back(false);
  }
  // One example's answer decoded by several policies: the best one's decode decisions at this lambda,
  // weighted by DecodeLabelWeights.
  void AddDecode(std::span<const Episode* const> variants, double lambda) {
    const auto decode = static_cast<int>(router::Phase::kDecode);
    std::vector<AnswerDecoding> decodings(variants.size());
    size_t best = 0;
    for (size_t v = 0; v < variants.size(); ++v) {
      decodings[v].reward = variants[v]->Reward(lambda);
      for (const auto& [key, s] : variants[v]->steps) {
        if (key.first == decode) decodings[v].modes[key.second] = s.mode;
      }
      if (decodings[v].reward > decodings[best].reward) best = v;
    }
    for (const auto& [position, weight] : DecodeLabelWeights(decodings, best)) {
      const Step& s = variants[best]->steps.at({decode, position});
      steps.push_back(&s);
      modes.push_back(s.mode == Mode::kAttention ? 1 : 0);
      weights.push_back(static_cast<float>(weight));
      in_decode.push_back(true);
    }
  }
  // One example run by a chain of schedules, each attending a superset of the decisions of the one before
  // it (all-linear, prefill-linear, the tails, all-attention): where two neighbours differ, attention where the
  // later one's reward is higher, weighted by that margin shared among the decisions they differ in. These are
  // AddFlip's cost-sensitive labels with a band of decisions flipped at once, from episodes already run; the
  // steps come from the neighbour with the higher reward (a band of the prompt: the same features in both).
  void AddChain(std::span<const Episode* const> chain, double lambda) {
    for (size_t j = 1; j < chain.size(); ++j) {
      const Episode& a = *chain[j - 1];
      const Episode& b = *chain[j];
      const double margin = b.Reward(lambda) - a.Reward(lambda);
      const Episode& from = margin > 0 ? b : a;
      const Episode& other = margin > 0 ? a : b;
      std::vector<std::pair<StepKey, const Step*>> differ;
      for (const auto& [key, s] : from.steps) {
        const auto it = other.steps.find(key);
        if (it != other.steps.end() && it->second.mode != s.mode) differ.emplace_back(key, &s);
      }
      for (const auto& [key, s] : differ) {
        steps.push_back(s);
        modes.push_back(margin > 0 ? 1 : 0);
        weights.push_back(static_cast<float>(std::abs(margin) / static_cast<double>(differ.size())));
        in_decode.push_back(key.first == static_cast<int>(router::Phase::kDecode));
      }
    }
  }
  // Every decision of `e` labelled with its own mode, all alike: imitation of the policy that ran it.
  void AddEpisode(const Episode& e) {
    for (const auto& [key, s] : e.steps) {
      steps.push_back(&s);
      modes.push_back(s.mode == Mode::kAttention ? 1 : 0);
      weights.push_back(1.0f);
      in_decode.push_back(key.first == static_cast<int>(router::Phase::kDecode));
    }
  }
  // One example decoded with each draft length: the best length's decisions, labelled with it and weighted
  // by its reward over the mean of all lengths.
  void AddDrafts(std::span<const Episode> by_length, double lambda) {
    size_t best = 0;
    double mean_reward = 0;
    for (size_t j = 0; j < by_length.size(); ++j) {
      mean_reward += by_length[j].Reward(lambda) / static_cast<double>(by_length.size());
      if (by_length[j].Reward(lambda) > by_length[best].Reward(lambda)) best = j;
    }
    for (const auto& [key, s] : by_length[best].steps) {
      if (s.draft_index < 0) continue;
      draft_steps.push_back(&s);
      drafts.push_back(s.draft_index);
      draft_weights.push_back(static_cast<float>(by_length[best].Reward(lambda) - mean_reward));
    }
  }
};

// Fits the network to the labels: `steps` Adam steps of the stake-weighted cross-entropy (weights normalised
// per head). Returns the loss and how closely the net then follows its prefill and decode labels (their
// weights differ by orders of magnitude: a prefill segment's stake against a decode token's share of one
// answer).
nlohmann::json Fit(Net& net, torch::optim::Adam& opt, const Labels& labels, int64_t steps) {
  auto normalised = [](const std::vector<float>& w) {
    torch::Tensor t = torch::tensor(w);
    return t / t.sum().clamp_min(1e-12);
  };
  torch::Tensor x, dx, unused;
  Stack(labels.steps, &x, &unused);
  const torch::Tensor y = torch::tensor(labels.modes, torch::kInt64), w = normalised(labels.weights);
  const bool train_draft = net->draft && !labels.draft_steps.empty();
  torch::Tensor dy, dw;
  if (train_draft) {
    Stack(labels.draft_steps, &dx, &unused);
    dy = torch::tensor(labels.drafts, torch::kInt64), dw = normalised(labels.draft_weights);
  }
  double loss_value = 0;
  for (int64_t step = 0; step < steps; ++step) {
    opt.zero_grad();
    torch::Tensor loss = WeightedCrossEntropy(net->forward(x).first, y, w);
    if (train_draft) loss = loss + WeightedCrossEntropy(net->forward(dx).second, dy, dw);
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
  }
  nlohmann::json r = {{"labels", labels.modes.size()},
                      {"attention_label_share", y.to(torch::kFloat64).mean().item<double>()},
                      {"loss", loss_value}};
  torch::NoGradGuard no_grad;
  const torch::Tensor match = (net->forward(x).first.argmax(-1) == y).to(torch::kFloat64);
  std::vector<double> decode_flags(labels.in_decode.begin(), labels.in_decode.end());
  const torch::Tensor is_decode = torch::tensor(decode_flags, torch::kFloat64);
  auto part = [&](const torch::Tensor& in) {
    const double n = in.sum().item<double>();
    if (n == 0) return nlohmann::json();
    const torch::Tensor pw = w.to(torch::kFloat64) * in;
    const torch::Tensor m = match * in;
    return nlohmann::json{
        {"labels", static_cast<int64_t>(n)},
        {"attention_label_share", (y.to(torch::kFloat64) * in).sum().item<double>() / n},
        {"agreement", m.sum().item<double>() / n},
        {"weighted_agreement", (pw * match).sum().item<double>() / std::max(1e-300, pw.sum().item<double>())},
        {"weight_share", pw.sum().item<double>()}};
  };
  r["prefill_labels"] = part(1 - is_decode);
  r["decode_labels"] = part(is_decode);
  if (train_draft) {
    std::vector<int64_t> counts(net->draft->weight.size(0), 0);
    for (int64_t l : labels.drafts) ++counts[l];
    r["draft_labels_by_length"] = counts;
  }
  return r;
}

// ---- Training state ------------------------------------------------------------------------------------

std::vector<torch::Tensor> CloneParameters(Net& net) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}
void CopyParameters(const std::vector<torch::Tensor>& from, Net& net) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> ps = net->parameters();
  for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(from[i]);
}

// The network a lambda keeps where validation chooses it (TrainRouterOptions::validation_examples): its
// parameters when its validation reward was the highest so far.
struct Kept {
  int64_t iteration = -1;  // 0: the warm start's, i: after REINFORCE iteration i, -1: none yet
  double reward = 0;
  std::vector<torch::Tensor> parameters;
  // TrainRouterOptions::validation_front: the checks no other check dominates on (quality, cost).
  struct Point {
    int64_t iteration = 0;
    double quality = 0, cost = 0;
    std::vector<torch::Tensor> parameters;
  };
  std::vector<Point> front;

  // Keeps net's parameters if `reward` is the best so far; whether it was.
  bool Offer(Net& net, int64_t at, double r) {
    if (iteration >= 0 && r <= reward) return false;
    iteration = at, reward = r, parameters = CloneParameters(net);
    return true;
  }
  // Adds net to the front unless a point there has at least its quality at no more cost; drops the points it
  // dominates.
  void OfferFront(Net& net, int64_t at, double quality, double cost) {
    for (const Point& p : front) {
      if (p.quality >= quality && p.cost <= cost) return;
    }
    std::erase_if(front, [&](const Point& p) { return quality >= p.quality && cost <= p.cost; });
    front.push_back({at, quality, cost, CloneParameters(net)});
  }
};

std::string StatePath(const TrainRouterOptions& o) { return o.out_path + ".state"; }

absl::Status SaveState(const TrainRouterOptions& o, Net& net, torch::optim::Adam& opt, int64_t lambda_index,
                       int64_t iteration, const Kept& kept = {}) {
  const std::string path = StatePath(o), tmp = path + ".tmp";
  try {
    torch::serialize::OutputArchive archive;
    net->save(archive);
    torch::serialize::OutputArchive opt_archive;
    opt.save(opt_archive);
    archive.write("optimizer", opt_archive);
    archive.write("lambda_index", torch::tensor(lambda_index));
    archive.write("iteration", torch::tensor(iteration));
    archive.write("segments", torch::tensor({o.segment_len, o.tail_len}));
    archive.write("kept_iteration", torch::tensor(kept.iteration));
    archive.write("kept_reward", torch::tensor(kept.reward, torch::kFloat64));
    for (size_t i = 0; i < kept.parameters.size(); ++i) archive.write(Cat("kept_", i), kept.parameters[i]);
    archive.write("front_points", torch::tensor(static_cast<int64_t>(kept.front.size())));
    for (size_t k = 0; k < kept.front.size(); ++k) {
      const Kept::Point& p = kept.front[k];
      archive.write(Cat("front_", k),
                    torch::tensor({static_cast<double>(p.iteration), p.quality, p.cost}, torch::kFloat64));
      for (size_t i = 0; i < p.parameters.size(); ++i) archive.write(Cat("front_", k, "_", i), p.parameters[i]);
    }
    archive.save_to(tmp);
  } catch (const c10::Error& e) {
    return absl::InternalError(Cat("saving ", tmp, ": ", e.what_without_backtrace()));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::InternalError(Cat("renaming ", tmp, " to ", path));
  return absl::OkStatus();
}

absl::Status ReadCursor(const TrainRouterOptions& o, int64_t* lambda_index, int64_t* iteration) {
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(StatePath(o));
    torch::Tensor t;
    archive.read("lambda_index", t);
    *lambda_index = t.item<int64_t>();
    archive.read("iteration", t);
    *iteration = t.item<int64_t>();
    torch::Tensor segments;  // (absent from states written before the tail: segments of --segment-len alone)
    const bool known = archive.try_read("segments", segments);
    const int64_t segment_len = known ? segments[0].item<int64_t>() : o.segment_len;
    const int64_t tail_len = known ? segments[1].item<int64_t>() : 0;
    if (segment_len != o.segment_len || tail_len != o.tail_len) {
      return absl::InvalidArgumentError(Cat("--resume: the state in ", StatePath(o), " was trained with --segment-len ",
                                            segment_len, " --segment-tail ", tail_len, "; this run routes with ",
                                            o.segment_len, " and ", o.tail_len));
    }
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(Cat("--resume: cannot read ", StatePath(o), ": ", e.what_without_backtrace()));
  }
  if (*lambda_index < 0 || *lambda_index > static_cast<int64_t>(o.lambdas.size()) || *iteration < -1 ||
      *iteration > o.iterations) {
    return absl::InvalidArgumentError(Cat("--resume: the state in ", StatePath(o), " (lambda index ", *lambda_index,
                                          ", iteration ", *iteration, ") does not fit this run's --lambda / --iterations"));
  }
  return absl::OkStatus();
}

absl::Status LoadState(const TrainRouterOptions& o, Net& net, torch::optim::Adam& opt, Kept* kept) {
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(StatePath(o));
    net->load(archive);
    torch::serialize::InputArchive opt_archive;
    archive.read("optimizer", opt_archive);
    opt.load(opt_archive);
    // Each read into a tensor of its own: reading into one that holds another shape would resize the
    // archive's storage, which it refuses.
    auto read = [&](const std::string& key) {
      torch::Tensor t;
      archive.read(key, t);
      return t.clone();
    };
    torch::Tensor kept_iteration, front_points;
    if (archive.try_read("kept_iteration", kept_iteration) && kept_iteration.item<int64_t>() >= 0) {
      kept->iteration = kept_iteration.item<int64_t>();
      kept->reward = read("kept_reward").item<double>();
      for (size_t i = 0; i < net->parameters().size(); ++i) kept->parameters.push_back(read(Cat("kept_", i)));
    }
    if (archive.try_read("front_points", front_points)) {
      for (int64_t k = 0; k < front_points.item<int64_t>(); ++k) {
        const torch::Tensor point = read(Cat("front_", k));
        Kept::Point p{
            static_cast<int64_t>(point[0].item<double>()), point[1].item<double>(), point[2].item<double>(), {}};
        for (size_t i = 0; i < net->parameters().size(); ++i) p.parameters.push_back(read(Cat("front_", k, "_", i)));
        kept->front.push_back(std::move(p));
      }
    }
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(Cat("--resume: cannot load ", StatePath(o),
                                          " (written with other --hidden widths?): ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

// `path` with `suffix` before its extension (or at its end).
std::string BeforeExtension(const std::string& path, const std::string& suffix) {
  const size_t slash = path.find_last_of('/'), dot = path.find_last_of('.');
  const size_t cut = dot != std::string::npos && (slash == std::string::npos || dot > slash) ? dot : path.size();
  return Cat(path.substr(0, cut), suffix, path.substr(cut));
}

}  // namespace

std::string PolicyPathFor(const TrainRouterOptions& o, size_t index) {
  if (o.lambdas.size() <= 1) return o.out_path;
  char value[32];
  std::snprintf(value, sizeof(value), "%g", o.lambdas[index]);
  return BeforeExtension(o.out_path, Cat("-lambda", value));
}

std::string FrontPathFor(const TrainRouterOptions& o, size_t index, int64_t iteration) {
  return BeforeExtension(PolicyPathFor(o, index), Cat("-iter", iteration));
}

namespace {

absl::StatusOr<CostKind> ParseCost(const std::string& name) {
  if (name == "attention") return CostKind::kAttention;
  if (name == "time") return CostKind::kTime;
  if (name == "bytes") return CostKind::kBytes;
  return absl::InvalidArgumentError(Cat("--cost '", name, "': one of attention, time, bytes"));
}

// The comparison routes every policy in this run's segments: a file trained in others would be judged on
// decisions it never learned.
absl::Status SameSegments(const PolicyNetwork& net, const std::string& path, const TrainRouterOptions& o) {
  if (net.segment_len == o.segment_len && net.tail_len == o.tail_len) return absl::OkStatus();
  return absl::InvalidArgumentError(Cat("policy file ", path, " was trained with --segment-len ", net.segment_len,
                                        " --segment-tail ", net.tail_len, "; this run routes with ", o.segment_len,
                                        " and ", o.tail_len));
}

absl::Status ValidateOptions(const TrainRouterOptions& o) {
  if (o.lambdas.empty()) return absl::InvalidArgumentError("--lambda: give at least one value");
  for (double l : o.lambdas) {
    if (!(l >= 0)) return absl::InvalidArgumentError(Cat("--lambda ", l, ": must be >= 0"));
  }
  if (o.samples < 2) return absl::InvalidArgumentError("--samples must be >= 2 (the leave-one-out baseline)");
  if (o.segment_len < 1) return absl::InvalidArgumentError("--segment-len must be >= 1");
  if (o.tail_len < 0 || (o.tail_len > 0 && o.tail_len >= o.segment_len)) {
    return absl::InvalidArgumentError(
        Cat("--segment-tail ", o.tail_len, " must be 0 (off) or below --segment-len ", o.segment_len));
  }
  if (o.continuation < 1) return absl::InvalidArgumentError("--continuation must be >= 1");
  if (o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(Cat("--device '", o.device, "': cpu or cuda"));
  }
  if (!o.draft_lengths.empty()) {
    if (o.draft_lengths.size() < 2) {
      return absl::InvalidArgumentError("--draft-lengths: give two or more choices (0 = no speculation), or none");
    }
    for (size_t i = 0; i < o.draft_lengths.size(); ++i) {
      if (o.draft_lengths[i] < 0 || o.draft_lengths[i] > 32) {
        return absl::InvalidArgumentError(Cat("--draft-lengths: ", o.draft_lengths[i], " is outside [0, 32]"));
      }
      for (size_t j = 0; j < i; ++j) {
        if (o.draft_lengths[j] == o.draft_lengths[i]) {
          return absl::InvalidArgumentError(Cat("--draft-lengths: ", o.draft_lengths[i], " given twice"));
        }
      }
    }
  }
  for (const std::string& rule : o.eval_rules) ORYX_RETURN_IF_ERROR(MakeRuleRouter(rule).status());
  if (o.eval_only) {
    if (o.eval_examples < 1) return absl::InvalidArgumentError("--eval-only needs --eval-examples N (N >= 1)");
    for (size_t li = 0; li < o.lambdas.size(); ++li) {
      const std::string path = PolicyPathFor(o, li);
      if (!std::filesystem::exists(path)) {
        return absl::NotFoundError(Cat("--eval-only: no policy file ", path, " (lambda ", o.lambdas[li], ")"));
      }
      ORYX_ASSIGN_OR_RETURN(PolicyNetwork net, ReadPolicyFile(path));
      ORYX_RETURN_IF_ERROR(SameSegments(net, path, o));
    }
  }
  return ParseCost(o.cost).status();
}

// Per (task, policy) sums of the held-out evaluation.
struct EvalTotal {
  double n = 0, quality = 0, quality_sq = 0, correct = 0, attention = 0, cost = 0, drafted = 0, accepted = 0;
  void Add(const Episode& e) {
    n += 1, quality += e.quality, quality_sq += e.quality * e.quality, correct += e.correct;
    attention += e.attention_fraction, cost += e.cost;
    drafted += static_cast<double>(e.drafted), accepted += static_cast<double>(e.accepted);
  }
  // The standard error of the mean quality.
  double QualityError() const {
    if (n < 2) return 0;
    const double mean = quality / n, var = std::max(0.0, (quality_sq - n * mean * mean) / (n - 1));
    return std::sqrt(var / n);
  }
};

// A policy over the mixed workload: each task's means, averaged with equal weights.
struct MixedPoint {
  std::string policy;
  bool learned = false;
  double quality = 0, quality_error = 0, attention = 0, cost = 0;
};

}  // namespace

namespace {

// The phases of TrainRouter over what they share: the engine that runs the episodes, the counterfactual data
// of phase 1 and the log.
class RouterTrainer {
 public:
  // Loads the model, the task sources and (cost "time") the cost model, calibrated here.
  static absl::StatusOr<std::unique_ptr<RouterTrainer>> Create(const TrainRouterOptions& o);
  // 1. Counterfactual data, shared by every lambda, and the feature normalisation from it.
  absl::Status CollectCounterfactuals();
  // 2. One lambda: labels and warm start (unless resumed after them), REINFORCE, the policy file.
  absl::Status TrainLambda(size_t li, int64_t resume_iteration);
  // 3. Held-out evaluation: every task's examples from a stream no training step drew from, run with the
  //    rule baselines and each trained policy (greedy).
  absl::Status Evaluate();

 private:
  using RuleFn = std::function<router::Decision(const router::RouterContext&)>;
  RouterTrainer(const TrainRouterOptions& o, Engine engine) : o_(o), engine_(std::move(engine)) {}
  // Examples first .. first + count of a stream (see Examples' body).
  absl::StatusOr<std::vector<Example>> Examples(uint64_t stream, int64_t first, int64_t count,
                                                std::optional<size_t> task_index = {});
  // A router from a fixed rule, recording its decisions.
  std::unique_ptr<router::Router> Rule(RuleFn fn, LearnedRouter::Trace trace) const;
  void Record(const nlohmann::json& r) { log_ << JsonText(r) << "\n" << std::flush; }
  // The counterfactuals' cost-sensitive labels at a lambda.
  Labels WarmLabels(double lambda) const;
  // The warm start of a fresh network: fitted to WarmLabels.
  void WarmStart(double lambda, Net& net, torch::optim::Adam& opt);
  // REINFORCE iterations first_iteration .. o.iterations - 1; *last_record: the last one's log record.
  absl::Status Reinforce(size_t li, Net& net, torch::optim::Adam& opt, int64_t first_iteration, Kept& kept,
                         nlohmann::json* last_record);
  // With validation examples: net's greedy mean reward on them (the tasks weighted alike), offered to
  // `kept` as the network after `iteration` (0: the warm start).
  absl::Status Validate(size_t li, Net& net, int64_t iteration, Kept& kept);

  const TrainRouterOptions& o_;
  Engine engine_;
  int64_t max_draft_ = 0;
  std::vector<std::optional<tasks::TaskKind>> kinds_;  // per task; none: text continuation
  std::optional<train::TaskSetup> setup_;
  std::unique_ptr<tasks::HaystackSource> haystack_, text_source_;
  std::ofstream log_;
  std::optional<Costs> costs_;
  std::optional<EpisodeRunner> runner_;
  // Phase 1: the base episodes of the warm-start examples, each with one decision flipped, with the decode
  // phase flipped as one and gated by entropy (kDecodeEntropyTaus), and under every draft length.
  struct Flip {
    size_t base;  // index into base_
    StepKey key;
  };
  std::vector<Example> warm_, validation_;
  std::vector<const Example*> base_examples_;
  std::vector<Base> base_kinds_;
  std::vector<int64_t> base_tails_;  // the tail of each kTail base episode (else 0)
  std::vector<Episode> base_, flipped_, decode_flipped_, decode_gated_, drafted_;
  std::vector<Flip> flips_;
  std::vector<size_t> decode_flip_of_;  // warm example index of each decode flip
  // decode_gated_[j * kDecodeVariants + v]: decode flip j's example with kDecodeEntropyTaus[v]'s decoding
  torch::Tensor mean_, inv_std_;
};

absl::StatusOr<std::unique_ptr<RouterTrainer>> RouterTrainer::Create(const TrainRouterOptions& o) {
  const BackendOptions backend{.device = o.device, .threads = o.threads, .cuda = CudaSwitches::FromEnvironment()};
  ORYX_ASSIGN_OR_RETURN(Engine engine, Engine::Load(o.model_dir, backend));
  engine.set_prefix_cache(std::nullopt);  // an episode's cost is that of its whole prompt
  if (!engine.tokenizer()) return absl::InvalidArgumentError("train-router: the model has no tokenizer");
  std::unique_ptr<RouterTrainer> t(new RouterTrainer(o, std::move(engine)));
  const Tokenizer& tokenizer = *t->engine_.tokenizer();
  const ModelConfig& config = t->engine_.backend().config();
  t->max_draft_ = o.draft_lengths.empty() ? 0 : *std::max_element(o.draft_lengths.begin(), o.draft_lengths.end());
  bool text = false;
  for (const std::string& task : o.tasks) {
    if (task == "text") {
      t->kinds_.push_back(std::nullopt);
      text = true;
      continue;
    }
    ORYX_ASSIGN_OR_RETURN(tasks::TaskKind k, train::ParseTaskName(task));
    t->kinds_.push_back(k);
  }
  for (int32_t len : o.lengths) {
    const int64_t need = len + (text ? o.continuation + t->max_draft_ + 1 : 0);
    if (len < 64 || need > config.max_position) {
      return absl::InvalidArgumentError(Cat("--lengths: ", len, text ? Cat(" (+ ", o.continuation, " continued tokens)") : "",
                                            " is outside [64, max_position ", config.max_position, "]"));
    }
  }
  ORYX_ASSIGN_OR_RETURN(t->setup_, train::MakeTaskSetup(tokenizer));
  ORYX_ASSIGN_OR_RETURN(t->haystack_, train::OpenHaystack(o.haystack_files, o.data_dir, "train", tokenizer));
  // Text to continue: held out from the model's training (the validation split), unless files are given.
  if (text) {
    ORYX_ASSIGN_OR_RETURN(t->text_source_, train::OpenHaystack(o.haystack_files, o.data_dir, "val", tokenizer));
  }

  const std::string log_path = o.log_path.empty() ? o.out_path + ".log.jsonl" : o.log_path;
  // A resumed run goes on with its log, and a comparison of a finished run's files adds to that run's.
  t->log_.open(log_path, o.resume || o.eval_only ? std::ios::app : std::ios::trunc);
  if (!t->log_) return absl::InvalidArgumentError(Cat("cannot write the log ", log_path));

  const CostKind cost_kind = *ParseCost(o.cost);
  std::optional<router::CostModel> cost_model;
  if (cost_kind == CostKind::kTime) {
    const auto t0 = Clock::now();
    ORYX_ASSIGN_OR_RETURN(std::vector<router::Measurement> ms,
                          router::MeasureSpans(t->engine_.backend(), router::CalibrationShapes(config), 3));
    ORYX_ASSIGN_OR_RETURN(cost_model, router::CostModel::Fit(config, ms));
    const nlohmann::json r = {{"phase", "cost_model"}, {"coefficients", cost_model->ToJson()}, {"seconds", Seconds(t0)}};
    t->Record(r);
    std::cerr << "train-router: calibrated the cost model in " << Seconds(t0) << " s\n";
  }
  t->costs_.emplace(cost_kind, config, cost_model, o.segment_len, o.tail_len);
  t->runner_.emplace(&t->engine_, o.segment_len, o.tail_len, &*t->costs_, o.draft_lengths);
  return t;
}


  // Examples first .. first + count of a stream: task (task_index, or drawn), length and depth from each
  // example's own seed (disjoint from the benchmark's grid, whose seeds mix base seed 7 with the grid point).
absl::StatusOr<std::vector<Example>> RouterTrainer::Examples(uint64_t stream, int64_t first, int64_t count,
                                                             std::optional<size_t> task_index) {
  const TrainRouterOptions& o = o_;
  const ModelConfig& config = engine_.backend().config();
  std::vector<Example> out;
  for (int64_t n = first; n < first + count; ++n) {
    const uint64_t seed = MixSeed({0x747261696e, o.seed, stream, static_cast<uint64_t>(n)});
    Rng rng(seed);
    const size_t t = task_index ? *task_index : rng.UniformInt(kinds_.size());
    const int32_t len = o.lengths[rng.UniformInt(o.lengths.size())];
    Example x;
    x.name = o.tasks[t];
    if (!kinds_[t]) {
      x.prompt = {static_cast<int32_t>(config.bos_id)};
      ORYX_ASSIGN_OR_RETURN(std::vector<int32_t> window, text_source_->Tokens(len - 1, seed));
      x.prompt.insert(x.prompt.end(), window.begin(), window.end());
      x.generate = o.continuation;
      x.prefix_quality = true;
    } else {
      ORYX_ASSIGN_OR_RETURN(x.task, tasks::MakeExample(*kinds_[t], setup_->configs, haystack_.get(), len, rng.UniformDouble(), seed));
      x.teacher_forced = *kinds_[t] == tasks::TaskKind::kMqar;
      x.prompt = x.task.Prompt();
      x.answer = x.task.AnswerTokens(0);
      x.generate = static_cast<int64_t>(x.answer.size());
    }
    out.push_back(std::move(x));
  }
  ORYX_RETURN_IF_ERROR(runner_->FillReferences(out));
  return out;
}

std::unique_ptr<router::Router> RouterTrainer::Rule(RuleFn fn, LearnedRouter::Trace trace) const {
  return std::make_unique<FunctionRouter>(
      [fn = std::move(fn), trace = std::move(trace)](const router::RouterContext& c) {
        const router::Decision d = fn(c);
        if (trace) trace(c, d);
        return d;
      },
      max_draft_);
}

absl::Status RouterTrainer::CollectCounterfactuals() {
  const TrainRouterOptions& o = o_;
  // For each warm-start example and each base, the base episode and one episode per decision with that
  // decision flipped_; and each generated example run prefill-linear with every draft length.
  auto t0 = Clock::now();
  ORYX_ASSIGN_OR_RETURN(warm_, Examples(0, 0, o.warm_examples));
  std::vector<Base> bases = {Base::kPrefillLinear, Base::kLinear, Base::kAttention};
  if (o.warm_tail) bases.push_back(Base::kTail);
  const int64_t tail = o.tail_len;
  for (Base b : bases) {
    for (const auto& e : warm_) {
      base_examples_.push_back(&e), base_kinds_.push_back(b), base_tails_.push_back(b == Base::kTail ? tail : 0);
    }
  }
  // Imitation also runs the longer tails 2N, 4N and 8N (the segment ends of --segment-tail N), and learns
  // each example's best at the lambda.
  for (int64_t longer = 2 * tail; o.warm_imitate && longer <= 8 * tail; longer *= 2) {
    for (const auto& e : warm_)
      base_examples_.push_back(&e), base_kinds_.push_back(Base::kTail), base_tails_.push_back(longer);
  }
  ORYX_ASSIGN_OR_RETURN(base_, runner_->Run(base_examples_, [&](size_t i, LearnedRouter::Trace trace) {
    const Base kind = base_kinds_[i];
    const int64_t its_tail = base_tails_[i];
    return Rule([kind, its_tail](const router::RouterContext& c) { return BaseDecision(kind, c, 0, its_tail); },
                std::move(trace));
  }));
  std::vector<const Example*> flip_examples;
  for (size_t i = 0; i < base_.size() && !o.warm_imitate; ++i) {  // imitation learns from the bases alone
    for (const auto& [key, step] : base_[i].steps) {
      flips_.push_back({i, key});
      flip_examples.push_back(base_examples_[i]);
    }
  }
  // The decode phase flipped_ as one segment: prefill-linear with linear decoding. One decode step rarely
  // changes a continuation alone, while all of them do.
  std::vector<const Example*> decode_flip_examples;
  for (size_t i = 0; i < warm_.size() && !o.warm_imitate; ++i) {
    if (!warm_[i].teacher_forced && warm_[i].generate >= 2) decode_flip_of_.push_back(i), decode_flip_examples.push_back(&warm_[i]);
  }
  std::vector<const Example*> draft_examples;  // each generated warm example once per draft length, in order
  for (const Example& e : warm_) {
    if (e.teacher_forced || e.generate < 2) continue;
    for (size_t k = 0; k < o.draft_lengths.size(); ++k) draft_examples.push_back(&e);
  }
  std::vector<const Example*> decode_gated_examples;
  for (const Example* e : decode_flip_examples)
    decode_gated_examples.insert(decode_gated_examples.end(), kDecodeVariants, e);
  std::cerr << "train-router: " << warm_.size() << " warm-start examples, "
            << base_.size() + flips_.size() + decode_flip_of_.size() + decode_gated_examples.size() +
                   draft_examples.size()
            << " counterfactual episodes\n";
  ORYX_ASSIGN_OR_RETURN(flipped_, runner_->Run(flip_examples, [&](size_t j, LearnedRouter::Trace trace) {
    const StepKey key = flips_[j].key;
    const Base kind = base_kinds_[flips_[j].base];
    return Rule(
        [kind, key, tail](const router::RouterContext& c) {
          router::Decision d = BaseDecision(kind, c, 0, tail);
          if (KeyOf(c) == key) d.mode = d.mode == Mode::kAttention ? Mode::kLinear : Mode::kAttention;
          return d;
        },
        std::move(trace));  // (the trace also costs the decisions)
  }));
  ORYX_ASSIGN_OR_RETURN(decode_flipped_, runner_->Run(decode_flip_examples, [&](size_t, LearnedRouter::Trace trace) {
    return Rule([](const router::RouterContext& c) {
      return router::Decision{c.last_prompt_token ? Mode::kAttention : Mode::kLinear};
    }, std::move(trace));
  }));
  ORYX_ASSIGN_OR_RETURN(decode_gated_, runner_->Run(decode_gated_examples, [&](size_t j, LearnedRouter::Trace trace) {
    const policies::EntropyRouter rule(kDecodeEntropyTaus[j % kDecodeVariants]);
    return Rule([rule](const router::RouterContext& c) { return rule.Decide(c); }, std::move(trace));
  }));
  const size_t n_lengths = o.draft_lengths.size();
  ORYX_ASSIGN_OR_RETURN(drafted_, runner_->Run(draft_examples, [&](size_t j, LearnedRouter::Trace trace) {
    const int64_t k = o.draft_lengths[j % n_lengths];
    return Rule([k](const router::RouterContext& c) { return BaseDecision(Base::kPrefillLinear, c, k); }, std::move(trace));
  }));
  {
    double base_quality[kBases] = {}, base_cost[kBases] = {}, helped = 0, hurt = 0;
    std::map<int64_t, std::pair<double, double>> by_tail;  // each tail base's quality and cost
    for (size_t i = 0; i < base_.size(); ++i) {
      if (base_kinds_[i] == Base::kTail) {
        by_tail[base_tails_[i]].first += base_[i].quality, by_tail[base_tails_[i]].second += base_[i].cost;
      } else {
        base_quality[static_cast<int>(base_kinds_[i])] += base_[i].quality;
        base_cost[static_cast<int>(base_kinds_[i])] += base_[i].cost;
      }
    }
    for (size_t j = 0; j < flips_.size(); ++j) {
      const double d = flipped_[j].quality - base_[flips_[j].base].quality;
      helped += d > 0, hurt += d < 0;
    }
    const double n = static_cast<double>(std::max<size_t>(1, warm_.size()));
    const size_t episodes =
        base_.size() + flips_.size() + decode_flipped_.size() + decode_gated_.size() + drafted_.size();
    nlohmann::json r = {{"phase", "counterfactual"}, {"examples", warm_.size()}, {"cost", o.cost},
                        {"episodes", episodes},
                        {"prefill_linear_quality", base_quality[0] / n}, {"linear_quality", base_quality[1] / n},
                        {"attention_quality", base_quality[2] / n}, {"prefill_linear_cost", base_cost[0] / n},
                        {"linear_cost", base_cost[1] / n}, {"attention_cost", base_cost[2] / n},
                        {"flips_that_helped", helped}, {"flips_that_hurt", hurt}, {"seconds", Seconds(t0)}};
    if (o.warm_imitate) {
      r["warm_start"] = o.warm_margins ? "imitation-margins" : "imitation";
      nlohmann::json tails = nlohmann::json::array();
      for (const auto& [t, qc] : by_tail)
        tails.push_back({{"tail", t}, {"quality", qc.first / n}, {"cost", qc.second / n}});
      r["imitation_tails"] = tails;
    }
    if (o.warm_tail) r["tail_quality"] = by_tail[tail].first / n, r["tail_cost"] = by_tail[tail].second / n;
    if (!decode_gated_.empty()) {  // the entropy-gated answers, over the generated examples
      nlohmann::json by_tau = nlohmann::json::array();
      for (size_t v = 0; v < kDecodeVariants; ++v) {
        double cost = 0, quality = 0, attention = 0, m = 0;
        for (size_t j = v; j < decode_gated_.size(); j += kDecodeVariants) {
          cost += decode_gated_[j].cost, quality += decode_gated_[j].quality;
          attention += decode_gated_[j].attention_fraction, m += 1;
        }
        by_tau.push_back({{"tau", kDecodeEntropyTaus[v]}, {"cost", cost / m}, {"quality", quality / m},
                          {"attention", attention / m}});
      }
      r["entropy_gated_decoding"] = by_tau;
    }
    if (!drafted_.empty()) {
      nlohmann::json by_length = nlohmann::json::array();
      for (size_t k = 0; k < n_lengths; ++k) {
        double cost = 0, quality = 0, dr = 0, ac = 0, m = 0;
        for (size_t j = k; j < drafted_.size(); j += n_lengths) {
          cost += drafted_[j].cost, quality += drafted_[j].quality, dr += drafted_[j].drafted, ac += drafted_[j].accepted, m += 1;
        }
        by_length.push_back({{"draft_length", o.draft_lengths[k]}, {"cost", cost / m}, {"quality", quality / m},
                             {"acceptance", dr > 0 ? ac / dr : 0.0}});
      }
      r["prefill_linear_by_draft_length"] = by_length;
    }
    Record(r);
    std::cerr << "train-router: counterfactual " << JsonText(r) << "\n";
  }
  // Feature normalisation from the base and draft episodes' decisions.
  std::vector<const Step*> all_steps;
  for (const auto* episodes : {&base_, &drafted_}) {
    for (const Episode& e : *episodes) {
      for (const auto& [key, s] : e.steps) all_steps.push_back(&s);
    }
  }
  torch::Tensor warm_x, warm_a;
  Stack(all_steps, &warm_x, &warm_a);
  // A feature (nearly) constant over the warm-start decisions keeps scale 1: dividing by its tiny spread
  // would blow up whatever variation later episodes bring.
  mean_ = warm_x.mean(0);
  const torch::Tensor spread = warm_x.std(0, /*unbiased=*/false);
  inv_std_ = torch::where(spread > 1e-2, 1.0 / spread, torch::ones_like(spread));
  return absl::OkStatus();
}

absl::Status RouterTrainer::TrainLambda(size_t li, int64_t resume_iteration) {
  const TrainRouterOptions& o = o_;
  // A lambda's network, warm start, training examples and samples depend on the seed and the lambda alone,
  // not on the lambdas before it in the list: the same lambda alone, or resumed at its start, trains alike.
  torch::manual_seed(MixSeed({o.seed, 0x6e6574, LambdaKey(o.lambdas[li])}));
  Net net(o.hidden, static_cast<int64_t>(o.draft_lengths.size()));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(o.learning_rate));
  int64_t first_iteration = 0;
  Kept kept;
  if (resume_iteration >= 0) {
    ORYX_RETURN_IF_ERROR(LoadState(o, net, opt, &kept));
    first_iteration = resume_iteration;
  } else {
    {
      torch::NoGradGuard no_grad;
      net->mean.copy_(mean_);
      net->inv_std.copy_(inv_std_);
    }
    WarmStart(o.lambdas[li], net, opt);
    ORYX_RETURN_IF_ERROR(Validate(li, net, 0, kept));
    ORYX_RETURN_IF_ERROR(SaveState(o, net, opt, static_cast<int64_t>(li), 0, kept));
  }
  nlohmann::json last;
  ORYX_RETURN_IF_ERROR(Reinforce(li, net, opt, first_iteration, kept, &last));
  nlohmann::json front = nlohmann::json::array();
  std::sort(kept.front.begin(), kept.front.end(), [](const auto& a, const auto& b) { return a.cost < b.cost; });
  for (const Kept::Point& p : kept.front) {
    CopyParameters(p.parameters, net);
    PolicyNetwork point = Export(net, o);
    point.training = {{"lambda", o.lambdas[li]},   {"iteration", p.iteration}, {"validation_quality", p.quality},
                      {"validation_cost", p.cost}, {"lengths", o.lengths},     {"seed", o.seed}};
    ORYX_RETURN_IF_ERROR(WritePolicyFile(FrontPathFor(o, li, p.iteration), point));
    front.push_back({{"iteration", p.iteration}, {"quality", p.quality}, {"cost", p.cost}});
  }
  if (!kept.front.empty()) {
    std::fprintf(stderr, "train-router: lambda %g wrote its validation front, %zu %s (the cheapest: %s)\n",
                 o.lambdas[li], kept.front.size(), kept.front.size() == 1 ? "network" : "networks",
                 FrontPathFor(o, li, kept.front[0].iteration).c_str());
  }
  if (kept.iteration >= 0) {
    CopyParameters(kept.parameters, net);
    std::fprintf(stderr, "train-router: lambda %g keeps the network after %s (validation reward %.4f)\n", o.lambdas[li],
                 kept.iteration == 0 ? "the warm start" : Cat("iteration ", kept.iteration).c_str(), kept.reward);
  }
  PolicyNetwork out = Export(net, o);
  out.training = {{"lambda", o.lambdas[li]}, {"cost", o.cost}, {"iterations", o.iterations}, {"batch", o.batch},
                  {"samples", o.samples}, {"warm_examples", o.warm_examples}, {"tasks", o.tasks},
                  {"lengths", o.lengths}, {"seed", o.seed}, {"last_iteration", last}};
  if (kept.iteration >= 0) {
    out.training["validation"] = {{"examples_per_task", o.validation_examples},
                                  {"kept_iteration", kept.iteration},
                                  {"reward", kept.reward},
                                  {"front", front}};
  }
  const std::string path = PolicyPathFor(o, li);
  ORYX_RETURN_IF_ERROR(WritePolicyFile(path, out));
  std::cerr << "train-router: wrote " << path << "\n";
  ORYX_RETURN_IF_ERROR(SaveState(o, net, opt, static_cast<int64_t>(li) + 1, -1));
  return absl::OkStatus();
}

Labels RouterTrainer::WarmLabels(double lambda) const {
  Labels labels;
  // The bases run every warm example in turn, so base i is of warm example i % warm_.size().
  if (o_.warm_imitate && o_.warm_margins) {  // mode head: each example's chain of schedules, band by band
    std::vector<std::map<int64_t, const Episode*>> chains(warm_.size());  // ordered by what they attend
    for (size_t i = 0; i < base_.size(); ++i) {
      constexpr int64_t kLinearRank = -2, kPrefillLinearRank = -1, kAttentionRank = int64_t{1} << 40;
      const int64_t rank = base_kinds_[i] == Base::kLinear          ? kLinearRank
                           : base_kinds_[i] == Base::kPrefillLinear ? kPrefillLinearRank
                           : base_kinds_[i] == Base::kAttention     ? kAttentionRank
                                                                    : base_tails_[i];
      chains[i % warm_.size()][rank] = &base_[i];
    }
    for (const auto& chain : chains) {
      std::vector<const Episode*> ordered;
      for (const auto& [rank, e] : chain) ordered.push_back(e);
      labels.AddChain(ordered, lambda);
    }
  } else if (o_.warm_imitate) {  // mode head: each example's best tail rule at this lambda, decision for decision
    std::vector<const Episode*> best(warm_.size(), nullptr);
    for (size_t i = 0; i < base_.size(); ++i) {
      const Episode*& b = best[i % warm_.size()];
      if (base_kinds_[i] == Base::kTail && (b == nullptr || base_[i].Reward(lambda) > b->Reward(lambda))) b = &base_[i];
    }
    for (const Episode* b : best) labels.AddEpisode(*b);
  }
  // Mode head: each base decision against the same episode with it flipped.
  for (size_t j = 0; j < flips_.size(); ++j) labels.AddFlip(base_[flips_[j].base], flipped_[j], flips_[j].key, lambda);
  // The decode decisions: each generated example's best answer policy among attention (prefill-linear
  // itself), linear (the decode flip) and the entropy-gated ones.
  for (size_t j = 0; j < decode_flip_of_.size(); ++j) {
    std::vector<const Episode*> variants = {&base_[decode_flip_of_[j]], &decode_flipped_[j]};
    for (size_t v = 0; v < kDecodeVariants; ++v) variants.push_back(&decode_gated_[j * kDecodeVariants + v]);
    labels.AddDecode(variants, lambda);
  }
  // Draft head: each generated example run prefill-linear with every draft length.
  const size_t n_lengths = o_.draft_lengths.size();
  for (size_t g = 0; n_lengths > 0 && g + n_lengths <= drafted_.size(); g += n_lengths) {
    labels.AddDrafts(std::span(drafted_).subspan(g, n_lengths), lambda);
  }
  return labels;
}

void RouterTrainer::WarmStart(double lambda, Net& net, torch::optim::Adam& opt) {
  nlohmann::json r = {{"phase", "warm_start"}, {"lambda", lambda}};
  r.update(Fit(net, opt, WarmLabels(lambda), o_.warm_steps));
  Record(r);
  std::cerr << "train-router: warm start " << JsonText(r) << "\n";
}

absl::Status RouterTrainer::Reinforce(size_t li, Net& net, torch::optim::Adam& opt, int64_t first_iteration, Kept& kept,
                                      nlohmann::json* last_record) {
  const TrainRouterOptions& o = o_;
  const double lambda = o.lambdas[li];
  nlohmann::json& last = *last_record;
  for (int64_t it = first_iteration; it < o.iterations; ++it) {
    auto ti = Clock::now();
    ORYX_ASSIGN_OR_RETURN(auto policy, SharedPolicy(Export(net, o)));
    ORYX_ASSIGN_OR_RETURN(std::vector<Example> batch,
                          Examples(MixSeed({0x7472616e, LambdaKey(o.lambdas[li])}), it * o.batch, o.batch));
    std::vector<const Example*> ptrs;
    for (int64_t g = 0; g < o.samples; ++g) {
      for (const auto& e : batch) ptrs.push_back(&e);
    }
    ORYX_ASSIGN_OR_RETURN(std::vector<Episode> episodes, runner_->Run(ptrs, [&](size_t i, LearnedRouter::Trace trace) {
      const uint64_t sample_seed =
          MixSeed({o.seed, LambdaKey(o.lambdas[li]), static_cast<uint64_t>(it), i / batch.size()});
      return std::make_unique<LearnedRouter>(policy, sample_seed, std::move(trace), o.exploration);
    }));
    // Leave-one-out advantages; every decision of an episode is weighted by its episode's advantage.
    const int64_t B = o.batch, G = o.samples;
    std::vector<const Step*> steps;
    std::vector<float> weights;
    EvalTotal sum;
    double reward_sum = 0;
    for (int64_t b = 0; b < B; ++b) {
      double total = 0;
      for (int64_t g = 0; g < G; ++g) total += episodes[g * B + b].Reward(lambda);
      for (int64_t g = 0; g < G; ++g) {
        const Episode& e = episodes[g * B + b];
        const double advantage = e.Reward(lambda) - (total - e.Reward(lambda)) / static_cast<double>(G - 1);
        for (const auto& [key, s] : e.steps) {
          steps.push_back(&s);
          weights.push_back(static_cast<float>(advantage / static_cast<double>(B * G)));
        }
        reward_sum += e.Reward(lambda);
        sum.Add(e);
      }
    }
    torch::Tensor x, a, k;
    Stack(steps, &x, &a, &k);
    const torch::Tensor w = torch::tensor(weights);
    opt.zero_grad();
    const auto [mode_logits, draft_logits] = net->forward(x);
    const torch::Tensor logp = torch::log_softmax(mode_logits, 1);
    // The modes were sampled from the exploring mixture e/2 + (1 - e) p: its log-probabilities.
    const torch::Tensor sampled = (o.exploration / 2 + (1 - o.exploration) * logp.exp()).log();
    torch::Tensor chosen = sampled.gather(1, a.unsqueeze(1)).squeeze(1);
    torch::Tensor entropy = -(logp.exp() * logp).sum(1).mean();
    if (net->draft) {
      // Draft lengths were sampled from the head itself, where it was asked.
      const torch::Tensor logq = torch::log_softmax(draft_logits, 1);
      const torch::Tensor asked = (k >= 0).to(torch::kFloat32);
      chosen = chosen + asked * logq.gather(1, k.clamp_min(0).unsqueeze(1)).squeeze(1);
      entropy = entropy + (asked * -(logq.exp() * logq).sum(1)).sum() / asked.sum().clamp_min(1);
    }
    const torch::Tensor loss = -(w * chosen).sum() - o.entropy_bonus * entropy;
    loss.backward();
    opt.step();
    const double n = static_cast<double>(B * G);
    last = {{"phase", "reinforce"}, {"lambda", lambda}, {"iteration", it + 1}, {"iterations", o.iterations},
            {"reward", reward_sum / n}, {"accuracy", sum.correct / n}, {"quality", sum.quality / n},
            {"attention_fraction", sum.attention / n}, {"cost", sum.cost / n},
            {"acceptance", sum.drafted > 0 ? sum.accepted / sum.drafted : 0.0}, {"drafted", sum.drafted},
            {"entropy", entropy.item<double>()}, {"decisions", steps.size()}, {"seconds", Seconds(ti)}};
    Record(last);
    std::fprintf(stderr, "train-router: lambda %g  iter %lld/%lld  reward %.3f  quality %.3f  attention %.3f  cost %.3f  entropy %.3f  %.1f s\n",
                 lambda, static_cast<long long>(it + 1), static_cast<long long>(o.iterations), reward_sum / n,
                 sum.quality / n, sum.attention / n, sum.cost / n, entropy.item<double>(), Seconds(ti));
    ORYX_RETURN_IF_ERROR(Validate(li, net, it + 1, kept));
    ORYX_RETURN_IF_ERROR(SaveState(o, net, opt, static_cast<int64_t>(li), it + 1, kept));
  }
  return absl::OkStatus();
}

absl::Status RouterTrainer::Validate(size_t li, Net& net, int64_t iteration, Kept& kept) {
  const TrainRouterOptions& o = o_;
  if (o.validation_examples == 0) return absl::OkStatus();
  const int64_t n = o.validation_examples;
  if (validation_.empty()) {  // the same examples for every lambda, from a stream no other phase draws from
    for (size_t t = 0; t < o.tasks.size(); ++t) {
      ORYX_ASSIGN_OR_RETURN(std::vector<Example> some, Examples(0x76616c31, 0, n, t));
      for (Example& e : some) validation_.push_back(std::move(e));
    }
  }
  ORYX_ASSIGN_OR_RETURN(auto policy, SharedPolicy(Export(net, o)));
  std::vector<const Example*> ptrs;
  for (const Example& e : validation_) ptrs.push_back(&e);
  ORYX_ASSIGN_OR_RETURN(std::vector<Episode> episodes, runner_->Run(ptrs, [&](size_t, LearnedRouter::Trace trace) {
    return std::make_unique<LearnedRouter>(policy, std::nullopt, std::move(trace));
  }));
  // validation_ holds each task's n examples in turn: every task's mean counts alike, as in the comparison.
  const double lambda = o.lambdas[li], per_task = 1.0 / static_cast<double>(o.tasks.size() * n);
  double reward = 0, quality = 0, cost = 0;
  for (const Episode& e : episodes) {
    reward += per_task * e.Reward(lambda), quality += per_task * e.quality, cost += per_task * e.cost;
  }
  const bool best = kept.Offer(net, iteration, reward);
  if (o.validation_front) kept.OfferFront(net, iteration, quality, cost);
  Record({{"phase", "validation"}, {"lambda", lambda}, {"iteration", iteration}, {"reward", reward},
          {"quality", quality}, {"cost", cost}, {"best", best}});
  std::fprintf(stderr, "train-router: lambda %g  validation after %s  reward %.4f  quality %.3f  cost %.3f%s\n", lambda,
               iteration == 0 ? "the warm start" : Cat("iteration ", iteration).c_str(), reward, quality, cost,
               best ? "  (best so far)" : "");
  return absl::OkStatus();
}

absl::Status RouterTrainer::Evaluate() {
  const TrainRouterOptions& o = o_;
  std::vector<std::pair<std::string, EpisodeRunner::MakeRouter>> policies;
  auto add_rule = [&](std::string name, std::function<router::Decision(const router::RouterContext&)> fn) {
    policies.push_back({std::move(name), [this, fn](size_t, LearnedRouter::Trace trace) { return Rule(fn, std::move(trace)); }});
  };
  add_rule("attention", [](const router::RouterContext&) { return router::Decision{Mode::kAttention}; });
  add_rule("linear", [](const router::RouterContext&) { return router::Decision{Mode::kLinear}; });
  add_rule("prefill-linear", [](const router::RouterContext& c) { return BaseDecision(Base::kPrefillLinear, c); });
  for (const std::string& rule : o.eval_rules) {
    ORYX_ASSIGN_OR_RETURN(std::unique_ptr<router::Router> r, MakeRuleRouter(rule));
    std::shared_ptr<const router::Router> shared = std::move(r);
    add_rule(rule, [shared](const router::RouterContext& c) { return shared->Decide(c); });
  }
  for (int64_t k : o.draft_lengths) {
    if (k == 0) continue;
    add_rule(Cat("speculative:", k), [k](const router::RouterContext& c) {
      return router::Decision{Mode::kAttention, c.phase == router::Phase::kDecode ? k : 0};
    });
    add_rule(Cat("prefill-linear+speculative:", k),
             [k](const router::RouterContext& c) { return BaseDecision(Base::kPrefillLinear, c, k); });
  }
  const size_t num_rules = policies.size();  // then the learned policies (and their fronts)
  // A policy file's network, under `name`.
  auto add_learned = [&](std::string name,
                         const std::string& path) -> absl::StatusOr<std::shared_ptr<const LearnedPolicy>> {
    ORYX_ASSIGN_OR_RETURN(PolicyNetwork net, ReadPolicyFile(path));  // (in this run's segments: ValidateOptions)
    ORYX_ASSIGN_OR_RETURN(auto shared, SharedPolicy(std::move(net)));
    policies.push_back({std::move(name), [shared](size_t, LearnedRouter::Trace trace) {
                          return std::make_unique<LearnedRouter>(shared, std::nullopt, std::move(trace));
                        }});
    return shared;
  };
  for (size_t li = 0; li < o.lambdas.size(); ++li) {
    char name[48];
    std::snprintf(name, sizeof(name), "learned lambda %g", o.lambdas[li]);
    ORYX_ASSIGN_OR_RETURN(auto shared, add_learned(name, PolicyPathFor(o, li)));
    const nlohmann::json validation = shared->network().training.value("validation", nlohmann::json::object());
    if (!o.validation_front || !validation.contains("front")) continue;
    for (const nlohmann::json& point : validation.at("front")) {
      const int64_t iteration = point.at("iteration").get<int64_t>();
      ORYX_RETURN_IF_ERROR(add_learned(Cat(name, " iter ", iteration), FrontPathFor(o, li, iteration)).status());
    }
  }
  std::vector<MixedPoint> mixed(policies.size());
  for (size_t p = 0; p < policies.size(); ++p) mixed[p].policy = policies[p].first, mixed[p].learned = p >= num_rules;
  // qualities[p][t][i]: policy p's quality on held-out example i of task t (the same examples for every policy).
  std::vector<std::vector<std::vector<double>>> qualities(policies.size(),
                                                          std::vector<std::vector<double>>(o.tasks.size()));
  const double share = 1.0 / static_cast<double>(o.tasks.size());
  std::fprintf(stderr, "\n%-16s %-30s %8s %9s %10s %8s %10s\n", "task", "policy", "quality", "accuracy", "attention",
               "cost", "acceptance");
  for (size_t t = 0; t < o.tasks.size(); ++t) {
    ORYX_ASSIGN_OR_RETURN(std::vector<Example> held_out, Examples(0x65766131, 0, o.eval_examples, t));
    std::vector<const Example*> ptrs;
    for (const Example& e : held_out) ptrs.push_back(&e);
    for (size_t p = 0; p < policies.size(); ++p) {
      const auto& [name, make] = policies[p];
      ORYX_ASSIGN_OR_RETURN(std::vector<Episode> episodes, runner_->Run(ptrs, make));
      EvalTotal sum;
      for (const Episode& e : episodes) sum.Add(e), qualities[p][t].push_back(e.quality);
      MixedPoint& m = mixed[p];
      m.quality += share * sum.quality / sum.n, m.attention += share * sum.attention / sum.n;
      m.cost += share * sum.cost / sum.n;
      m.quality_error += share * share * sum.QualityError() * sum.QualityError();  // a variance until the end
      const double acceptance = sum.drafted > 0 ? sum.accepted / sum.drafted : -1;
      Record({{"phase", "eval"}, {"task", o.tasks[t]}, {"policy", name}, {"examples", sum.n}, {"cost_kind", o.cost},
              {"quality", sum.quality / sum.n}, {"quality_error", sum.QualityError()}, {"accuracy", sum.correct / sum.n},
              {"attention_fraction", sum.attention / sum.n}, {"cost", sum.cost / sum.n},
              {"acceptance", sum.drafted > 0 ? nlohmann::json(acceptance) : nlohmann::json(nullptr)}});
      std::fprintf(stderr, "%-16s %-30s %8.3f %9.3f %10.3f %8.3f %10s\n", o.tasks[t].c_str(), name.c_str(),
                   sum.quality / sum.n, sum.correct / sum.n, sum.attention / sum.n, sum.cost / sum.n,
                   acceptance < 0 ? "-" : Cat(acceptance).substr(0, 5).c_str());
    }
  }
  // The mixed workload: every task alike. Then each rule against the learned policies.
  std::fprintf(stderr, "\nmixed workload (%zu tasks, %lld held-out examples each)\n%-30s %8s %8s %10s %8s\n",
               o.tasks.size(), static_cast<long long>(o.eval_examples), "policy", "quality", "+-", "attention",
               "cost");
  for (MixedPoint& m : mixed) {
    m.quality_error = std::sqrt(m.quality_error);
    Record({{"phase", "eval_mixed"}, {"policy", m.policy}, {"tasks", o.tasks}, {"examples", o.eval_examples},
            {"cost_kind", o.cost}, {"quality", m.quality}, {"quality_error", m.quality_error},
            {"attention_fraction", m.attention}, {"cost", m.cost}});
    std::fprintf(stderr, "%-30s %8.3f %8.3f %10.3f %8.3f\n", m.policy.c_str(), m.quality, m.quality_error,
                 m.attention, m.cost);
  }
  // A rule that a learned policy beats only by margins below DominanceTolerance is a tie, counted apart. Each
  // policy that dominates or ties a rule comes with its margins: the quality gain, paired over the same
  // examples, with its standard error, and the cost saving.
  const DominanceTolerance tolerance;
  int64_t dominated = 0, tied = 0;
  for (size_t r = 0; r < num_rules; ++r) {
    std::vector<std::string> by, ties;
    nlohmann::json margins = nlohmann::json::array();
    std::string strongest;  // the dominating policy with the largest gain in standard errors
    double strongest_z = -INFINITY;
    for (size_t l = num_rules; l < mixed.size(); ++l) {
      const Dominance d = Compare({mixed[l].quality, mixed[l].cost}, {mixed[r].quality, mixed[r].cost}, tolerance);
      if (d == Dominance::kNone) continue;
      (d == Dominance::kClear ? by : ties).push_back(mixed[l].policy);
      const PairedGain gain = PairedQualityGain(qualities[l], qualities[r]);
      const double saving = mixed[r].cost - mixed[l].cost;
      margins.push_back({{"policy", mixed[l].policy},
                         {"quality_gain", gain.mean},
                         {"quality_gain_error", gain.standard_error},
                         {"cost_saving", saving}});
      const double z = gain.standard_error > 0 ? gain.mean / gain.standard_error : gain.mean > 0 ? INFINITY : 0;
      if (d == Dominance::kClear && z > strongest_z) {
        strongest_z = z;
        char margin[96];
        std::snprintf(margin, sizeof(margin), " (quality %+.3f +- %.3f paired, cost %+.4f)", gain.mean,
                      gain.standard_error, -saving);
        strongest = mixed[l].policy + margin;
      }
    }
    dominated += by.empty() ? 0 : 1;
    tied += by.empty() && !ties.empty() ? 1 : 0;
    Record({{"phase", "pareto"},
            {"rule", mixed[r].policy},
            {"dominated_by", by},
            {"tied_by", ties},
            {"margins", margins}});
    std::string verdict = "not dominated";
    if (!by.empty()) {
      verdict = Cat("dominated by ", strongest);
      if (by.size() > 1) verdict += Cat(" and ", by.size() - 1, " more");
    }
    if (!ties.empty()) verdict += Cat(by.empty() ? ", " : "; ", "tied by ", absl::StrJoin(ties, ", "));
    std::fprintf(stderr, "%-30s %s\n", mixed[r].policy.c_str(), verdict.c_str());
  }
  std::fprintf(stderr,
               "%lld of %zu rules dominated by a learned policy (%lld more only tied: better by less than %g quality "
               "and %g cost)\n",
               static_cast<long long>(dominated), num_rules, static_cast<long long>(tied), tolerance.quality,
               tolerance.cost);
  return absl::OkStatus();
}

}  // namespace

absl::Status TrainRouter(const TrainRouterOptions& o) {
  ORYX_RETURN_IF_ERROR(ValidateOptions(o));
  if (o.threads > 0) torch::set_num_threads(o.threads);
  torch::manual_seed(o.seed);
  // The state file's cursor says where a resumed run goes on: (lambda index, iteration), iteration -1 when
  // that lambda's warm start has not run. (Read first: a state that does not fit is refused at once.)
  int64_t start_lambda = 0, start_iteration = -1;
  const bool resuming = !o.eval_only && o.resume && std::filesystem::exists(StatePath(o));
  if (resuming) {
    ORYX_RETURN_IF_ERROR(ReadCursor(o, &start_lambda, &start_iteration));
    if (start_lambda == static_cast<int64_t>(o.lambdas.size())) {
      std::cerr << "train-router: every lambda in " << StatePath(o)
                << " is trained; nothing to resume (a finished lambda takes no more --iterations)\n";
    }
  }
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<RouterTrainer> trainer, RouterTrainer::Create(o));
  if (o.eval_only) return trainer->Evaluate();
  if (start_lambda < static_cast<int64_t>(o.lambdas.size())) {
    if (resuming) {
      std::cerr << "train-router: resuming at lambda index " << start_lambda << ", iteration " << start_iteration
                << "\n";
    }
    ORYX_RETURN_IF_ERROR(trainer->CollectCounterfactuals());
    for (size_t li = static_cast<size_t>(start_lambda); li < o.lambdas.size(); ++li) {
      ORYX_RETURN_IF_ERROR(
          trainer->TrainLambda(li, static_cast<int64_t>(li) == start_lambda ? start_iteration : int64_t{-1}));
    }
  }
  if (o.eval_examples == 0) return absl::OkStatus();
  return trainer->Evaluate();
}

}  // namespace oryx::policies
