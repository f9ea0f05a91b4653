#!/usr/bin/env bash
# End-to-end checks of the `oryx` command's edges: every subcommand answers --help with exit 0, and bad
# input (unknown command or flag, missing value or required flag, missing path) gets exactly one
# "oryx: error:" line on stderr and a non-zero exit, never a crash.
#   cli_test.sh PATH_TO_ORYX [SOURCE_DIR]   (with SOURCE_DIR, also bad requests to the bundled model)
set -u
ORYX="$1"
SRC="${2:-}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
passed=0 failed=0

# expect CODE DESCRIPTION -- ARGS...: exit code CODE (2: usage error, 1: failed run); for CODE != 0, exactly
# one "oryx: error: ..." line on stderr, and it is the last (progress lines may come before it).
expect() {
  local code="$1" what="$2"; shift 3
  "$ORYX" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local ok=1
  [[ $rc -eq $code ]] || ok=0
  if [[ $code -ne 0 ]]; then
    [[ $(grep -c '^oryx: error: ' "$TMP/err") -eq 1 ]] && tail -1 "$TMP/err" | grep -q '^oryx: error: ' || ok=0
  fi
  if [[ $ok -eq 1 ]]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL: $what (oryx $*): exit $rc, expected $code; stderr:"; cat "$TMP/err"
  fi
}

expect 0 "top-level help" -- --help
expect 2 "unknown command" -- frobnicate
expect 0 "version" -- --version
if ! "$ORYX" --version | head -1 | grep -Eq '^oryx [0-9]+\.[0-9]+\.[0-9]+$'; then
  failed=$((failed + 1)); echo "FAIL: oryx --version's first line is not 'oryx X.Y.Z'"
elif [[ -n "$SRC" ]]; then  # the version CMake gives is the one pyproject.toml gives
  want=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$SRC/pyproject.toml")
  got=$("$ORYX" --version | head -1 | cut -d' ' -f2)
  [[ "$got" == "$want" ]] || { failed=$((failed + 1)); echo "FAIL: oryx --version says $got, pyproject.toml $want"; }
