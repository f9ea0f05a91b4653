// What the parts of the `oryx` Python module share: the engine behind its lock, requests made of Python's
// arguments, results and errors turned into Python's. The module adds no logic of its own to the engine's.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace oryx::python {

namespace nb = nanobind;

// An engine and the lock that serialises its use. An Engine runs one Generate, Score or GenerationBatch
// step at a time (its backend and prefix cache are shared by every call), so Python threads take turns:
// whole calls for generate and score, one engine step at a time for streams, which therefore interleave
// with other calls. A thread releases the GIL before it waits for the lock and takes the GIL back only after
// letting the lock go, so whoever holds the lock never waits for the GIL.
struct EngineHandle {
  Engine engine;
  std::mutex mutex;
};

// Runs fn() (which must not touch Python objects) with the GIL released and the engine's lock held.
template <class Fn>
auto RunLocked(EngineHandle& handle, Fn&& fn) {
  nb::gil_scoped_release no_gil;
  std::lock_guard lock(handle.mutex);
  return fn();
}

// A status as a C++ exception; the module translates it into the Python exception for its code (oryx.Error
// and its subclasses), carrying the engine's message. Thrown where the GIL may be released: the translation
// happens once the call has taken it back.
struct StatusError {
  absl::Status status;
};
void ThrowIfError(const absl::Status& status);
template <class T>
T ValueOrThrow(absl::StatusOr<T> value) {
  ThrowIfError(value.status());
  return *std::move(value);
}
// Makes oryx.Error and its subclasses in `module`, and translates StatusError into them.
void RegisterErrors(nb::module_& module);

// A prompt as Python gives it: text (the engine puts BOS in front) or token ids (used as given).
using Prompt = std::variant<std::string, std::vector<int32_t>>;
using StopStrings = std::optional<std::variant<std::string, std::vector<std::string>>>;

// The generation options generate and stream share, as keyword arguments.
struct GenerateOptions {
  std::string policy;
  int64_t max_tokens = 0;
  double temperature = 0, top_p = 1;
  int64_t top_k = 0;
  uint64_t seed = 0;
  StopStrings stop;
  bool ignore_eos = false;
};
GenerateRequest MakeRequest(const Prompt& prompt, const GenerateOptions& options);

// A finished request: the object `oryx generate --json` prints (text, tokens, finish_reason, policy, stats),
// read through attributes.
struct Result {
  nb::dict object;
};
Result ToPython(const GenerateResult& result);  // needs the GIL
// Parses JSON text into Python objects (json.loads). Needs the GIL.
nb::object ParseJson(const std::string& text);
// Result and its attributes.
void DefineResult(nb::module_& module);

}  // namespace oryx::python
