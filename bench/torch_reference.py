#!/usr/bin/env python3
"""PyTorch reference for the Oryx decode step (DESIGN.md §2), the baseline of issue 7's GPU benchmarks.

It measures what a PyTorch user would get from the same model: one decode token per sequence through every
layer (RMSNorm, fused input projection, causal depthwise conv window update, RoPE, KV cache append, fp32
recurrent state update, attention over the cache with F.scaled_dot_product_attention or the recurrent read,
gated per-head RMSNorm, output projection, SwiGLU MLP, final norm, LM head), bf16 weights and activations.
  attention mode: KV append + state update + attention read (the model keeps both states current).
  linear mode:    KV append + state update + recurrent read (no attention read).
Implementations: eager; graph (the eager step captured once as a CUDA graph and replayed); compile
(torch.compile mode="max-autotune-no-cudagraphs"); compile-cg (torch.compile mode="reduce-overhead").
The KV cache is pre-filled with random values (no prefill is run); every timed step writes the token at
position `context` and reads context+1 cache entries. Times are CUDA-event medians over --steps steps.
Each (impl, batch, context, mode) is a fresh measurement; torch.compile recompiles (max-autotune re-tunes)
for each, reported as first_call_s, so split long sweeps over several calls (--out per call).
bytes_per_step counts what the step must move: every weight it reads once, the KV cache it reads (attention
mode) and writes, the recurrent and conv states it reads and writes, the logits it writes.
--check compares with the C++ engine: fp32 CPU greedy tokens (`oryx generate`) and the perplexity of one
window of a text file (`oryx eval ppl --text`), in both modes; the engine also tokenises the prompt.

  python3 bench/torch_reference.py --config 1.4b --contexts 1024,8192,32768 --batches 1,4 \
      --modes attention,linear --impl eager,graph,compile,compile-cg --out results/torch.jsonl
  python3 bench/torch_reference.py --model models/default --contexts 1024 --batches 1
  python3 bench/torch_reference.py --check models/default [--oryx build/bin/oryx]   # CPU, fp32
  python3 bench/torch_reference.py --device cpu --config tiny --contexts 64 --batches 1 --steps 3  # smoke
"""
import argparse, itertools, json, math, os, statistics, subprocess, sys, time, warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {  # random-weight configs at the paper's scales; the rest comes from base_config()
    "tiny": dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, head_dim=32, mlp_hidden=384),
    "130m": dict(d_model=768, n_layers=24, n_heads=12, head_dim=64),
    "1.4b": dict(d_model=2048, n_layers=24, n_heads=16, head_dim=128),
}
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def base_config(preset, mixer, tie):
    c = dict(vocab_size=32000, conv_width=4, rope_theta=10000.0, norm_eps=1e-6, linear_mixer=mixer,
             conv_activation="identity" if mixer == "mamba2" else "silu", tie_embeddings=tie, bos_id=2, eos_id=3)
    c.update(PRESETS[preset])
    c.setdefault("mlp_hidden", int(round(8 * c["d_model"] / 3 / 64)) * 64)
    return c


def tensor_shapes(c):
    """Name -> shape, as engine/tensor_names.cc lists them."""
    V, D, H, dh, Fh, w = c["vocab_size"], c["d_model"], c["n_heads"], c["head_dim"], c["mlp_hidden"], c["conv_width"]
    HD = H * dh
    s = {"embed.weight": (V, D), "final_norm.weight": (D,)}
    if not c["tie_embeddings"]:
        s["lm_head.weight"] = (V, D)
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        s.update({p + "attn_norm.weight": (D,), p + "mlp_norm.weight": (D,), p + "mixer.o_proj.weight": (D, HD),
                  p + "mixer.conv.weight": (2 * HD, w), p + "mixer.conv.bias": (2 * HD,),
                  p + "mixer.gate_norm.weight": (dh,), p + "mixer.dt_bias": (H,), p + "mixer.A_log": (H,),
                  p + "mlp.gate.weight": (Fh, D), p + "mlp.up.weight": (Fh, D), p + "mlp.down.weight": (D, Fh)})
        for n in ("k_proj", "v_proj", "g_proj", "q_attn", "q_linear"):
            s[p + f"mixer.{n}.weight"] = (HD, D)
        if c["linear_mixer"] == "mamba2":
            s.update({p + "mixer.dt_proj.weight": (H, D), p + "mixer.D_skip": (H,)})
        else:
            s.update({p + "mixer.beta_proj.weight": (H, D), p + "mixer.alpha_proj.weight": (H, D)})
    return s


