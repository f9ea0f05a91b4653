#!/usr/bin/env bash
# Builds before_after.cc against the EarlierMatch of 8f9d9fa (renamed oldrouter) and the tree's, and runs it.
# From the repository root: results/2026-12-06-cpu-earlier-match/run.sh
set -euo pipefail
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git show 8f9d9fa:router/earlier_match.h | sed 's|oryx::router|oldrouter|g' > "$tmp/old_em.h"
git show 8f9d9fa:router/earlier_match.cc | sed 's|oryx::router|oldrouter|g; s|#include "router/earlier_match.h"|#include "old_em.h"|' > "$tmp/old_em.cc"
g++ -O2 -std=c++20 -I. -I"$tmp" "$(dirname "$0")/before_after.cc" "$tmp/old_em.cc" router/earlier_match.cc -o "$tmp/ab" \
  -labsl_raw_hash_set -labsl_hash -labsl_city -labsl_low_level_hash -labsl_throw_delegate
"$tmp/ab"
