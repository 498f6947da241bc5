"""`normkit <command>`: the command-line entry point (also `python -m normkit`).

Each command lives in its own module that provides add_arguments(parser) and run(args) -> int;
modules are imported only to build their parser, so they must import heavy packages lazily.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help)
COMMANDS = {
    "bench": ("normkit.bench.cli", "benchmark normkit against torch, torch.compile, Liger and quack"),
    "ladder": ("normkit.ladder", "run the seeds' kernel ladders (CUDA C++ or WebGPU) on this machine"),
    "export-wgsl": ("normkit.backends.webgpu.export", "write the WGSL shaders as a browser wants them"),
    "export-web": ("normkit.web.export", "write normkit.js (an ES module over the WGSL kernels), its types and a demo page"),
    "info": ("normkit.info", "print what normkit sees: devices, backends and versions"),
    "recognition": ("normkit.bench.recognition", "what normkit.patch recognises and fuses in real model families, as installed"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normkit", description="normalization kernels for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a command whose optional parts are missing still shows up
            p.set_defaults(_missing=f"normkit {name} is unavailable: {e}")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