def random_tensors(c, device, seed=1):
    g, out = torch.Generator(device=device).manual_seed(seed), {}
    for name, shape in tensor_shapes(c).items():
        if name.endswith(("norm.weight", "D_skip")):
            out[name] = torch.ones(shape, device=device)
        elif name.endswith(("dt_bias", "conv.bias")):
            out[name] = torch.zeros(shape, device=device)
        elif name.endswith("A_log"):  # decay rates exp(A_log) in [1, 16]
            out[name] = torch.rand(shape, device=device, generator=g) * math.log(16)
        else:
            out[name] = torch.randn(shape, device=device, generator=g) / math.sqrt(shape[-1])
    return out


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    n = int.from_bytes(blob[:8], "little")
    if n <= 0 or 8 + n > len(blob):
        raise ValueError(f"{path}: bad safetensors header length {n}")
    header, base, out = json.loads(blob[8:8 + n].decode("utf-8")), 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {meta['dtype']}")
        (b, e), dt, count = meta["data_offsets"], DTYPES[meta["dtype"]], math.prod(meta["shape"])
        if base + e > len(blob) or e - b != count * dt.itemsize:
            raise ValueError(f"{path}: tensor {name}: data offsets {b}..{e} out of bounds or wrong size")
        out[name] = torch.frombuffer(blob, dtype=dt, count=count, offset=base + b).reshape(meta["shape"]).clone()
    return out


