// The flags that say how the commands that generate (generate, serve) load their engine: the model, the
// backend and the prefix cache (engine/prefix_cache.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "base/flags.h"
#include "base/status_macros.h"
#include "base/str_cat.h"
#include "cli/commands.h"
#include "engine/engine.h"
#include "policies/rule_policies.h"

namespace oryx::cli {

struct PrefixCacheFlags {
  bool off = false;
  int64_t mib = PrefixCacheOptions{}.max_bytes >> 20;
  int64_t snapshot_every = 0;

  void Add(FlagSet& f) {
    f.Bool("no-prefix-cache", &off, "compute every prompt in full (no reuse of earlier prompts' beginnings)");
    f.Int("prefix-cache-mib", &mib, "memory the prefix cache's snapshots may hold, in MiB", 1, int64_t{1} << 30);
    f.Int("prefix-snapshot-every", &snapshot_every,
          "a prompt is snapshotted every N tokens as it is prefilled (a multiple of 64), and at its end; 0: the "
          "backend's prefill span for one prompt, at least 2048 (2048 on the CPU, 16384 on the GPU)",
          0, int64_t{1} << 30);
  }
  absl::Status Apply(Engine& engine) const {
    if (snapshot_every % PrefixCacheOptions{}.block_tokens != 0) {
      return absl::InvalidArgumentError(Cat("--prefix-snapshot-every ", snapshot_every, " is not a multiple of ",
                                            PrefixCacheOptions{}.block_tokens));
    }
    if (off) {
      engine.set_prefix_cache(std::nullopt);
    } else {
      engine.set_prefix_cache(PrefixCacheOptions{.snapshot_every = snapshot_every, .max_bytes = mib << 20});
    }
    return absl::OkStatus();
  }
};

struct EngineFlags {
  std::string model_dir;
  std::string device = "cpu";
  int64_t threads = 0;
  std::string weights = "f32";
  std::string kv_dtype;
  PrefixCacheFlags prefix_cache;

  void AddModel(FlagSet& f) {
    f.String("model", &model_dir, "model directory (config.json, weights, tokenizer.model)", true);
  }
  // --device, --threads, --weights, --kv-dtype and the prefix cache's flags.
  void AddBackend(FlagSet& f) {
    f.String("device", &device, "cpu | cuda");
    f.Int("threads", &threads, "CPU threads (0: one per hardware thread)", 0, 1024);
    f.String("weights", &weights, kWeightsHelp);
    f.String("kv-dtype", &kv_dtype, kKvDtypeHelp);
    prefix_cache.Add(f);
  }
  // The engine the flags name, its prefix cache set and the rule policies registered.
  absl::StatusOr<Engine> Load() const {
    const BackendOptions backend{.device = device,
                                 .threads = static_cast<int>(threads),
                                 .weights = weights,
                                 .kv_dtype = kv_dtype,
                                 .cuda = CudaSwitches::FromEnvironment()};
    ORYX_ASSIGN_OR_RETURN(Engine engine, Engine::Load(model_dir, backend));
    ORYX_RETURN_IF_ERROR(prefix_cache.Apply(engine));
    policies::RegisterAllPolicies(engine.policies());
    return engine;
  }
};

}  // namespace oryx::cli
