// The prefix cache for the hybrid state (DESIGN.md §5): snapshots of sequences taken at block boundaries
// while their prompts are prefilled, so that a later prompt with the same beginning resumes from the longest
// one instead of recomputing it.
//
// A snapshot is a whole SequenceState (the KV cache of its positions, the recurrent state and the conv
// window), so a hit resumes exactly where the snapshot was taken, in every layer and either mode. Where to take
// them: the cache also remembers the names of every full block of the prompts it was told of (Remember), so
// that a prompt can be snapshotted where it stops sharing an earlier prompt's blocks (Seen), the point a third
// prompt with the same beginning will need. It is named
// by a hash chained over its blocks' tokens *and the mode of every token* (ChainHash): a later layer's keys,
// values and recurrent state depend on the modes earlier tokens ran in, so a prefix is reusable only under
// the same mode schedule. A snapshot shares the sequence's full KV blocks by reference count, on the host and on
// a device (a writer copies a shared block first).
//
// The budget counts a KV block once, however many snapshots hold it: the snapshots of one prompt every 2048
// tokens, or of a conversation's turns, each hold the blocks of the ones before, and counted one by one a 16K
// prompt's eight would have been charged 4.5 times the memory they hold. Eviction, when the bytes pass the
// budget, is a segmented LRU: snapshots never hit go first (least recently inserted first), then those hit at
// least once (least recently hit first), and the hit ones keep at most half the budget. So the snapshot of a
// system prompt that every request hits outlives the end-of-prompt snapshots that requests with distinct
// suffixes leave behind, however many of them arrive between two hits. An evicted snapshot gives back only the
// blocks no other snapshot holds.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "engine/backend.h"

namespace oryx {

struct PrefixCacheOptions {
  int64_t block_tokens = 64;             // snapshots sit at multiples of this many positions
  // A prompt is snapshotted every this many tokens (a multiple of block_tokens). A prefill span ends at each
  // snapshot, so an Engine given 0 takes its backend's span for one prompt (at least 2048; Engine::set_prefix_cache).
  int64_t snapshot_every = 2048;
  int64_t max_bytes = int64_t{4} << 30;  // snapshots held at most (a KV block shared by several counted once)
};

struct PrefixCacheStats {
  int64_t lookups = 0;        // prompts looked up
  int64_t lookup_tokens = 0;  // their tokens
  int64_t hit_tokens = 0;     // of those, restored from a snapshot instead of forwarded
  int64_t snapshots = 0;      // held now
  int64_t bytes = 0;          // held now: the snapshots' recurrent states and the KV blocks they hold, each once
  int64_t inserted = 0, evicted = 0;
  double hit_rate() const {
    return lookup_tokens > 0 ? static_cast<double>(hit_tokens) / static_cast<double>(lookup_tokens) : 0.0;
  }
};

// Thread-safe.
class PrefixCache {
 public:
  explicit PrefixCache(PrefixCacheOptions options = {});
  const PrefixCacheOptions& options() const { return options_; }

  // A prompt as the cache reads it: its tokens, their modes, and the names of its full blocks (Names: the j-th
  // names positions [0, (j + 1) * block_tokens)), computed once per prompt and read by every call below.
  struct Prefix {
    std::span<const int32_t> tokens;
    std::span<const Mode> modes;
    std::span<const uint64_t> names;
    Prefix First(int64_t blocks, int64_t block_tokens) const {  // its first `blocks` whole blocks
      return {tokens.first(blocks * block_tokens), modes.first(blocks * block_tokens), names.first(blocks)};
    }
  };
  std::vector<uint64_t> Names(std::span<const int32_t> tokens, std::span<const Mode> modes) const;

  // The length of the longest prefix of p, of at most max_tokens tokens, that has a snapshot (0: none).
  // Counts nothing.
  int64_t Longest(const Prefix& p, int64_t max_tokens) const;
  // The length of the longest prefix of p, of at most max_tokens tokens, whose blocks an earlier prompt had
  // (Remember), snapshotted or not. Counts nothing.
  int64_t Seen(const Prefix& p, int64_t max_tokens) const;
  // Remembers the names of p's full blocks (forgetting all of them past a million blocks).
  void Remember(const Prefix& p);
  // Longest, and a copy of that snapshot (at position `tokens`) with room for `room` positions: a lookup of
  // p's tokens in the statistics. A copy the memory has no room for is a miss.
  struct Hit {
    int64_t tokens = 0;
    std::optional<SequenceState> state;
  };
  Hit Lookup(const Prefix& p, int64_t max_tokens, int64_t room = 0);
  // Keeps a snapshot of `seq`, which ran exactly p: a whole number of blocks, at least one. Returns whether it
  // was kept (not: held already, larger than the budget, or no memory for the copy).
  bool Insert(const Prefix& p, const SequenceState& seq);
  PrefixCacheStats stats() const;
  void Clear();

 private:
  struct Entry {
    std::vector<int32_t> tokens;  // the prefix, checked on every match (the hash names it, the tokens prove it)
    std::vector<Mode> modes;
    SequenceState state;
    bool hit = false;  // in `hit_` (hit at least once), else in `unhit_`
    std::list<uint64_t>::iterator lru;
  };
  // How many entries of a set hold each KV block (by pool and id), so that a block counts once.
  using BlockHolders = absl::flat_hash_map<std::pair<const void*, int32_t>, int32_t>;
  // The bytes that entering (delta 1) or leaving (-1) a set with `holders` adds to it or takes from it: its
  // recurrent state, and its KV blocks that no other entry of the set holds. Updates `holders`.
  static int64_t Hold(BlockHolders& holders, const SequenceState& state, int delta);
  // The bytes that `state` would add to the cache now, without changing it.
  int64_t BytesToAdd(const SequenceState& state) const;
  // The entry named `hash` if it holds exactly this prefix.
  const Entry* Find(uint64_t hash, std::span<const int32_t> tokens, std::span<const Mode> modes) const;
  // The length of the longest snapshotted prefix and its name.
  std::pair<int64_t, uint64_t> LongestLocked(const Prefix& p, int64_t max_tokens) const;
  bool EvictOne();  // the next snapshot in eviction order; false when none is left
  void EvictTo(int64_t max_bytes);
  void Touch(Entry& e);  // a hit: the most recent of hit_

  const PrefixCacheOptions options_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_;  // by chain hash of the prefix
  std::list<uint64_t> unhit_, hit_;              // by recency, least recent first
  BlockHolders holders_, hit_holders_;           // of all the snapshots, of those in hit_
  int64_t hit_bytes_ = 0;                        // of the snapshots in hit_ (a block shared by several once)
  std::unordered_set<uint64_t> seen_;            // chain hashes of the remembered prompts' full blocks
  PrefixCacheStats stats_;
};

}  // namespace oryx
