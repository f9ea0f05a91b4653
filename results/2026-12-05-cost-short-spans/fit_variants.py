# Fits variants of the time cost law (router/cost_model.cc, replicated) to the calibration rows of `oryx bench
# cost --json` files and reports the errors in sample and on the held-out rows (short spans, prefill
# segments): mean / max, in percent. Needs torch.
#   python3 fit_variants.py MODEL_CONFIG.json FILE1.jsonl+FILE2.jsonl [VARIANTS [ONE_VARIANT_TO_LIST]]
# A variant is a set of letters: S drops the small-product FLOP rate, A adds a small product's fixed cost,
# B a multi-token short span's, C a per-row cost of short spans of more than 6 rows, E a per-row cost of
# every short span, G a per-sequence attention cost of short spans, P drops the GEMM regime. '' is the law
# before 2026-12-05 (later); SABE is the law after.
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import torch
from cost_law import base_features, fit, work_of  # the law's work terms and fit, shared with ../2026-12-05-cost-long-spans
cfg = json.load(open(sys.argv[1]))
work = work_of(cfg)
def feats(s, variant):
    b, t, att = s[0], s[1], s[3]
    m, long = b * t, t > 64
    f = base_features(work, s)
    if 'S' in variant: f[2] = 0.0  # no small-product flop rate
    if 'P' in variant: f[3] = 0.0; f[4] = 0.0  # no GEMM regime for short spans
    if 'A' in variant: f.append(1.0 if 2 <= m <= 6 else 0)             # a small product's weight read
    if 'B' in variant: f.append(1.0 if (t > 1 and not long) else 0)    # a multi-token short span
    if 'C' in variant: f.append(float(m) if (m > 6 and not long) else 0)  # rows of a short span
    if 'E' in variant: f.append(float(m) if not long else 0)  # rows of any short span
    if 'G' in variant: f.append(float(b * cfg['n_layers']) if (att and not long) else 0)  # attention launches/splits per sequence
    return f
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
