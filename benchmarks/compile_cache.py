"""How long torch.compile takes in a first and a second process that share Inductor's cache
directory, for a small Llama-shaped HF model (random init, no download) unpatched and after
normkit.patch (issue 25: normkit's pass once made Inductor bypass its caches, so every process paid
the whole compile again).

Each case gets its own fresh cache directory; each process is a fresh interpreter that builds the
model, compiles it and times its first step (compile included; a CUDA step is synchronized), then a
second step (the run alone). One CSV line per process: the case, first or second, the seconds, and
Inductor's and AOTAutograd's cache counters (hit / miss / bypass). The second process should show
hits and no misses or bypasses, for the patched model as for the unpatched one.

    python benchmarks/compile_cache.py --device cuda            # Llama-ish widths, bf16, training step
    python benchmarks/compile_cache.py --device cpu --tiny      # a quick check of the plumbing
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("case", "process", "compile_s", "step_s", "fxgraph_hit", "fxgraph_miss", "fxgraph_bypass",
           "autograd_hit", "autograd_miss", "autograd_bypass", "normkit_pass")


def child(args) -> dict:
    """One process: build, (patch,) compile, time the first and the second step."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    from torch._dynamo.utils import counters

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 64),
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    if args.case == "patched":
        import normkit
        normkit.patch(model)
    model.train(args.mode == "train")
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    compiled = torch.compile(model)

    def step():
        if args.mode == "train":
            out = compiled(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
        else:
            with torch.no_grad():
                compiled(input_ids=ids, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize()

    counters.clear()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    step()
    second = time.perf_counter() - start
    import torch._inductor.config as config
    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"compile_s": round(first, 3), "step_s": round(second, 4),
            "fxgraph_hit": ind["fxgraph_cache_hit"], "fxgraph_miss": ind["fxgraph_cache_miss"],
            "fxgraph_bypass": ind["fxgraph_cache_bypass"], "autograd_hit": aot["autograd_cache_hit"],
            "autograd_miss": aot["autograd_cache_miss"], "autograd_bypass": aot["autograd_cache_bypass"],
            "normkit_pass": config.pre_grad_custom_pass is not None}


def run_process(argv: list, cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the child process failed:\n{proc.stderr[-4000:]}")
    for line in proc.stderr.splitlines():  # what Inductor said about its caches (none expected)
        if "pickle" in line.lower() or "uuid()" in line or "bypass" in line.lower():
            print(f"# stderr: {line}", file=sys.stderr)
    return json.loads([s for s in proc.stdout.splitlines() if s.startswith("{")][-1])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    p.add_argument("--mode", default="train", choices=("train", "infer"))
    p.add_argument("--cases", default="unpatched,patched")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU check)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cache-dir", default=None, help="keep the (fresh) per-case cache directories under this one")
    p.add_argument("--out", default=None, help="also write the CSV here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 1, 64, 128, 4, 2
        args.vocab, args.seq, args.batch = 128, 16, 2
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="normkit-compile-cache-") as tmp:
        base = Path(tempfile.mkdtemp(dir=args.cache_dir) if args.cache_dir else tmp)  # always fresh
        lines = [",".join(COLUMNS)]
        print(lines[0], flush=True)
        for case in args.cases.split(","):
            cache_dir = base / case
            for process in ("first", "second"):
                row = {"case": case, "process": process, **run_process([*argv, "--case", case], cache_dir)}
                lines.append(",".join(str(row[c]) for c in COLUMNS))
                print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
