#include "engine/prefix_cache.h"

#include <algorithm>
#include <cassert>

namespace oryx {

PrefixCache::PrefixCache(PrefixCacheOptions options) : options_(options) {
  assert(options_.block_tokens >= 1 && options_.snapshot_every >= options_.block_tokens &&
         options_.snapshot_every % options_.block_tokens == 0);
}

const PrefixCache::Entry* PrefixCache::Find(uint64_t hash, std::span<const int32_t> tokens,
                                            std::span<const Mode> modes) const {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return nullptr;
  const Entry& e = it->second;
  if (!std::ranges::equal(e.tokens, tokens) || !std::ranges::equal(e.modes, modes)) return nullptr;
  return &e;
}

std::vector<uint64_t> PrefixCache::Names(std::span<const int32_t> tokens, std::span<const Mode> modes) const {
  const int64_t b = options_.block_tokens;
  std::vector<uint64_t> names(tokens.size() / static_cast<size_t>(b));
  for (size_t j = 0; j < names.size(); ++j) {
    names[j] = ChainHash(j == 0 ? 0 : names[j - 1], tokens.subspan(j * b, b), modes.subspan(j * b, b));
  }
  return names;
}

std::pair<int64_t, uint64_t> PrefixCache::LongestLocked(const Prefix& p, int64_t max_tokens) const {
  const int64_t b = options_.block_tokens;
  const int64_t blocks = std::min<int64_t>(max_tokens / b, static_cast<int64_t>(p.names.size()));
  // Snapshots are sparse along a prefix (every snapshot_every tokens and where prompts ended or parted), so
  // every block boundary is tried, the longest first.
  for (int64_t j = blocks; j > 0 && !entries_.empty(); --j) {
    if (Find(p.names[j - 1], p.tokens.first(j * b), p.modes.first(j * b)) != nullptr) return {j * b, p.names[j - 1]};
  }
  return {0, 0};
}

int64_t PrefixCache::Longest(const Prefix& p, int64_t max_tokens) const {
  std::lock_guard<std::mutex> lock(mu_);
  return LongestLocked(p, max_tokens).first;
}

int64_t PrefixCache::Seen(const Prefix& p, int64_t max_tokens) const {
  const int64_t b = options_.block_tokens;
  const int64_t blocks = std::min<int64_t>(max_tokens / b, static_cast<int64_t>(p.names.size()));
  std::lock_guard<std::mutex> lock(mu_);
  int64_t j = 0;
  while (j < blocks && seen_.contains(p.names[j])) ++j;
  return j * b;
}

void PrefixCache::Remember(const Prefix& p) {
  constexpr size_t kMaxSeen = size_t{1} << 20;
  std::lock_guard<std::mutex> lock(mu_);
  if (seen_.size() + p.names.size() > kMaxSeen) seen_.clear();
  seen_.insert(p.names.begin(), p.names.end());
}

PrefixCache::Hit PrefixCache::Lookup(const Prefix& p, int64_t max_tokens, int64_t room) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.lookups;
  stats_.lookup_tokens += static_cast<int64_t>(p.tokens.size());
  const auto [length, hash] = LongestLocked(p, max_tokens);
  if (length == 0) return {};
  Entry& e = entries_.at(hash);
  absl::StatusOr<SequenceState> copy = e.state.TryCloneWithRoom(std::max(room, length));
  if (!copy.ok()) return {};
  Touch(e);
  stats_.hit_tokens += length;
  return {length, std::move(*copy)};
}

bool PrefixCache::Insert(const Prefix& p, const SequenceState& seq) {
  const int64_t n = static_cast<int64_t>(p.tokens.size());
  assert(n == static_cast<int64_t>(p.modes.size()) && n == seq.position() && n > 0 &&
         n == static_cast<int64_t>(p.names.size()) * options_.block_tokens);
  const uint64_t hash = p.names.back();
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.contains(hash)) {
    return false;  // held already (or, with odds of 2^-64, another prefix of the same name: that one stays)
  }
  absl::StatusOr<SequenceState> snapshot = seq.TryCloneWithRoom(n);
  if (!snapshot.ok()) return false;
  // Alone it would hold all its bytes; with the others, what they do not hold already. Evicting one of those
  // can make that more, hence the loop.
  if (snapshot->kv_bytes() + snapshot->recurrent_bytes() > options_.max_bytes) return false;
  while (stats_.bytes + BytesToAdd(*snapshot) > options_.max_bytes && EvictOne()) {
  }
  stats_.bytes += Hold(holders_, *snapshot, +1);
  unhit_.push_back(hash);
  entries_.emplace(hash, Entry{std::vector<int32_t>(p.tokens.begin(), p.tokens.end()),
                               std::vector<Mode>(p.modes.begin(), p.modes.end()), std::move(*snapshot),
                               /*hit=*/false, std::prev(unhit_.end())});
  ++stats_.inserted;
  ++stats_.snapshots;
  return true;
}

int64_t PrefixCache::Hold(BlockHolders& holders, const SequenceState& state, int delta) {
  const void* pool = state.kv_pool();
  int64_t blocks = 0;  // that came to be held by the set, or were let go by it
  for (const int32_t id : state.kv_block_ids()) {
    const auto it = holders.try_emplace({pool, id}, 0).first;
    it->second += delta;
    if (it->second == 0) {
      holders.erase(it);
      ++blocks;
    } else if (delta > 0 && it->second == 1) {
      ++blocks;
    }
  }
  return state.recurrent_bytes() + blocks * state.kv_block_bytes();
}

int64_t PrefixCache::BytesToAdd(const SequenceState& state) const {
  const void* pool = state.kv_pool();
  const auto ids = state.kv_block_ids();
  const auto new_blocks = std::ranges::count_if(ids, [&](int32_t id) { return !holders_.contains({pool, id}); });
  return state.recurrent_bytes() + static_cast<int64_t>(new_blocks) * state.kv_block_bytes();
}

void PrefixCache::Touch(Entry& e) {
  if (!e.hit) {
    hit_.splice(hit_.end(), unhit_, e.lru);
    e.hit = true;
    hit_bytes_ += Hold(hit_holders_, e.state, +1);
  } else {
    hit_.splice(hit_.end(), hit_, e.lru);
  }
}

bool PrefixCache::EvictOne() {
  // The hit snapshots' least recent when they hold more than half the budget or nothing else is left.
  const bool from_hit = !hit_.empty() && (unhit_.empty() || hit_bytes_ > options_.max_bytes / 2);
  std::list<uint64_t>& order = from_hit ? hit_ : unhit_;
  if (order.empty()) return false;
  auto it = entries_.find(order.front());
  stats_.bytes -= Hold(holders_, it->second.state, -1);
  if (from_hit) hit_bytes_ -= Hold(hit_holders_, it->second.state, -1);
  --stats_.snapshots;
  ++stats_.evicted;
  entries_.erase(it);
  order.pop_front();
  return true;
}

void PrefixCache::EvictTo(int64_t max_bytes) {
  while (stats_.bytes > max_bytes && EvictOne()) {
  }
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void PrefixCache::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  EvictTo(0);
}

}  // namespace oryx
