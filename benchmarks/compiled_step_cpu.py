"""Compiled step time of a bench model, unpatched vs normkit.patch, on the CPU (process time), and
what Dynamo's graph holds in each: a quick look at a compiled case's host cost without a GPU.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/compiled_step_cpu.py unet2d infer inductor
"""
import collections
import copy
import statistics
import sys
import time

import torch

from normkit.bench import model_zoo, models


def main(name: str, mode: str, backend: str) -> None:
    spec = model_zoo.SPECS[name]
    size = spec.sizes["tiny"]
    torch.manual_seed(0)
    base = spec.build(size, "cpu").float()
    batch = spec.batch(size, "cpu", torch.float32, torch.Generator("cpu").manual_seed(2))
    for variant in ("unpatched", "normkit"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        models.apply_variant(variant, spec, model)
        graphs = []

        def seen(gm, example_inputs):  # Dynamo's graph, then the backend asked for
            graphs.append(gm)
            return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

        work = models.Work(spec, model, mode, batch, size, "cpu", torch.Generator("cpu").manual_seed(1))
        work.compile(seen)
        for _ in range(3):
            work.prepare()
            work.step()
        times = []
        for _ in range(7):
            spent = 0.0
            for _ in range(20):
                work.prepare()  # the decoder's next position, outside the timing
                t0 = time.process_time()
                work.step()
                spent += time.process_time() - t0
            times.append(spent / 20 * 1e3)
        ops = collections.Counter(str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function")
        print(f"{variant}: {statistics.median(times):.3f} ms per step (median of 7 x 20), {len(graphs)} graph(s); "
              f"most called: {ops.most_common(6)}")


if __name__ == "__main__":
    main(*(sys.argv[1:4] + ["unet2d", "infer", "inductor"][len(sys.argv) - 1:]))
