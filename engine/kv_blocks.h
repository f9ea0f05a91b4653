// The bookkeeping of a paged KV cache and its prefix cache, apart from where the blocks' bytes live.
//
// A sequence's KV cache is a table of fixed-size blocks of `block_tokens` positions each. BlockPool hands out
// block ids, counts who holds each block, and remembers which full blocks hold a known prefix: a block is
// named by a hash chained over the tokens *and the modes* of every position up to its end, because a later
// layer's keys and values (and the recurrent state) depend on the modes earlier tokens ran in, so a prefix is
// reusable only under the same mode schedule. Unreferenced blocks that hold a prefix stay cached and are
// evicted least recently released first, when nothing else is free. Backends own the storage (block id i at
// offset i * block bytes of their pool); this class never touches it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/aligned_vector.h"
#include "kernels/ops.h"

namespace oryx {

enum class Mode : uint8_t;

// The name of a full block: parent is the chain hash of the block before it (0 for the first).
uint64_t ChainHash(uint64_t parent, std::span<const int32_t> tokens, std::span<const Mode> modes);

class BlockPool {
 public:
  // capacity blocks of block_tokens positions each (both >= 1).
  BlockPool(int64_t capacity, int64_t block_tokens);

  int64_t capacity() const { return static_cast<int64_t>(refs_.size()); }
  int64_t block_tokens() const { return block_tokens_; }
  // Blocks that Allocate can hand out: never used, or released (cached ones included, which it evicts).
  int64_t available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  int64_t referenced() const { return capacity() - available(); }
  int64_t cached() const { return static_cast<int64_t>(by_hash_.size()); }
  int64_t evictions() const { return evictions_; }
  int32_t refs(int32_t block) const { return refs_[block]; }
  bool is_cached(int32_t block) const { return cached_.contains(block); }

  // A block for new contents, referenced once: a free one, else the least recently released cached one
  // (evicted from the prefix cache); ResourceExhausted when every block is referenced.
  absl::StatusOr<int32_t> Allocate();
  // Another holder of a referenced block (a clone of a sequence shares its full blocks).
  void Ref(int32_t block);
  // More blocks, free: ids capacity() .. capacity() + more - 1.
  void Grow(int64_t more);
  // A holder lets go. At zero references a cached block waits in the eviction order; any other is free.
  void Unref(int32_t block);

  // The block, referenced, now holds the full block_tokens positions (tokens, modes) that follow the prefix
  // named `parent` (0: none). Returns the prefix's name through this block, and the block that holds it: if
  // another block already does, nothing changes and that one is returned; otherwise `block` itself.
  struct Published {
    int32_t block;
    uint64_t hash;
  };
  Published Publish(int32_t block, uint64_t parent, std::span<const int32_t> tokens, std::span<const Mode> modes);
  // The cached blocks that hold the longest prefix of (tokens, modes) in whole blocks, each referenced once
  // more for the caller (unreferenced ones leave the eviction order), in order. Also counts the lookup.
  std::vector<int32_t> MatchPrefix(std::span<const int32_t> tokens, std::span<const Mode> modes);

  // Tokens looked up by MatchPrefix and those found, over the pool's life.
  int64_t lookup_tokens() const { return lookup_tokens_; }
  int64_t hit_tokens() const { return hit_tokens_; }

