"""Which normkit calls of a patched model still take the Python path (the C++ host path declined
them), per training or inference step, and what they look like.

    python benchmarks/python_path_calls.py whisper-encoder train

Prints the C++ host path's counters for one step (plan replays, Python runs) and the calls that
reached normkit's Python autograd function or inference kernels, grouped by shape, strides and
options. On a CPU (no host path) it runs tiny sizes as a check of the script.
"""
from __future__ import annotations

import collections
import sys

import torch

import normkit
import normkit.functional as nkf
from normkit import _host
from normkit.bench import model_zoo
from normkit.bench.models import DTYPES


def _describe(t):
    return None if t is None else (tuple(t.shape), t.stride(), str(t.dtype).replace("torch.", ""))


def main(name: str, mode: str) -> None:
    spec = model_zoo.SPECS[name]
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of this script, tiny sizes
    size = model_zoo.size_of(spec, "full" if dev == "cuda" else "tiny")
    dtype = DTYPES[spec.dtype] if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    model = spec.build(size, dev).to(dtype)
    normkit.patch(model, fuse=spec.fuse)
    model.train(mode == "train")
    batch = spec.batch(size, dev, dtype, torch.Generator(device=dev).manual_seed(1))
    seen = collections.Counter()
    real_cls, real_fwd = nkf.RowNormFn, nkf.row_norm_forward_fused

    class Apply:  # the autograd function as functional.py calls it, recorded
        @staticmethod
        def apply(x, w, b, residual, scale, ndim, eps, rms, act, opts, backend, *rest):
            seen[("autograd", _describe(x), _describe(residual), ndim, rms, act, repr(opts)[:120])] += 1
            return real_cls.apply(x, w, b, residual, scale, ndim, eps, rms, act, opts, backend, *rest)

    def fwd(backend, x, weight, bias, ndim, *a, **k):
        seen[("inference", _describe(x), _describe(k.get("residual")), ndim, repr(k.get("opts"))[:120])] += 1
        return real_fwd(backend, x, weight, bias, ndim, *a, **k)

    def step():
        if mode == "train":
            spec.loss(model, batch).backward()
        else:
            with torch.no_grad():
                spec.output(model, batch)

    step()
    torch.cuda.synchronize() if dev == "cuda" else None
    nkf.RowNormFn, nkf.row_norm_forward_fused = Apply, fwd
    before = _host.stats()
    step()
    torch.cuda.synchronize() if dev == "cuda" else None
    after = _host.stats()
    nkf.RowNormFn, nkf.row_norm_forward_fused = real_cls, real_fwd
    print(f"{name} {mode}: host path {_host.status}")
    print("host counters for one step:", {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)})
    print(f"python-path calls for one step: {sum(seen.values())}")
    for key, n in seen.most_common(20):
        print(f"  {n:4d} x {key}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
