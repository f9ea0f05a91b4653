// The JSON of the completions endpoint, apart from any socket: an OpenAI-style `POST /v1/completions`
// body to a GenerateRequest, and results, stream chunks and errors to JSON.
//
// Request fields: prompt (a string, or an array of token ids), max_tokens (default: up to the context), temperature
// (default 0: greedy, as `oryx generate`), top_p, top_k, seed, stop (a string or an array of strings),
// stream, ignore_eos, policy (an Oryx mode policy, default "attention"), model (if given, the served
// model's name), n (choices per prompt, 1..16; best_of, if given, equal to it), user (accepted, unused),
// logprobs (0..20: each generated token's log-probability and that many alternatives; streamed per chunk), echo
// (the prompt returned before the completion, with its log-probabilities when logprobs is set; max_tokens may
// then be 0; a stream sends the prompt in a first chunk, and does not take echo with logprobs); the prompt may also be a list of strings or of token-id arrays; presence_penalty and
// frequency_penalty (-2..2, on the generated tokens) and logit_bias ({"token id": -100..100}), not with the
// speculative policies. Any other field is an error: a misspelt or unsupported option never passes silently. The chat endpoint (ParseChatRequest) takes messages
// instead of a prompt, and logprobs (true or false) with top_logprobs (0..20).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"

