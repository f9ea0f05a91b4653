# Fits variants of the time cost law (router/cost_model.cc, replicated) to the calibration rows of `oryx bench
# cost --json` files and reports the errors in sample and on the held-out rows (short spans, prefill
# segments): mean / max, in percent. Needs torch.
#   python3 fit_variants.py MODEL_CONFIG.json FILE1.jsonl+FILE2.jsonl [VARIANTS [ONE_VARIANT_TO_LIST]]
# A variant is a set of letters: S drops the small-product FLOP rate, A adds a small product's fixed cost,
# B a multi-token short span's, C a per-row cost of short spans of more than 6 rows, E a per-row cost of
# every short span, G a per-sequence attention cost of short spans, P drops the GEMM regime. '' is the law
# before 2026-12-05 (later); SABE is the law after.
import json, sys, itertools, torch
torch.set_default_dtype(torch.float64)
cfg = json.load(open(sys.argv[1]))
D, H, dh, F, L, V = cfg['d_model'], cfg['n_heads'], cfg['head_dim'], cfg['mlp_hidden'], cfg['n_layers'], cfg['vocab_size']
HD = H * dh; gates = H
def work(b, t, ctx, att, al):
    tokens = b * t; keys = ctx + 0.5 * (t + 1)
    lp = (4 * HD + gates + (HD if att else 0)) * D + HD * D + 3 * F * D
    rows = b * (t if al else 1)
    dense = 2 * (tokens * L * lp + rows * V * D)
    kv = b * L * (ctx + t) * 2 * HD * 4 if att else 0.0
    af = tokens * L * keys * 4 * HD if att else 0.0
    rec = tokens * L * H * dh * dh * 6
    return dense, kv, af, rec
def feats(s, variant):
    b, t, ctx, att, al = s
    dense, kv, af, rec = work(*s)
    m = b * t; long = t > 64
    f = [1.0, dense if m == 1 else 0, dense if 2 <= m <= 6 else 0, 1.0 if m > 6 else 0, dense if m > 6 else 0, float(b),
         kv if not long else 0, af, rec, 1.0 if long else 0, kv if long else 0]
    if 'S' in variant: f[2] = 0.0  # no small-product flop rate
    if 'P' in variant: f[3] = 0.0; f[4] = 0.0  # no GEMM regime for short spans
    if 'A' in variant: f.append(1.0 if 2 <= m <= 6 else 0)             # a small product's weight read
    if 'B' in variant: f.append(1.0 if (t > 1 and not long) else 0)    # a multi-token short span
    if 'C' in variant: f.append(float(m) if (m > 6 and not long) else 0)  # rows of a short span
    if 'E' in variant: f.append(float(m) if not long else 0)  # rows of any short span
    if 'G' in variant: f.append(float(b*L) if (att and not long) else 0)  # attention launches/splits per sequence
    return f
def fit(rows, ys):
    X = torch.tensor(rows) / torch.tensor(ys)[:, None]; y = torch.ones(len(ys))
    sc = X.abs().max(0).values; sc[sc == 0] = 1; X = X / sc
    best = (1e300, None); k = X.shape[1]
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        A = X[:, cols]; sol = torch.linalg.lstsq(A, y[:, None], driver='gelsd').solution[:, 0]
        if (sol < 0).any(): continue
        e = ((A @ sol - y) ** 2).sum().item()
        if e < best[0]: c = torch.zeros(k); c[cols] = sol; best = (e, c / sc)
    return best[1]
def load(path):
    cal, ho = [], []
    for l in open(path):
        r = json.loads(l)
        if 'mode' not in r: continue
        s = (r['batch'], r['tokens'], r['context'], r['mode'] == 'attention', bool(r.get('all_logits', r['tokens'] <= 8)))
        (cal if r.get('calibration') else ho).append((s, r['measured_ms']))
    return cal, ho
def mm(e): return f"{100*sum(e)/len(e):5.1f}/{100*max(e):5.1f}"
variants = sys.argv[3].split(',') if len(sys.argv) > 3 else ['', 'A', 'B', 'C', 'AB', 'AC', 'BC', 'ABC', 'E', 'AE', 'BE', 'ABE', 'G', 'ABCG']
paths = [p for p in sys.argv[2].split('+')]
for v in variants:
    out = []
    for p in paths:
        cal, ho = load(p)
        c = fit([feats(s, v) for s, _ in cal], [m for _, m in cal])
        def err(rows): return [abs((torch.tensor(feats(s, v)) @ c).item() / m - 1) for s, m in rows]
        ec, eh = err(cal), err(ho)
        sh = [e for (s, _), e in zip(ho, eh) if s[1] <= 64]; lo = [e for (s, _), e in zip(ho, eh) if s[1] > 64]
        out.append(f"in {mm(ec)} | short {mm(sh)} | segs {mm(lo)}")
    print(f"{v or '-':5} " + "  ||  ".join(out))
if len(sys.argv) > 4:
    v = sys.argv[4]; cal, ho = load(paths[0])
    c = fit([feats(s, v) for s, _ in cal], [m for _, m in cal])
    print([f"{x:.3g}" for x in c.tolist()])
    for tag, rows in (('cal', cal), ('HO', ho)):
        for s, m in rows:
            if s[1] > 64: continue
            p = (torch.tensor(feats(s, v)) @ c).item()
            print(f"{tag:3} {'att' if s[3] else 'lin'} b{s[0]:<3} t{s[1]:<3} ctx{s[2]:<6} meas {m:6.3f} pred {p:6.3f} err {100*(p/m-1):6.1f}%")
