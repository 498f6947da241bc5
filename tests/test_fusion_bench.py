"""The fused points of `normkit bench` (normkit/bench/fused.py): their byte model, and normkit and the
torch peer checked against the float64 oracle through the same runner as every other point."""
import pytest

from normkit.bench import fused, impls, report, runner
from normkit.bench.ops import OPS, SUITES, Point, plan
from normkit.bench.timing import CpuTimer


def test_byte_model_counts_the_residual_read_the_prenorm_write_and_the_fp8_byte():
    numel = 1024 * 4096
    bf16 = lambda op: Point("fused-sweep", op, "bf16", (1024, 4096))  # noqa: E731
    # forward: x + y, + r read, + h written; fp8 y is 1 byte
    assert fused.bytes_moved(bf16("rms+add"), "fwd") == numel * 2 * 3
    assert fused.bytes_moved(bf16("rms+add+pre"), "fwd") == numel * 2 * 4
    assert fused.bytes_moved(bf16("rms+fp8"), "fwd") == numel * (2 + 1)
    # backward: h, dy read, dx written (dx is the residual's gradient too); + dh read with prenorm
    assert fused.bytes_moved(bf16("ln+add"), "bwd") == numel * 2 * 3
    assert fused.bytes_moved(bf16("ln+add+pre"), "bwd") == numel * 2 * 4
    assert fused.bytes_moved(bf16("ln+fp8"), "bwd") == numel * (2 + 1 + 2)
    assert runner.point_bytes(bf16("rms+add+pre"), "fwd") == fused.bytes_moved(bf16("rms+add+pre"), "fwd")


def test_fused_suites_plan_every_fused_op():
    pts = plan(tuple(fused.FUSIONS), ("bf16",), ("fused-llm", "fused-sweep"), (1024, 4096), lambda d: 2**20)
    assert {p.op for p in pts} == set(fused.FUSIONS)
    assert {p.shape for p in pts if p.suite == "fused-llm"} == {shape for shape, _ in SUITES["fused-llm"].shapes}
    assert all(OPS[op].fusion is not None for op in fused.FUSIONS)


def _run(point, direction, impl_list):
    s = runner.Settings("cpu", warmup_ms=0.1, rep_ms=0.5)
    return {r.impl: r for r in report.finalize(runner.run_task(point, direction, impl_list, CpuTimer(), s, seed=1))}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("op", list(fused.FUSIONS))
def test_fused_points_run_and_pass_the_oracle(op, direction):
    p = Point("fused-sweep", op, "bf16", (8, 96))
    rows = _run(p, direction, [impls.Normkit("torch"), impls.Normkit("triton"), impls.Torch()])
    for name in ("normkit[torch]", "normkit[triton]", "torch"):
        assert rows[name].ok == "yes", (name, rows[name].rel_err, rows[name].note)
        assert rows[name].gbps > 0
    assert rows["normkit[torch]"].tol == (fused.FP8_TOL if "fp8" in op else 2e-2)


def test_host_overhead_rows_cover_the_fused_ops():
    rows = runner.run_host(["rms+add+pre"], [impls.Normkit("torch"), impls.Torch()], CpuTimer(), "cpu")
    assert len(rows) == 4 and all(r.us_per_call and r.us_per_call > 0 for r in rows), [r.note for r in rows]
