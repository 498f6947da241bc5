"""Issue 24: the fused RMSNorm + float8 output forward at decoder widths against torch.compile, one run.

  PYTHONPATH=. python benchmarks/fp8_sweep.py --out DIR [--widths 2048,3072,4096,5120,8192] [--tokens 16384]

Variants of normkit (configs.FP8_HW_CAST: the float8 bits by the integer encoding, "enc", or by the
GPU's conversion instruction, "hw"), each without and with the amax, next to normkit's bf16 output
(the same kernel's memory-bound reference), torch.compile(dynamic=False) of the torch sequence
(rms_norm, * scale, clamp, .to(float8)) and of the same with amax = max |y|. Bytes counted as the
bench does (normkit.bench.fused.bytes_moved): x read (2 B) + y written (1 B per fp8 element).
Timed as `normkit bench` does (normkit.bench.timing: a GPU spin hides the host, input sets rotate
over more than 4x L2, median). Before timing, "hw" is checked against "enc" bit for bit on every
timed shape (a NaN row, scale chosen so that the largest values saturate): equal bits everywhere
but NaNs, which must be NaN in both. Writes DIR/{env.txt, check.csv, time.csv}; a table last.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import traceback

import torch

import normkit
from normkit.backends import triton as tb
from normkit.backends.triton import configs as tc
from normkit.bench.impls import compiled_path_problem, fresh_dynamo
from normkit.bench.timing import copy_ceiling_gbps, make_timer

from bwd_sweep import log, write_csv  # beside this script

FP8, FP8_MAX, SCALE, EPS = torch.float8_e4m3fn, 448.0, 8.0, 1e-6
WARM_MS, REP_MS = 10, 40
RING_BYTES = 4 * 50 * 2**20  # more than 4x the H100/H200 L2
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script under TRITON_INTERPRET=1


def normkit_call(hw: bool, amax: bool, out=FP8):
    """normkit's call with the float8 conversion chosen (the plan cache is cleared by the caller)."""
    kw = dict(out_dtype=out, out_scale=SCALE) if out is FP8 else {}
    if amax:
        kw["return_amax"] = True
    return lambda x, w: normkit.rms_norm(x, x.shape[-1], w, EPS, **kw)


def torch_seq(amax: bool):
    F = torch.nn.functional

    def call(x, w):
        y = F.rms_norm(x, (x.shape[-1],), w, EPS)
        z = y.float()
        out = (z * SCALE).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return (out, z.abs().amax()) if amax else out
    return call


def set_hw(on: bool):
    tc.FP8_HW_CAST = on
    tb.clear_caches()


def check(rows, widths, tokens):
    for N in widths:
        x = (torch.randn(tokens, N, device=DEV) * 2).to(torch.bfloat16)
        x[tokens // 3, N // 2] = float("nan")
        w = (torch.randn(N, device=DEV) * 0.5 + 1).to(torch.bfloat16)
        y = normkit.rms_norm(x, N, w, EPS)
        scale = 2 * FP8_MAX / y.float().nan_to_num(0.0).abs().max().item()  # the largest values saturate
        outs = {}
        for hw in (False, True):
            set_hw(hw)
            outs[hw] = normkit.rms_norm(x, N, w, EPS, out_dtype=FP8, out_scale=scale, return_amax=True)
        set_hw(True)
        (enc, a_enc), (hw8, a_hw) = outs[False], outs[True]
        be, bh = enc.view(torch.uint8), hw8.view(torch.uint8)
        nan = enc.float().isnan()
        row = dict(N=N, tokens=tokens, differ=int(((be != bh) & ~nan).sum()),
                   nan_both=bool(torch.equal(nan, hw8.float().isnan())),
                   saturated=int((hw8.float().abs() == FP8_MAX).sum()),
                   amax_equal=bool(a_enc.view(torch.int32).item() == a_hw.view(torch.int32).item()))
        row["ok"] = row["differ"] == 0 and row["nan_both"] and row["saturated"] > 0 and row["amax_equal"]
        rows.append(row)
        log("check", row)


def time_all(rows, widths, tokens, copy, path, names):
    timer = make_timer(DEV)
    for N in widths:
        per = tokens * N * 2
        sets = [((torch.randn(tokens, N, device=DEV) * 2).to(torch.bfloat16),
                 (torch.randn(N, device=DEV) * 0.5 + 1).to(torch.bfloat16))
                for _ in range(max(2, -(-RING_BYTES // per)) if DEV == "cuda" else 2)]
        for name in names:
            row = dict(N=N, tokens=tokens, variant=name)
            try:
                before = None
                if name.startswith("compile"):
                    before = fresh_dynamo()
                    fn = torch.compile(torch_seq(name.endswith("amax")), dynamic=False)
                else:
                    fn = normkit_call(name.startswith("hw"), name.endswith("amax"),
                                      torch.bfloat16 if name == "bf16" else FP8)
                    set_hw(not name.startswith("enc"))
                calls = [functools.partial(fn, *s) for s in sets]
                calls[0]()
                timer.sync()
                ms, _ = timer.median_ms(calls, WARM_MS, REP_MS)
                if before is not None and compiled_path_problem(before):
                    raise RuntimeError(compiled_path_problem(before))
                nbytes = tokens * N * (2 + (2 if name == "bf16" else 1))
                gbps = nbytes / (ms * 1e6)
                row.update(us=f"{ms * 1e3:.1f}", gbps=f"{gbps:.0f}", frac=f"{gbps / copy:.3f}")
            except Exception as e:  # noqa: BLE001
                row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                traceback.print_exc()
            rows.append(row)
            log(f"N={N} {name:<12} {row.get('us', '')} us {row.get('frac', row.get('error'))}")
            write_csv(path, rows)
        set_hw(True)
        del sets
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_sweep_out")
    ap.add_argument("--widths", default="2048,3072,4096,5120,8192")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--variants", default="enc,hw,compile,enc-amax,hw-amax,compile-amax,bf16")
    ap.add_argument("--parts", default="check,time")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    widths = tuple(int(n) for n in a.widths.split(","))
    names = a.variants.split(",")
    gpu = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    copy = copy_ceiling_gbps(make_timer(DEV), WARM_MS, REP_MS) if DEV == "cuda" else 1.0
    env = (f"date {datetime.datetime.now().isoformat(timespec='seconds')}\ngpu {gpu}"
           f"\ntorch {torch.__version__} triton {__import__('triton').__version__}\ncommand {' '.join(sys.argv)}\n"
           f"copy {copy:.0f} GB/s\n")
    open(os.path.join(a.out, "env.txt"), "w").write(env)
    log(env)
    if "check" in a.parts:
        rows = []
        check(rows, widths, a.tokens)
        write_csv(os.path.join(a.out, "check.csv"), rows)
        log(f"checks: {sum(r['ok'] for r in rows)}/{len(rows)} ok")
    if "time" in a.parts:
        rows = []
        time_all(rows, widths, a.tokens, copy, os.path.join(a.out, "time.csv"), names)
        log("N      " + " ".join(f"{k:>12}" for k in names) + "   (fraction of copy; hw/compile, hw-amax/compile-amax)")
        for N in widths:
            got = {r["variant"]: float(r["frac"]) for r in rows if r["N"] == N and "frac" in r}
            ratio = " ".join(f"{got[a_] / got[b_]:.2f}" if a_ in got and b_ in got else "-"
                             for a_, b_ in (("hw", "compile"), ("hw-amax", "compile-amax")))
            log(f"{N:<6} " + " ".join(f"{got.get(k, float('nan')):>12.3f}" for k in names) + "   " + ratio)


if __name__ == "__main__":
    main()
