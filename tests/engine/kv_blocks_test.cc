// BlockPool: allocation and reference counts, the prefix cache's chained names (tokens and modes), whole-block
// matches, and eviction of released cached blocks, least recently released first.
#include "engine/kv_blocks.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "engine/backend.h"

namespace oryx {
namespace {

constexpr Mode A = Mode::kAttention, L = Mode::kLinear;

std::vector<int32_t> Iota(int n, int from) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// Allocates and publishes the whole blocks of (tokens, modes) as one sequence would; returns the blocks.
std::vector<int32_t> Fill(BlockPool& pool, const std::vector<int32_t>& tokens, const std::vector<Mode>& modes) {
  std::vector<int32_t> blocks;
  uint64_t parent = 0;
  const size_t b = static_cast<size_t>(pool.block_tokens());
  for (size_t start = 0; start + b <= tokens.size(); start += b) {
    absl::StatusOr<int32_t> block = pool.Allocate();
    EXPECT_TRUE(block.ok()) << block.status();
    const BlockPool::Published p =
        pool.Publish(*block, parent, std::span(tokens).subspan(start, b), std::span(modes).subspan(start, b));
    EXPECT_EQ(p.block, *block);
    blocks.push_back(*block);
    parent = p.hash;
  }
  return blocks;
}

TEST(ChainHash, NamesTokensModesAndParent) {
  const std::vector<int32_t> t = {5, 6, 7, 8};
  const std::vector<Mode> m = {A, A, A, A};
  const uint64_t h = ChainHash(0, t, m);
  EXPECT_EQ(h, ChainHash(0, t, m));
  EXPECT_NE(h, ChainHash(1, t, m));
  EXPECT_NE(h, ChainHash(0, std::vector<int32_t>{5, 6, 7, 9}, m));
  EXPECT_NE(h, ChainHash(0, t, std::vector<Mode>{A, A, L, A}));  // the same tokens in another mode
}

TEST(BlockPool, AllocatesUntilFullAndFreesAtZeroReferences) {
  BlockPool pool(3, 16);
  std::vector<int32_t> got;
  for (int i = 0; i < 3; ++i) got.push_back(*pool.Allocate());
  EXPECT_EQ(pool.available(), 0);
  const absl::StatusOr<int32_t> none = pool.Allocate();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("all 3 KV blocks (48 positions)"), std::string::npos) << none.status();
  pool.Ref(got[1]);  // a clone shares it
  EXPECT_EQ(pool.refs(got[1]), 2);
  pool.Unref(got[1]);
  EXPECT_EQ(pool.available(), 0);
  pool.Unref(got[1]);
  EXPECT_EQ(pool.available(), 1);
  EXPECT_EQ(*pool.Allocate(), got[1]);
  for (int32_t b : got) pool.Unref(b);
  EXPECT_EQ(pool.available(), 3);
  EXPECT_EQ(pool.referenced(), 0);
}

// Whole blocks only: a prompt that ends inside a block matches the blocks before it; one that diverges in a
// token or only in a mode matches up to the block where it diverges.
TEST(BlockPool, MatchesWholeBlocksOfTheSameTokensAndModes) {
  BlockPool pool(16, 4);
  const std::vector<int32_t> tokens = Iota(12, 100);
  const std::vector<Mode> modes(12, A);
  const std::vector<int32_t> blocks = Fill(pool, tokens, modes);
  ASSERT_EQ(blocks.size(), 3u);

  std::vector<int32_t> t = Iota(10, 100);  // ends inside the third block
  std::vector<int32_t> hit = pool.MatchPrefix(t, std::vector<Mode>(10, A));
  EXPECT_EQ(hit, std::vector<int32_t>(blocks.begin(), blocks.begin() + 2));
  EXPECT_EQ(pool.refs(blocks[0]), 2);  // the match holds them for the caller
  for (int32_t b : hit) pool.Unref(b);

  t = tokens;
  t[5] = 7;  // a token of the second block differs
  hit = pool.MatchPrefix(t, modes);
  EXPECT_EQ(hit, std::vector<int32_t>{blocks[0]});
  for (int32_t b : hit) pool.Unref(b);

  std::vector<Mode> m = modes;
  m[9] = L;  // the same tokens, one of the third block's in linear mode
  hit = pool.MatchPrefix(tokens, m);
  EXPECT_EQ(hit, std::vector<int32_t>(blocks.begin(), blocks.begin() + 2));
  for (int32_t b : hit) pool.Unref(b);

  m = modes;
  m[0] = L;  // the first token in another mode: every later block's contents differ too
  EXPECT_TRUE(pool.MatchPrefix(tokens, m).empty());

  // The same contents in another chain position are another name: the second block's tokens alone.
  EXPECT_TRUE(pool.MatchPrefix(std::vector<int32_t>(tokens.begin() + 4, tokens.end()),
                               std::vector<Mode>(8, A)).empty());
  EXPECT_EQ(pool.hit_tokens(), 8 + 4 + 8);
  EXPECT_EQ(pool.lookup_tokens(), 10 + 12 + 12 + 12 + 8);
}

TEST(BlockPool, APrefixPublishedTwiceKeepsTheFirstBlock) {
  BlockPool pool(4, 2);
  const std::vector<int32_t> t = {1, 2};
  const std::vector<Mode> m = {A, A};
  const int32_t first = *pool.Allocate();
  const int32_t second = *pool.Allocate();
  const BlockPool::Published p1 = pool.Publish(first, 0, t, m);
  const BlockPool::Published p2 = pool.Publish(second, 0, t, m);
  EXPECT_EQ(p2.block, first);
  EXPECT_EQ(p2.hash, p1.hash);
  EXPECT_EQ(pool.cached(), 1);
  pool.Unref(second);  // not cached: free at once
  pool.Unref(first);   // cached: kept for a later match
  EXPECT_EQ(pool.available(), 4);
  EXPECT_EQ(pool.MatchPrefix(t, m), std::vector<int32_t>{first});
}

// Released cached blocks stay matchable until the free blocks run out; then the least recently released
// goes first, and a block matched again leaves the eviction order.
TEST(BlockPool, EvictsReleasedCachedBlocksLeastRecentlyReleasedFirst) {
  BlockPool pool(3, 2);
  const std::vector<Mode> m = {A, A};
  const std::vector<int32_t> a = {1, 2}, b = {3, 4}, c = {5, 6};
  const int32_t ba = Fill(pool, a, m)[0];
  const int32_t bb = Fill(pool, b, m)[0];
  const int32_t bc = Fill(pool, c, m)[0];
  pool.Unref(bb);
  pool.Unref(ba);
  pool.Unref(bc);  // released: b, then a, then c
  EXPECT_EQ(pool.available(), 3);
  EXPECT_EQ(pool.cached(), 3);

  EXPECT_EQ(pool.MatchPrefix(a, m), std::vector<int32_t>{ba});  // a is taken up again
  EXPECT_EQ(*pool.Allocate(), bb);                               // b was released first
  EXPECT_EQ(pool.evictions(), 1);
  EXPECT_TRUE(pool.MatchPrefix(b, m).empty());
  EXPECT_EQ(*pool.Allocate(), bc);  // a is held, so c goes next
  EXPECT_EQ(pool.Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.MatchPrefix(a, m), std::vector<int32_t>{ba});
  EXPECT_EQ(pool.refs(ba), 2);
  EXPECT_EQ(pool.cached(), 1);
}

// A sequence's own pool doubles when full, and the blocks handed out keep their memory; a pool with a
// maximum stops there.
TEST(HostKvPool, GrowsUpToItsMaximumAndKeepsBlocksInPlace) {
  HostKvPool own(2, 4, /*layers=*/2, /*row_elements=*/3);
  const int32_t first = *own.Allocate();
  float* keys = static_cast<float*>(own.keys(first, 1));
  keys[0] = 42.f;
  std::vector<int32_t> got = {first};
  for (int i = 0; i < 9; ++i) got.push_back(*own.Allocate());
  EXPECT_EQ(own.blocks().capacity(), 16);  // 2 -> 4 -> 8 -> 16
  EXPECT_EQ(own.keys(first, 1), keys);
  EXPECT_EQ(keys[0], 42.f);
  EXPECT_EQ(own.block_bytes(), 2 * 2 * 4 * 3 * 4);
  HostKvPool halves(2, 4, 2, 3, /*max_capacity=*/0, kernels::KvFormat::kBf16);
  EXPECT_EQ(halves.block_bytes(), 2 * 2 * 4 * 3 * 2);
  const int32_t block = *halves.Allocate();  // layer 1's values end where the block's memory ends
  EXPECT_EQ(static_cast<std::byte*>(halves.values(block, 1)) + 4 * 3 * 2,
            static_cast<std::byte*>(halves.keys(block, 0)) + halves.block_bytes());

  HostKvPool capped(2, 4, 2, 3, /*max_capacity=*/3);
  EXPECT_TRUE(capped.Allocate().ok());
  EXPECT_TRUE(capped.Allocate().ok());
  EXPECT_TRUE(capped.Allocate().ok());
  EXPECT_EQ(capped.Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(capped.blocks().capacity(), 3);
}

}  // namespace
}  // namespace oryx
