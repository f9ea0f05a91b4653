// Whether the text just read occurred before: for each token as it arrives, the longest run of tokens
// ending at it that also ends somewhere earlier in the text, and how far back. A causal content feature
// for routing: a question that repeats a needle's key, or a passage that repeats earlier text, is where
// attention mode can retrieve and linear mode has to remember.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace oryx::router {

// A suffix automaton of the text pushed so far (Blumer et al., 1985), built online: O(1) amortised states
// and transitions per token, each transition found in one hash table keyed by (state, token). (Searched
// linearly in each state's list, the start state's thousands of distinct tokens made a 16K prompt take
// 18-31 ms on the 2-core VM.) After Push(t) at position n, the longest
// suffix of text[0..n] that also occurs ending before n is the suffix link of the automaton's last state.
class EarlierMatch {
 public:
  struct Match {
    int64_t length = 0;    // tokens; 0: the token is new
    int64_t distance = 0;  // n minus the end of that suffix's first occurrence (0 when length is 0)
  };

  EarlierMatch();
  // Room for `tokens` more tokens without regrowing: at most two states and three transitions a token.
  void Reserve(int64_t tokens);
  // Appends `token` and returns the match ending at it.
  Match Push(int32_t token);
  int64_t size() const { return size_; }

 private:
  struct State {
    int64_t len = 0;
    int32_t link = -1;
    int64_t first_end = -1;  // end position of the first occurrence of this state's strings
    int32_t tokens = -1;     // the list of tokens with a transition out (for a clone's copy): its head in tokens_
  };
  // The start state's transitions on ids in [0, 2^20) sit in an array (a vocabulary's ids); others in next_.
  static bool Dense(int32_t token) { return token >= 0 && token < (1 << 20); }
  static uint64_t Key(int32_t state, int32_t token) {
    return static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32 | static_cast<uint32_t>(token);
  }
  int32_t Next(int32_t state, int32_t token) const;
  void SetNext(int32_t state, int32_t token, int32_t target);

  std::vector<State> states_;
  std::vector<std::pair<int32_t, int32_t>> tokens_;  // the states' token lists: (token, the next entry or -1)
  std::vector<int32_t> start_next_;                  // the start state's transitions by token (-1: none)
  absl::flat_hash_map<uint64_t, int32_t> next_;      // the other states': Key(state, token) -> state
  int32_t last_ = 0;
  int64_t size_ = 0;
};

// The longest of the matches Push returns for the last `last` of `tokens`, pushed from the start (the first
// such, on a tie): for a prompt, whether it ends with text that occurred earlier in it (a question naming a
// needle's key, a passage that repeats) and how far back. O(tokens).
EarlierMatch::Match LongestMatchAtEnd(std::span<const int32_t> tokens, int64_t last);
// LongestMatchAtEnd from the matches Push returned for every token, in order (PrefillModes has them).
EarlierMatch::Match LongestOfLast(std::span<const EarlierMatch::Match> matches, int64_t last);

// What Push returns for tokens[end] after tokens[0..end-1], by brute force (O(end^2)): the reference the
// tests check the automaton against.
EarlierMatch::Match NaiveEarlierMatch(const std::vector<int32_t>& tokens, int64_t end);

}  // namespace oryx::router
