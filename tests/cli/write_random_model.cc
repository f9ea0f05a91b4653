// write_random_model OUT LIKE [SEED]: a checkpoint in OUT with LIKE's config and tokenizer and small random
// weights (bench::WriteRandomCheckpoint). Such a model emits byte-fallback pieces at once, so that the
// commands' JSON output meets text that is not valid UTF-8 (json_output_test.sh).
#include <cstdlib>
#include <iostream>
#include <string>

#include "bench/engine_bench.h"
#include "engine/config.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: write_random_model OUT LIKE [SEED]\n";
    return 2;
  }
  const std::string out = argv[1], like = argv[2];
  const uint32_t seed = argc > 3 ? static_cast<uint32_t>(std::strtoul(argv[3], nullptr, 10)) : 1;
  absl::StatusOr<oryx::ModelConfig> config = oryx::LoadModelConfig(like + "/config.json");
  if (!config.ok()) {
    std::cerr << "write_random_model: " << config.status() << "\n";
    return 1;
  }
  if (absl::Status s = oryx::bench::WriteRandomCheckpoint(out, *config, seed, like + "/tokenizer.model"); !s.ok()) {
    std::cerr << "write_random_model: " << s << "\n";
    return 1;
  }
  return 0;
}
