"""Per-call CPU cost of two normkit trees in paired rounds: one long-lived worker process per tree, rounds
alternated between them, so that both see the same load of a shared machine (separate runs per tree were swamped
by it: torch's own rows moved 0.85-1.2 between processes). Cases: patched torch modules, the functional API, the
fused blocks (norm_act, norm_modulate), torch's modules as the control (their ratio should be ~1.00).

    OMP_NUM_THREADS=1 python benchmarks/cpu_paired.py /path/to/base /path/to/branch [--rounds 11]

Prints per case: us per call (process time, medians over rounds) for each tree, no grad and forward + backward(dy),
and the median of the per-round ratios branch / base [quartiles].
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = ["LN patched", "LN patched off1e4", "RMS patched", "GN patched", "LN functional", "GN+mish norm_act",
         "LN modulate", "torch LN", "torch RMS", "torch GN"]


def worker() -> None:
    """Reads 'case grad n' lines; prints the process time per call of n calls."""
    import copy

    import torch

    import normkit
    import normkit.blocks as B
    torch.manual_seed(0)
    x, xg, xm = torch.randn(2, 16, 64), torch.randn(2, 32, 16), torch.randn(2, 5, 16)
    ln, rn, gn = torch.nn.LayerNorm(64), torch.nn.RMSNorm(64), torch.nn.GroupNorm(8, 32)
    patched = torch.nn.Sequential(copy.deepcopy(ln), copy.deepcopy(rn), copy.deepcopy(gn))
    normkit.patch(patched)
    pln, prn, pgn = patched
    mn, act = torch.nn.LayerNorm(16, elementwise_affine=False, eps=1e-6), torch.nn.Mish()
    scale, shift = torch.randn(2, 1, 16).requires_grad_(), torch.randn(2, 1, 16).requires_grad_()
    cases = {
        "LN patched": (pln, x), "LN patched off1e4": (pln, x + 1e4), "RMS patched": (prn, x), "GN patched": (pgn, xg),
        "LN functional": (lambda t: normkit.layer_norm(t, 64, ln.weight, ln.bias), x),
        "GN+mish norm_act": (lambda t: B.norm_act(gn, act, t), xg),
        "LN modulate": (lambda t: B.norm_modulate(mn, t, scale, shift), xm),
        "torch LN": (ln, x), "torch RMS": (rn, x), "torch GN": (gn, xg),
    }
    fns = {}
    for name, (f, inp) in cases.items():
        xr, dy = inp.clone().requires_grad_(), torch.randn_like(inp)
        fns[name, "0"] = lambda f=f, inp=inp: f(inp)
        fns[name, "1"] = lambda f=f, xr=xr, dy=dy: f(xr).backward(dy)
    print("ready", normkit.__file__, flush=True)
    for line in sys.stdin:
        name, grad, n = line.rstrip("\n").rsplit(" ", 2)
        fn, n = fns[name, grad], int(n)
        with torch.no_grad() if grad == "0" else torch.enable_grad():
            for _ in range(200):
                fn()
            t0 = time.process_time()
            for _ in range(n):
                fn()
        print((time.process_time() - t0) / n * 1e6, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("branch")
    ap.add_argument("--rounds", type=int, default=11)
    a = ap.parse_args()
    procs = {}
    for tag, tree in (("base", a.base), ("branch", a.branch)):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=tree)
        p = subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        print(f"{tag}: {p.stdout.readline().split()[1]}")
        procs[tag] = p

    def run(tag, case, grad, n):
        procs[tag].stdin.write(f"{case} {grad} {n}\n")
        procs[tag].stdin.flush()
        return float(procs[tag].stdout.readline())

    print(f"{'case':18s} | no grad: base  branch  ratio [q1-q3]   | fwd+bwd: base  branch  ratio [q1-q3]")
    for case in CASES:
        row = f"{case:18s} |"
        for grad, n in (("0", 2000), ("1", 400)):
            res = {"base": [], "branch": []}
            for i in range(a.rounds):
                for tag in (("base", "branch") if i % 2 == 0 else ("branch", "base")):
                    res[tag].append(run(tag, case, grad, n))
            ratios = [c / b for b, c in zip(res["base"], res["branch"])]
            q = statistics.quantiles(ratios, n=4)
            row += (f" {statistics.median(res['base']):13.1f} {statistics.median(res['branch']):7.1f} "
                    f"{statistics.median(ratios):6.2f} [{q[0]:.2f}-{q[2]:.2f}] |")
        print(row, flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
