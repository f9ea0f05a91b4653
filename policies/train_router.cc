#include "policies/train_router.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>

#include "engine/engine.h"
#include "engine/file_util.h"
#include "engine/status_macros.h"
#include "engine/str_cat.h"
#include "policies/learned_policy.h"
#include "policies/task_episodes.h"
#include "router/features.h"
#include "tasks/rng.h"
#include "tasks/task_mix.h"
#include "train/shards.h"
#include "train/task_data.h"

namespace oryx::policies {

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }
constexpr int64_t F = router::kNumFeatures;

// ---- Episodes ------------------------------------------------------------------------------------------

// One decision of an episode: what the router saw, what it chose, and how many tokens that covered.
struct Step {
  std::vector<float> features;
  Mode mode = Mode::kLinear;
  int64_t tokens = 1;
};
// Decisions by (phase, position): replayed prefill decisions land on the same key.
using StepKey = std::pair<int, int64_t>;
StepKey KeyOf(const router::RouterContext& c) { return {static_cast<int>(c.phase), c.position}; }

struct Episode {
  std::map<StepKey, Step> steps;
  bool correct = false;  // the answer exactly
  double quality = 0;    // the share of answer tokens right, position by position (partial credit)
  double attention_fraction = 0;
  int64_t tokens = 0;
  double Reward(double lambda) const { return quality - lambda * attention_fraction; }
};

// A router whose decisions come from a function of the context.
class FunctionRouter final : public router::Router {
 public:
  using Fn = std::function<router::Decision(const router::RouterContext&)>;
  explicit FunctionRouter(Fn fn) : fn_(std::move(fn)) {}
  router::Decision Decide(const router::RouterContext& c) const override { return fn_(c); }

 private:
  Fn fn_;
};

// Runs episodes through the engine with a router per episode whose every decision is recorded. Needle
// tasks: greedy generation of the answer (quality: its tokens right, position by position). MQAR (answers
// inside the sequence): the sequence teacher-forced in the router's prompt modes (quality: queries right).
class EpisodeRunner {
 public:
  EpisodeRunner(Engine* engine, int64_t segment_len) : engine_(engine), segment_len_(segment_len) {}

  // make_router(i, trace) builds episode i's router around the trace it must call on every decision.
  using MakeRouter = std::function<std::unique_ptr<router::Router>(size_t i, LearnedRouter::Trace trace)>;

  absl::StatusOr<std::vector<Episode>> Run(const std::vector<const tasks::TaskExample*>& examples,
                                           const MakeRouter& make_router) {
    std::vector<Episode> episodes(examples.size());
    std::vector<size_t> generated, forced;
    for (size_t i = 0; i < examples.size(); ++i) {
      (examples[i]->kind == tasks::TaskKind::kMqar ? forced : generated).push_back(i);
    }
    ORYX_RETURN_IF_ERROR(RunGenerated(examples, generated, make_router, episodes));
    ORYX_RETURN_IF_ERROR(RunTeacherForced(examples, forced, make_router, episodes));
    return episodes;
  }

 private:
  static LearnedRouter::Trace TraceInto(Episode* e) {
    return [e](const router::RouterContext& c, const router::Decision& d) {
      Step s{std::vector<float>(F), d.mode, c.segment_tokens};
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
    return std::make_unique<router::RouterDecoder>(std::move(f), ro);
  }

  absl::Status RunGenerated(const std::vector<const tasks::TaskExample*>& examples, std::span<const size_t> which,
                            const MakeRouter& make_router, std::vector<Episode>& episodes) {
    constexpr size_t kGroup = 64;  // requests per Generate call (bounds the KV memory)
    for (size_t begin = 0; begin < which.size(); begin += kGroup) {
      const size_t end = std::min(which.size(), begin + kGroup);
      std::vector<GenerateRequest> requests(end - begin);
      for (size_t j = begin; j < end; ++j) {
        const size_t i = which[j];
        GenerateRequest& q = requests[j - begin];
        q.prompt_tokens = examples[i]->Prompt();
        q.max_tokens = examples[i]->answers[0].length;
        q.stop_at_eos = false;
        q.policy = Cat("episode-", j - begin);
        std::shared_ptr<router::Router> r = make_router(i, TraceInto(&episodes[i]));
        engine_->policies().Register(q.policy, "episode", [this, r](std::string_view) {
          return absl::StatusOr<std::unique_ptr<Decoder>>(MakeDecoder(r));
        });
      }
      ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> results, engine_->Generate(requests));
      for (size_t j = begin; j < end; ++j) {
        const GenerateResult& r = results[j - begin];
        Episode& e = episodes[which[j]];
        const std::vector<int32_t> answer = examples[which[j]]->AnswerTokens(0);
        e.correct = r.tokens == answer;
        int64_t right = 0;
        for (size_t t = 0; t < answer.size() && t < r.tokens.size(); ++t) right += r.tokens[t] == answer[t];
        e.quality = static_cast<double>(right) / static_cast<double>(answer.size());
        e.tokens = r.stats.attention_tokens + r.stats.linear_tokens;
        e.attention_fraction = r.stats.attention_fraction();
      }
    }
    return absl::OkStatus();
  }

