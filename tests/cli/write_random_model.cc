// write_random_model OUT LIKE [SEED [FIELD=N...]]: a checkpoint in OUT with LIKE's config and tokenizer and
// small random weights (bench::WriteRandomCheckpoint); FIELD=N overrides an integer field of the config
// (d_model, n_layers, n_heads, head_dim, mlp_hidden, max_position), for a model small enough to keep a
// test fast. Such a model emits byte-fallback pieces at once, so that the commands' JSON output meets text
// that is not valid UTF-8 (json_output_test.sh), and it runs any pipeline end to end (train_router_test.sh).
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "bench/engine_bench.h"
#include "engine/config.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: write_random_model OUT LIKE [SEED [FIELD=N...]]\n";
    return 2;
  }
  const std::string out = argv[1], like = argv[2];
  const uint32_t seed = argc > 3 ? static_cast<uint32_t>(std::strtoul(argv[3], nullptr, 10)) : 1;
  absl::StatusOr<oryx::ModelConfig> config = oryx::LoadModelConfig(like + "/config.json");
  if (!config.ok()) {
    std::cerr << "write_random_model: " << config.status() << "\n";
    return 1;
  }
  for (int i = 4; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    int64_t value = 0;
    const bool number = eq != std::string::npos && absl::SimpleAtoi(arg.substr(eq + 1), &value);
    const std::string field = number ? arg.substr(0, eq) : "";
    int64_t* slot = field == "d_model"        ? &config->d_model
                    : field == "n_layers"     ? &config->n_layers
                    : field == "n_heads"      ? &config->n_heads
                    : field == "head_dim"     ? &config->head_dim
                    : field == "mlp_hidden"   ? &config->mlp_hidden
                    : field == "max_position" ? &config->max_position
                                              : nullptr;
    if (slot == nullptr) {
      std::cerr << "write_random_model: '" << arg << "' is not FIELD=N with FIELD one of d_model n_layers n_heads "
                << "head_dim mlp_hidden max_position\n";
      return 2;
    }
    *slot = value;
  }
  if (absl::Status s = oryx::ValidateModelConfig(*config, "overridden config"); !s.ok()) {
    std::cerr << "write_random_model: " << s << "\n";
    return 1;
  }
  if (absl::Status s = oryx::bench::WriteRandomCheckpoint(out, *config, seed, like + "/tokenizer.model"); !s.ok()) {
    std::cerr << "write_random_model: " << s << "\n";
    return 1;
  }
  return 0;
}