fi
commands=(generate eval bench tokenizer data)
"$ORYX" --help | grep -q '^  train ' && commands+=(train)
"$ORYX" --help | grep -q '^  train-router ' && commands+=(train-router)
"$ORYX" --help | grep -q '^  serve ' && commands+=(serve)
for c in "${commands[@]}"; do expect 0 "$c --help" -- "$c" --help; done
expect 0 "tokenizer train --help" -- tokenizer train --help
expect 0 "data prepare --help" -- data prepare --help
expect 2 "tokenizer: unknown subcommand" -- tokenizer frob
expect 2 "tokenizer train: unknown flag" -- tokenizer train --bogus 1
expect 2 "tokenizer train: missing required flags" -- tokenizer train --vocab 300
expect 2 "tokenizer train: non-integer vocab" -- tokenizer train --input x --vocab many --out y
expect 1 "tokenizer train: missing input file" -- tokenizer train --input "$TMP/none.txt" --vocab 300 --out "$TMP/t.model"
expect 2 "data prepare: flag without value" -- data prepare --out
expect 1 "data verify: missing corpus" -- data verify --corpus "$TMP/no-corpus"
expect 1 "data text: missing corpus" -- data text --corpus "$TMP/no-corpus" --out "$TMP/t.txt"
expect 1 "data unpack: missing archive" -- data unpack --archive "$TMP/none.tar.xz" --out "$TMP/u"
expect 0 "bench decode --help" -- bench decode --help
expect 0 "bench spec --help" -- bench spec --help
expect 0 "bench cost --help" -- bench cost --help
expect 1 "bench cost: missing model" -- bench cost --model "$TMP/no-model"
expect 2 "bench cost: zero repeats" -- bench cost --repeats 0
expect 1 "bench cost: unknown device" -- bench cost --device tpu
expect 0 "bench router --help" -- bench router --help
expect 1 "bench router: neither data nor haystack" -- bench router --model x
expect 2 "bench: unknown kind" -- bench warp
expect 2 "generate: missing --model" -- generate --prompt hi
expect 2 "generate: non-numeric --max-tokens" -- generate --model x --prompt hi --max-tokens lots
expect 1 "generate: missing model" -- generate --model "$TMP/no-model" --prompt hi
expect 1 "generate: corrupt model" -- generate --model "$TMP" --prompt hi
expect 2 "eval: unknown kind" -- eval bogus --model x
expect 1 "eval: missing model" -- eval ppl --model "$TMP/no-model" --data "$TMP"
expect 1 "eval: depth out of range" -- eval niah --model x --data y --depths 1.5
expect 1 "eval: neither data nor haystack" -- eval niah --model x
expect 1 "eval: unknown backend" -- eval ppl --model x --data y --backend abacus
expect 1 "bench decode: bad batch list" -- bench decode --batches 1,zero
expect 1 "bench decode: speculative rounds on the CPU" -- bench decode --spec-k 2
expect 1 "bench decode: a zero draft length" -- bench decode --device cuda --spec-k 0
expect 1 "bench decode: acceptance without rounds" -- bench decode --device cuda --acceptance 0.9
expect 1 "bench decode: temperature without data" -- bench decode --device cuda --spec-k 2 --temperature 1
expect 1 "bench decode: negative temperature" -- bench decode --device cuda --spec-k 2 --data "$TMP" --temperature -1
expect 1 "bench decode: temperature on the cpu" -- bench decode --device cpu --temperature 0.5
expect 1 "bench spec: missing model" -- bench spec --model "$TMP/no-model" --data "$TMP"
if [[ -n "$SRC" && -f "$SRC/models/default/config.json" ]]; then
  M="$SRC/models/default"
  expect 0 "generate on the bundled model" -- generate --model "$M" --prompt "int main" --max-tokens 4 --json
  expect 1 "generate: empty prompt" -- generate --model "$M" --prompt ""
  expect 1 "generate: prompt and prompt file" -- generate --model "$M" --prompt a --prompt-file "$TMP/p.txt"
  head -c 60000 /dev/urandom | base64 >"$TMP/long.txt"  # far more than the 16,384-token context
  expect 1 "generate: prompt past max_position" -- generate --model "$M" --prompt-file "$TMP/long.txt"
  expect 1 "generate: unknown policy" -- generate --model "$M" --prompt hi --policy sometimes
  expect 1 "generate: bad speculative k" -- generate --model "$M" --prompt hi --policy speculative:0
  expect 1 "generate: negative entropy threshold" -- generate --model "$M" --prompt hi --policy entropy:-1
  expect 0 "generate: budget policy" -- generate --model "$M" --prompt hi --max-tokens 4 --policy budget:0.2 --json
  expect 1 "generate: missing learned policy file" -- generate --model "$M" --prompt hi --max-tokens 4 --policy "learned:$TMP/none.safetensors"
  expect 0 "generate: logprobs with echo" -- generate --model "$M" --prompt hi --max-tokens 2 --json --logprobs 3 --echo
  expect 1 "generate: logprobs without --json" -- generate --model "$M" --prompt hi --logprobs 3
  expect 2 "generate: logprobs out of range" -- generate --model "$M" --prompt hi --json --logprobs 21
  expect 1 "generate: bad top-p" -- generate --model "$M" --prompt hi --top-p 1.5
  expect 1 "generate: negative temperature" -- generate --model "$M" --prompt hi --temperature -1
  expect 1 "generate: cuda backend not built" -- generate --model "$M" --prompt hi --device cuda
  mkdir -p "$TMP/broken" && find "$M" -maxdepth 1 -type f -exec cp {} "$TMP/broken/" \;
  chmod u+w "$TMP/broken"/* && head -c 1000 "$M/model-00001-of-00004.safetensors" >"$TMP/broken/model-00001-of-00004.safetensors"
  expect 1 "generate: truncated shard" -- generate --model "$TMP/broken" --prompt hi
  # bench serve through the real server: each policy's attention share of the tokens its requests forwarded.
  for policy in attention linear; do
    expect 0 "bench serve: $policy" -- bench serve --model "$M" --concurrency 2 --requests 2 --prompt-tokens 64 \
      --max-tokens 4 --policy "$policy" --json
    want=$([[ $policy == attention ]] && echo 1 || echo 0)
    python3 -c 'import json, sys; j = json.loads(open(sys.argv[1]).read().splitlines()[-1])
sys.exit(0 if j["attention_fraction"] == float(sys.argv[2]) and j["generated_tokens_per_s"] > 0 else 1)' "$TMP/out" "$want" ||
      { failed=$((failed + 1)); echo "FAIL: bench serve --policy $policy: attention_fraction is not $want"; cat "$TMP/out"; }
  done
  # eval runs schedules; a routed policy is refused before any other policy runs, pointing to bench router.
  expect 1 "eval niah: a routed policy" -- eval niah-multikey --model "$M" --haystack "$SRC"/tests/data/default_model/val-100000.txt \
    --lengths 256 --seeds 1 --policies linear entropy:1
  grep -q "bench router" "$TMP/err" && ! grep -q '"results"' "$TMP/out" ||
    { failed=$((failed + 1)); echo "FAIL: eval niah with entropy:1 did not point to bench router before running"; }
fi
if [[ " ${commands[*]} " == *" serve "* ]]; then
  expect 0 "bench serve --help" -- bench serve --help
  expect 1 "bench serve: no model" -- bench serve
  expect 2 "bench serve: zero tokens" -- bench serve --model x --max-tokens 0
  expect 1 "bench serve: bad concurrency list" -- bench serve --model x --concurrency 4,none
  expect 1 "bench serve: closed and open loop" -- bench serve --model x --concurrency 4 --rates 2
  expect 1 "bench serve: zero rate" -- bench serve --model x --rates 0
  expect 2 "serve: missing --model" -- serve --port 0
  expect 2 "serve: port out of range" -- serve --model x --port 70000
  expect 2 "serve: zero batch" -- serve --model x --max-batch 0
  expect 2 "serve: negative prefill budget" -- serve --model x --max-prefill-tokens -1
  expect 1 "serve: missing model" -- serve --model "$TMP/no-model" --port 0
  if [[ -n "${M:-}" ]]; then
    # A server starts, says where it listens, refuses a second server on its port, and stops cleanly on
    # SIGTERM (it drains: nothing was taken) with its counters.
    "$ORYX" serve --model "$M" --port 0 --threads 1 >"$TMP/serve.out" 2>"$TMP/serve.err" &
    pid=$!
    for _ in $(seq 1 200); do grep -q "listening on" "$TMP/serve.err" && break; sleep 0.1; done
    port=$(sed -n 's/.*listening on http:[/][/][^:]*:\([0-9]*\).*/\1/p' "$TMP/serve.err")
    if [[ -n "$port" ]]; then
      expect 1 "serve: port in use" -- serve --model "$M" --port "$port"
    else
      failed=$((failed + 1)); echo "FAIL: serve printed no port:"; cat "$TMP/serve.err"
    fi
    expect 1 "bench serve: a directory without a corpus" -- bench serve --model "$M" --data "$TMP" --concurrency 1
    kill -TERM "$pid"; wait "$pid"; rc=$?
    if [[ $rc -eq 0 ]] && grep -q "SIGTERM, draining: requests taken 0" "$TMP/serve.err" && grep -q '"completed":0' "$TMP/serve.err"; then
      passed=$((passed + 1))
    else
      failed=$((failed + 1)); echo "FAIL: serve did not stop cleanly on SIGTERM (exit $rc):"; cat "$TMP/serve.err"
    fi
  fi
