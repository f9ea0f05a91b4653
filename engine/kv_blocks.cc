#include "engine/kv_blocks.h"

#include <algorithm>
#include <cassert>
#include <new>
#include <utility>

#include "base/status_macros.h"
#include "base/str_cat.h"
#include "engine/backend.h"

namespace oryx {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t ChainHash(uint64_t parent, std::span<const int32_t> tokens, std::span<const Mode> modes) {
  assert(tokens.size() == modes.size());
  uint64_t h = SplitMix(parent ^ 0x6f7279784b56ULL);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint64_t position = (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) << 1) |
                              static_cast<uint64_t>(modes[i] == Mode::kAttention);
    h = SplitMix(h ^ position);
  }
  return h;
}

BlockPool::BlockPool(int64_t capacity, int64_t block_tokens)
    : block_tokens_(block_tokens), refs_(static_cast<size_t>(capacity), 0) {
  assert(capacity >= 1 && block_tokens >= 1);
  free_.reserve(refs_.size());
  for (int64_t b = capacity - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));  // block 0 first
}

absl::StatusOr<int32_t> BlockPool::Allocate() {
  int32_t block;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    block = lru_.front();
    Evict(block);
  } else {
    return absl::ResourceExhaustedError(Cat("all ", capacity(), " KV blocks (", capacity() * block_tokens_,
                                            " positions) are in use"));
  }
  refs_[block] = 1;
  return block;
}

void BlockPool::Evict(int32_t block) {
  auto it = cached_.find(block);
  assert(it != cached_.end() && refs_[block] == 0);
  lru_.erase(it->second.lru);
  by_hash_.erase(it->second.hash);
  cached_.erase(it);
  ++evictions_;
}

void BlockPool::Grow(int64_t more) {
  const int64_t from = capacity();
  refs_.resize(static_cast<size_t>(from + more), 0);
  for (int64_t b = from + more - 1; b >= from; --b) free_.push_back(static_cast<int32_t>(b));
}

void BlockPool::Ref(int32_t block) {
  if (refs_[block] == 0) {  // a released cached block taken up again
    auto it = cached_.find(block);
    assert(it != cached_.end());
    lru_.erase(it->second.lru);
  }
  ++refs_[block];
}

void BlockPool::Unref(int32_t block) {
  assert(refs_[block] > 0);
  if (--refs_[block] > 0) return;
  auto it = cached_.find(block);
  if (it == cached_.end()) {
    free_.push_back(block);
  } else {
    it->second.lru = lru_.insert(lru_.end(), block);
  }
}

BlockPool::Published BlockPool::Publish(int32_t block, uint64_t parent, std::span<const int32_t> tokens,
                                       std::span<const Mode> modes) {
  assert(refs_[block] > 0 && static_cast<int64_t>(tokens.size()) == block_tokens_ && tokens.size() == modes.size());
  const uint64_t hash = ChainHash(parent, tokens, modes);
  if (auto it = by_hash_.find(hash); it != by_hash_.end()) return {it->second, hash};
  if (auto it = cached_.find(block); it != cached_.end()) return {block, it->second.hash};  // published before
  Cached& c = cached_[block];
  c.hash = hash;
  c.parent = parent;
  c.tokens.assign(tokens.begin(), tokens.end());
  c.modes.assign(modes.begin(), modes.end());
  by_hash_[hash] = block;
  return {block, hash};
}

std::vector<int32_t> BlockPool::MatchPrefix(std::span<const int32_t> tokens, std::span<const Mode> modes) {
  assert(tokens.size() == modes.size());
  std::vector<int32_t> blocks;
  const size_t b = static_cast<size_t>(block_tokens_);
  uint64_t parent = 0;
  for (size_t start = 0; start + b <= tokens.size(); start += b) {
    const auto t = tokens.subspan(start, b);
    const auto m = modes.subspan(start, b);
    const uint64_t hash = ChainHash(parent, t, m);
    auto it = by_hash_.find(hash);
    if (it == by_hash_.end()) break;
    const Cached& c = cached_.at(it->second);
    if (c.parent != parent || !std::equal(t.begin(), t.end(), c.tokens.begin()) ||
        !std::equal(m.begin(), m.end(), c.modes.begin())) {
      break;  // a hash collision: not the same prefix
    }
    blocks.push_back(it->second);
    parent = hash;
  }
  for (int32_t block : blocks) Ref(block);
  lookup_tokens_ += static_cast<int64_t>(tokens.size());
  hit_tokens_ += static_cast<int64_t>(blocks.size()) * block_tokens_;
  return blocks;
}

HostKvPool::HostKvPool(int64_t capacity, int64_t block_tokens, int64_t layers, int64_t row_elements,
                       int64_t max_capacity, kernels::KvFormat format)
    : blocks_(capacity, block_tokens),
      layer_elements_(block_tokens * row_elements),
      block_elements_(layers * 2 * block_tokens * row_elements),
      max_capacity_(max_capacity),
      format_(format),
      storage_(static_cast<size_t>(capacity)) {}

void HostKvPool::GrowLocked(int64_t more) {  // storage_ moves, but each block's memory stays put
  blocks_.Grow(more);
  storage_.resize(static_cast<size_t>(blocks_.capacity()));
}

