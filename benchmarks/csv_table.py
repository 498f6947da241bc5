"""A sweep's CSV (fwd_sweep.py, bwd_sweep.py, widefwd_sweep.py) as one line per (op, N, variant): its timed fractions of copy in order."""
import collections
import csv
import sys

t = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    t[(r["op"], r["N"], r.get("variant") or r.get("impl"))].append(r.get("frac") or "err")
for (op, n, v), f in t.items():
    print(op, n, v, " ".join(f))