  absl::Status RunTeacherForced(const std::vector<const tasks::TaskExample*>& examples, std::span<const size_t> which,
                                const MakeRouter& make_router, std::vector<Episode>& episodes) {
    std::vector<const tasks::TaskExample*> subset;
    std::vector<std::vector<Mode>> modes;
    for (size_t i : which) {
      const std::vector<int32_t>& ids = examples[i]->ids;
      subset.push_back(examples[i]);
      modes.emplace_back(ids.size() - 1);
      MakeDecoder(make_router(i, TraceInto(&episodes[i])))
          ->PrefillModes(std::span(ids.data(), ids.size() - 1), 0, modes.back());
    }
    ORYX_ASSIGN_OR_RETURN(std::vector<AnswerScore> scores, ScoreTeacherForced(engine_->backend(), subset, modes));
    for (size_t j = 0; j < which.size(); ++j) {
      Episode& e = episodes[which[j]];
      e.correct = scores[j].right == scores[j].asked;
      e.quality = static_cast<double>(scores[j].right) / static_cast<double>(scores[j].asked);
      e.tokens = static_cast<int64_t>(modes[j].size());
      e.attention_fraction = static_cast<double>(std::count(modes[j].begin(), modes[j].end(), Mode::kAttention)) /
                             static_cast<double>(e.tokens);
    }
    return absl::OkStatus();
  }

  Engine* engine_;
  int64_t segment_len_;
};

// The counterfactual bases: prefill-linear (the prompt linear, its last token and the answer in attention
// mode) and all-linear.
enum class Base { kPrefillLinear, kLinear };
router::Decision BaseDecision(Base base, const router::RouterContext& c) {
  const bool attend = base == Base::kPrefillLinear && (c.phase == router::Phase::kDecode || c.last_prompt_token);
  return {attend ? Mode::kAttention : Mode::kLinear};
}

// ---- The network in LibTorch, the same function as LearnedPolicy ---------------------------------------

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const std::vector<int64_t>& widths) {
    int64_t in = F;
    for (size_t i = 0; i < widths.size(); ++i) {
      hidden.push_back(register_module(Cat("hidden", i), torch::nn::Linear(in, widths[i])));
      in = widths[i];
    }
    mode = register_module("mode", torch::nn::Linear(in, 2));
    mean = register_buffer("mean", torch::zeros({F}));
    inv_std = register_buffer("inv_std", torch::ones({F}));
  }
  torch::Tensor forward(torch::Tensor x) {  // [N, F] -> mode logits [N, 2] (linear, attention)
    x = (x - mean) * inv_std;
    for (auto& l : hidden) x = torch::tanh(l->forward(x));
    return mode->forward(x);
  }
  std::vector<torch::nn::Linear> hidden;
  torch::nn::Linear mode{nullptr};
  torch::Tensor mean, inv_std;
};
TORCH_MODULE(Net);

