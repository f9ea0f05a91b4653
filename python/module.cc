// `import oryx`: the engine from Python (DESIGN.md §9). Engine(model_dir) loads a model with every policy
// `oryx generate` takes; generate, stream and score run it with the GIL released; errors are oryx.Error
// subclasses carrying the engine's message. Conversions only: the engine decides everything.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "base/str_cat.h"
#include "engine/config.h"
#include "policies/rule_policies.h"
#include "python/binding.h"
#include "python/stream.h"
#include "train/mode_sampling.h"

namespace oryx::python {

namespace {

using namespace nb::literals;

// Each registered policy's usage, by name: what `oryx generate --policy` takes.
nb::dict Policies() {
  PolicyRegistry registry;
  policies::RegisterAllPolicies(registry);
  nb::dict usages;
  for (const auto& [name, usage] : registry.Usages()) usages[nb::str(name.c_str())] = usage;
  return usages;
}

void Init(EngineHandle* self, const std::string& model_dir, const std::string& device, int threads,
          const std::string& weights, const std::string& kv_dtype) {
  absl::StatusOr<Engine> loaded = [&] {
    nb::gil_scoped_release no_gil;
    return Engine::Load(model_dir, {.device = device,
                                    .threads = threads,
                                    .weights = weights,
                                    .kv_dtype = kv_dtype,
                                    .cuda = CudaSwitches::FromEnvironment()});
  }();
  Engine engine = ValueOrThrow(std::move(loaded));
  policies::RegisterAllPolicies(engine.policies());
  new (self) EngineHandle{std::move(engine), {}};
}

std::vector<GenerateResult> GenerateLocked(EngineHandle& handle, const std::vector<GenerateRequest>& requests) {
  return ValueOrThrow(RunLocked(handle, [&] { return handle.engine.Generate(requests); }));
}

Result GenerateOne(EngineHandle& handle, const Prompt& prompt, const GenerateOptions& options) {
  return ToPython(GenerateLocked(handle, {MakeRequest(prompt, options)})[0]);
}

std::vector<Result> GenerateMany(EngineHandle& handle, const std::vector<Prompt>& prompts,
                                 const GenerateOptions& options) {
  std::vector<GenerateRequest> requests;
  for (const Prompt& prompt : prompts) requests.push_back(MakeRequest(prompt, options));
  std::vector<Result> results;
  for (const GenerateResult& result : GenerateLocked(handle, requests)) results.push_back(ToPython(result));
  return results;
}

std::unique_ptr<Stream> StreamOne(EngineHandle& handle, const Prompt& prompt, const GenerateOptions& options) {
  return std::make_unique<Stream>(handle, MakeRequest(prompt, options));
}

// The modes a score runs its tokens in: a schedule's name (train/mode_sampling.h) or one mode per token
// ("attention" | "linear"; the last token's may be left out, since no token follows it to score).
using Modes = std::variant<std::string, std::vector<std::string>>;

std::vector<Mode> ModesOf(const Modes& modes, int64_t n, const ModelConfig& config, uint64_t seed, int64_t sequence) {
  std::vector<Mode> out;
  if (const auto* schedule = std::get_if<std::string>(&modes)) {
    for (uint8_t m : ValueOrThrow(train::ScheduleModes(*schedule, n, config, seed, sequence))) {
      out.push_back(m ? Mode::kAttention : Mode::kLinear);
    }
    return out;
  }
  const auto& names = std::get<std::vector<std::string>>(modes);
  const int64_t given = static_cast<int64_t>(names.size());
  if (given != n && given != n - 1) {
    ThrowIfError(absl::InvalidArgumentError(
        Cat("score: ", given, " modes for ", n, " tokens (give one per token, or one per token but the last)")));
  }
  for (const std::string& name : names) {
    if (name != "attention" && name != "linear") {
      ThrowIfError(absl::InvalidArgumentError(Cat("score: mode '", name, "' is not attention or linear")));
    }
    out.push_back(name == "attention" ? Mode::kAttention : Mode::kLinear);
  }
  return out;
}

std::vector<std::optional<double>> Score(EngineHandle& handle, const std::vector<int32_t>& tokens, const Modes& modes,
                                         int64_t start, uint64_t seed, int64_t sequence) {
  const std::vector<Mode> m =
      ModesOf(modes, static_cast<int64_t>(tokens.size()), handle.engine.backend().config(), seed, sequence);
  const std::vector<TokenLogProb> scored =
      ValueOrThrow(RunLocked(handle, [&] { return handle.engine.Score(tokens, m, start, /*top_n=*/0); }));
  std::vector<std::optional<double>> logprobs;
  for (const TokenLogProb& t : scored) logprobs.push_back(t.logprob);
  return logprobs;
}

// generate and stream take the same keyword arguments, with GenerateRequest's defaults.
auto GenerateArgs() {
  const GenerateRequest d;
  return std::make_tuple("policy"_a = d.policy, "max_tokens"_a = d.max_tokens,
                         "temperature"_a = static_cast<double>(d.sampling.temperature),
                         "top_p"_a = static_cast<double>(d.sampling.top_p), "top_k"_a = d.sampling.top_k,
                         "seed"_a = d.sampling.seed, "stop"_a = nb::none(), "ignore_eos"_a = !d.stop_at_eos);
}

// fn(handle, prompt, GenerateOptions) as a method taking those keyword arguments.
template <class PromptArg, class Fn>
auto WithOptions(Fn fn) {
  return [fn](EngineHandle& handle, const PromptArg& prompt, std::string policy, int64_t max_tokens, double temperature,
              double top_p, int64_t top_k, uint64_t seed, StopStrings stop, bool ignore_eos) {
    return fn(
        handle, prompt,
        GenerateOptions{std::move(policy), max_tokens, temperature, top_p, top_k, seed, std::move(stop), ignore_eos});
  };
}

constexpr const char* kGenerateDoc =
    "Generates a continuation of each prompt, all of them together in one batch. A prompt is text (the engine "
    "puts BOS in front) or a list of token ids (used as given). One prompt gives one Result, a list of prompts "
    "a list of Results. policy: any of oryx.policies(), e.g. 'speculative:4', 'learned:PATH'. temperature 0 "
    "is greedy. stop: a string or a list of strings that end generation before them. The GIL is released "
    "while the engine runs.";

constexpr const char* kStreamDoc =
    "The tokens of one prompt's continuation as the engine produces them: iterate the Stream for Tokens "
    "(id, text); its result is the Result once it has finished.";

constexpr const char* kScoreDoc =
    "The log-probability of each of token_ids[start:] given the tokens before it (teacher-forced, temperature "
    "1), the tokens run in `modes`: a schedule's name, as `oryx eval ppl --schedules` takes it (attention, "
    "linear, mixed[:F], lin-to-attn:P, attn-to-lin:P; mixed is drawn as the evaluation's sequence `sequence` "
    "with seed `seed`), or one mode per token ('attention' or 'linear'; the last token's may be left out). "
    "start=0 puts None first: nothing precedes the first token. Text prompts begin with BOS: "
    "tokenizer.encode(text, bos=True).";

void DefineTokenizer(nb::module_& module) {
  nb::class_<Tokenizer>(module, "Tokenizer", "The model's SentencePiece tokenizer (engine.tokenizer).")
      .def(
          "encode",
          [](const Tokenizer& t, const std::string& text, bool bos) {
            nb::gil_scoped_release no_gil;
            std::vector<int32_t> ids;
            if (bos) ids.push_back(t.bos_id());
            t.EncodeAppend(text, &ids);
            return ids;
          },
          "text"_a, "bos"_a = false,
          "The token ids of text (its UTF-8 bytes); bos=True puts BOS first, as the engine does to a text prompt.")
      .def(
          "decode",
          [](const Tokenizer& t, const std::vector<int32_t>& ids) {
            std::string bytes;
            {
              nb::gil_scoped_release no_gil;
              bytes = t.Decode(ids);
            }
            return nb::steal<nb::str>(
                PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace"));
          },
          "ids"_a, "The text of token ids (bytes that are not UTF-8 become U+FFFD).")
      .def_prop_ro("vocab_size", &Tokenizer::vocab_size)
      .def_prop_ro("bos_id", &Tokenizer::bos_id)
      .def_prop_ro("eos_id", &Tokenizer::eos_id);
}

void DefineEngine(nb::module_& module) {
  nb::class_<EngineHandle> engine(
      module, "Engine",
      "Engine(model_dir, device='cpu', threads=0, weights='f32'): a model and its tokenizer, with every policy "
      "`oryx generate` takes. device: 'cpu' or 'cuda' (in CUDA builds); threads: CPU threads, 0 for one per "
      "hardware thread; weights: the CPU projections as 'f32', 'bf16', 'int8' or 'w8a8', the CUDA ones as 'bf16' or "
      "'fp8' (fewer bytes per token); "
      "kv_dtype: the CPU KV cache as 'f32', 'bf16' (half its memory) or 'int8' (about a quarter; '' for the "
      "backend's own). "
      "Safe to use from several Python threads: calls take turns on the engine (a stream between its steps), "
      "with the GIL released while it runs.");
  engine.def("__init__", &Init, "model_dir"_a, "device"_a = "cpu", "threads"_a = 0, "weights"_a = "f32",
             "kv_dtype"_a = "");
  const auto args = GenerateArgs();
  std::apply(
      [&](auto... options) {
        engine.def("generate", WithOptions<Prompt>(GenerateOne), "prompts"_a, options..., kGenerateDoc);
        engine.def("generate", WithOptions<std::vector<Prompt>>(GenerateMany), "prompts"_a, options...);
        engine.def("stream", WithOptions<Prompt>(StreamOne), "prompt"_a, options..., nb::keep_alive<0, 1>(),
                   kStreamDoc);
      },
      args);
  engine.def("score", &Score, "token_ids"_a, "modes"_a = "attention", "start"_a = 1, "seed"_a = 1, "sequence"_a = 0,
             kScoreDoc);
  engine.def_prop_ro(
      "tokenizer", [](EngineHandle& h) -> const Tokenizer& { return *h.engine.tokenizer(); },
      nb::rv_policy::reference_internal, "the model's tokenizer");
  engine.def_prop_ro(
      "config", [](EngineHandle& h) { return ParseJson(ToJson(h.engine.backend().config())); },
      "the model's config.json, as a dict");
}

void DefineModule(nb::module_& module) {
  module.doc() =
      "Oryx Engine from Python: generation under mode policies (speculative, routed, learned), scoring, and "
      "the model's tokenizer. See the README's Python section.";
  RegisterErrors(module);
  DefineResult(module);
  DefineStream(module);
  DefineTokenizer(module);
  DefineEngine(module);
  module.def("policies", &Policies,
             "Every policy generate and stream take, by name, with its usage ({'periodic': 'periodic:N', ...}).");
}

}  // namespace
}  // namespace oryx::python

NB_MODULE(oryx, module) { oryx::python::DefineModule(module); }