def load_checkpoint(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for fn in files:
        tensors.update(read_safetensors(os.path.join(model_dir, fn)))
    want = tensor_shapes(c)
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError(f"{model_dir}: missing tensor {name}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{model_dir}: tensor {name} has shape {list(tensors[name].shape)}, want {list(shape)}")
    if set(tensors) - set(want):
        raise ValueError(f"{model_dir}: unexpected tensors {sorted(set(tensors) - set(want))[:5]}")
    return c, tensors


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def l2norm(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def attn_query_scales(base, length):
    """The factors attention mode multiplies the queries of positions 0..length-1 by (config.json's
    attn_log_scale_base: max(1, ln(pos + 1) / ln(base)) in double, then float; 1 when base is 0 or absent)."""
    if not base:
        return torch.ones(length)
    pos = torch.arange(length, dtype=torch.float64)
    return torch.clamp(torch.log(pos + 1) / math.log(base), min=1.0).float()


def rope(x, cos, sin):  # x [B, H, dh], half-split pairing
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class OryxLayer(torch.nn.Module):
    def __init__(self, c, t, i, dtype):
        super().__init__()
        p, self.c = f"layers.{i}.mixer.", c
        sup = ["dt_proj"] if c["linear_mixer"] == "mamba2" else ["beta_proj", "alpha_proj"]
        # One fused input projection; rows [q_attn | k v g gates | q_linear]: attention mode reads the first
        # 4*HD+gates rows, linear mode the last, both contiguous slices.
        rows = [t[p + "q_attn.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"], t[p + "g_proj.weight"]]
        rows += [t[p + s + ".weight"] for s in sup] + [t[p + "q_linear.weight"]]
        mlp = f"layers.{i}.mlp."
        bufs = {"attn_norm": t[f"layers.{i}.attn_norm.weight"], "in_w": torch.cat(rows), "o_w": t[p + "o_proj.weight"],
                "conv_w": t[p + "conv.weight"], "conv_b": t[p + "conv.bias"], "gate_norm": t[p + "gate_norm.weight"],
                "mlp_norm": t[f"layers.{i}.mlp_norm.weight"], "mlp_down": t[mlp + "down.weight"],
                "mlp_in": torch.cat([t[mlp + "gate.weight"], t[mlp + "up.weight"]])}
        for k, v in bufs.items():
            self.register_buffer(k, v.to(dtype).contiguous())
        for k in ("dt_bias", "A_log", "D_skip"):  # small per-head parameters stay fp32
            if p + k in t:
                self.register_buffer(k, t[p + k].float().contiguous())

    def alloc(self, batch, length, dtype, device):
        c = self.c
        H, dh, HD = c["n_heads"], c["head_dim"], c["n_heads"] * c["head_dim"]
        # Registered buffers, so that torch.compile's CUDA graphs treat them as static inputs it may mutate.
        for name, shape, dt in (("k_cache", (batch, H, length, dh), dtype), ("v_cache", (batch, H, length, dh), dtype),
                                ("conv_state", (batch, 2 * HD, c["conv_width"] - 1), dtype),
                                ("S", (batch, H, dh, dh), torch.float32)):
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)

    def forward(self, x, pos: int, cos, sin, q_scale, attn: bool):
        c = self.c
        B, H, dh, eps = x.shape[0], c["n_heads"], c["head_dim"], c["norm_eps"]
        HD, ng = H * dh, (1 if c["linear_mixer"] == "mamba2" else 2) * H
        u = rms_norm(x, self.attn_norm, eps)
        if attn:
            qa, k, v, g, gates = F.linear(u, self.in_w[:4 * HD + ng]).split([HD, HD, HD, HD, ng], dim=-1)
        else:
            k, v, g, gates, ql = F.linear(u, self.in_w[HD:]).split([HD, HD, HD, ng, HD], dim=-1)
        # Causal depthwise conv over the last w inputs of (k, v): shift the window, then one dot per channel.
        window = torch.cat([self.conv_state, torch.cat([k, v], dim=-1).unsqueeze(-1)], dim=-1)
        self.conv_state.copy_(window[..., 1:])
        kv = (window.float() * self.conv_w.float()).sum(-1) + self.conv_b.float()
        if c["conv_activation"] == "silu":
            kv = F.silu(kv)
        k, v = kv.view(B, 2, H, dh).unbind(1)  # fp32 [B, H, dh]
        gates = gates.float()
        # Recurrent state update (fp32), every token.
        if c["linear_mixer"] == "mamba2":
            dt = F.softplus(gates + self.dt_bias)
            a = torch.exp(-dt * torch.exp(self.A_log))
            self.S.mul_(a[..., None, None]).add_((dt[..., None] * k).unsqueeze(-1) * v.unsqueeze(-2))
        else:
            beta = torch.sigmoid(gates[:, :H])
            alpha = torch.exp(-torch.exp(self.A_log) * F.softplus(gates[:, H:] + self.dt_bias))
            kn = l2norm(k)
            kS = torch.einsum("bhk,bhkv->bhv", kn, self.S)  # kn^T S
            delta = beta[..., None] * (v - alpha[..., None] * kS)
            self.S.mul_(alpha[..., None, None]).add_(kn.unsqueeze(-1) * delta.unsqueeze(-2))
        # KV cache append: rotated keys, every token.
        self.k_cache[:, :, pos] = rope(k, cos, sin).to(self.k_cache.dtype)
        self.v_cache[:, :, pos] = v.to(self.v_cache.dtype)
        if attn:
            q = (rope(qa.view(B, H, dh), cos, sin).float() * q_scale).to(qa.dtype).unsqueeze(2)
            o = F.scaled_dot_product_attention(q, self.k_cache[:, :, :pos + 1], self.v_cache[:, :, :pos + 1])
            o = o.squeeze(2).float()
        else:
            q = ql.float().view(B, H, dh)
            if c["linear_mixer"] == "mamba2":
                o = torch.einsum("bhkv,bhk->bhv", self.S, q) + self.D_skip[:, None] * v
            else:
                o = torch.einsum("bhkv,bhk->bhv", self.S, l2norm(q) / math.sqrt(dh))
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * self.gate_norm.float()
        y = (o * F.silu(g.float().view(B, H, dh))).to(x.dtype).view(B, HD)
        x = x + F.linear(y, self.o_w)
        gate, up = F.linear(rms_norm(x, self.mlp_norm, eps), self.mlp_in).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.mlp_down)