std::vector<float> Floats(const torch::Tensor& t) {
  torch::Tensor c = t.detach().to(torch::kFloat32).contiguous().cpu();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

PolicyNetwork Export(Net& net, int64_t segment_len) {
  PolicyNetwork n;
  n.features.assign(router::kFeatureNames.begin(), router::kFeatureNames.end());
  n.segment_len = segment_len;
  n.input_mean = Floats(net->mean);
  n.input_inv_std = Floats(net->inv_std);
  auto linear = [](torch::nn::Linear& l) {
    return PolicyNetwork::Linear{l->weight.size(0), l->weight.size(1), Floats(l->weight), Floats(l->bias)};
  };
  for (auto& l : net->hidden) n.hidden.push_back(linear(l));
  n.mode_head = linear(net->mode);
  return n;
}

// Features [N, F] and chosen modes [N] of the steps.
void Stack(const std::vector<const Step*>& steps, torch::Tensor* x, torch::Tensor* a) {
  std::vector<float> flat;
  std::vector<int64_t> modes;
  for (const Step* s : steps) {
    flat.insert(flat.end(), s->features.begin(), s->features.end());
    modes.push_back(static_cast<int64_t>(s->mode));
  }
  const int64_t n = static_cast<int64_t>(steps.size());
  *x = torch::from_blob(flat.data(), {n, F}, torch::kFloat32).clone();
  *a = torch::tensor(modes, torch::kInt64);
}

// ---- Training state ------------------------------------------------------------------------------------

std::string StatePath(const TrainRouterOptions& o) { return o.out_path + ".state"; }

absl::Status SaveState(const TrainRouterOptions& o, Net& net, torch::optim::Adam& opt, int64_t lambda_index,
                       int64_t iteration) {
  const std::string path = StatePath(o), tmp = path + ".tmp";
  try {
    torch::serialize::OutputArchive archive;
    net->save(archive);
    torch::serialize::OutputArchive opt_archive;
    opt.save(opt_archive);
    archive.write("optimizer", opt_archive);
    archive.write("lambda_index", torch::tensor(lambda_index));
    archive.write("iteration", torch::tensor(iteration));
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

absl::Status LoadState(const TrainRouterOptions& o, Net& net, torch::optim::Adam& opt) {
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(StatePath(o));
    net->load(archive);
    torch::serialize::InputArchive opt_archive;
    archive.read("optimizer", opt_archive);
    opt.load(opt_archive);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(Cat("--resume: cannot load ", StatePath(o),
                                          " (written with other --hidden widths?): ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

}  // namespace

std::string PolicyPathFor(const TrainRouterOptions& o, size_t index) {
  if (o.lambdas.size() <= 1) return o.out_path;
  const std::string& p = o.out_path;
  const size_t slash = p.find_last_of('/'), dot = p.find_last_of('.');
  const size_t cut = dot != std::string::npos && (slash == std::string::npos || dot > slash) ? dot : p.size();
  char value[32];
  std::snprintf(value, sizeof(value), "%g", o.lambdas[index]);
  return Cat(p.substr(0, cut), "-lambda", value, p.substr(cut));
}

absl::Status TrainRouter(const TrainRouterOptions& o) {
  if (o.lambdas.empty()) return absl::InvalidArgumentError("--lambda: give at least one value");
  for (double l : o.lambdas) {
    if (!(l >= 0)) return absl::InvalidArgumentError(Cat("--lambda ", l, ": must be >= 0"));
  }
  if (o.samples < 2) return absl::InvalidArgumentError("--samples must be >= 2 (the leave-one-out baseline)");
  if (o.segment_len < 1) return absl::InvalidArgumentError("--segment-len must be >= 1");
  if (o.threads > 0) torch::set_num_threads(o.threads);
  torch::manual_seed(o.seed);

  ORYX_ASSIGN_OR_RETURN(Engine engine, Engine::Load(o.model_dir, {"cpu", o.threads}));
  if (!engine.tokenizer()) return absl::InvalidArgumentError("train-router: the model has no tokenizer");
  const ModelConfig& config = engine.backend().config();
  for (int32_t len : o.lengths) {
    if (len < 64 || len > config.max_position) {
      return absl::InvalidArgumentError(Cat("--lengths: ", len, " is outside [64, max_position ", config.max_position, "]"));
    }
  }
  std::vector<tasks::TaskKind> kinds;
  for (const std::string& t : o.tasks) {
    ORYX_ASSIGN_OR_RETURN(tasks::TaskKind k, train::ParseTaskName(t));
    kinds.push_back(k);
  }
  ORYX_ASSIGN_OR_RETURN(train::TaskSetup setup, train::MakeTaskSetup(*engine.tokenizer()));
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<tasks::HaystackSource> haystack,
                        train::OpenHaystack(o.haystack_files, o.data_dir, "train", *engine.tokenizer()));
  // Example n of a stream: task, length and depth drawn from its own seed (disjoint from the benchmark's
  // grid, whose seeds mix base seed 7 with the grid point).
  auto example = [&](uint64_t stream, int64_t n) -> absl::StatusOr<tasks::TaskExample> {
    const uint64_t seed = tasks::MixSeed({0x747261696e, o.seed, stream, static_cast<uint64_t>(n)});
    tasks::Rng rng(seed);
    const tasks::TaskKind kind = kinds[rng.UniformInt(kinds.size())];
    const int32_t len = o.lengths[rng.UniformInt(o.lengths.size())];
    return tasks::MakeExample(kind, setup.configs, haystack.get(), len, rng.UniformDouble(), seed);
  };

  EpisodeRunner runner(&engine, o.segment_len);
  const std::string log_path = o.log_path.empty() ? o.out_path + ".log.jsonl" : o.log_path;
  std::ofstream log(log_path, o.resume ? std::ios::app : std::ios::trunc);
  if (!log) return absl::InvalidArgumentError(Cat("cannot write the log ", log_path));

  // 1. Counterfactual data, shared by every lambda: for each warm-start example and each base, the base
  //    episode and one episode per decision with that decision flipped.
  auto t0 = Clock::now();
  std::vector<tasks::TaskExample> warm;
  for (int64_t i = 0; i < o.warm_examples; ++i) {
    ORYX_ASSIGN_OR_RETURN(tasks::TaskExample e, example(0, i));
    warm.push_back(std::move(e));
  }
  std::vector<const tasks::TaskExample*> base_examples;
  std::vector<Base> base_kinds;
  for (Base b : {Base::kPrefillLinear, Base::kLinear}) {
    for (const auto& e : warm) base_examples.push_back(&e), base_kinds.push_back(b);
  }
  ORYX_ASSIGN_OR_RETURN(std::vector<Episode> base, runner.Run(base_examples, [&](size_t i, LearnedRouter::Trace trace) {
    const Base kind = base_kinds[i];
    return std::make_unique<FunctionRouter>([kind, trace](const router::RouterContext& c) {
      const router::Decision d = BaseDecision(kind, c);
      trace(c, d);
      return d;
    });
  }));
  struct Flip {
    size_t base;  // index into `base`
    StepKey key;
  };
  std::vector<Flip> flips;
  std::vector<const tasks::TaskExample*> flip_examples;
  for (size_t i = 0; i < base.size(); ++i) {
    for (const auto& [key, step] : base[i].steps) {
      flips.push_back({i, key});
      flip_examples.push_back(base_examples[i]);
    }
  }
  std::cerr << "train-router: " << warm.size() << " warm-start examples, " << base.size() + flips.size()
            << " counterfactual episodes\n";
  ORYX_ASSIGN_OR_RETURN(std::vector<Episode> flipped, runner.Run(flip_examples, [&](size_t j, LearnedRouter::Trace) {
    const StepKey key = flips[j].key;
    const Base kind = base_kinds[flips[j].base];
    return std::make_unique<FunctionRouter>([kind, key](const router::RouterContext& c) {
      router::Decision d = BaseDecision(kind, c);
      if (KeyOf(c) == key) d.mode = d.mode == Mode::kAttention ? Mode::kLinear : Mode::kAttention;
      return d;
    });
  }));
  {
    double base_quality[2] = {0, 0}, helped = 0, hurt = 0;
    for (size_t i = 0; i < base.size(); ++i) base_quality[static_cast<int>(base_kinds[i])] += base[i].quality;
    for (size_t j = 0; j < flips.size(); ++j) {
      const double d = flipped[j].quality - base[flips[j].base].quality;
      helped += d > 0, hurt += d < 0;
    }
    const double n = static_cast<double>(warm.size());
    const nlohmann::json r = {{"phase", "counterfactual"}, {"examples", warm.size()}, {"episodes", base.size() + flips.size()},
                              {"prefill_linear_quality", base_quality[0] / n}, {"linear_quality", base_quality[1] / n},
                              {"flips_that_helped", helped}, {"flips_that_hurt", hurt}, {"seconds", Seconds(t0)}};
    log << r.dump() << "\n" << std::flush;
    std::cerr << "train-router: counterfactual " << r.dump() << "\n";
  }
  // Feature normalisation from the base episodes' decisions.
  std::vector<const Step*> all_steps;
  for (const Episode& e : base) {
    for (const auto& [key, s] : e.steps) all_steps.push_back(&s);
  }
  torch::Tensor warm_x, warm_a;
  Stack(all_steps, &warm_x, &warm_a);
  // A feature (nearly) constant over the warm-start decisions keeps scale 1: dividing by its tiny spread
  // would blow up whatever variation later episodes bring.
  const torch::Tensor mean = warm_x.mean(0), spread = warm_x.std(0, /*unbiased=*/false);
  const torch::Tensor inv_std = torch::where(spread > 1e-2, 1.0 / spread, torch::ones_like(spread));

  // 2. Per lambda: labels, warm start, REINFORCE. The state file's cursor says where a resumed run goes
  //    on: (lambda index, iteration), iteration -1 when that lambda's warm start has not run.
  int64_t start_lambda = 0, start_iteration = -1;
  if (o.resume && std::filesystem::exists(StatePath(o))) {
    ORYX_RETURN_IF_ERROR(ReadCursor(o, &start_lambda, &start_iteration));
    std::cerr << "train-router: resuming at lambda index " << start_lambda << ", iteration " << start_iteration << "\n";
  }
  for (size_t li = static_cast<size_t>(start_lambda); li < o.lambdas.size(); ++li) {
    const double lambda = o.lambdas[li];
    Net net(o.hidden);
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(o.learning_rate));
    int64_t first_iteration = 0;
    if (static_cast<int64_t>(li) == start_lambda && start_iteration >= 0) {
      ORYX_RETURN_IF_ERROR(LoadState(o, net, opt));
      first_iteration = start_iteration;
    } else {
      {
        torch::NoGradGuard no_grad;
        net->mean.copy_(mean);
        net->inv_std.copy_(inv_std);
      }
      // Cost-sensitive labels: attention where attention beats linear by more than lambda times its token
      // share, each decision weighted by how much the choice matters, |gain - lambda * share|. A decision
      // that helps one example in five by a third of its answer then outweighs the four where it changes
      // nothing (whose weight is only its small cost), so the classifier follows the expected gain rather
      // than the majority of examples.
      std::vector<const Step*> steps;
      std::vector<int64_t> labels;
      std::vector<float> weights;
      for (size_t j = 0; j < flips.size(); ++j) {
        const Episode& b = base[flips[j].base];
        const Step& s = b.steps.at(flips[j].key);
        const double attention_quality = s.mode == Mode::kAttention ? b.quality : flipped[j].quality;
        const double linear_quality = s.mode == Mode::kAttention ? flipped[j].quality : b.quality;
        const double margin = attention_quality - linear_quality -
                              lambda * static_cast<double>(s.tokens) / static_cast<double>(b.tokens);
        steps.push_back(&s);
        labels.push_back(margin > 0 ? 1 : 0);
        weights.push_back(static_cast<float>(std::abs(margin)));
      }
      torch::Tensor x, unused;
      Stack(steps, &x, &unused);
      const torch::Tensor y = torch::tensor(labels, torch::kInt64);
      torch::Tensor w = torch::tensor(weights);
      w = w / w.sum().clamp_min(1e-12);
      double loss_value = 0;
      for (int64_t step = 0; step < o.warm_steps; ++step) {
        opt.zero_grad();
        torch::Tensor loss = (w * torch::nn::functional::cross_entropy(
                                      net->forward(x), y,
                                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone)))
                                 .sum();
        loss.backward();
        opt.step();
        loss_value = loss.item<double>();
      }
      const double attention_labels = y.to(torch::kFloat64).mean().item<double>();
      const nlohmann::json r = {{"phase", "warm_start"}, {"lambda", lambda}, {"labels", labels.size()},
                                {"attention_label_share", attention_labels}, {"loss", loss_value}};
      log << r.dump() << "\n" << std::flush;
      std::cerr << "train-router: warm start " << r.dump() << "\n";
      ORYX_RETURN_IF_ERROR(SaveState(o, net, opt, static_cast<int64_t>(li), 0));
    }

    nlohmann::json last;
    for (int64_t it = first_iteration; it < o.iterations; ++it) {
      auto ti = Clock::now();
      ORYX_ASSIGN_OR_RETURN(LearnedPolicy snapshot, LearnedPolicy::Create(Export(net, o.segment_len)));
      auto policy = std::make_shared<const LearnedPolicy>(std::move(snapshot));
      std::vector<tasks::TaskExample> batch;
      for (int64_t b = 0; b < o.batch; ++b) {
        ORYX_ASSIGN_OR_RETURN(tasks::TaskExample e, example(1 + li, it * o.batch + b));
        batch.push_back(std::move(e));
      }
      std::vector<const tasks::TaskExample*> ptrs;
      for (int64_t g = 0; g < o.samples; ++g) {
        for (const auto& e : batch) ptrs.push_back(&e);
      }
      ORYX_ASSIGN_OR_RETURN(std::vector<Episode> episodes, runner.Run(ptrs, [&](size_t i, LearnedRouter::Trace trace) {
        const uint64_t sample_seed = tasks::MixSeed({o.seed, li, static_cast<uint64_t>(it), i / batch.size()});
        return std::make_unique<LearnedRouter>(policy, sample_seed, std::move(trace), o.exploration);
      }));
      // Leave-one-out advantages; every decision of an episode is weighted by its episode's advantage.
      const int64_t B = o.batch, G = o.samples;
      std::vector<const Step*> steps;
      std::vector<float> weights;
      double reward_sum = 0, correct = 0, quality = 0, attention = 0;
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
          reward_sum += e.Reward(lambda), correct += e.correct, quality += e.quality, attention += e.attention_fraction;
        }
      }
      torch::Tensor x, a;
      Stack(steps, &x, &a);
      const torch::Tensor w = torch::tensor(weights);
      opt.zero_grad();
      const torch::Tensor logp = torch::log_softmax(net->forward(x), 1);
      // The episodes were sampled from the exploring mixture e/2 + (1 - e) p: its log-probabilities.
      const torch::Tensor sampled = (o.exploration / 2 + (1 - o.exploration) * logp.exp()).log();
      const torch::Tensor chosen = sampled.gather(1, a.unsqueeze(1)).squeeze(1);
      const torch::Tensor entropy = -(logp.exp() * logp).sum(1).mean();
      const torch::Tensor loss = -(w * chosen).sum() - o.entropy_bonus * entropy;
      loss.backward();
      opt.step();
      const double n = static_cast<double>(B * G);
      last = {{"phase", "reinforce"}, {"lambda", lambda}, {"iteration", it + 1}, {"iterations", o.iterations},
              {"reward", reward_sum / n}, {"accuracy", correct / n}, {"quality", quality / n},
              {"attention_fraction", attention / n},
              {"entropy", entropy.item<double>()}, {"decisions", steps.size()}, {"seconds", Seconds(ti)}};
      log << last.dump() << "\n" << std::flush;
      std::fprintf(stderr, "train-router: lambda %g  iter %lld/%lld  reward %.3f  accuracy %.3f  attention %.3f  entropy %.3f  %.1f s\n",
                   lambda, static_cast<long long>(it + 1), static_cast<long long>(o.iterations), reward_sum / n,
                   correct / n, attention / n, entropy.item<double>(), Seconds(ti));
      ORYX_RETURN_IF_ERROR(SaveState(o, net, opt, static_cast<int64_t>(li), it + 1));
    }
    PolicyNetwork out = Export(net, o.segment_len);
    out.training = {{"lambda", lambda}, {"iterations", o.iterations}, {"batch", o.batch}, {"samples", o.samples},
                    {"warm_examples", o.warm_examples}, {"tasks", o.tasks}, {"lengths", o.lengths},
                    {"seed", o.seed}, {"last_iteration", last}};
    const std::string path = PolicyPathFor(o, li);
    ORYX_RETURN_IF_ERROR(WritePolicyFile(path, out));
    std::cerr << "train-router: wrote " << path << "\n";
    ORYX_RETURN_IF_ERROR(SaveState(o, net, opt, static_cast<int64_t>(li) + 1, -1));
  }
  return absl::OkStatus();
}

}  // namespace oryx::policies