 private:
  struct Cached {
    uint64_t hash = 0, parent = 0;  // lookups check the parent too, so a match is a match of the whole chain
    std::vector<int32_t> tokens;
    std::vector<Mode> modes;
    std::list<int32_t>::iterator lru;  // valid while unreferenced
  };
  void Evict(int32_t block);
  int64_t block_tokens_;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // never used or released uncached, taken from the back
  std::list<int32_t> lru_;     // released cached blocks, least recently released first
  std::unordered_map<int32_t, Cached> cached_;    // by block
  std::unordered_map<uint64_t, int32_t> by_hash_;  // chain hash -> block
  int64_t evictions_ = 0, lookup_tokens_ = 0, hit_tokens_ = 0;
};

// Host storage for a BlockPool: block i holds, for every layer, block_tokens rows of keys and then
// block_tokens rows of values, row_elements elements each ([layers][2][block_tokens * row_elements]; the CPU
// backend orders a layer's keys head by head, SequenceState::KeyAt), fp32, bf16 or int8 with a scale per head
// (kernels::KvFormat); its memory is allocated the first time the block is handed out (or by Reserve)
// and kept for reuse. With max_capacity 0 the pool doubles when every block is held (bounded by the host's
// memory only); otherwise it stops at max_capacity blocks. A backend's sequences share one pool (CpuBackend),
// and may be used from several threads: every method locks, and a block's memory never moves.
class HostKvPool {
 public:
  HostKvPool(int64_t capacity, int64_t block_tokens, int64_t layers, int64_t row_elements, int64_t max_capacity = 0,
             kernels::KvFormat format = kernels::KvFormat::kF32);
  // The bookkeeping, unlocked: for tests and single-threaded tools.
  const BlockPool& blocks() const { return blocks_; }
  int64_t block_tokens() const { return blocks_.block_tokens(); }
  kernels::KvFormat format() const { return format_; }
  int64_t element_bytes() const { return kernels::KvElementBytes(format_); }
  int64_t block_bytes() const { return block_elements_ * element_bytes(); }
  // BlockPool::Allocate, with the block's memory; ResourceExhausted when the pool or the host has no room.
  absl::StatusOr<int32_t> Allocate();
  void Ref(int32_t block);
  void Unref(int32_t block);
  int32_t refs(int32_t block) const;
  // Whether a writer must copy the block first: another holder has it, or the prefix cache names it.
  bool Shared(int32_t block) const;
  // Memory for at least `blocks` blocks allocated now (the pool's size at start; ResourceExhausted, and what
  // was allocated kept, when the host has no room).
  absl::Status Reserve(int64_t blocks);
  int64_t referenced() const;  // blocks held
  int64_t allocated() const;   // blocks with memory
  // A layer's keys and values in a block: format() elements (float or uint16_t).
  void* keys(int32_t block, int64_t layer) {
    std::lock_guard<std::mutex> lock(mu_);
    return Bytes(block) + layer * layer_stride() * element_bytes();
  }
  void* values(int32_t block, int64_t layer) {
    return static_cast<std::byte*>(keys(block, layer)) + layer_elements_ * element_bytes();
  }
  // Layer 0's keys and values of each block of `ids`, under one lock (a forward gathers whole tables).
  void Locate(std::span<const int32_t> ids, const void** keys, const void** values);
  // Elements from one layer's keys in a block to the next layer's.
  int64_t layer_stride() const { return 2 * layer_elements_; }
  // A block with `block`'s contents that only the caller holds, in place of the caller's reference to it.
  absl::StatusOr<int32_t> CopyOf(int32_t block);

 private:
  absl::StatusOr<int32_t> AllocateLocked();
  void GrowLocked(int64_t more);
  mutable std::mutex mu_;
  BlockPool blocks_;
  std::byte* Bytes(int32_t block) { return reinterpret_cast<std::byte*>(storage_[block].data()); }
  int64_t StorageFloats() const { return (block_bytes() + 3) / static_cast<int64_t>(sizeof(float)); }
  int64_t layer_elements_, block_elements_;  // block_tokens * row_elements; all layers' keys and values
  int64_t max_capacity_;
  kernels::KvFormat format_;
  std::vector<kernels::AlignedVector<float>> storage_;  // by block (block_bytes()), empty until first handed out
  int64_t allocated_ = 0;
};

// A sequence's KV blocks from a host pool, in position order: block j holds positions [j * block_tokens,
// (j + 1) * block_tokens). It holds one reference to each and lets them go when it goes (move-only).
class HostKvTable {
 public:
  HostKvTable() = default;
  explicit HostKvTable(std::shared_ptr<HostKvPool> pool) : pool_(std::move(pool)) {}
  HostKvTable(HostKvTable&& other) noexcept;
  HostKvTable& operator=(HostKvTable&& other) noexcept;
  ~HostKvTable() { Clear(); }

  HostKvPool* pool() const { return pool_.get(); }  // null: no host cache (a device sequence)
  int64_t size() const { return static_cast<int64_t>(ids_.size()); }
  int32_t operator[](int64_t j) const { return ids_[j]; }
  std::span<const int32_t> ids() const { return ids_; }
  // Layer 0's keys and values of every block, in order (HostKvPool::Locate).
  void Locate(const void** keys, const void** values) const { pool_->Locate(ids_, keys, values); }
  // A table on the same pool that holds the first n blocks too.
  HostKvTable Share(int64_t n) const;
  // At least n blocks; ResourceExhausted, the table as it was, when the pool has no room.
  absl::Status Grow(int64_t n);
  // Block j made this table's alone: copied first when another table or the prefix cache holds it.
  absl::Status Own(int64_t j);
  int64_t shared() const;  // blocks another holder holds too
  void Clear();

 private:
  std::shared_ptr<HostKvPool> pool_;
  std::vector<int32_t> ids_;
};

}  // namespace oryx