class OryxDecoder(torch.nn.Module):
    def __init__(self, c, t, dtype, device):
        super().__init__()
        self.c, self.dtype, self.device = c, dtype, device
        t = {k: v.to(device) for k, v in t.items()}
        self.register_buffer("embed", t["embed.weight"].to(dtype).contiguous())
        self.register_buffer("final_norm", t["final_norm.weight"].to(dtype))
        if not c["tie_embeddings"]:
            self.register_buffer("lm_head", t["lm_head.weight"].to(dtype).contiguous())
        self.layers = torch.nn.ModuleList(OryxLayer(c, t, i, dtype) for i in range(c["n_layers"]))

    def alloc(self, batch, length):
        for layer in self.layers:
            layer.alloc(batch, length, self.dtype, self.device)
        half = self.c["head_dim"] // 2
        freq = self.c["rope_theta"] ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.c["head_dim"])
        if self.c["rope_theta"] <= 0:
            freq = torch.zeros(half, dtype=torch.float64)  # no RoPE: cos 1, sin 0
        ang = (torch.arange(length, dtype=torch.float64)[:, None] * freq).float()
        self.register_buffer("cos", ang.cos().to(self.device), persistent=False)
        self.register_buffer("sin", ang.sin().to(self.device), persistent=False)
        q_scale = attn_query_scales(self.c.get("attn_log_scale_base", 0), length)
        self.register_buffer("q_scale", q_scale.to(self.device), persistent=False)

    def head(self):
        return self.embed if self.c["tie_embeddings"] else self.lm_head

    def forward(self, tokens, pos: int, attn: bool):
        x = F.embedding(tokens, self.embed)
        cos, sin, q_scale = self.cos[pos], self.sin[pos], self.q_scale[pos]
        for layer in self.layers:
            x = layer(x, pos, cos, sin, q_scale, attn)
        return F.linear(rms_norm(x, self.final_norm, self.c["norm_eps"]), self.head())


def step_bytes(m, batch, context, attn):
    """Bytes one decode step must move: weights read once, KV read (attention) and written, states, logits."""
    c, es = m.c, m.embed.element_size()
    H, dh, HD, V = c["n_heads"], c["head_dim"], c["n_heads"] * c["head_dim"], c["vocab_size"]
    ng = (1 if c["linear_mixer"] == "mamba2" else 2) * H
    weights = batch * c["d_model"] * es + m.final_norm.nbytes + m.head().nbytes  # embedding rows, norm, head
    skip = {"in_w", "k_cache", "v_cache", "conv_state", "S"} | ({"D_skip"} if attn else set())
    for layer in m.layers:  # all its weights but the unused q projection (and D_skip in attention mode)
        weights += sum(b.nbytes for n, b in layer.named_buffers() if n not in skip)
        weights += (4 * HD + ng) * c["d_model"] * es
    L = c["n_layers"]
    kv = L * batch * 2 * HD * es * ((context + 1) if attn else 0) + L * batch * 2 * HD * es
    state = L * batch * (2 * H * dh * dh * 4 + 2 * 2 * HD * (c["conv_width"] - 1) * es)
    return {"bytes_per_step": weights + kv + state + batch * V * es, "weight_bytes": weights, "kv_bytes": kv,
            "state_bytes": state}


