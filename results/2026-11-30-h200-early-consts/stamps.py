#!/usr/bin/env python3
"""Reads a stamp dump (global_ns clock kernel n block slot sm per line) of one decode step and prints, per
kernel instance in time order, when its blocks started, passed the wait, finished the prologue and ended."""
import sys, collections, statistics as st
recs = [tuple(int(v) for v in l.split()) for l in open(sys.argv[1])]
names = {1: 'fgemv', 2: 'gemv', 3: 'mixer'}
by_block = collections.defaultdict(list)
for g, c, k, n, b, slot, sm in recs:
    by_block[(k, n, b)].append((g, c, slot, sm))
inst = collections.defaultdict(lambda: collections.defaultdict(list))  # (k,n,occ) -> slot -> [(g,c,b,sm)]
for (k, n, b), rs in by_block.items():
    rs.sort()
    occ = -1
    for g, c, slot, sm in rs:
        if slot == 0: occ += 1
        inst[(k, n, occ)][slot].append((g, c, b, sm))
order = sorted(inst, key=lambda key: min(r[0] for r in inst[key][0]))
t0 = min(r[0] for key in order for r in inst[key][0])
print(f"records {len(recs)}, instances {len(order)}, step span {(max(r[0] for key in order for s in inst[key] for r in inst[key][s]) - t0)/1e3:.1f} us")
gl = sorted(set(r[0] for r in recs)); diffs = sorted(set(b - a for a, b in zip(gl, gl[1:])))[:5]
print("smallest globaltimer steps (ns):", diffs)
prev_end = None
rows = []
for key in order:
    k, n, occ = key
    s = inst[key]
    def tmin(slot): return (min(r[0] for r in s[slot]) - t0) / 1e3 if s.get(slot) else float('nan')
    def tmax(slot): return (max(r[0] for r in s[slot]) - t0) / 1e3 if s.get(slot) else float('nan')
    def tmed(slot): return (st.median(r[0] for r in s[slot]) - t0) / 1e3 if s.get(slot) else float('nan')
    # clock deltas per block (cycles at 1.98 GHz) wait->prologue, prologue->sums, sums->end, wait->end
    cyc = {}
    blocks = collections.defaultdict(dict)
    for slot, rs in s.items():
        for g, c, b, sm in rs: blocks[b][slot] = c
    def dmed(a, z):
        v = [bl[z] - bl[a] for bl in blocks.values() if a in bl and z in bl]
        return st.median(v) / 1980.0 if v else float('nan')
    end = tmax(3)
    rows.append(dict(name=f"{names.get(k,k)}:{n}", blocks=len(s[0]), start_min=tmin(0), start_max=tmax(0), wait_min=tmin(1),
                     wait_max=tmax(1), end_med=tmed(3), end_max=end, crit=end - prev_end if prev_end is not None else float('nan'),
                     w2p=dmed(1, 2), p2s=dmed(2, 4), s2e=dmed(4, 3), w2e=dmed(1, 3), s2w=dmed(0, 1)))
    prev_end = end
hdr = "name blocks start_min start_max wait_min wait_max end_med end_max crit | s2w w2p p2s s2e w2e(us,median block)"
print(hdr)
for r in rows[:14] + [None] + rows[-8:]:
    if r is None: print("..."); continue
    print(f"{r['name']:>14} {r['blocks']:4d} {r['start_min']:8.1f} {r['start_max']:8.1f} {r['wait_min']:8.1f} {r['wait_max']:8.1f} {r['end_med']:8.1f} {r['end_max']:8.1f} {r['crit']:6.2f} | {r['s2w']:5.2f} {r['w2p']:5.2f} {r['p2s']:5.2f} {r['s2e']:5.2f} {r['w2e']:5.2f}")
# per identity averages over instances (excluding first layer)
agg = collections.defaultdict(list)
for r in rows: agg[r['name']].append(r)
print("\nper kernel, mean over instances: count crit  wait_min-prev_end_max  s2w w2p p2s s2e w2e  end_max-wait_max")
prev = None
gaps = collections.defaultdict(list)
for r in rows:
    if prev: gaps[r['name']].append(r['wait_min'] - prev['end_max'])
    prev = r
for name, rs in agg.items():
    crit = [r['crit'] for r in rs if r['crit'] == r['crit']]
    m = lambda f: st.mean([r[f] for r in rs if r[f] == r[f]]) if any(r[f] == r[f] for r in rs) else float('nan')
    tail = st.mean([r['end_max'] - r['wait_max'] for r in rs])
    print(f"{name:>14} {len(rs):3d} {st.mean(crit) if crit else float('nan'):6.2f} {st.mean(gaps[name]) if gaps[name] else float('nan'):6.2f}   {m('s2w'):5.2f} {m('w2p'):5.2f} {m('p2s'):5.2f} {m('s2e'):5.2f} {m('w2e'):5.2f}  {tail:5.2f}")
