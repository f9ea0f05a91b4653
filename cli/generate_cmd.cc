// `oryx generate`: text generation with a mode policy (DESIGN.md §9). Streams the text to stdout as it is
// produced and ends with one statistics line on stderr; --json prints only the result object.
#include <cstdio>
#include <iostream>

#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "base/flags.h"
#include "engine/engine.h"
#include "base/file_util.h"
#include "base/status_macros.h"
#include "policies/rule_policies.h"
#include "engine/json_text.h"

namespace oryx::cli {

namespace {

std::string StatsLine(const GenerateResult& r) {
  const GenerateStats& s = r.stats;
  const nlohmann::json j = ToJson(r)["stats"];
  std::string line = absl::StrFormat(
      "[%s] %d prompt + %d generated tokens (%s) | attention %d, linear %d tokens (%.0f%% attention) | "
      "prefill %.1f tok/s, decode %.1f tok/s",
      r.policy, s.prompt_tokens, s.generated_tokens, FinishReasonName(r.finish_reason), s.attention_tokens,
      s.linear_tokens, 100 * s.attention_fraction(), j["prefill_tokens_per_s"].get<double>(),
      j["decode_tokens_per_s"].get<double>());
  if (s.spec) {
    line += absl::StrFormat(" | speculation: %d rounds, %d/%d drafts accepted (%.0f%%), %.2f per round",
                            s.spec->rounds, s.spec->accepted, s.spec->drafted,
                            100 * j["spec"]["acceptance_rate"].get<double>(),
                            j["spec"]["mean_accepted_per_round"].get<double>());
  }
  return line;
}

}  // namespace

int RunGenerate(const Args& args) {
  std::string prompt, prompt_file;
  std::vector<std::string> stop;
  int64_t max_tokens = 128, top_k = 0, seed = 0;
  double temperature = 0, top_p = 1;
  bool json = false, ignore_eos = false;
  GenerateRequest request;
  FlagSet f(
      "oryx generate --model DIR --prompt TEXT|--prompt-file F [--max-tokens N] [--policy NAME]\n"
      "                    [--temperature T --top-k K --top-p P --seed S] [--device cpu|cuda] [--json]",
      "Generates a continuation of the prompt, switching modes as the policy says:\n"
      "  attention | linear          every token in that mode\n"
      "  prefill-linear              the prompt in linear mode, generation in attention mode\n"
      "  periodic:N                  every N-th token in attention mode, the rest linear\n"
      "  speculative[:K]             linear-mode drafts of K tokens (adaptive K if omitted) verified in\n"
      "                              attention mode: exactly attention mode's output, faster when drafts agree\n"
      "  speculative:ngram[:K]       drafts copied from earlier context (prompt lookup), same verification\n"
      "  entropy:TAU                 prompt linear (its last token attention); a generated token attends when\n"
      "                              the distribution it came from had entropy above TAU nats\n"
      "  budget:FRACTION             prompt linear (its last token attention); attention wherever the\n"
      "                              sequence's share of attention tokens stays at most FRACTION\n"
      "  match:L                     prompt linear, except its last token and segments repeating a run of at\n"
      "                              least L earlier tokens; generation in attention mode\n"
      "  tail:N                      prompt linear, except its last N tokens (where a continuation or a\n"
      "                              question begins); generation in attention mode\n"
      "  random:FRACTION             each segment or token attends with probability FRACTION (a baseline)\n"
      "  learned:PATH                a policy file trained by `oryx train-router`: an MLP over the router's\n"
      "                              features picks each segment's mode (and, if trained to, draft lengths)\n"
      "  drafted:POLICY              a router policy above (entropy to learned) whose decode steps, where\n"
      "                              every sequence decides attention mode, are speculative rounds of adaptive\n"
      "                              length (lossless)");
  EngineFlags engine_flags;
  engine_flags.AddModel(f);
  f.String("prompt", &prompt, "the prompt text");
  f.String("prompt-file", &prompt_file, "read the prompt from this file");
  f.Int("max-tokens", &max_tokens, "tokens to generate at most", 1, 1 << 30);
  f.String("policy", &request.policy, "mode policy (see above)");
  f.Double("temperature", &temperature, "sampling temperature; 0 is greedy");
  f.Int("top-k", &top_k, "keep the k most likely tokens (0: all)", 0);
  f.Double("top-p", &top_p, "keep the smallest set of tokens with this much probability mass, in (0, 1]");
  f.Int("seed", &seed, "sampling seed", 0);
  f.StringList("stop", &stop, "stop strings: generation ends before the first one produced");
  f.Bool("ignore-eos", &ignore_eos, "keep generating past the end-of-sequence token");
  engine_flags.AddBackend(f);
  f.Bool("json", &json, "print one JSON object (text, tokens, finish_reason, policy, stats) instead of streaming");
  int64_t logprobs = -1;
  bool echo = false;
  f.Int("logprobs", &logprobs, "with --json: each generated token's log-probability and N alternatives (0..20)", 0,
        kMaxTopLogprobs);
  f.Bool("echo", &echo, "with --logprobs: the prompt's tokens' log-probabilities too (prompt_logprobs)");
  return RunWithFlags(f, args, [&]() -> absl::Status {
    if (f.was_set("prompt") && prompt.empty() && prompt_file.empty()) {
      return absl::InvalidArgumentError(
          "--prompt is empty: the model continues a prompt, so give it at least one character");
    }
    if (prompt.empty() == prompt_file.empty()) {
      return absl::InvalidArgumentError("give exactly one of --prompt and --prompt-file");
    }
    if (!prompt_file.empty()) {
      ORYX_ASSIGN_OR_RETURN(prompt, ReadFile(prompt_file));
      if (prompt.empty()) return absl::InvalidArgumentError(prompt_file + ": the prompt file is empty");
    }
    if (f.was_set("logprobs") && !json) return absl::InvalidArgumentError("--logprobs prints them in the --json object: add --json");
    if (echo && !f.was_set("logprobs")) return absl::InvalidArgumentError("--echo goes with --logprobs");
    request.logprobs = static_cast<int32_t>(f.was_set("logprobs") ? logprobs : -1);
    request.echo = echo;
    request.prompt = prompt;
    request.max_tokens = max_tokens;
    request.stop = stop;
    request.stop_at_eos = !ignore_eos;
    request.sampling = {static_cast<float>(temperature), top_k, static_cast<float>(top_p), static_cast<uint64_t>(seed)};
    ORYX_RETURN_IF_ERROR(ValidateSampling(request.sampling));
    ORYX_ASSIGN_OR_RETURN(Engine engine, engine_flags.Load());
    if (!json) {
      request.on_token = [](const TokenEvent& e) {
        std::fwrite(e.text.data(), 1, e.text.size(), stdout);
        std::fflush(stdout);
        return true;
      };
    }
    ORYX_ASSIGN_OR_RETURN(GenerateResult result, engine.Generate(request));
    if (json) {
      std::cout << JsonText(ToJson(result)) << "\n";
    } else {
      std::cout << "\n";
      std::cerr << StatsLine(result) << "\n";
      if (result.finish_reason == FinishReason::kLength && static_cast<int64_t>(result.tokens.size()) < max_tokens) {
        std::cerr << "oryx: generation stopped at the end of the model's context ("
                  << engine.backend().config().max_position << " positions), before --max-tokens " << max_tokens
                  << "\n";
      }
    }
    return absl::OkStatus();
  });
}

}  // namespace oryx::cli
