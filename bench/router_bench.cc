#include "bench/router_bench.h"

#include <map>
#include <memory>
#include <optional>

#include "bench/bench_util.h"
#include "engine/engine.h"
#include "engine/status_macros.h"
#include "engine/str_cat.h"
#include "policies/rule_policies.h"
#include "router/router.h"
#include "speculative/speculative.h"
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
}  // namespace

absl::Status RunRouterBench(const RouterBenchOptions& o, const Emit& emit) {
  ORYX_ASSIGN_OR_RETURN(Engine engine, Engine::Load(o.model_dir, {"cpu", o.threads}));
  speculative::RegisterPolicies(engine.policies());
  policies::RegisterPolicies(engine.policies());
  if (!engine.tokenizer()) return absl::InvalidArgumentError("bench router: the model has no tokenizer");
  const ModelConfig& c = engine.backend().config();
  ORYX_ASSIGN_OR_RETURN(train::TaskSetup setup, train::MakeTaskSetup(*engine.tokenizer()));
  std::optional<CorpusReader> val;
  std::unique_ptr<tasks::HaystackSource> haystack;
  if (o.haystack_files.empty()) {
    ORYX_ASSIGN_OR_RETURN(CorpusReader reader, CorpusReader::Open(o.data_dir, "val"));
    val.emplace(std::move(reader));
    haystack = std::make_unique<train::CorpusHaystack>(&*val);
  } else {
    ORYX_ASSIGN_OR_RETURN(train::TextHaystack text, train::TextHaystack::Load(o.haystack_files, *engine.tokenizer()));
    haystack = std::make_unique<train::TextHaystack>(std::move(text));
  }
  for (int32_t len : o.lengths) {
    if (len > c.max_position) return absl::InvalidArgumentError(Cat("length ", len, " exceeds max_position ", c.max_position));
  }
  std::vector<std::string> names = o.policies;
  if (o.oracle) names.push_back("oracle");
  for (const std::string& task : o.tasks) {
    ORYX_ASSIGN_OR_RETURN(tasks::TaskKind kind, tasks::ParseTaskKind(task == "niah" ? "niah_single"
                                                                     : task == "niah-multikey" ? "niah_multikey"
                                                                                               : task));
    if (kind == tasks::TaskKind::kMqar) {
      return absl::InvalidArgumentError("bench router: mqar has answers inside the prompt; use oryx eval mqar");
    }
    struct Total {
      double correct = 0, n = 0, attention = 0, tokens = 0;
    };
    std::map<std::string, Total> totals;
    for (int32_t len : o.lengths) {
      ORYX_ASSIGN_OR_RETURN(std::vector<tasks::EvalPoint> grid, tasks::EvalGrid(std::span(&len, 1), o.depths, o.seeds, o.base_seed));
      std::vector<tasks::TaskExample> examples;
      for (const tasks::EvalPoint& p : grid) {
        ORYX_ASSIGN_OR_RETURN(tasks::TaskExample ex, tasks::MakeExample(kind, setup.configs, haystack.get(), p.length, p.depth, p.seed));
        examples.push_back(std::move(ex));
      }
      for (const std::string& policy : names) {
        std::vector<GenerateRequest> requests(examples.size());
        for (size_t i = 0; i < examples.size(); ++i) {
          requests[i].prompt_tokens = examples[i].Prompt();
          requests[i].max_tokens = examples[i].answers[0].length;
          requests[i].stop_at_eos = false;
          requests[i].policy = policy;
          if (policy == "oracle") {
            // A policy per example: it knows where that example's needle is (needle tasks: 2-token key and
            // 3-token value plus four markers).
            const int64_t begin = examples[i].needle_position, end = begin + 9;
            requests[i].policy = Cat("oracle-", i);
            engine.policies().Register(requests[i].policy, "oracle", [begin, end](std::string_view) {
              router::RouterOptions ro;
              ro.segment_len = 16;
              return absl::StatusOr<std::unique_ptr<Decoder>>(std::unique_ptr<Decoder>(
                  new router::RouterDecoder(std::make_unique<OracleRouter>(begin, end), ro)));
            });
          }
        }
        ORYX_ASSIGN_OR_RETURN(std::vector<GenerateResult> results, engine.Generate(requests));
        Total t;
        for (size_t i = 0; i < results.size(); ++i) {
          t.correct += results[i].tokens == examples[i].AnswerTokens(0);
          t.n += 1;
          t.attention += results[i].stats.attention_tokens;
          t.tokens += results[i].stats.attention_tokens + results[i].stats.linear_tokens;
        }
        Total& all = totals[policy];
        all.correct += t.correct, all.n += t.n, all.attention += t.attention, all.tokens += t.tokens;
        nlohmann::json r = {{"bench", "router"}, {"task", task}, {"length", len}, {"policy", policy},
                            {"n", t.n}, {"accuracy", t.correct / t.n}, {"attention_fraction", t.attention / t.tokens}};
        emit(r);
      }
    }
    // Summaries: accuracy and attention share over all lengths; the share of the linear -> attention gap
    // each policy recovers, and the best share among the (non-oracle) policies at 5%, 10% and 20% attention.
    auto acc = [&](const std::string& p) { return totals[p].correct / totals[p].n; };
    const bool has_ends = totals.count("attention") && totals.count("linear");
    const double gap = has_ends ? acc("attention") - acc("linear") : 0.0;
    for (const std::string& policy : names) {
      const Total& t = totals[policy];
      nlohmann::json r = {{"bench", "router"}, {"task", task}, {"summary", true}, {"policy", policy},
                          {"n", t.n}, {"accuracy", t.correct / t.n}, {"attention_fraction", t.attention / t.tokens}};
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
