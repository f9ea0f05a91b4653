"""Copies a model, scaling attention-mode query rows of the named heads: layer.head=factor,...

Scaling head h's rows of layers.L.mixer.q_attn.weight by F multiplies that head's attention logits by F
exactly (q_attn is used by attention mode only; RoPE is a rotation, so it commutes with the scale).
"""
import json, shutil, struct, sys, pathlib, torch

src, dst, spec = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
cfg = json.loads((src / "config.json").read_text())
dh = cfg["head_dim"]
want = {}
for item in spec.split(","):
    lh, f = item.split("=")
    layer, head = map(int, lh.split("."))
    want.setdefault(f"layers.{layer}.mixer.q_attn.weight", []).append((head, float(f)))
if dst.exists(): shutil.rmtree(dst)
shutil.copytree(src, dst)
for shard in sorted(dst.glob("*.safetensors")):
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for name, heads in want.items():
        if name not in header: continue
        meta = header[name]
        assert meta["dtype"] == "BF16", meta
        a, b = meta["data_offsets"]
        base = 8 + n
        t = torch.frombuffer(raw[base + a:base + b], dtype=torch.bfloat16).reshape(meta["shape"]).clone()
        for head, f in heads:
            t[head * dh:(head + 1) * dh] = (t[head * dh:(head + 1) * dh].float() * f).to(torch.bfloat16)
        out = torch.frombuffer(raw, dtype=torch.uint8, offset=base + a, count=b - a)  # writes into raw
        out.copy_(t.contiguous().view(-1).view(torch.uint8))
        print(f"{shard.name}: {name} heads {heads}")
    shard.write_bytes(bytes(raw))
