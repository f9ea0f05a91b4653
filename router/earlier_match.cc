#include "router/earlier_match.h"

#include <algorithm>

namespace oryx::router {

EarlierMatch::EarlierMatch() { states_.push_back(State{}); }

void EarlierMatch::Reserve(int64_t tokens) {
  const size_t n = static_cast<size_t>(size_ + std::max<int64_t>(0, tokens));
  states_.reserve(2 * n + 1);
  tokens_.reserve(3 * n);
  next_.reserve(3 * n);
}

int32_t EarlierMatch::Next(int32_t state, int32_t token) const {
  if (state == 0 && Dense(token)) return token < static_cast<int64_t>(start_next_.size()) ? start_next_[token] : -1;
  const auto it = next_.find(Key(state, token));
  return it == next_.end() ? -1 : it->second;
}

void EarlierMatch::SetNext(int32_t state, int32_t token, int32_t target) {
  if (state == 0 && Dense(token)) {
    if (token >= static_cast<int64_t>(start_next_.size())) start_next_.resize(token + 1, -1);
    start_next_[token] = target;  // (the start state is never cloned: its token list is not kept)
    return;
  }
  const auto [it, fresh] = next_.try_emplace(Key(state, token), target);
  if (fresh) {
    tokens_.emplace_back(token, states_[state].tokens);
    states_[state].tokens = static_cast<int32_t>(tokens_.size()) - 1;
  } else {
    it->second = target;
  }
}

EarlierMatch::Match EarlierMatch::Push(int32_t token) {
  const int64_t n = size_++;
  const int32_t cur = static_cast<int32_t>(states_.size());
  states_.push_back(State{.len = states_[last_].len + 1, .first_end = n});
  int32_t p = last_;
  while (p != -1 && Next(p, token) == -1) {
    SetNext(p, token, cur);
    p = states_[p].link;
  }
  if (p == -1) {
    states_[cur].link = 0;
  } else {
    const int32_t q = Next(p, token);
    if (states_[p].len + 1 == states_[q].len) {
      states_[cur].link = q;
    } else {
      const int32_t clone = static_cast<int32_t>(states_.size());
      State copy = states_[q];  // link and first occurrence of q; a shorter length; q's transitions below
      copy.len = states_[p].len + 1;
      copy.tokens = -1;
      states_.push_back(copy);
      for (int32_t e = states_[q].tokens; e != -1; e = tokens_[e].second) {
        SetNext(clone, tokens_[e].first, next_.at(Key(q, tokens_[e].first)));
      }
      while (p != -1 && Next(p, token) == q) {
        SetNext(p, token, clone);
        p = states_[p].link;
      }
      states_[q].link = clone;
      states_[cur].link = clone;
    }
  }
  last_ = cur;
  const State& earlier = states_[states_[cur].link];
  if (earlier.len == 0) return {};
  return {earlier.len, n - earlier.first_end};
}

EarlierMatch::Match LongestMatchAtEnd(std::span<const int32_t> tokens, int64_t last) {
  EarlierMatch index;
  index.Reserve(static_cast<int64_t>(tokens.size()));
  std::vector<EarlierMatch::Match> matches;
  matches.reserve(tokens.size());
  for (const int32_t t : tokens) matches.push_back(index.Push(t));
  return LongestOfLast(matches, last);
}

EarlierMatch::Match LongestOfLast(std::span<const EarlierMatch::Match> matches, int64_t last) {
  EarlierMatch::Match best;
  const int64_t n = static_cast<int64_t>(matches.size());
  for (int64_t i = std::max<int64_t>(0, n - last); i < n; ++i) {
    if (matches[i].length > best.length) best = matches[i];
  }
  return best;
}

EarlierMatch::Match NaiveEarlierMatch(const std::vector<int32_t>& tokens, int64_t end) {
  // The longest L such that tokens[end-L+1 .. end] equals tokens[j-L+1 .. j] for some j < end; among the
  // j that reach L, the first.
  EarlierMatch::Match best;
  for (int64_t j = 0; j < end; ++j) {
    int64_t len = 0;
    while (len <= j && tokens[end - len] == tokens[j - len]) ++len;
    if (len > best.length) best = {len, end - j};
  }
  return best;
}

}  // namespace oryx::router