absl::StatusOr<int32_t> HostKvPool::AllocateLocked() {
  const int64_t room = max_capacity_ == 0 ? blocks_.capacity() : max_capacity_ - blocks_.capacity();
  if (blocks_.available() == 0 && room > 0) GrowLocked(std::min(blocks_.capacity(), room));
  ORYX_ASSIGN_OR_RETURN(const int32_t block, blocks_.Allocate());
  kernels::AlignedVector<float>& memory = storage_[block];
  if (memory.empty()) {
    try {
      memory.resize(static_cast<size_t>(StorageFloats()));
      ++allocated_;
    } catch (const std::bad_alloc&) {
      blocks_.Unref(block);
      return absl::ResourceExhaustedError(Cat("out of host memory for a KV block of ", block_bytes(), " bytes"));
    }
  }
  return block;
}

absl::StatusOr<int32_t> HostKvPool::Allocate() {
  std::lock_guard<std::mutex> lock(mu_);
  return AllocateLocked();
}

void HostKvPool::Ref(int32_t block) {
  std::lock_guard<std::mutex> lock(mu_);
  blocks_.Ref(block);
}

void HostKvPool::Unref(int32_t block) {
  std::lock_guard<std::mutex> lock(mu_);
  blocks_.Unref(block);
}

int32_t HostKvPool::refs(int32_t block) const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocks_.refs(block);
}

bool HostKvPool::Shared(int32_t block) const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocks_.refs(block) > 1 || blocks_.is_cached(block);
}

int64_t HostKvPool::referenced() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocks_.referenced();
}

int64_t HostKvPool::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

absl::Status HostKvPool::Reserve(int64_t blocks) {
  std::lock_guard<std::mutex> lock(mu_);
  if (max_capacity_ > 0) blocks = std::min(blocks, max_capacity_);
  if (blocks > blocks_.capacity()) GrowLocked(blocks - blocks_.capacity());
  for (int64_t b = 0; b < blocks_.capacity() && allocated_ < blocks; ++b) {
    kernels::AlignedVector<float>& memory = storage_[b];
    if (!memory.empty()) continue;
    try {
      memory.resize(static_cast<size_t>(StorageFloats()));
      ++allocated_;
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(Cat("out of host memory reserving ", blocks, " KV blocks of ", block_bytes(),
                                              " bytes (", allocated_, " allocated)"));
    }
  }
  return absl::OkStatus();
}

void HostKvPool::Locate(std::span<const int32_t> ids, const void** keys, const void** values) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t j = 0; j < ids.size(); ++j) {
    keys[j] = Bytes(ids[j]);
    values[j] = Bytes(ids[j]) + layer_elements_ * element_bytes();
  }
}

absl::StatusOr<int32_t> HostKvPool::CopyOf(int32_t block) {
  std::lock_guard<std::mutex> lock(mu_);
  ORYX_ASSIGN_OR_RETURN(const int32_t copy, AllocateLocked());
  std::copy(storage_[block].begin(), storage_[block].end(), storage_[copy].begin());
  blocks_.Unref(block);
  return copy;
}

HostKvTable::HostKvTable(HostKvTable&& other) noexcept
    : pool_(std::move(other.pool_)), ids_(std::exchange(other.ids_, {})) {}

HostKvTable& HostKvTable::operator=(HostKvTable&& other) noexcept {
  if (this != &other) {
    Clear();
    pool_ = std::move(other.pool_);
    ids_ = std::exchange(other.ids_, {});
  }
  return *this;
}

void HostKvTable::Clear() {
  if (pool_) {
    for (int32_t b : ids_) pool_->Unref(b);
  }
  ids_.clear();
}

HostKvTable HostKvTable::Share(int64_t n) const {
  HostKvTable copy(pool_);
  copy.ids_.assign(ids_.begin(), ids_.begin() + n);
  for (int32_t b : copy.ids_) pool_->Ref(b);
  return copy;
}

absl::Status HostKvTable::Grow(int64_t n) {
  const int64_t had = size();
  if (n <= had) return absl::OkStatus();
  try {
    ids_.reserve(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory for a KV block table");
  }
  while (size() < n) {
    absl::StatusOr<int32_t> block = pool_->Allocate();
    if (!block.ok()) {
      while (size() > had) {
        pool_->Unref(ids_.back());
        ids_.pop_back();
      }
      return absl::ResourceExhaustedError(Cat(n, " KV blocks of ", pool_->block_bytes(),
                                              " bytes: ", block.status().message()));
    }
    ids_.push_back(*block);
  }
  return absl::OkStatus();
}

absl::Status HostKvTable::Own(int64_t j) {
  if (!pool_->Shared(ids_[j])) return absl::OkStatus();
  ORYX_ASSIGN_OR_RETURN(ids_[j], pool_->CopyOf(ids_[j]));
  return absl::OkStatus();
}

int64_t HostKvTable::shared() const {
  if (!pool_) return 0;
  return std::count_if(ids_.begin(), ids_.end(), [&](int32_t b) { return pool_->refs(b) > 1; });
}

}  // namespace oryx
