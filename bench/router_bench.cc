#include "bench/router_bench.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "bench/bench_util.h"
#include "engine/engine.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "policies/rule_policies.h"
#include "policies/task_episodes.h"
#include "router/cost_model.h"
#include "router/router.h"
#include "tasks/task_mix.h"
#include "train/shards.h"
#include "train/task_data.h"

namespace oryx::bench {

namespace {
// Attention on the segments that overlap [begin, end) (the asked needle), on the last prompt token and while
// generating; linear elsewhere. It knows where the needle is: an upper bound for routers, not a policy.
class OracleRouter final : public router::Router {
 public:
  OracleRouter(int64_t begin, int64_t end) : begin_(begin), end_(end) {}
  router::Decision Decide(const router::RouterContext& c) const override {
    if (c.phase == router::Phase::kDecode || c.last_prompt_token) return {Mode::kAttention};
    const bool overlaps = c.position < end_ && c.position + c.segment_tokens > begin_;
    return {overlaps ? Mode::kAttention : Mode::kLinear};
  }

 private:
  int64_t begin_, end_;
};
struct Total {
  double correct = 0, n = 0;               // answers right, answers asked
  double attention = 0, tokens = 0;        // tokens forwarded in attention mode, and in all
  double flops = 0;                        // model FLOPs of every forwarded token (router::WorkOf)
  void Add(const Total& t) {
    correct += t.correct, n += t.n, attention += t.attention, tokens += t.tokens, flops += t.flops;
  }
};

double TokenFlops(const ModelConfig& c, Mode m, int64_t context) {
  const router::SpanWork w = router::WorkOf(c, {1, 1, context, m});
  return w.dense_flops + w.attention_flops + w.recurrent_flops;
}

// Needle tasks: each prompt generated from with the policy (greedy); right when the generated tokens equal
// the answer. `policy_of(i)` names example i's policy.
absl::StatusOr<Total> ScoreByGeneration(Engine& engine, const std::vector<tasks::TaskExample>& examples,
                                        const std::function<std::string(size_t)>& policy_of) {
  const ModelConfig& c = engine.backend().config();
  std::vector<GenerateRequest> requests(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    requests[i].prompt_tokens = examples[i].Prompt();
    requests[i].max_tokens = examples[i].answers[0].length;
    requests[i].stop_at_eos = false;
    requests[i].policy = policy_of(i);
  }
  ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> results, engine.Generate(requests));
  Total t;
  std::map<std::string, std::unique_ptr<Decoder>> decoders;  // by policy name (a learned one reads a file)
  for (size_t i = 0; i < results.size(); ++i) {
    const GenerateStats& s = results[i].stats;
    t.correct += results[i].tokens == examples[i].AnswerTokens(0);
    t.n += 1;
    t.attention += s.attention_tokens;
    t.tokens += s.attention_tokens + s.linear_tokens;
    // FLOPs: the prompt's modes replayed from the decoder, the generated tokens' from the counts left over.
    std::unique_ptr<Decoder>& d = decoders[requests[i].policy];
    if (!d) {
      ORYX_ASSIGN_OR_RETURN(d, engine.policies().Make(requests[i].policy));
    }
    const std::vector<int32_t>& prompt = requests[i].prompt_tokens;
    std::vector<Mode> modes(prompt.size());
    d->PrefillModes(prompt, 0, modes);
    int64_t prompt_attention = 0;
    for (size_t p = 0; p < modes.size(); ++p) {
      t.flops += TokenFlops(c, modes[p], static_cast<int64_t>(p));
      prompt_attention += modes[p] == Mode::kAttention;
    }
    const int64_t n = static_cast<int64_t>(prompt.size());
    const int64_t decode_attention = std::max<int64_t>(0, s.attention_tokens - prompt_attention);
    const int64_t decode_linear = std::max<int64_t>(0, s.linear_tokens - (n - prompt_attention));
    t.flops += decode_attention * TokenFlops(c, Mode::kAttention, n) + decode_linear * TokenFlops(c, Mode::kLinear, n);
  }
  return t;
}

// MQAR (answers inside the sequence): the whole sequence teacher-forced in the modes the policy gives its
// prompt (policies/task_episodes.h).
absl::StatusOr<Total> ScoreByTeacherForcing(Engine& engine, const std::vector<tasks::TaskExample>& examples,
                                            const std::string& policy) {
  const ModelConfig& c = engine.backend().config();
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder, engine.policies().Make(policy));
  std::vector<const tasks::TaskExample*> ptrs;
  std::vector<std::vector<Mode>> modes;
  for (const tasks::TaskExample& ex : examples) {
    ptrs.push_back(&ex);
    modes.emplace_back(ex.ids.size() - 1);
    decoder->PrefillModes(std::span(ex.ids.data(), ex.ids.size() - 1), 0, modes.back());
  }
  ORYX_ASSIGN_OR_RETURN(std::vector<policies::AnswerScore> scores,
                        policies::ScoreTeacherForced(engine.backend(), ptrs, modes));
  Total t;
  for (size_t i = 0; i < examples.size(); ++i) {
    t.correct += static_cast<double>(scores[i].right);
    t.n += static_cast<double>(scores[i].asked);
    for (size_t p = 0; p < modes[i].size(); ++p) {
      t.attention += modes[i][p] == Mode::kAttention;
      t.flops += TokenFlops(c, modes[i][p], static_cast<int64_t>(p));
    }
    t.tokens += static_cast<double>(modes[i].size());
  }
  return t;
}
}  // namespace