def make_impl(name, model, dev):
    if name == "eager":
        return lambda tok, pos, attn: model(tok, pos, attn)
    if name in ("compile", "compile-cg"):
        for k in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, k):
                setattr(torch._dynamo.config, k, 256)
        if name == "compile":
            return torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False)
        if dev.type != "cuda":
            raise RuntimeError("compile-cg (reduce-overhead CUDA graphs) needs CUDA")
        fn = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def run(tok, pos, attn):
            torch.compiler.cudagraph_mark_step_begin()
            return fn(tok, pos, attn)
        return run
    if name == "graph":
        if dev.type != "cuda":
            raise RuntimeError("graph (eager step captured as a CUDA graph) needs CUDA")
        graphs = {}

        def run(tok, pos, attn):  # one graph per (pos, attn, batch); tok's values are copied into its input
            key = (pos, attn, tok.shape[0])
            if key not in graphs:
                static = tok.clone()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        model(static, pos, attn)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = model(static, pos, attn)
                graphs[key] = (g, static, out)
            g, static, out = graphs[key]
            static.copy_(tok)
            g.replay()
            return out
        return run
    raise ValueError(name)


def time_steps(fn, tok, pos, attn, dev, warmup, steps):
    t0 = time.perf_counter()
    fn(tok, pos, attn)  # first call: compiles / captures
    if dev.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        fn(tok, pos, attn)
    times = []
    if dev.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        torch.cuda.synchronize()
        for a, b in ev:
            a.record()
            fn(tok, pos, attn)
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in ev]
    else:
        for _ in range(steps):
            t = time.perf_counter()
            fn(tok, pos, attn)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), first_s


def git_rev():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def write_atomic(path, lines):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in lines)
    os.replace(tmp, path)


@torch.no_grad()
def measure(model, impls, impl, batch, ctx, attn, args):
    dev, r = model.device, step_bytes(model, batch, ctx, attn)
    model.alloc(batch, ctx + 1)
    g = torch.Generator(device=dev).manual_seed(ctx)
    for layer in model.layers:  # a filled cache and live states instead of a prefill
        for t in (layer.k_cache, layer.v_cache, layer.conv_state):
            t.normal_(generator=g)
        layer.S.normal_(generator=g).mul_(0.1)
    tok = torch.randint(4, model.c["vocab_size"], (batch,), device=dev, generator=g)
    if impl not in impls:
        impls[impl] = make_impl(impl, model, dev)
    skips = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
    ms, first_s = time_steps(impls[impl], tok, ctx, attn, dev, args.warmup, args.steps)
    r.update(ms_per_step=ms, tokens_per_s=batch * 1e3 / ms, first_call_s=first_s,
             achieved_gb_per_s=r["bytes_per_step"] / ms / 1e6)
    if impl == "compile-cg":  # non-zero: inductor ran (part of) the step without CUDA graphs
        r["cudagraph_skips"] = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]) - skips
    return r