namespace oryx::server {

inline constexpr int64_t kMaxChoices = 16;
// max_tokens when a request leaves it out: up to the model's context (the engine caps it at max_position).
inline constexpr int64_t kUpToTheContext = int64_t{1} << 30;

struct CompletionRequest {
  GenerateRequest generate;  // the request of choice 0 (its prompt the first of `prompts`)
  // A list of prompts (completions' prompt as an array of strings or of token-id arrays); empty: generate's.
  std::vector<GenerateRequest> prompts;
  int64_t n = 1;  // choices per prompt (1 .. kMaxChoices)
  int64_t best_of = 0;  // given: equal to n
  bool stream = false;
  bool chat = false;           // from /v1/chat/completions
  bool include_usage = false;  // chat streams: stream_options.include_usage (a last chunk with the usage)
};

// How chat messages become a prompt: each message is its role's form with {content} replaced by its text, in
// order, then `generation` (the start of the assistant's turn). A model directory may hold one as
// chat_template.json ({"system": ..., "user": ..., "assistant": ..., "generation": ..., "stop": [...]}, any of them);
// the defaults are below. A "developer" message takes the system form.
struct ChatTemplate {
  static constexpr const char* kFileName = "chat_template.json";
  std::string system = "{content}\n\n";
  std::string user = "User: {content}\n";
  std::string assistant = "Assistant: {content}\n";
  std::string generation = "Assistant:";
  // Where the assistant's turn ends, added to a request's own stop strings: a model without an end-of-turn
  // token would otherwise write the next turns too.
  std::vector<std::string> stop = {"\nUser:", "\nAssistant:"};
  // The model directory's template, or the defaults when it has none; InvalidArgument for a bad file.
  static absl::StatusOr<ChatTemplate> Load(const std::string& model_dir);
  std::string Render(std::span<const std::pair<std::string, std::string>> messages) const;  // (role, content)
};

// POST /v1/chat/completions: messages (roles system, developer, user, assistant; content a string or text
// parts), max_completion_tokens (or max_tokens), stream_options.include_usage, and the sampling, stop,
// stream, ignore_eos, policy, model, n and user fields of completions. InvalidArgument as for completions, and
// for no or empty messages, an unknown role or a content that is not text.
absl::StatusOr<CompletionRequest> ParseChatRequest(std::string_view body, std::string_view model_name,
                                                   const ChatTemplate& chat_template);

// InvalidArgument naming the field for a body that is not a JSON object, a field of the wrong type or out
// of range, an unknown field, or another model's name.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body, std::string_view model_name);
// The request's choices in the order of their index: each prompt n times (the j-th with seed + j, so that
// sampled choices differ; greedy ones are the same), prompt-major as OpenAI numbers them.
std::vector<GenerateRequest> Choices(const CompletionRequest& request);

// What identifies one completion in its response and every chunk of its stream.
struct CompletionId {
  std::string id;       // "cmpl-N"
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// What a choice's response shows beside its result: the prompt's text for echo, and the tokenizer that names
// the tokens of log-probabilities (without one a token is "token:<id>").
struct ChoiceContext {
  const Tokenizer* tokenizer = nullptr;
  std::string prompt_text;  // the prompt as text (ids decoded), for echo and log-probabilities' text offsets
  bool echo = false;
};

// The response of a request that does not stream: choices[0] with the text and finish_reason ("stop" or
// "length"; the end-of-sequence token is "stop"), usage, and "oryx": the policy, tokens, Oryx's own
// finish_reason and the statistics of `oryx generate --json`. With log-probabilities, choices[0].logprobs in
// OpenAI's completions form: tokens, token_logprobs, top_logprobs and text_offset (offsets into the prompt's
// text followed by the completion's); the tokens of a stop string cut from the text are left out.
nlohmann::json CompletionObject(const CompletionId& id, const GenerateResult& result,
                                const ChoiceContext& context = {});
// A chunk of a stream: one per generated token, with its text (possibly empty: held back, or no tokenizer)
// and "oryx": {"token": id}; the last chunk (result given, token < 0) has the finish reason, usage and the
// whole "oryx" part of CompletionObject.
nlohmann::json CompletionChunk(const CompletionId& id, std::string_view text, const GenerateResult* result,
                               int32_t token, int64_t index = 0, nlohmann::json logprobs = nullptr);
// One streamed token's log-probabilities in the completions form (`offset`: its text's, as text_offset) and
// in the chat form (logprobs.content), for its chunk.
nlohmann::json CompletionTokenLogprobs(const TokenLogProb& t, const ChoiceContext& context, size_t offset);
nlohmann::json ChatTokenLogprobs(const TokenLogProb& t, const ChoiceContext& context);
// The bytes of a token's text (what text offsets count).
size_t TokenTextBytes(const ChoiceContext& context, int32_t token);
// The response of several choices (n > 1, a list of prompts): every choice of the one-choice form at its
// index, the usage summed (each prompt's tokens once), and "oryx" a list of each choice's part.
nlohmann::json MergeChoices(std::vector<nlohmann::json> objects, int64_t n);
// The chat forms: a chat.completion (choices[0].message), and chat.completion.chunk frames: the first with
// delta.role, then one per token with delta.content, the last with the finish reason (and "oryx"); with
// include_usage, one more with no choices and the usage.
// Chat log-probabilities are choices[0].logprobs.content: token, logprob, bytes and top_logprobs per token.
nlohmann::json ChatCompletionObject(const CompletionId& id, const GenerateResult& result,
                                    const ChoiceContext& context = {});
nlohmann::json ChatCompletionChunk(const CompletionId& id, std::string_view text, const GenerateResult* result,
                                   bool first, int64_t index = 0, nlohmann::json logprobs = nullptr);
// The usage of all the choices (each prompt's tokens once, as in MergeChoices).
nlohmann::json ChatUsageChunk(const CompletionId& id, std::span<const GenerateResult> results, int64_t n);
// {"error": {"message", "type", "code"}}: the code is the HTTP status, the type follows from it.
nlohmann::json ErrorObject(std::string_view message, int http_status);
nlohmann::json ErrorObject(const absl::Status& status);  // with HttpStatus(status)
// 400 InvalidArgument, 404 NotFound, 503 Unavailable / ResourceExhausted, 504 DeadlineExceeded, 500 otherwise.
int HttpStatus(const absl::Status& status);

// The length of text's longest prefix that does not end inside a UTF-8 character: a stream sends that and
// keeps the rest for the next token (byte-fallback tokens split characters).
size_t CompleteUtf8Prefix(std::string_view text);

}  // namespace oryx::server
