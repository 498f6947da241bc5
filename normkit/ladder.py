"""`normkit ladder`: the seeds' kernel ladders, each kernel timed and checked against the oracle.

The CUDA C++ ladder (seeds 001, 003, 004) lives in normkit.backends.cuda.ladder, the WebGPU one
(seed 000) in normkit.backends.webgpu.ladder; both provide add_arguments(parser) and run(args).
"""
from __future__ import annotations

import importlib

LADDERS = {"cuda": "normkit.backends.cuda.ladder", "webgpu": "normkit.backends.webgpu.ladder"}


def add_arguments(parser) -> None:
    parser.add_argument("--backend", choices=sorted(LADDERS), default="cuda", help="which ladder to run")
    parser.add_argument("--plot", action="store_true", help="also write a PNG of the table")
    parser.add_argument("--out", default="ladder-out", help="folder for the CSV/markdown/PNG outputs")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repetitions")


def run(args) -> int:
    try:
        mod = importlib.import_module(LADDERS[args.backend])
    except ImportError as e:
        print(f"normkit ladder --backend {args.backend}: unavailable ({e})")
        return 2
    return int(mod.run(args) or 0)
