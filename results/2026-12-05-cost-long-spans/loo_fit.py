# Fits the cost law (router/cost_model.cc, replicated) to measured spans by non-negative least squares over
# every subset of terms, with and without the long-span terms, and reports the leave-one-out and in-sample
# errors. Usage: python3 loo_fit.py MODEL_CONFIG.json BENCH_COST.jsonl (needs torch).
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import torch
from cost_law import base_features, fit, work_of  # the law's work terms and fit, shared with ../2026-12-05-cost-short-spans
work = work_of(json.load(open(sys.argv[1])))
def feats(s, new): return base_features(work, s, long_terms=new)
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