def bench(args):
    dev = torch.device(args.device)
    if args.model:
        c, tensors = load_checkpoint(args.model)
        cname = os.path.basename(os.path.normpath(args.model))
    else:
        c, tensors, cname = base_config(args.config, args.mixer, args.tie), None, args.config
        c.update({k: v for k, v in (("vocab_size", args.vocab), ("mlp_hidden", args.mlp_hidden)) if v})
    with torch.no_grad():
        if tensors is None:
            tensors = random_tensors(c, dev)
        model = OryxDecoder(c, tensors, torch.bfloat16 if args.dtype == "bf16" else torch.float32, dev)
    del tensors
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    common = {"bench": "torch_decode", "config": cname, "model_config": c, "device": gpu, "dtype": args.dtype,
              "torch_version": torch.__version__, "git_rev": git_rev(), "steps": args.steps}
    results, impls = [], {}
    for impl, batch, ctx, mode in itertools.product(args.impl, args.batches, args.contexts, args.modes):
        r = dict(common, impl=impl, mode=mode, context=ctx, batch=batch, linear_mixer=c["linear_mixer"])
        try:
            r.update(measure(model, impls, impl, batch, ctx, mode == "attention", args))
        except Exception as e:  # one failure is reported in its line and does not end the run
            r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            impls.pop(impl, None)
        finally:
            if impl == "graph":  # its graphs hold this measurement's buffers
                impls.pop(impl, None)
            for layer in model.layers:
                layer.k_cache = layer.v_cache = layer.S = layer.conv_state = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        log(f"{impl:10s} {mode:9s} ctx {ctx:7d} batch {batch:3d}: " +
            (f"{r['ms_per_step']:.3f} ms/step" if "error" not in r else r["error"]))
        results.append(r)
        if args.out:
            write_atomic(args.out, results)
        else:
            print(json.dumps(r, sort_keys=True), flush=True)
    failed = sum("error" in r for r in results)
    log(f"{len(results)} measurements, {failed} failed (see their 'error' fields)")
    return 0


def greedy(model, ids, new_tokens, attn, eos):
    model.alloc(1, len(ids) + new_tokens)
    out, logits = [], None
    with torch.no_grad():
        for pos, t in enumerate(ids):
            logits = model(torch.tensor([t]), pos, attn)[0].float()
        top5 = torch.topk(logits, 5)
        pos = len(ids)
        while len(out) < new_tokens:
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == eos:
                break
            logits = model(torch.tensor([nxt]), pos, attn)[0].float()
            pos += 1
    return out, [(int(i), round(float(v), 4)) for v, i in zip(top5.values, top5.indices)]


def run_text(*cmd):
    return subprocess.run([str(x) for x in cmd], capture_output=True, text=True, check=True).stdout


def check(args):
    c, tensors = load_checkpoint(args.check)
    model = OryxDecoder(c, tensors, torch.float32, torch.device("cpu"))
    oryx = args.oryx or os.path.join(REPO, "build", "bin", "oryx")
    if not (os.path.isfile(oryx) and os.access(oryx, os.X_OK)):  # our side only, on --prompt-ids
        log(f"{oryx}: missing; engine comparison SKIPPED (prompt: BOS + --prompt-ids)")
        for mode in ("attention", "linear"):
            mine, top5 = greedy(model, [c["bos_id"]] + args.prompt_ids, args.max_tokens, mode == "attention", c["eos_id"])
            print(json.dumps({"bench": "torch_check", "mode": mode, "prompt_ids": [c["bos_id"]] + args.prompt_ids,
                              "last_prompt_top5": top5, "torch_tokens": mine, "engine": "skipped"}))
        return 0
    newest = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%ct", "--", "engine", "kernels", "cli"],
                            capture_output=True, text=True).stdout.strip()
    if newest and os.path.getmtime(oryx) < int(newest):
        log(f"warning: {oryx} is older than the last commit to engine/, kernels/ or cli/; it may be stale")
    tokenizer = os.path.join(args.check, "tokenizer.model")
    ids = [c["bos_id"]] + [int(x) for x in run_text(oryx, "tokenizer", "encode", "--model", tokenizer,
                                                      "--text", args.prompt).split()]
    ok = True
    for mode in ("attention", "linear"):
        mine, top5 = greedy(model, ids, args.max_tokens, mode == "attention", c["eos_id"])
        theirs = json.loads(run_text(oryx, "generate", "--model", args.check, "--prompt", args.prompt, "--max-tokens",
                                     args.max_tokens, "--policy", mode, "--json", "--threads", 1))["tokens"]
        n = min(len(mine), len(theirs))
        agree, same = next((i for i in range(n) if mine[i] != theirs[i]), n), mine == theirs
        ok &= same
        print(json.dumps({"bench": "torch_check", "mode": mode, "prompt_ids": ids, "last_prompt_top5": top5,
                          "torch_tokens": mine, "engine_tokens": theirs, "agree_prefix": agree, "match": same}))
    # Perplexity of the first window of --check-text (BOS + its tokens, as `oryx eval ppl --text` builds it).
    T = args.check_len
    enc = run_text(oryx, "tokenizer", "encode", "--model", tokenizer, "--text-file", args.check_text).split()
    window = ([c["bos_id"]] + [int(x) for x in enc])[:T + 1]
    eng = json.loads(run_text(oryx, "eval", "ppl", "--model", args.check, "--text", args.check_text, "--seq-len", T,
                              "--sequences", 1, "--schedules", "attention,linear", "--json", "--threads", 1))
    for res in eng["results"]:
        model.alloc(1, T)
        nll = 0.0
        with torch.no_grad():
            for pos in range(T):
                logits = model(torch.tensor([window[pos]]), pos, res["schedule"] == "attention")[0].float()
                nll -= float(torch.log_softmax(logits, -1)[window[pos + 1]])
        ppl = math.exp(nll / T)
        rel = abs(ppl / res["ppl"] - 1)
        ok &= rel < 0.005
        print(json.dumps({"bench": "torch_check", "mode": res["schedule"], "text": args.check_text, "seq_len": T,
                          "torch_ppl": ppl, "engine_ppl": res["ppl"], "rel_diff": rel, "match": rel < 0.005}))
    log("check: " + ("greedy tokens identical and ppl within 0.5% in both modes" if ok else "MISMATCH"))
    return 0 if ok else 3


