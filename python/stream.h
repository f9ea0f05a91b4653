// engine.stream(prompt, ...): one request's tokens as they are produced, as a Python iterator.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "python/binding.h"

namespace oryx::python {

// One generated token: its id and the text it added. The text holds whole characters only: a character that
// byte-fallback tokens split comes with the token that completes it (bytes that never complete one become
// U+FFFD at the end), so the tokens' texts add up to the result's text.
struct Token {
  int32_t id = 0;
  nb::object text;
};

// The request runs in a GenerationBatch of its own, one engine step per __next__ that finds no token waiting
// (the GIL released and the engine's lock held for that step only), so no thread runs behind Python's back,
// and a stream that is closed, or dropped unfinished, just gives its batch back. One thread at a time may
// iterate it (as with any Python iterator); another that tries while a step runs gets RuntimeError.
class Stream {
 public:
  // Checks the request (StatusError, as Engine::Generate would fail) and queues it.
  Stream(EngineHandle& handle, GenerateRequest request);
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  Token Next();         // the next token; raises StopIteration when the request has finished
  void Close();         // ends the request where it is (no result then); idempotent
  nb::object result();  // the Result once the request has finished, else None

 private:
  struct Emitted {
    int32_t id;
    std::string bytes;  // what the token added to the result's text
  };
  void StepLocked();              // one engine step; the caller holds the engine's lock without the GIL
  void CheckNotStepping() const;  // raises RuntimeError while another thread runs a step of this stream

  EngineHandle& handle_;
  std::unique_ptr<GenerationBatch> batch_;  // null once the request has finished or failed, or after Close
  std::deque<Emitted> emitted_;             // filled by the request's on_token during a step
  std::optional<GenerateResult> finished_;
  nb::object result_;      // finished_ as a Result, made on first use
  nb::object decoder_;     // an incremental UTF-8 decoder (codecs'), which keeps a split character's bytes
  bool stepping_ = false;  // a thread is running a step of this stream (without the GIL)
};

void DefineStream(nb::module_& module);

}  // namespace oryx::python
