#include "server/completions.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "engine/sampler.h"
#include "base/str_cat.h"
#include "engine/json_text.h"

namespace oryx::server {

namespace {

using json = nlohmann::json;

// The bytes of the UTF-8 character this byte leads (0 for a continuation byte or an invalid one).
size_t Utf8Length(unsigned char lead) {
  return lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3 : (lead & 0xF8) == 0xF0 ? 4 : 0;
}

absl::Status Bad(std::string_view field, std::string_view want, const json& got) {
  return absl::InvalidArgumentError(Cat("'", field, "' must be ", want, ", got ", JsonText(got)));
}

absl::StatusOr<int64_t> Integer(std::string_view field, const json& v, int64_t min, int64_t max) {
  bool fits = false;
  if (v.is_number_unsigned()) {  // nlohmann reads every non-negative integer as unsigned
    const uint64_t u = v.get<uint64_t>();
    fits = u <= static_cast<uint64_t>(max) && (min <= 0 || u >= static_cast<uint64_t>(min));
  } else if (v.is_number_integer()) {
    fits = v.get<int64_t>() >= min && v.get<int64_t>() <= max;
  }
  if (!fits) return Bad(field, Cat("an integer in [", min, ", ", max, "]"), v);
  return v.get<int64_t>();
}

absl::StatusOr<double> Number(std::string_view field, const json& v) {
  if (!v.is_number()) return Bad(field, "a number", v);
  return v.get<double>();
}

absl::Status ParsePrompt(const json& v, GenerateRequest& q) {
  if (v.is_string()) {
    q.prompt = v.get<std::string>();
    if (q.prompt.empty()) return absl::InvalidArgumentError("'prompt' is empty");
    return absl::OkStatus();
  }
  if (v.is_array() && !v.empty()) {
    for (const json& t : v) {
      absl::StatusOr<int64_t> id = Integer("prompt token id", t, 0, std::numeric_limits<int32_t>::max());
      if (!id.ok()) return id.status();
      q.prompt_tokens.push_back(static_cast<int32_t>(*id));
    }
    return absl::OkStatus();
  }
  return Bad("prompt", "a string, a non-empty array of token ids, or a list of either", v);
}

// A prompt, or a list of prompts (strings or token-id arrays): one request each, the rest of `q` copied later.
absl::Status ParsePrompts(const json& v, CompletionRequest& out) {
  const bool list = v.is_array() && !v.empty() && (v[0].is_string() || v[0].is_array());
  if (!list) return ParsePrompt(v, out.generate);
  constexpr size_t kMaxPrompts = 64;
  if (v.size() > kMaxPrompts) return Bad("prompt", Cat("at most ", kMaxPrompts, " prompts"), json(v.size()));
  for (const json& p : v) {
    if (!p.is_string() && !p.is_array()) return Bad("prompt", "a list of strings or of token-id arrays", p);
    GenerateRequest q;
    if (absl::Status s = ParsePrompt(p, q); !s.ok()) return s;
    out.prompts.push_back(std::move(q));
  }
  return absl::OkStatus();
}

absl::Status ParseStop(const json& v, GenerateRequest& q) {
  if (v.is_null()) return absl::OkStatus();
  if (v.is_string()) {
    q.stop = {v.get<std::string>()};
  } else if (v.is_array()) {
    for (const json& s : v) {
      if (!s.is_string()) return Bad("stop", "a string or an array of strings", v);
      q.stop.push_back(s.get<std::string>());
    }
  } else {
    return Bad("stop", "a string or an array of strings", v);
  }
  for (const std::string& s : q.stop) {
    if (s.empty()) return absl::InvalidArgumentError("'stop' holds an empty string");
  }
  return absl::OkStatus();
}

std::string_view OpenAiFinishReason(FinishReason reason) {
  return reason == FinishReason::kLength ? "length" : "stop";
}

json Usage(const GenerateResult& r) {
  return {{"prompt_tokens", r.stats.prompt_tokens},
          {"prompt_tokens_details", {{"cached_tokens", r.stats.cached_tokens}}},
          {"completion_tokens", r.stats.generated_tokens},
          {"total_tokens", r.stats.prompt_tokens + r.stats.generated_tokens}};
}

// Oryx's part of a response: what the OpenAI fields cannot say.
json OryxPart(const GenerateResult& r) {
  json j = ToJson(r);
  for (const char* said : {"text", "logprobs", "prompt_logprobs"}) j.erase(said);  // in the OpenAI fields
  return j;
}

}  // namespace

namespace {

absl::StatusOr<json> ParseBody(std::string_view body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    return absl::InvalidArgumentError(Cat("the body is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError("the body must be a JSON object");
  return j;
}

// The fields completions and chat share; false for a field that is not one of them.
absl::StatusOr<bool> ParseSharedField(const std::string& key, const json& v, std::string_view model_name,
                                      CompletionRequest& out) {
  GenerateRequest& q = out.generate;
  if (key == "max_tokens" || key == "max_completion_tokens") {
    absl::StatusOr<int64_t> n = Integer(key, v, 0, std::numeric_limits<int32_t>::max());
    if (!n.ok()) return n.status();
    q.max_tokens = *n;
  } else if (key == "temperature" || key == "top_p") {
    absl::StatusOr<double> x = Number(key, v);
    if (!x.ok()) return x.status();
    (key == "temperature" ? q.sampling.temperature : q.sampling.top_p) = static_cast<float>(*x);
  } else if (key == "top_k") {
    absl::StatusOr<int64_t> k = Integer(key, v, 0, std::numeric_limits<int32_t>::max());
    if (!k.ok()) return k.status();
    q.sampling.top_k = *k;
  } else if (key == "seed") {
    absl::StatusOr<int64_t> seed = Integer(key, v, 0, std::numeric_limits<int64_t>::max());
    if (!seed.ok()) return seed.status();
    q.sampling.seed = static_cast<uint64_t>(*seed);
  } else if (key == "stop") {
    if (absl::Status s = ParseStop(v, q); !s.ok()) return s;
  } else if (key == "stream" || key == "ignore_eos") {
    if (!v.is_boolean()) return Bad(key, "true or false", v);
    if (key == "stream") {
      out.stream = v.get<bool>();
    } else {
      q.stop_at_eos = !v.get<bool>();
    }
  } else if (key == "policy") {
    if (!v.is_string()) return Bad(key, "a policy name", v);
    q.policy = v.get<std::string>();
  } else if (key == "model") {
    if (!v.is_string() || v.get<std::string>() != model_name) {
      return absl::InvalidArgumentError(Cat("this server serves the model '", model_name, "', not ", JsonText(v)));
    }
  } else if (key == "n" || key == "best_of") {
    absl::StatusOr<int64_t> n = Integer(key, v, 1, kMaxChoices);
    if (!n.ok()) return n.status();
    if (key == "n") {
      out.n = *n;
    } else {
      out.best_of = *n;
    }
  } else if (key == "presence_penalty" || key == "frequency_penalty") {
    if (v.is_null()) return true;
    absl::StatusOr<double> x = Number(key, v);
    if (!x.ok()) return x.status();
    (key == "presence_penalty" ? q.sampling.presence_penalty : q.sampling.frequency_penalty) = static_cast<float>(*x);
  } else if (key == "logit_bias") {  // {"token id": bias}
    if (v.is_null()) return true;
    if (!v.is_object()) return Bad(key, "an object of token ids to biases", v);
    q.sampling.logit_bias.clear();
    for (const auto& [id, bias] : v.items()) {
      int32_t token = 0;
      if (!absl::SimpleAtoi(id, &token) || token < 0) return Bad("logit_bias", "keyed by token ids", json(id));
      if (!bias.is_number()) return Bad("logit_bias", "numbers", bias);
      q.sampling.logit_bias.emplace_back(token, bias.get<float>());
    }
  } else if (key == "user") {
    if (!v.is_string()) return Bad(key, "a string", v);  // an end user's id: accepted, not used
  } else {
    return false;
  }
  return true;
}

constexpr std::string_view kSharedFields =
    "max_tokens, temperature, top_p, top_k, seed, stop, stream, ignore_eos, policy, model, n, best_of, user, "
    "presence_penalty, frequency_penalty, logit_bias";

// What completions and chat check once every field is read: max_tokens 0 only with echo, and no echo with
// log-probabilities in a stream.
absl::Status CheckLogprobs(const CompletionRequest& out) {
  const GenerateRequest& q = out.generate;
  if (q.max_tokens == 0 && !q.echo) {
    return absl::InvalidArgumentError("'max_tokens' must be >= 1 (0 only with echo: the prompt scored, nothing generated)");
  }
  if (q.echo && out.stream && q.logprobs >= 0) {
    return absl::InvalidArgumentError("'echo' with 'logprobs' is not built for streams yet: the prompt's scores come "
                                      "without streaming");
  }
  return absl::OkStatus();
}

// best_of is accepted only where it changes nothing: equal to n (no choice is generated and dropped).
absl::Status CheckBestOf(const CompletionRequest& out) {
  if (out.best_of != 0 && out.best_of != out.n) {
    return absl::InvalidArgumentError(Cat("'best_of' ", out.best_of, " must equal 'n' (", out.n,
                                          "): choosing among extra completions is not built"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body, std::string_view model_name) {
  absl::StatusOr<json> j = ParseBody(body);
  if (!j.ok()) return j.status();
  CompletionRequest out;
  GenerateRequest& q = out.generate;
  q.max_tokens = kUpToTheContext;
  bool has_prompt = false;
  for (const auto& [key, v] : j->items()) {
    if (key == "prompt") {
      if (absl::Status s = ParsePrompts(v, out); !s.ok()) return s;
      has_prompt = true;
      continue;
    }
    if (key == "logprobs") {  // null: none
      if (v.is_null()) continue;
      absl::StatusOr<int64_t> n = Integer(key, v, 0, kMaxTopLogprobs);
      if (!n.ok()) return n.status();
      q.logprobs = static_cast<int32_t>(*n);
      continue;
    }
    if (key == "echo") {
      if (!v.is_boolean()) return Bad(key, "true or false", v);
      q.echo = v.get<bool>();
      continue;
    }
    absl::StatusOr<bool> shared = ParseSharedField(key, v, model_name, out);
    if (!shared.ok()) return shared.status();
    if (!*shared) {
      return absl::InvalidArgumentError(Cat("unknown field '", key, "' (known: prompt, logprobs, echo, ", kSharedFields, ")"));
    }
  }
  if (!has_prompt) return absl::InvalidArgumentError("'prompt' is missing");
  if (absl::Status s = ValidateSampling(q.sampling); !s.ok()) return s;
  if (absl::Status s = CheckBestOf(out); !s.ok()) return s;
  if (absl::Status s = CheckLogprobs(out); !s.ok()) return s;
  if (!out.prompts.empty()) {
    q.prompt = out.prompts[0].prompt;
    q.prompt_tokens = out.prompts[0].prompt_tokens;
  }
  return out;
}

std::vector<GenerateRequest> Choices(const CompletionRequest& request) {
  std::vector<GenerateRequest> out;
  const size_t prompts = std::max<size_t>(1, request.prompts.size());
  for (size_t p = 0; p < prompts; ++p) {
    for (int64_t j = 0; j < request.n; ++j) {
      GenerateRequest q = request.generate;
      if (!request.prompts.empty()) {
        q.prompt = request.prompts[p].prompt;
        q.prompt_tokens = request.prompts[p].prompt_tokens;
      }
      q.sampling.seed += static_cast<uint64_t>(j);
      out.push_back(std::move(q));
    }
  }
  return out;
}

absl::StatusOr<ChatTemplate> ChatTemplate::Load(const std::string& model_dir) {
  const std::string path = model_dir + "/" + kFileName;
  ChatTemplate t;
  if (!std::filesystem::exists(path)) return t;
  std::ifstream in(path);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    return absl::InvalidArgumentError(Cat(path, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(Cat(path, ": must be a JSON object"));
  for (const auto& [key, v] : j.items()) {
    if (key == "stop") {
      if (!v.is_array() || !std::ranges::all_of(v, [](const json& x) { return x.is_string() && !x.empty(); })) {
        return absl::InvalidArgumentError(Cat(path, ": 'stop' must be an array of non-empty strings"));
      }
      t.stop = v.get<std::vector<std::string>>();
      continue;
    }
    std::string* field = key == "system" ? &t.system : key == "user" ? &t.user : key == "assistant" ? &t.assistant
                         : key == "generation" ? &t.generation : nullptr;
    if (field == nullptr) {
      return absl::InvalidArgumentError(Cat(path, ": unknown key '", key, "' (system, user, assistant, generation, stop)"));
    }
    if (!v.is_string()) return absl::InvalidArgumentError(Cat(path, ": '", key, "' must be a string"));
    *field = v.get<std::string>();
    if (key != "generation" && field->find("{content}") == std::string::npos) {
      return absl::InvalidArgumentError(Cat(path, ": '", key, "' has no {content}"));
    }
  }
  return t;
}

std::string ChatTemplate::Render(std::span<const std::pair<std::string, std::string>> messages) const {
  std::string out;
  for (const auto& [role, content] : messages) {
    const std::string& form = role == "system" ? system : role == "user" ? user : assistant;
    const size_t at = form.find("{content}");
    out += form.substr(0, at) + content + form.substr(at + std::string_view("{content}").size());
  }
  return out + generation;
}

absl::StatusOr<CompletionRequest> ParseChatRequest(std::string_view body, std::string_view model_name,
                                                   const ChatTemplate& chat_template) {
  absl::StatusOr<json> j = ParseBody(body);
  if (!j.ok()) return j.status();
  CompletionRequest out;
  out.chat = true;
  GenerateRequest& q = out.generate;
  q.max_tokens = kUpToTheContext;
  std::vector<std::pair<std::string, std::string>> messages;
  bool has_messages = false;
  bool logprobs = false;
  int64_t top_logprobs = -1;  // not given
  for (const auto& [key, v] : j->items()) {
    if (key == "messages") {
      if (!v.is_array() || v.empty()) return Bad(key, "a non-empty array of messages", v);
      for (const json& m : v) {
        if (!m.is_object() || !m.contains("role") || !m.contains("content")) {
          return Bad("messages", "objects with a role and a content", m);
        }
        const json& role = m["role"];
        if (role != "system" && role != "user" && role != "assistant" && role != "developer") {
          return Bad("role", "system, developer, user or assistant", role);
        }
        std::string text;
        if (m["content"].is_string()) {
          text = m["content"].get<std::string>();
        } else if (m["content"].is_array()) {  // parts: text only
          for (const json& part : m["content"]) {
            if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string()) {
              return Bad("content", "a string, or parts of type text", part);
            }
            text += part["text"].get<std::string>();
          }
        } else {
          return Bad("content", "a string, or parts of type text", m["content"]);
        }
        for (const auto& [field, x] : m.items()) {
          if (field != "role" && field != "content" && field != "name") {
            return absl::InvalidArgumentError(Cat("unknown message field '", field, "' (role, content, name)"));
          }
        }
        messages.emplace_back(role == "developer" ? "system" : role.get<std::string>(), std::move(text));
      }
      has_messages = true;
      continue;
    }
    if (key == "logprobs") {
      if (v.is_null()) continue;
      if (!v.is_boolean()) return Bad(key, "true or false", v);
      logprobs = v.get<bool>();
      continue;
    }
    if (key == "top_logprobs") {
      if (v.is_null()) continue;
      absl::StatusOr<int64_t> n = Integer(key, v, 0, kMaxTopLogprobs);
      if (!n.ok()) return n.status();
      top_logprobs = *n;
      continue;
    }
    if (key == "stream_options") {
      if (!v.is_object()) return Bad(key, "an object", v);
      for (const auto& [field, x] : v.items()) {
        if (field != "include_usage" || !x.is_boolean()) return Bad("stream_options", "{\"include_usage\": bool}", v);
        out.include_usage = x.get<bool>();
      }
      continue;
    }
    absl::StatusOr<bool> shared = ParseSharedField(key, v, model_name, out);
    if (!shared.ok()) return shared.status();
    if (!*shared) {
      return absl::InvalidArgumentError(
          Cat("unknown field '", key, "' (known: messages, max_completion_tokens, stream_options, logprobs, top_logprobs, ",
              kSharedFields, ")"));
    }
  }
  if (!has_messages) return absl::InvalidArgumentError("'messages' is missing");
  if (absl::Status s = CheckBestOf(out); !s.ok()) return s;
  if (top_logprobs >= 0 && !logprobs) return absl::InvalidArgumentError("'top_logprobs' needs 'logprobs': true");
  if (logprobs) q.logprobs = static_cast<int32_t>(std::max<int64_t>(top_logprobs, 0));
  if (absl::Status s = CheckLogprobs(out); !s.ok()) return s;
  q.prompt = chat_template.Render(messages);
  for (const std::string& stop : chat_template.stop) {
    if (std::ranges::find(q.stop, stop) == q.stop.end()) q.stop.push_back(stop);
  }
  if (absl::Status s = ValidateSampling(q.sampling); !s.ok()) return s;
  return out;
}

namespace {

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t len = Utf8Length(static_cast<unsigned char>(s[i]));
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

std::string TokenBytes(const ChoiceContext& context, int32_t token) {
  if (context.tokenizer == nullptr) return Cat("token:", token);
  return context.tokenizer->Decode(std::span(&token, 1));
}

// A token's text as OpenAI's completions name it: the text, or "bytes:\xNN..." for part of a character.
std::string TokenName(const ChoiceContext& context, int32_t token) {
  std::string bytes = TokenBytes(context, token);
  if (IsValidUtf8(bytes)) return bytes;
  std::string out = "bytes:";
  for (unsigned char c : bytes) out += absl::StrFormat("\\x%02x", c);
  return out;
}

// The generated tokens that produced the text: a stop string cut from the text takes its tokens along.
size_t KeptTokens(const GenerateResult& result, const ChoiceContext& context) {
  if (context.tokenizer == nullptr || result.finish_reason != FinishReason::kStop) return result.logprobs.size();
  size_t offset = 0, kept = 0;
  for (const TokenLogProb& t : result.logprobs) {
    if (offset >= result.text.size()) break;
    offset += TokenBytes(context, t.token).size();
    ++kept;
  }
  return kept;
}

json CompletionLogprobs(const GenerateResult& result, const ChoiceContext& context) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  size_t offset = context.echo ? 0 : context.prompt_text.size();
  const auto add = [&](const TokenLogProb& t) {
    json one = CompletionTokenLogprobs(t, context, offset);
    tokens.push_back(std::move(one["tokens"][0]));
    token_logprobs.push_back(std::move(one["token_logprobs"][0]));
    top.push_back(std::move(one["top_logprobs"][0]));
    offsets.push_back(offset);
    offset += TokenBytes(context, t.token).size();
  };
  if (context.echo) {
    for (const TokenLogProb& t : result.prompt_logprobs) add(t);
  }
  const size_t kept = KeptTokens(result, context);
  for (size_t i = 0; i < kept; ++i) add(result.logprobs[i]);
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json ChatLogprobs(const GenerateResult& result, const ChoiceContext& context) {
  json content = json::array();
  const size_t kept = KeptTokens(result, context);
  for (size_t i = 0; i < kept; ++i) content.push_back(std::move(ChatTokenLogprobs(result.logprobs[i], context)["content"][0]));
  return {{"content", content}, {"refusal", nullptr}};
}

}  // namespace

nlohmann::json CompletionTokenLogprobs(const TokenLogProb& t, const ChoiceContext& context, size_t offset) {
  json top = nullptr;
  if (t.logprob) {
    top = json::object();
    for (const auto& [id, lp] : t.top) top[TokenName(context, id)] = lp;
  }
  return {{"tokens", {TokenName(context, t.token)}},
          {"token_logprobs", {t.logprob ? json(*t.logprob) : json(nullptr)}},
          {"top_logprobs", json::array({top})},
          {"text_offset", {offset}}};
}

nlohmann::json ChatTokenLogprobs(const TokenLogProb& t, const ChoiceContext& context) {
  const auto entry = [&](int32_t token, double logprob) {
    const std::string bytes = TokenBytes(context, token);
    json list = json::array();
    for (unsigned char c : bytes) list.push_back(static_cast<int>(c));
    return json{{"token", bytes}, {"logprob", logprob}, {"bytes", list}};
  };
  json e = entry(t.token, t.logprob.value_or(0));
  e["top_logprobs"] = json::array();
  for (const auto& [id, lp] : t.top) e["top_logprobs"].push_back(entry(id, lp));
  return {{"content", json::array({std::move(e)})}, {"refusal", nullptr}};
}

size_t TokenTextBytes(const ChoiceContext& context, int32_t token) { return TokenBytes(context, token).size(); }

namespace {
// What every response and chunk starts with: its id, its object type, when and by which model, its choices.
json Envelope(const CompletionId& id, std::string_view object, json choices) {
  return {{"id", id.id}, {"object", object}, {"created", id.created}, {"model", id.model}, {"choices", std::move(choices)}};
}
// A response that does not stream: its one choice, then the usage and Oryx's part.
json WholeResponse(const CompletionId& id, std::string_view object, json choice, const GenerateResult& result) {
  json j = Envelope(id, object, json::array({std::move(choice)}));
  j["usage"] = Usage(result);
  j["oryx"] = OryxPart(result);
  return j;
}
}  // namespace

nlohmann::json CompletionObject(const CompletionId& id, const GenerateResult& result, const ChoiceContext& context) {
  const bool logprobs = !result.logprobs.empty() || !result.prompt_logprobs.empty();
  return WholeResponse(id, "text_completion",
                       {{"index", 0},
                        {"text", context.echo ? context.prompt_text + result.text : result.text},
                        {"logprobs", logprobs ? CompletionLogprobs(result, context) : json(nullptr)},
                        {"finish_reason", OpenAiFinishReason(result.finish_reason)}},
                       result);
}

nlohmann::json CompletionChunk(const CompletionId& id, std::string_view text, const GenerateResult* result,
                               int32_t token, int64_t index, nlohmann::json logprobs) {
  json choice = {{"index", index}, {"text", text}, {"logprobs", std::move(logprobs)}, {"finish_reason", nullptr}};
  if (result != nullptr) choice["finish_reason"] = OpenAiFinishReason(result->finish_reason);
  json j = Envelope(id, "text_completion", json::array({std::move(choice)}));
  if (result != nullptr) {
    j["usage"] = Usage(*result);
    j["oryx"] = OryxPart(*result);
  } else {
    j["oryx"] = {{"token", token}};
  }
  return j;
}

int HttpStatus(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kResourceExhausted:
      return 503;
    default:
      return 500;
  }
}

nlohmann::json ChatCompletionObject(const CompletionId& id, const GenerateResult& result,
                                    const ChoiceContext& context) {
  return WholeResponse(id, "chat.completion",
                       {{"index", 0},
                        {"message", {{"role", "assistant"}, {"content", result.text}}},
                        {"logprobs", result.logprobs.empty() ? json(nullptr) : ChatLogprobs(result, context)},
                        {"finish_reason", OpenAiFinishReason(result.finish_reason)}},
                       result);
}

nlohmann::json ChatCompletionChunk(const CompletionId& id, std::string_view text, const GenerateResult* result,
                                   bool first, int64_t index, nlohmann::json logprobs) {
  json delta = json::object();
  if (first) delta["role"] = "assistant";
  if (!text.empty() || (result == nullptr && !first)) delta["content"] = text;
  json choice = {{"index", index}, {"delta", delta}, {"logprobs", std::move(logprobs)}, {"finish_reason", nullptr}};
  if (result != nullptr) choice["finish_reason"] = OpenAiFinishReason(result->finish_reason);
  json j = Envelope(id, "chat.completion.chunk", json::array({std::move(choice)}));
  if (result != nullptr) j["oryx"] = OryxPart(*result);
  return j;
}

namespace {
// The usage of several choices: each prompt's tokens once (choices come n to a prompt), all generated tokens.
json SummedUsage(const std::vector<json>& usages, int64_t n) {
  int64_t prompt = 0, cached = 0, completion = 0;
  for (size_t i = 0; i < usages.size(); ++i) {
    if (static_cast<int64_t>(i) % n == 0) {
      prompt += usages[i]["prompt_tokens"].get<int64_t>();
      cached += usages[i]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
    }
    completion += usages[i]["completion_tokens"].get<int64_t>();
  }
  return {{"prompt_tokens", prompt},
          {"prompt_tokens_details", {{"cached_tokens", cached}}},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}
}  // namespace

nlohmann::json ChatUsageChunk(const CompletionId& id, std::span<const GenerateResult> results, int64_t n) {
  std::vector<json> usages;
  for (const GenerateResult& r : results) usages.push_back(Usage(r));
  json j = Envelope(id, "chat.completion.chunk", json::array());
  j["usage"] = SummedUsage(usages, n);
  return j;
}

nlohmann::json MergeChoices(std::vector<nlohmann::json> objects, int64_t n) {
  if (objects.size() == 1) return std::move(objects[0]);
  json merged = objects[0];
  merged["choices"] = json::array();
  merged["oryx"] = json::array();
  std::vector<json> usages;
  for (size_t i = 0; i < objects.size(); ++i) {
    json choice = objects[i]["choices"][0];
    choice["index"] = i;
    merged["choices"].push_back(std::move(choice));
    merged["oryx"].push_back(objects[i]["oryx"]);
    usages.push_back(objects[i]["usage"]);
  }
  merged["usage"] = SummedUsage(usages, n);
  return merged;
}

nlohmann::json ErrorObject(std::string_view message, int http_status) {
  const char* type = http_status == 404   ? "not_found"
                     : http_status == 503 ? "unavailable"
                     : http_status == 504 ? "timeout"
                     : http_status == 429 ? "rate_limit_exceeded"
                     : http_status < 500  ? "invalid_request_error"
                                          : "server_error";
  return {{"error", {{"message", message}, {"type", type}, {"code", http_status}}}};
}

nlohmann::json ErrorObject(const absl::Status& status) {
  return ErrorObject(std::string_view(status.message().data(), status.message().size()), HttpStatus(status));
}

size_t CompleteUtf8Prefix(std::string_view text) {
  // Look back at most 3 bytes for the lead byte of the last character; cut before it if it is incomplete.
  const size_t n = text.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t len = std::max<size_t>(Utf8Length(c), 1);  // a byte that leads nothing: a character of its own
    return back < len ? n - back : n;
  }
  return n;  // only continuation bytes at the end: not a character we can complete
}

}  // namespace oryx::server