absl::Status RunRouterBench(const RouterBenchOptions& o, const Emit& emit) {
  ORYX_ASSIGN_OR_RETURN(Engine engine, Engine::Load(o.model_dir, {"cpu", o.threads}));
  engine.set_prefix_cache(std::nullopt);  // policies are compared on the compute of whole prompts
  policies::RegisterAllPolicies(engine.policies());
  if (!engine.tokenizer()) return absl::InvalidArgumentError("bench router: the model has no tokenizer");
  const ModelConfig& c = engine.backend().config();
  for (const std::string& p : o.policies) ORYX_RETURN_IF_ERROR(engine.policies().Make(p).status());
  ORYX_ASSIGN_OR_RETURN(train::TaskSetup setup, train::MakeTaskSetup(*engine.tokenizer()));
  ORYX_ASSIGN_OR_RETURN(std::unique_ptr<tasks::HaystackSource> haystack,
                        train::OpenHaystack(o.haystack_files, o.data_dir, "val", *engine.tokenizer()));
  for (int32_t len : o.lengths) {
    if (len > c.max_position) return absl::InvalidArgumentError(Cat("length ", len, " exceeds max_position ", c.max_position));
  }
  for (const std::string& task : o.tasks) {
    ORYX_ASSIGN_OR_RETURN(tasks::TaskKind kind, train::ParseTaskName(task));
    const bool mqar = kind == tasks::TaskKind::kMqar;
    std::vector<std::string> names = o.policies;
    if (o.oracle && !mqar) names.push_back("oracle");  // (no oracle for MQAR: every query is a needle)
    std::map<std::string, Total> totals;
    for (int32_t len : o.lengths) {
      const std::vector<double> no_depths;
      ORYX_ASSIGN_OR_RETURN(std::vector<tasks::EvalPoint> grid,
                            tasks::EvalGrid(std::span(&len, 1), mqar ? no_depths : o.depths, o.seeds, o.base_seed));
      std::vector<tasks::TaskExample> examples;
      for (const tasks::EvalPoint& p : grid) {
        ORYX_ASSIGN_OR_RETURN(tasks::TaskExample ex, tasks::MakeExample(kind, setup.configs, haystack.get(), p.length, p.depth, p.seed));
        examples.push_back(std::move(ex));
      }
      for (const std::string& policy : names) {
        absl::StatusOr<Total> scored;
        if (mqar) {
          scored = ScoreByTeacherForcing(engine, examples, policy);
        } else if (policy == "oracle") {
          // A policy per example: it knows where that example's needle is (needle tasks: 2-token key and
          // 3-token value plus four markers).
          for (size_t i = 0; i < examples.size(); ++i) {
            const int64_t begin = examples[i].needle_position, end = begin + 9;
            engine.policies().Register(Cat("oracle-", i), "oracle", [begin, end](std::string_view) {
              router::RouterOptions ro;
              ro.segment_len = 16;
              return absl::StatusOr<std::unique_ptr<Decoder>>(std::unique_ptr<Decoder>(
                  new router::RouterDecoder(std::make_unique<OracleRouter>(begin, end), ro)));
            });
          }
          scored = ScoreByGeneration(engine, examples, [](size_t i) { return Cat("oracle-", i); });
        } else {
          scored = ScoreByGeneration(engine, examples, [&](size_t) { return policy; });
        }
        ORYX_RETURN_IF_ERROR(scored.status());
        const Total& t = *scored;
        totals[policy].Add(t);
        nlohmann::json r = {{"bench", "router"}, {"task", task}, {"length", len}, {"policy", policy},
                            {"n", t.n}, {"accuracy", t.correct / t.n}, {"attention_fraction", t.attention / t.tokens},
                            {"gflops_per_token", t.flops / t.tokens / 1e9}};
        emit(r);
      }
    }
    // Summaries: accuracy, attention share and FLOPs (against all-attention's) over all lengths; the share of
    // the linear -> attention gap each policy recovers, and the best share among the (non-oracle) policies at
    // 5%, 10% and 20% attention.
    auto acc = [&](const std::string& p) { return totals[p].correct / totals[p].n; };
    const bool has_ends = totals.count("attention") && totals.count("linear");
    const double gap = has_ends ? acc("attention") - acc("linear") : 0.0;
    for (const std::string& policy : names) {
      const Total& t = totals[policy];
      nlohmann::json r = {{"bench", "router"}, {"task", task}, {"summary", true}, {"policy", policy},
                          {"n", t.n}, {"accuracy", t.correct / t.n}, {"attention_fraction", t.attention / t.tokens},
                          {"gflops_per_token", t.flops / t.tokens / 1e9}};
      if (totals.count("attention")) r["flops_fraction"] = t.flops / totals["attention"].flops;
      if (has_ends && gap > 0) r["gap_recovered"] = (acc(policy) - acc("linear")) / gap;
      emit(r);
    }
    if (has_ends) {
      nlohmann::json best = {{"bench", "router"}, {"task", task}, {"summary", "best_at_fraction"},
                             {"attention_accuracy", acc("attention")}, {"linear_accuracy", acc("linear")}};
      for (double f : {0.05, 0.10, 0.20}) {
        double b = acc("linear");
        std::string who = "linear";
        for (const std::string& p : o.policies) {
          const Total& t = totals[p];
          if (t.attention / t.tokens <= f && acc(p) > b) b = acc(p), who = p;
        }
        best[Cat("best_at_", static_cast<int>(f * 100), "pct")] = {
            {"policy", who}, {"accuracy", b}, {"gap_recovered", gap > 0 ? (b - acc("linear")) / gap : 0.0}};
      }
      best.update(Provenance());
      emit(best);
    }
  }
  return absl::OkStatus();
}

}  // namespace oryx::bench
