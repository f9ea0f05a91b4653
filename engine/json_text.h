// JSON text that never throws: every JSON the project writes (CLI output, benchmark lines, logs, the server's
// bodies, manifests) goes through JsonText. nlohmann::json's own dump() throws type_error.316 on a string
// that is not valid UTF-8, which generated text often is (byte-fallback pieces, a character cut between
// two tokens); here each ill-formed byte becomes U+FFFD instead.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace oryx {

inline std::string JsonText(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace oryx
