#!/usr/bin/env python3
"""Summarises `oryx bench decode --json` files side by side: one line per (file, mode, batch) step and per
speculative round. Used to compare weight formats (--weights bf16 / fp8) measured in one device call.

    bench/summarize_decode_ab.py decode-bf16-1.jsonl decode-fp8-1.jsonl ...
"""
import json
import os
import sys


def main(paths):
    for path in paths:
        tag = os.path.basename(path).removesuffix(".jsonl")
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "decode_ms_per_step" in r and r.get("next_token") == "device":
                    print(f"{tag:16} {r['mode']:9} batch {r['batch']:2}  {r['decode_ms_per_step']:7.3f} ms/step"
                          f"  roofline {r['roofline_fraction']:.2f}")
                elif "speedup_over_attention" in r:
                    where = "device" if r.get("verify_ms", 0) == 0 else "host"
                    print(f"{tag:16} round k={r['k']} batch {r['batch']:2} ({where})  {r['round_ms']:7.3f} ms"
                          f"  verify {r.get('verify_ms', 0):6.3f} ms  x{r['speedup_over_attention']:.2f} over attention")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