def ints(s):
    return [int(x) for x in s.split(",") if x]


def names(s):
    return [x for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(PRESETS), default="130m", help="random-weight config")
    ap.add_argument("--mixer", choices=["mamba2", "gdn"], default="mamba2", help="linear mixer of --config")
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the embedding (--config)")
    ap.add_argument("--vocab", type=int, help="vocabulary of --config [default: 32000; tiny 512]")
    ap.add_argument("--mlp-hidden", type=int, help="SwiGLU hidden of --config [default: 8/3 d_model, multiple of 64]")
    ap.add_argument("--model", help="checkpoint directory to benchmark instead of --config")
    ap.add_argument("--contexts", type=ints, default=[1024, 8192, 32768])
    ap.add_argument("--batches", type=ints, default=[1, 4])
    ap.add_argument("--modes", type=names, default=["attention", "linear"])
    ap.add_argument("--impl", type=names, default=["eager", "graph", "compile", "compile-cg"])
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="write the JSON lines here (atomically, rewritten after each measurement)")
    ap.add_argument("--check", metavar="MODEL_DIR", help="fp32 CPU greedy decode vs the C++ engine, both modes")
    ap.add_argument("--oryx", help="engine binary for --check [default: build/bin/oryx of this repository]")
    ap.add_argument("--prompt", default="static int")
    ap.add_argument("--prompt-ids", type=ints, default=[542, 412], help="--check's prompt without an engine binary")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check-text", default=os.path.join(REPO, "engine", "tensor_names.cc"),
                    help="text file whose first window's perplexity --check compares")
    ap.add_argument("--check-len", type=int, default=256, help="tokens of that window")
    args = ap.parse_args()
    bad = [m for m in args.modes if m not in ("attention", "linear")]
    bad += [i for i in args.impl if i not in ("eager", "graph", "compile", "compile-cg")]
    if bad:
        ap.error(f"unknown mode or impl: {', '.join(bad)}")
    if min(args.contexts + args.batches, default=0) < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("contexts, batches and steps must be positive")
    try:
        torch.device(args.device)
    except RuntimeError as e:
        ap.error(str(e))
    try:
        return check(args) if args.check else bench(args)
    except (OSError, ValueError, KeyError, subprocess.CalledProcessError) as e:
        detail = f" ({e.stderr.strip()[:300]})" if isinstance(e, subprocess.CalledProcessError) else ""
        log(f"error: {type(e).__name__}: {e}{detail}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