fi
if [[ " ${commands[*]} " == *" train "* ]]; then
  expect 2 "train: missing --data/--out" -- train --steps 3
  expect 2 "train: unknown flag" -- train --data x --out y --warp-speed
  expect 1 "train: data directory without a corpus" -- train --data "$TMP" --out "$TMP/run"
  expect 1 "train: bad mixer" -- train --data "$TMP" --out "$TMP/run" --mixer lstm
  expect 2 "train: scan chunk 0" -- train --data "$TMP" --out "$TMP/run" --scan-chunk 0
  expect 1 "train: negative peak" -- train --data "$TMP" --out "$TMP/run" --peak-tflops -1
  expect 2 "train: --nproc 0" -- train --data "$TMP" --out "$TMP/run" --nproc 0
  expect 1 "train: unknown --dist-backend" -- train --data "$TMP" --out "$TMP/run" --nproc 2 --dist-backend mpi
  expect 1 "train: nccl on the cpu" -- train --data "$TMP" --out "$TMP/run" --nproc 2 --device cpu --dist-backend nccl
  expect 1 "train: zero --dist-timeout" -- train --data "$TMP" --out "$TMP/run" --nproc 2 --dist-timeout 0
  expect 1 "train: bad --bucket-mb without --nproc" -- train --data "$TMP" --out "$TMP/run" --bucket-mb -1
  RANK=0 WORLD_SIZE=2 expect 1 "train: a partial job environment" -- train --data "$TMP" --out "$TMP/run"
  RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
    expect 1 "train: RANK out of range" -- train --data "$TMP" --out "$TMP/run"
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
    expect 1 "train: --nproc inside a job" -- train --data "$TMP" --out "$TMP/run" --nproc 2
fi
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
