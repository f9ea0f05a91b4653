# Fits the cost law (router/cost_model.cc, replicated) to measured spans by non-negative least squares over
# every subset of terms, with and without the long-span terms, and reports the leave-one-out and in-sample
# errors. Usage: python3 loo_fit.py MODEL_CONFIG.json BENCH_COST.jsonl (needs torch).
import json, torch, sys
torch.set_default_dtype(torch.float64)
cfg = json.load(open(sys.argv[1]))
D, H, dh, F, L, V = cfg['d_model'], cfg['n_heads'], cfg['head_dim'], cfg['mlp_hidden'], cfg['n_layers'], cfg['vocab_size']
HD = H * dh; gates = H
def work(b, t, ctx, att, all_logits):
    tokens = b * t; keys = ctx + 0.5 * (t + 1)
    lp = (4 * HD + gates + (HD if att else 0)) * D + HD * D + 3 * F * D
    rows = b * (t if all_logits else 1)
    dense = 2 * (tokens * L * lp + rows * V * D)
    kv = b * L * (ctx + t) * 2 * HD * 4 if att else 0.0
    af = tokens * L * keys * 4 * HD if att else 0.0
    rec = tokens * L * H * dh * dh * 6
    return dense, kv, af, rec
def feats(s, new):
    b, t, ctx, att, al = s
    dense, kv, af, rec = work(*s)
    m = b * t; long = t > 64
    f = [1.0, dense if m == 1 else 0, dense if 2 <= m <= 6 else 0, 1.0 if m > 6 else 0, dense if m > 6 else 0, float(b),
         kv if not (new and long) else 0, af, rec]
    if new: f += [1.0 if long else 0, kv if long else 0]
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
pts = []
for l in open(sys.argv[2]):
    r = json.loads(l)
    if r.get('bench') != 'cost' or 'mode' not in r: continue
    s = (r['batch'], r['tokens'], r['context'], r['mode'] == 'attention', r['tokens'] <= 8)
    pts.append((s, r['measured_ms'], r['predicted_ms']))
print('shipped fit (54 calibration shapes) on these 24:', sum(abs(p/m-1) for _, m, p in pts)/len(pts))
for new in (False, True):
    errs = []
    for i in range(len(pts)):
        tr = [p for j, p in enumerate(pts) if j != i]
        c = fit([feats(s, new) for s, _, _ in tr], [m for _, m, _ in tr])
        s, m, _ = pts[i]; errs.append(abs((torch.tensor(feats(s, new)) @ c).item() / m - 1))
    long = [e for (s, _, _), e in zip(pts, errs) if s[1] > 64]; short = [e for (s, _, _), e in zip(pts, errs) if s[1] <= 64]
    print('new terms' if new else 'old terms', 'leave-one-out mean', round(sum(errs)/len(errs), 3), 'long', round(sum(long)/len(long), 3), 'short', round(sum(short)/len(short), 3), 'max', round(max(errs), 3))
c = fit([feats(s, True) for s, _, _ in pts], [m for _, m, _ in pts])
names = ["fixed","gemv","small","pack","gemm","seq","kv","attn","rec","long_fixed","long_kv"]
print({n: float(v) for n, v in zip(names, c)})
c0 = fit([feats(s, False) for s, _, _ in pts], [m for _, m, _ in pts])
print({n: float(v) for n, v in zip(names, c0)})
for new, cc in ((False, c0), (True, c)):
    e = [abs((torch.tensor(feats(s, new)) @ cc).item() / m - 1) for s, m, _ in pts]
    lo = [x for (s,_,_), x in zip(pts, e) if s[1] > 64]
    print('in-sample', new, 'mean', round(sum(e)/len(e),3), 'long mean', round(sum(lo)/len(lo),3), 'long max', round(max(lo),3))
