"""Host cost of a compiled call that keeps normkit's op (issue #22, the compiled part).

For each case, a torch.compile'd function doing one norm at decode size is timed three ways:
  cpp      normkit's op kept (compile_fusion policy "normkit"); the op's C++ dispatcher kernel
  python   the same compiled code with the op's Python implementation (normkit._host.python_path())
  inductor Inductor's own code for the norm (policy "torch"): what the compile table's min_elements
           fell back to
host_us: microseconds the host spends per call, the GPU held busy by torch.cuda._sleep so that the
loop measures enqueueing only (median of 5 loops of 200 calls); wall_us: a back-to-back loop of
calls without the spin, synchronized at its end (what a host-bound decode step sees).
Writes $OUT/compile_host_cost.json and .md.
"""
import json
import os
import statistics
import sys
import time

import torch

import normkit
from normkit import _host
from normkit import compile_fusion as cf
from normkit.bench.timing import spin_cycles_per_ms

CASES = {
    "rms bf16 1x4096": lambda d: ((torch.randn(1, 4096, device=d, dtype=torch.bfloat16),),
                                 lambda w: (lambda x: normkit.rms_norm(x, (4096,), w, 1e-6)),
                                 torch.randn(4096, device=d, dtype=torch.bfloat16)),
    "add+rms bf16 1x4096": lambda d: ((torch.randn(1, 4096, device=d, dtype=torch.bfloat16),
                                      torch.randn(1, 4096, device=d, dtype=torch.bfloat16)),
                                     lambda w: (lambda x, r: normkit.rms_norm(x, (4096,), w, 1e-6, residual=r,
                                                                              prenorm=True)),
                                     torch.randn(4096, device=d, dtype=torch.bfloat16)),
    "ln fp16 1x1024": lambda d: ((torch.randn(1, 1024, device=d, dtype=torch.float16),),
                                lambda w: (lambda x: normkit.layer_norm(x, (1024,), w, w, 1e-5)),
                                torch.randn(1024, device=d, dtype=torch.float16)),
    "gn+silu fp16 1x320x32x32": lambda d: ((torch.randn(1, 320, 32, 32, device=d, dtype=torch.float16),),
                                          lambda w: (lambda x: normkit.group_norm(x, 32, w, w, 1e-5,
                                                                                  activation="silu")),
                                          torch.randn(320, device=d, dtype=torch.float16)),
}


def host_us(f, args, cycles_ms, n=200, loops=5):
    out = []
    for _ in range(loops):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(cycles_ms * (n * 0.1 + 20)))  # 100 us per call of GPU spin, ahead of the calls
        t0 = time.perf_counter()
        for _ in range(n):
            f(*args)
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def wall_us(f, args, n=500):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main(out_dir):
    torch.manual_seed(0)
    cycles = spin_cycles_per_ms()
    rows = []
    for name, make in CASES.items():
        args, fn_of, w = make("cuda")
        for way in os.environ.get("NK_WAYS", "cpp,python,inductor").split(","):
            torch._dynamo.reset()
            with cf.policy("torch" if way == "inductor" else "normkit"), torch.no_grad():
                f = torch.compile(fn_of(w), fullgraph=True)
                for _ in range(5):
                    f(*args)
                before = _host.stats()
                if way == "python":
                    with _host.python_path():
                        h, wl = host_us(f, args, cycles), wall_us(f, args)
                else:
                    h, wl = host_us(f, args, cycles), wall_us(f, args)
                after = _host.stats()
            d = {k: after.get(k, 0) - before.get(k, 0) for k in ("op_served", "op_python", "replays", "python_runs")}
            rows.append(dict(case=name, way=way, host_us=round(h, 2), wall_us=round(wl, 2), **d))
            print(rows[-1], flush=True)
    os.makedirs(out_dir, exist_ok=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
               host_status=_host.status)
    with open(os.path.join(out_dir, "compile_host_cost.json"), "w") as fh:
        json.dump(dict(environment=env, rows=rows), fh, indent=1)
    lines = [f"# Host cost of a compiled call ({env['gpu']}, torch {env['torch']}, {env['date']})", "",
             "| case | way | host us/call | wall us/call | op calls served in C++ | op calls in Python |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['way']} | {r['host_us']:.1f} | {r['wall_us']:.1f} | {r['op_served']} | "
                     f"{r['op_python']} |")
    with open(os.path.join(out_dir, "compile_host_cost.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
