#!/usr/bin/env python
"""Train a small GPT-style model on N processes with normkit norms and with torch norms, from the
same initial weights and the same data, under DDP and under FSDP2, and check that the two loss
curves agree at every step.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      torchrun --standalone --nproc_per_node 2 benchmarks/distributed/train_gpt.py --out OUT

    # CPU smoke test (gloo): tiny sizes, few steps
    torchrun --standalone --nproc_per_node 2 benchmarks/distributed/train_gpt.py \\
      --device cpu --size tiny --steps 4 --out /tmp/smoke

The normkit run is the torch model passed through normkit.patch, so both runs start from one
state_dict. Everything else is made deterministic (explicit causal attention instead of SDPA,
torch.use_deterministic_algorithms, no TF32), so any difference between the curves comes from the
norms. Rank 0 writes OUT/log.txt, OUT/losses.csv, OUT/summary.json and OUT/losses.png; the exit
status is 1 if any step's losses differ by more than --tol (relative), 0 otherwise.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
import normkit  # noqa: E402

# NVLink multicast stays off on the shared GPU hosts (see the device notes); cuBLAS needs the
# workspace setting to be deterministic. Set in main(), before NCCL or cuBLAS start.
FIXED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@dataclass(frozen=True)
class Size:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int  # sequences per rank per step


SIZES = {
    "tiny": Size(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=4),
    "small": Size(vocab=2048, dim=384, heads=6, layers=6, seq=256, batch=16),
}


# ----------------------------------------------------------------------------- model

class Attention(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.heads = s.heads
        self.qkv = nn.Linear(s.dim, 3 * s.dim)
        self.proj = nn.Linear(s.dim, s.dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).transpose(1, 3).unbind(2)
        # explicit attention: deterministic in both directions, unlike the fused SDPA kernels
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, s: Size, norm):
        super().__init__()
        self.norm_1, self.attn = norm(s.dim), Attention(s)
        self.norm_2 = norm(s.dim)
        self.mlp = nn.Sequential(nn.Linear(s.dim, 4 * s.dim), nn.GELU(), nn.Linear(4 * s.dim, s.dim))

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, s: Size, norm_kind: str):
        super().__init__()
        norm = {"layer": nn.LayerNorm, "rms": lambda d: nn.RMSNorm(d, eps=1e-6)}[norm_kind]
        self.tok = nn.Embedding(s.vocab, s.dim)
        self.pos = nn.Embedding(s.seq, s.dim)
        self.blocks = nn.ModuleList(Block(s, norm) for _ in range(s.layers))
        self.norm_f = norm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        with torch.no_grad():  # norm weights away from 1 (and biases from 0), so they matter
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------- data

def batch_for(step: int, rank: int, s: Size, device):
    """Sequences from a fixed random bigram chain (4 likely successors per token), so the loss
    falls from ln(vocab) as the model learns; the same for every run, different per rank and step."""
    table = torch.randint(0, s.vocab, (s.vocab, 4), generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.empty(s.batch, s.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, s.vocab, (s.batch,), generator=gen)
    choice = torch.randint(0, 4, (s.batch, s.seq), generator=gen)
    for t in range(s.seq):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------- one training run

def wrap(model: nn.Module, mode: str, device, precision: str):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        return fully_shard(model, mesh=mesh, mp_policy=mp)
    raise ValueError(f"mode: expected 'ddp' or 'fsdp2', got {mode!r}")


def train(args, size: Size, mode: str, norm_kind: str, impl: str, device) -> list[float]:
    """Per-step losses (mean over ranks) of one run."""
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = GPT(size, norm_kind)
    if impl == "normkit":
        replaced = normkit.patch(model, backend=args.backend)
        expected = 2 * size.layers + 1
        if len(replaced) != expected:
            raise RuntimeError(f"normkit.patch replaced {len(replaced)} norms, expected {expected}")
    model = wrap(model.to(device), mode, device, args.precision)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16" and mode == "ddp")
    losses = []
    for step in range(args.steps):
        idx, targets = batch_for(step, rank, size, device)
        with autocast:
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


# ----------------------------------------------------------------------------- checking and reporting

def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check_agreement(rows: list[dict], tol: float) -> list[str]:
    """One line per step whose normkit loss differs from the torch loss by more than tol."""
    bad = []
    for r in rows:
        d = rel_diff(r["loss_normkit"], r["loss_torch"])
        if not d <= tol:  # NaN fails too
            bad.append(f"{r['mode']}/{r['norm']} step {r['step']}: normkit {r['loss_normkit']:.6f} "
                       f"torch {r['loss_torch']:.6f} rel diff {d:.2e} > {tol:.0e}")
    return bad


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({(r["mode"], r["norm"]) for r in rows})
    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 6.5), squeeze=False, sharex=True)
    for j, (mode, norm) in enumerate(runs):
        rs = [r for r in rows if (r["mode"], r["norm"]) == (mode, norm)]
        steps = [r["step"] for r in rs]
        ax = axes[0][j]
        ax.plot(steps, [r["loss_torch"] for r in rs], label="torch norms", lw=2.5, alpha=0.6)
        ax.plot(steps, [r["loss_normkit"] for r in rs], label="normkit norms", lw=1.2, ls="--")
        ax.set_title(f"{mode.upper()}, {'LayerNorm' if norm == 'layer' else 'RMSNorm'}")
        ax.set_ylabel("loss (mean over ranks)")
        ax.legend()
        ax = axes[1][j]
        ax.semilogy(steps, [max(rel_diff(r["loss_normkit"], r["loss_torch"]), 1e-12) for r in rs], marker=".")
        ax.axhline(rows[0]["tol"], color="red", ls=":", label="tolerance")
        ax.set_xlabel("step")
        ax.set_ylabel("relative difference (0 drawn at 1e-12)")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device, normkit_backend) -> dict:
    probe = torch.empty(1, 8, device=device)  # which normkit backend ran on this device
    env = {"torch": torch.__version__, "python": platform.python_version(), "world_size": dist.get_world_size(),
           "backend": dist.get_backend(), "device": str(device),
           "normkit_backend": normkit.backends.resolve(normkit_backend, probe).NAME,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    env.update({k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                 "NVSHMEM_DISABLE_NVLS")})
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (written by rank 0)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--modes", default="ddp,fsdp2", help="comma-separated: ddp, fsdp2")
    p.add_argument("--norms", default="layer,rms", help="comma-separated: layer, rms")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast under DDP, bf16 parameters (fp32 reductions) under FSDP2")
    p.add_argument("--backend", default=None, help="normkit backend (default: automatic)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tol", type=float, default=1e-3, help="largest allowed relative loss difference")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.update(FIXED_ENV)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    torch.use_deterministic_algorithms(True, warn_only=True)  # a missing deterministic kernel warns
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rank = dist.get_rank()
    size = SIZES[args.size]

    rows = []
    for mode in args.modes.split(","):
        for norm in args.norms.split(","):
            t0 = time.perf_counter()
            curves = {impl: train(args, size, mode, norm, impl, device) for impl in ("torch", "normkit")}
            for step, (lt, ln) in enumerate(zip(curves["torch"], curves["normkit"])):
                rows.append({"mode": mode, "norm": norm, "step": step, "loss_torch": lt, "loss_normkit": ln,
                             "rel_diff": rel_diff(ln, lt), "tol": args.tol})
            if rank == 0:
                worst = max(r["rel_diff"] for r in rows if (r["mode"], r["norm"]) == (mode, norm))
                print(f"[{mode}/{norm}] {args.steps} steps x 2 runs in {time.perf_counter() - t0:.1f}s, "
                      f"loss {curves['torch'][0]:.4f} -> {curves['torch'][-1]:.4f}, "
                      f"max rel diff {worst:.2e}", flush=True)

    failures = check_agreement(rows, args.tol)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        env = environment(device, args.backend)
        with open(os.path.join(args.out, "losses.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(args.out, "log.txt"), "w") as f:
            f.write(f"# train_gpt.py {' '.join(sys.argv[1:])}\n# {json.dumps(env)}\n# size {asdict(size)}\n")
            f.write(f"{'mode':6} {'norm':5} {'step':>4} {'loss_torch':>12} {'loss_normkit':>12} {'rel_diff':>9}\n")
            for r in rows:
                f.write(f"{r['mode']:6} {r['norm']:5} {r['step']:4d} {r['loss_torch']:12.6f} "
                        f"{r['loss_normkit']:12.6f} {r['rel_diff']:9.2e}\n")
            f.write("\n".join(["FAIL " + x for x in failures] or [f"PASS: every step within {args.tol:.0e}"]) + "\n")
        summary = {"env": env, "size": asdict(size), "args": vars(args), "passed": not failures,
                   "max_rel_diff": {f"{m}/{n}": max(r["rel_diff"] for r in rows if (r["mode"], r["norm"]) == (m, n))
                                    for m, n in sorted({(r["mode"], r["norm"]) for r in rows})},
                   "failures": failures}
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        where = env.get("gpu", "CPU")
        plot(rows, os.path.join(args.out, "losses.png"),
             f"normkit vs torch norms: {dist.get_world_size()} x {where}, {args.precision}, {args.size} GPT")
        print("\n".join(failures) if failures else f"PASS: every step within {args.tol:.0e} relative", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
