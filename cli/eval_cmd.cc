// `oryx eval`: perplexity by mode schedule and task accuracy by policy of a trained model, on the CPU engine
// (default) or the LibTorch reference, and self-speculation agreement on the reference. A readable table by
// default; --json prints one object.
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "base/flags.h"
#include "base/file_util.h"
#include "engine/json_text.h"
#include "base/status_macros.h"
#include "train/evaluate.h"

namespace oryx::cli {

namespace {

using Json = nlohmann::json;

absl::StatusOr<std::vector<double>> ParseDepths(const std::vector<std::string>& items) {
  std::vector<double> out;
  for (const std::string& item : items) {
    for (absl::string_view part : absl::StrSplit(item, ',', absl::SkipEmpty())) {
      double v;
      if (!absl::SimpleAtod(part, &v) || !(v >= 0 && v <= 1)) {
        return absl::InvalidArgumentError(absl::StrCat("--depths expects numbers in [0, 1], got '", part, "'"));
      }
      out.push_back(v);
    }
  }
  return out;
}

void PrintTable(const Json& result) {
  const std::string eval = result["eval"];
  if (eval == "ppl") {
    std::printf("%-20s %10s %10s %12s\n", "schedule", "loss", "ppl", "attn frac");
    for (const Json& r : result["results"]) {
      std::printf("%-20s %10.4f %10.2f %12.3f\n", r["schedule"].get<std::string>().c_str(), r["loss"].get<double>(),
                  r["ppl"].get<double>(), r["attention_fraction"].get<double>());
    }
  } else if (eval == "agreement") {
    std::printf("k=%d: acceptance %.3f, mean accepted per round %.2f, tokens per round %.2f (%d rounds)\n",
                result["k"].get<int>(), result["acceptance_rate"].get<double>(),
                result["mean_accepted_per_round"].get<double>(), result["tokens_per_round"].get<double>(),
                result["rounds"].get<int>());
    std::printf("per draft position:");
    for (const Json& v : result["per_position_acceptance"]) std::printf(" %.3f", v.get<double>());
    std::printf("\n");
  } else {
    std::printf("%-16s %8s %8s %6s %10s %12s\n", "policy", "length", "depth", "n", "accuracy", "answer ll");
    for (const Json& r : result["results"]) {
      if (r.contains("summary")) continue;
      std::string depth = r["depth"].is_null() ? "-" : absl::StrFormat("%.2f", r["depth"].get<double>());
      std::string ll = r["mean_log_likelihood"].is_null() ? "-" : absl::StrFormat("%.3f", r["mean_log_likelihood"].get<double>());
      std::printf("%-16s %8d %8s %6d %10.3f %12s\n", r["policy"].get<std::string>().c_str(), r["length"].get<int>(),
                  depth.c_str(), r["n"].get<int>(), r["accuracy"].get<double>(), ll.c_str());
    }
    std::printf("\n%-16s %10s %12s\n", "policy", "accuracy", "attn frac");
    for (const Json& r : result["results"]) {
      if (!r.contains("summary")) continue;
      std::printf("%-16s %10.3f %12.3f\n", r["policy"].get<std::string>().c_str(), r["accuracy"].get<double>(),
                  r["attention_fraction"].get<double>());
    }
  }
}

}  // namespace

int RunEval(const Args& args) {
  static const char* kUsage =
      "usage: oryx eval <ppl|niah|niah-multikey|passkey|mqar|copy|agreement> --model DIR [flags]\n\n"
      "  ppl         validation perplexity under mode schedules, with per-position losses\n"
      "  niah        needle-in-a-haystack accuracy by policy over lengths and depths\n"
      "  niah-multikey, passkey, mqar   the other synthetic retrieval tasks\n"
      "  copy        continuing a passage of ordinary text that the context already holds, by distance\n"
      "  agreement   greedy self-speculation on held-out text, on the LibTorch reference (runs oryx-torch)\n\n"
      "Run 'oryx eval <kind> --help' for its flags.\n";
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string kind = args[0];
  const Args rest(args.begin() + 1, args.end());
#ifndef ORYX_HAVE_TORCH
  // The LibTorch reference lives in the oryx-torch binary, so that this one loads no LibTorch.
  if (kind == "agreement" || HasFlagValue(rest, "backend", "libtorch")) return ExecTorchBinary("eval", args);
#endif
  train::EvalCommon common;
  std::string data, out_file;
  bool json = false;
  int64_t seed = 1, threads = 0;
  auto add_common = [&](FlagSet& f) {
    f.String("model", &common.model_dir, "model directory (config.json, weights, tokenizer.model)", true);
    f.String("data", &data, kind == "mqar" ? "unused by mqar (its examples are synthetic)"
                                            : "corpus directory (oryx data prepare): its validation split is read");
    f.String("backend", &common.backend, "engine (the engine's CPU or CUDA backend) | libtorch (the reference model)");
    f.String("device", &common.device, "auto | cpu | cuda (auto: the engine on the CPU, LibTorch on CUDA if present)");
    f.Int("threads", &threads, "CPU threads (0: default)", 0, 1024);
    f.String("weights", &common.weights, absl::StrCat("engine backend: ", kWeightsHelp));
    f.String("kv-dtype", &common.kv_dtype, absl::StrCat("engine backend: ", kKvDtypeHelp));
    f.Int("seed", &seed, "seed of schedules and task examples", 0);
    f.Bool("json", &json, "print one JSON object instead of a table");
    f.String("out", &out_file, "also write the JSON object to this file (atomically)");
  };
  auto finish = [&](const absl::StatusOr<Json>& result) -> absl::Status {
    if (!result.ok()) return result.status();
    if (!out_file.empty()) ORYX_RETURN_IF_ERROR(WriteFileAtomic(out_file, JsonText(*result, 1) + "\n"));
    if (json) {
      std::cout << JsonText(*result) << "\n";
    } else {
      PrintTable(*result);
    }
    return absl::OkStatus();
  };
  auto fill_common = [&] {
    common.seed = static_cast<uint64_t>(seed);
    common.threads = static_cast<int>(threads);
  };
  auto open_model = [&]() -> absl::StatusOr<std::unique_ptr<train::SequenceModel>> {
    if (common.backend == "engine") return train::OpenEngineModel(common);
    if (common.weights != "f32") return absl::InvalidArgumentError("--weights is for --backend engine");
    if (!common.kv_dtype.empty()) return absl::InvalidArgumentError("--kv-dtype is for --backend engine");
#ifdef ORYX_HAVE_TORCH
    if (common.backend == "libtorch") return train::OpenTorchModel(common);
#endif
    return absl::InvalidArgumentError(absl::StrCat("unknown --backend '", common.backend, "' (engine, libtorch)"));
  };

  if (kind == "ppl") {
    train::PplOptions o;
    std::vector<std::string> schedules, text;
    FlagSet f("oryx eval ppl --model DIR --data DIR|--text FILE... [--schedules S...] [--seq-len N] [--sequences N]",
              "Validation perplexity under mode schedules: attention, linear, mixed[:F] (fragments in\n"
              "attention mode with probability F), lin-to-attn:P and attn-to-lin:P (one switch at P).");
    add_common(f);
    f.StringList("schedules", &schedules, "schedules (space- or comma-separated) [default: attention linear mixed]");
    f.Int("seq-len", &o.seq_len, "tokens per sequence (0: max_position, at most 2048)", 0);
    f.Int("sequences", &o.sequences, "validation sequences", 1);
    f.StringList("text", &text, "text files to measure instead of --data");
    return RunWithFlags(f, rest, [&]() -> absl::Status {
      fill_common();
      o.common = common;
      o.data_dir = data;
      if (!schedules.empty()) o.schedules = SplitList(schedules);
      o.text_files = text;
      if (data.empty() == text.empty()) return absl::InvalidArgumentError("give exactly one of --data and --text");
      ORYX_ASSIGN_OR_RETURN(std::unique_ptr<train::SequenceModel> model, open_model());
      return finish(train::EvalPerplexity(o, *model));
    });
  }
  if (kind == "niah" || kind == "niah-multikey" || kind == "passkey" || kind == "mqar" || kind == "copy") {
    train::TaskEvalOptions o;
    o.task = kind;
    std::vector<std::string> policies, lengths, depths, haystack;
    int64_t seeds = o.seeds, pairs = o.mqar_pairs, needles = o.multikey_needles;
    int64_t cue = o.copy_cue_length, answer = o.copy_answer_length;
    const bool mqar = kind == "mqar";
    FlagSet f(mqar ? "oryx eval mqar --model DIR [--pairs N] [--policies P...] [--lengths N...]"
                   : absl::StrCat("oryx eval ", kind,
                                  " --model DIR --data DIR|--haystack FILE... [--policies P...] [--lengths N...]"),
              mqar ? "Multi-query associative recall (synthetic key-value pairs, then queries): accuracy\n"
                     "(teacher-forced exact match of every answer token) and answer log-likelihood by policy:\n"
                     "attention, linear, prefill-linear (prompt in linear mode, its last token and the answer in\n"
                     "attention mode)."
                   : kind == "copy"
                   ? "Copying ordinary text: a passage of the haystack (at the depth) is repeated at the end; given\n"
                     "its first --cue-tokens (16), the model must continue it for --answer-tokens (32). Accuracy is\n"
                     "the teacher-forced exact match of those tokens (and token_accuracy the share right), by policy:\n"
                     "attention, linear, prefill-linear. Haystack text\n"
                     "comes from the corpus's validation split, or from text files (--haystack), e.g. documents\n"
                     "the model never trained on."
                   : "Task accuracy (teacher-forced exact match of every answer token) and answer log-likelihood\n"
                     "by policy: attention, linear, prefill-linear (prompt in linear mode, its last token and the\n"
                     "answer in attention mode). Haystack text comes from the corpus's validation split, or from\n"
                     "text files (--haystack) tokenised with the model's tokenizer.");
    add_common(f);
    f.StringList("policies", &policies, "policies [default: attention linear prefill-linear]");
    f.StringList("lengths", &lengths, "sequence lengths [default: 256 512 1024 2048]");
    f.Int("seeds", &seeds, mqar ? "examples per length" : "examples per (length, depth)", 1, 100000);
    if (mqar) {
      f.Int("pairs", &pairs, "key-value pairs per example", 1, 100000);
    } else {
      if (kind == "niah-multikey") f.Int("needles", &needles, "needles per example: the asked one and distractors", 2, 64);
      if (kind == "copy") {
        f.Int("cue-tokens", &cue, "tokens of the repeated passage the model is given", 1, 4096);
        f.Int("answer-tokens", &answer, "tokens of the passage it must continue (scored)", 1, 4096);
      }
      f.StringList("depths", &depths, kind == "copy" ? "passage depths in [0, 1] [default: 0 0.25 0.5 0.75 1]"
                                                     : "needle depths in [0, 1] [default: 0 0.25 0.5 0.75 1]");
      f.StringList("haystack", &haystack, "text files for the haystack instead of --data");
    }
    return RunWithFlags(f, rest, [&]() -> absl::Status {
      fill_common();
      o.common = common;
      o.data_dir = data;
      o.haystack_files = haystack;
      if (!mqar && data.empty() == haystack.empty()) {
        return absl::InvalidArgumentError("give exactly one of --data and --haystack");
      }
      if (!policies.empty()) o.policies = SplitList(policies);
      if (!lengths.empty()) {
        ORYX_ASSIGN_OR_RETURN(std::vector<int64_t> ls, ParsePositiveInts(lengths, "lengths"));
        o.lengths.assign(ls.begin(), ls.end());
      }
      if (!depths.empty()) {
        ORYX_ASSIGN_OR_RETURN(o.depths, ParseDepths(depths));
      }
      o.seeds = static_cast<int32_t>(seeds);
      o.mqar_pairs = static_cast<int32_t>(pairs);
      o.multikey_needles = static_cast<int32_t>(needles);
      o.copy_cue_length = static_cast<int32_t>(cue);
      o.copy_answer_length = static_cast<int32_t>(answer);
      ORYX_ASSIGN_OR_RETURN(std::unique_ptr<train::SequenceModel> model, open_model());
      return finish(train::EvalTask(o, *model));
    });
  }
#ifdef ORYX_HAVE_TORCH
  if (kind == "agreement") {
    train::AgreementOptions o;
    FlagSet f("oryx eval agreement --model DIR --data DIR [--k N] [--prompts N]",
              "Greedy self-speculation on held-out text: after an attention-mode prefill, rounds of k\n"
              "linear-mode drafts verified in attention mode. Reports the acceptance rate, mean accepted\n"
              "tokens per round and acceptance per draft position.");
    add_common(f);
    f.Int("k", &o.k, "draft length", 1, 64);
    f.Int("prompts", &o.prompts, "prompts from the validation split", 1);
    f.Int("prompt-tokens", &o.prompt_tokens, "tokens per prompt", 1);
    f.Int("gen-tokens", &o.gen_tokens, "tokens generated per prompt", 1);
    return RunWithFlags(f, rest, [&]() -> absl::Status {
      fill_common();
      o.common = common;
      o.data_dir = data;
      if (data.empty()) return absl::InvalidArgumentError("--data is required");
      return finish(train::EvalAgreement(o));
    });
  }
#endif
  std::cerr << "oryx: error: unknown eval kind '" << kind << "' (ppl, niah, niah-multikey, passkey, mqar, agreement)\n";
  return 2;
}

}  // namespace oryx::cli
