// The flags of the engine's prefix cache (engine/prefix_cache.h), shared by the commands that generate.
#pragma once

#include <cstdint>
#include <optional>

#include "base/flags.h"
#include "base/str_cat.h"
#include "engine/engine.h"

namespace oryx::cli {

struct PrefixCacheFlags {
  bool off = false;
  int64_t mib = PrefixCacheOptions{}.max_bytes >> 20;
  int64_t snapshot_every = PrefixCacheOptions{}.snapshot_every;

  void Add(FlagSet& f) {
    f.Bool("no-prefix-cache", &off, "compute every prompt in full (no reuse of earlier prompts' beginnings)");
    f.Int("prefix-cache-mib", &mib, "memory the prefix cache's snapshots may hold, in MiB", 1, int64_t{1} << 30);
    f.Int("prefix-snapshot-every", &snapshot_every,
          "a prompt is snapshotted every N tokens as it is prefilled (a multiple of 64), and at its end", 64,
          int64_t{1} << 30);
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

}  // namespace oryx::cli
