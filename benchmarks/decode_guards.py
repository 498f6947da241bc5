"""Issue 22, compiled Llama decode (session 22): where does the patched model's extra host time per step come from?
Builds the bench's Llama decode case (model_zoo's full size, bf16, static KV cache), compiles the step for each
variant in turn (unpatched, normkit) and reports dynamo's own cold guard latency (logged when the guards are built),
the guard tree's size, the Inductor kernels and normkit ops in the generated code, and the host time per step
(queued back to back, 5 chunks of 100 steps, median), with the guards evaluated and with torch's stance that skips
them (skip_guard_eval_unsafe: one compiled entry per frame here), then with them again. Run on a GPU:
  PYTHONPATH=. python benchmarks/decode_guards.py [full|tiny] [cuda|cpu]
"""
import io
import logging
import re
import sys
import time

import torch
from torch._inductor.utils import run_and_get_code

import normkit
from normkit.bench import model_zoo


def main():
    spec = model_zoo.SPECS["llama"]
    size = spec.sizes[sys.argv[1] if len(sys.argv) > 1 else "full"]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for variant in ("unpatched", "normkit"):
        torch.manual_seed(0)
        model = spec.build(size, device).to(torch.bfloat16).eval()
        if variant == "normkit":
            normkit.patch(model)
        torch._dynamo.reset()
        dec = model_zoo.Decoder(model, size, device, torch.Generator(device=device).manual_seed(0))
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        logging.getLogger("torch._dynamo.guards").addHandler(handler)
        torch._logging.set_logs(guards=True)
        fn = torch.compile(dec.step_logits, dynamic=False)
        dec.prepare()
        with torch.no_grad():
            _, codes = run_and_get_code(fn, dec.tok, dec.pos)
        torch._logging.set_logs(guards=False)
        logging.getLogger("torch._dynamo.guards").removeHandler(handler)
        text, code = buf.getvalue(), "\n".join(codes)
        latency = re.findall(r"Guard eval latency = ([\d.]+) us", text)
        tree = len([line for line in text.splitlines() if " +- " in line])
        launches = len(re.findall(r"\.run\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+", code))
        dec.fn = fn

        def host_ms():
            times = []
            for _ in range(5):
                sync()
                t = time.perf_counter()
                for _ in range(100):
                    dec.prepare()  # rewinds the cache at the end of a round, as the bench does between steps
                    dec.step()
                times.append((time.perf_counter() - t) / 100 * 1e3)  # queued: the GPU idles most of a step
                sync()
            return sorted(times)[2]
        with_guards = host_ms()
        # torch's stance that skips the guards when a frame has one compiled entry: what is left is not guards
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            without = host_ms()
        again = host_ms()
        print(f"{variant}: guard eval latency (cold, dynamo's log) {latency} us; guard tree entries {tree}; "
              f"kernel launches / extern calls in the code {launches}; normkit ops {code.count('torch.ops.normkit')}; "
              f"host ms per step (median of 5 x 100): {with_guards:.3f}, guards skipped {without:.3f}, again {again:.3f}")


if __name__ == "__main__":
    main()
