#!/usr/bin/env python3
"""A multi-turn chat workload against a running `oryx serve`: each conversation sends its turns one after the
other, every prompt the whole conversation so far (the earlier prompts and replies, as text) plus a new user
message; conversations run concurrently. Prints one JSON object: prompt tokens sent, those the server's prefix
cache restored (usage.prompt_tokens_details.cached_tokens), and time to first token by turn.

  bench/multi_turn.py --url http://127.0.0.1:8080 [--conversations 4] [--turns 6] [--max-tokens 32]

Standard library only, so that it runs wherever Python does (the GPU machine included)."""
import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
import urllib.parse


def complete(url, prompt, max_tokens, policy, api_key=None):
    """One streaming completion: (reply text, usage, seconds to the first chunk)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "policy": policy})
    start = time.monotonic()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    conn.request("POST", "/v1/completions", body, headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
    text, usage, ttft = [], None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if ttft is None:
            ttft = time.monotonic() - start
        event = json.loads(line[6:])
        text.append(event["choices"][0]["text"])
        usage = event.get("usage", usage)
    conn.close()
    return "".join(text), usage, ttft


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--policy", default="attention")
    p.add_argument("--api-key", default=os.environ.get("ORYX_API_KEY"), help="for a server started with --api-key")
    p.add_argument("--messages", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                      "tokenizer_corpus.txt"),
                   help="a text file whose lines are the user messages")
    p.add_argument("--words", type=int, default=120, help="words per user message")
    args = p.parse_args()
    words = open(args.messages, encoding="utf-8").read().split()
    if not words:
        sys.exit(f"multi_turn: {args.messages} holds no words")

    turns = [[] for _ in range(args.turns)]  # per turn index: (prompt_tokens, cached_tokens, ttft_s)
    errors = []

    def conversation(c):
        history = "A conversation between a user and an assistant."
        for t in range(args.turns):
            at = ((c * args.turns + t) * args.words) % max(1, len(words) - args.words)
            history += "\n\nUser: " + " ".join(words[at:at + args.words]) + "\nAssistant:"
            try:
                reply, usage, ttft = complete(args.url, history, args.max_tokens, args.policy, args.api_key)
            except Exception as e:  # a failed request ends its conversation, and the run fails
                errors.append(f"conversation {c}, turn {t}: {e}")
                return
            turns[t].append((usage["prompt_tokens"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                             ttft))
            history += reply

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.conversations)]
    start = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - start
    if errors:
        sys.exit("multi_turn: " + "; ".join(errors))
    prompt = sum(x[0] for turn in turns for x in turn)
    cached = sum(x[1] for turn in turns for x in turn)
    print(json.dumps({
        "bench": "multi_turn", "conversations": args.conversations, "turns": args.turns,
        "max_tokens": args.max_tokens, "policy": args.policy, "wall_s": wall,
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens_saved": cached / prompt if prompt else 0.0,
        "by_turn": [{"turn": t + 1, "prompt_tokens": sum(x[0] for x in turn), "cached_tokens": sum(x[1] for x in turn),
                     "ttft_ms_p50": 1e3 * statistics.median(x[2] for x in turn)} for t, turn in enumerate(turns)],
    }))


if __name__ == "__main__":
    main()
