// Python's side of a request and its outcome: keyword arguments into a GenerateRequest, a GenerateResult into
// the object `oryx generate --json` prints, and a failed status into an exception carrying the engine's message.
#include <nanobind/stl/string.h>

#include <exception>
#include <string>

#include "engine/json_text.h"
#include "python/binding.h"

namespace oryx::python {

namespace {

// oryx.Error and the subclasses a status code maps to (owned by the module for the life of the process).
PyObject* error = nullptr;
PyObject* invalid_argument_error = nullptr;
PyObject* not_found_error = nullptr;
PyObject* resource_exhausted_error = nullptr;

PyObject* NewError(nb::module_& module, const char* name, nb::handle bases, const char* doc) {
  const std::string qualified = std::string("oryx.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (type == nullptr) throw nb::python_error();
  module.attr(name) = nb::handle(type);
  return type;
}

PyObject* ErrorFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return invalid_argument_error;
    case absl::StatusCode::kNotFound:
      return not_found_error;
    case absl::StatusCode::kResourceExhausted:
      return resource_exhausted_error;
    default:
      return error;
  }
}

}  // namespace

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError{status};
}

void RegisterErrors(nb::module_& module) {
  error = NewError(module, "Error", PyExc_Exception, "An error the engine reported; the message is the engine's.");
  // Each also derives from the built-in exception a Python caller would expect for it.
  invalid_argument_error =
      NewError(module, "InvalidArgumentError", nb::make_tuple(nb::handle(error), nb::handle(PyExc_ValueError)),
               "A bad argument: an unknown policy, a prompt longer than the context, bad sampling values, ...");
  not_found_error =
      NewError(module, "NotFoundError", nb::make_tuple(nb::handle(error), nb::handle(PyExc_FileNotFoundError)),
               "A file that is not there (a model directory, a policy file).");
  resource_exhausted_error =
      NewError(module, "ResourceExhaustedError", nb::make_tuple(nb::handle(error), nb::handle(PyExc_MemoryError)),
               "No room on the device for a request.");
  nb::register_exception_translator([](const std::exception_ptr& thrown, void*) {
    try {
      std::rethrow_exception(thrown);
    } catch (const StatusError& e) {
      PyErr_SetString(ErrorFor(e.status.code()), std::string(e.status.message()).c_str());
    }
  });
}

GenerateRequest MakeRequest(const Prompt& prompt, const GenerateOptions& options) {
  GenerateRequest request;
  if (const auto* text = std::get_if<std::string>(&prompt)) {
    request.prompt = *text;
  } else {
    request.prompt_tokens = std::get<std::vector<int32_t>>(prompt);
  }
  request.policy = options.policy;
  request.max_tokens = options.max_tokens;
  request.sampling = {.temperature = static_cast<float>(options.temperature),
                      .top_k = options.top_k,
                      .top_p = static_cast<float>(options.top_p),
                      .seed = options.seed};
  if (options.stop) {
    if (const auto* one = std::get_if<std::string>(&*options.stop)) {
      request.stop = {*one};
    } else {
      request.stop = std::get<std::vector<std::string>>(*options.stop);
    }
  }
  request.stop_at_eos = !options.ignore_eos;
  return request;
}

nb::object ParseJson(const std::string& text) {
  return nb::module_::import_("json").attr("loads")(nb::str(text.data(), text.size()));
}

Result ToPython(const GenerateResult& result) {
  // Through the same JSON as `oryx generate --json`, so that the two can never differ (ill-formed UTF-8 in
  // the text becomes U+FFFD there, as it does here).
  return Result{nb::cast<nb::dict>(ParseJson(JsonText(ToJson(result))))};
}

void DefineResult(nb::module_& module) {
  auto field = [](const char* key) { return [key](const Result& r) -> nb::object { return r.object[key]; }; };
  nb::class_<Result>(module, "Result", "A finished request: what `oryx generate --json` prints, as attributes.")
      .def_prop_ro("text", field("text"), "the generated text (the prompt not included)")
      .def_prop_ro("tokens", field("tokens"), "the generated token ids (an ending EOS not included)")
      .def_prop_ro("finish_reason", field("finish_reason"), "'length', 'stop' or 'eos'")
      .def_prop_ro("policy", field("policy"), "the policy that generated it")
      .def_prop_ro("stats", field("stats"),
                   "prompt_tokens, generated_tokens, attention_tokens, linear_tokens, attention_fraction, "
                   "prefill_tokens_per_s, decode_tokens_per_s, ... and, under speculative policies, spec "
                   "(acceptance_rate, mean_accepted_per_round, ...): docs/DESIGN.md section 9")
      .def(
          "to_dict", [](const Result& r) { return r.object.attr("copy")(); },
          "the whole object, as `oryx generate --json` prints it")
      .def("__repr__", [](const Result& r) -> nb::str {
        const nb::object tokens = r.object["tokens"];
        return nb::str("Result(finish_reason={!r}, policy={!r}, tokens={}, text={!r})")
            .format(r.object["finish_reason"], r.object["policy"], nb::len(tokens), r.object["text"]);
      });
}

}  // namespace oryx::python
