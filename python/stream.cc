// engine.stream: a request stepped by the iterator that reads it (python/stream.h).
#include "python/stream.h"

#include <nanobind/stl/string.h>

#include <stdexcept>
#include <utility>

namespace oryx::python {

Stream::Stream(EngineHandle& handle, GenerateRequest request) : handle_(handle) {
  request.on_token = [this](const TokenEvent& e) {
    emitted_.push_back({e.token, std::string(e.text)});
    return true;
  };
  decoder_ = nb::module_::import_("codecs").attr("getincrementaldecoder")("utf-8")("replace");
  RunLocked(handle_, [&] {
    auto batch = std::make_unique<GenerationBatch>(handle_.engine);
    ThrowIfError(batch->Add(std::move(request)).status());
    batch_ = std::move(batch);
  });
}

Stream::~Stream() {
  if (!stepping_) Close();  // (a step in flight holds a reference to the stream: it cannot be dropped then)
}

void Stream::StepLocked() {
  auto fail = [&](const absl::Status& status) {
    batch_.reset();  // a batch is spoilt after an error from Step
    emitted_.clear();
    throw StatusError{status};
  };
  if (absl::Status stepped = batch_->Step(); !stepped.ok()) fail(stepped);
  for (auto& [id, status] : batch_->TakeFailed()) fail(status);
  for (auto& [id, result] : batch_->TakeFinished()) {
    finished_ = std::move(result);
    batch_.reset();
  }
}

void Stream::CheckNotStepping() const {
  if (stepping_) throw std::runtime_error("oryx.Stream: used by another thread while it runs a step");
}

Token Stream::Next() {
  CheckNotStepping();
  while (emitted_.empty()) {
    if (batch_ == nullptr) throw nb::stop_iteration();
    // The GIL is released during the step: the flag (read and written under the GIL) keeps another thread
    // from reading emitted_ or dropping the batch meanwhile.
    stepping_ = true;
    try {
      RunLocked(handle_, [&] { StepLocked(); });
    } catch (...) {
      stepping_ = false;
      throw;
    }
    stepping_ = false;
  }
  Emitted e = std::move(emitted_.front());
  emitted_.pop_front();
  const bool last = emitted_.empty() && batch_ == nullptr;  // then flush the bytes of an unfinished character
  return {e.id, decoder_.attr("decode")(nb::bytes(e.bytes.data(), e.bytes.size()), last)};
}

void Stream::Close() {
  CheckNotStepping();
  emitted_.clear();
  if (batch_ == nullptr) return;
  // Dropping the batch gives its sequences back to the engine's pools and prefix cache: under the lock.
  RunLocked(handle_, [&] { batch_.reset(); });
}

nb::object Stream::result() {
  if (finished_ && !result_.is_valid()) result_ = nb::cast(ToPython(*finished_));
  return result_.is_valid() ? result_ : nb::none();
}

void DefineStream(nb::module_& module) {
  nb::class_<Token>(module, "Token", "A generated token: its id and the text it added (whole characters).")
      .def_ro("id", &Token::id)
      .def_ro("text", &Token::text)
      .def("__repr__", [](const Token& t) { return nb::str("Token(id={}, text={!r})").format(t.id, t.text); });
  nb::class_<Stream>(module, "Stream",
                     "The tokens of one request as the engine produces them (engine.stream). Iterating runs the "
                     "engine a step at a time; result is set once the request has finished. close(), or leaving "
                     "a with block, ends it early.")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &Stream::Next)
      .def("close", &Stream::Close, "ends the request where it is and gives its memory back")
      .def_prop_ro("result", &Stream::result, "the Result once the request has finished, else None")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](Stream& s, nb::args) { s.Close(); });
}

}  // namespace oryx::python
