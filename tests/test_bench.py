"""normkit bench: the byte model, the ops plan, the runner's checks, the report, the plots, and the
CPU end-to-end run of the command line (peers that are not installed must show up as skipped)."""
import importlib.util
import math

import pytest
import torch

import normkit.cli
from normkit import reference
from normkit.bench import bytemodel, impls, report, runner
from normkit.bench.cli import NO_GPU_LINE
from normkit.bench.ops import Point, plan, pow2_range
from normkit.bench.report import HostRow, Row
from normkit.bench.timing import CpuTimer

from conftest import HAS_CUDA


# ----------------------------------------------------------------------------- byte model

def test_byte_model_counts_passes_over_the_tensor():
    assert bytemodel.passes("fwd") == 2
    assert bytemodel.passes("bwd") == 3
    assert bytemodel.passes("fwd", residual=True) == 4
    assert bytemodel.passes("bwd", residual=True) == 5
    # LayerNorm bf16 at M=2^26/N: 128 MiB read + 128 MiB written
    p = Point("sweep", "ln", "bf16", (2**26 // 4096, 4096))
    assert bytemodel.bytes_moved(p.numel, p.torch_dtype.itemsize, "fwd") == 2 * 2**27
    assert bytemodel.bytes_moved(p.numel, p.torch_dtype.itemsize, "bwd") == 3 * 2**27
    # 1 GB moved in 1 ms is 1000 GB/s
    assert bytemodel.gbps(1e9, 1.0) == pytest.approx(1000.0)


def test_byte_model_groupnorm_counts_the_whole_tensor():
    p = Point("gn-anchors", "gn", "fp32", (16, 256, 4096), 8)
    assert p.rows_cols == (16 * 8, 32 * 4096)
    assert bytemodel.bytes_moved(p.numel, 4, "fwd") == 2 * 16 * 256 * 4096 * 4
    assert bytemodel.bytes_moved(p.numel, 4, "bwd") == 3 * 16 * 256 * 4096 * 4


def test_byte_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="direction"):
        bytemodel.passes("sideways")
    with pytest.raises(ValueError, match="ms"):
        bytemodel.gbps(1.0, 0.0)


# ----------------------------------------------------------------------------- plan

def test_default_gpu_plan_has_the_sweep_and_the_seeds_shapes():
    widths = pow2_range(32, 262144)
    assert widths[0] == 32 and widths[-1] == 262144 and len(widths) == 14
    pts = plan(("ln", "rms"), ("bf16", "fp16", "fp32"), ("sweep", "llm.c", "tutorial"), widths, lambda d: 2**26)
    sweep = [p for p in pts if p.suite == "sweep"]
    assert len(sweep) == 2 * 3 * 14
    assert all(p.rows_cols[0] * p.rows_cols[1] == 2**26 for p in sweep)
    assert [p.shape for p in pts if p.suite == "llm.c"] == [(8192, 768)]
    assert {p.dtype for p in pts if p.suite == "llm.c"} == {"fp32"}
    tut = [p for p in pts if p.suite == "tutorial"]
    # the tutorial's N=16384 (M=4096) is also the sweep's fp16 point at that width: it runs once
    assert [p.shape[1] for p in tut] == [512, 1024, 2048, 4096, 8192] and {p.shape[0] for p in tut} == {4096}
    assert Point("sweep", "ln", "fp16", (4096, 16384)) in sweep


def test_plan_filters_and_runs_a_repeated_shape_once():
    pts = plan(("ln",), ("fp16",), ("sweep", "tutorial"), (1024,), lambda d: 4096 * 1024)
    assert [(p.suite, p.shape) for p in pts] == [("sweep", (4096, 1024)), ("tutorial", (4096, 512)),
                                                ("tutorial", (4096, 2048)), ("tutorial", (4096, 4096)),
                                                ("tutorial", (4096, 8192)), ("tutorial", (4096, 16384))]
    assert plan(("rms",), ("bf16",), ("llm.c", "tutorial"), (1024,), lambda d: 1) == []


# ----------------------------------------------------------------------------- runner on CPU

class _Wrong(impls.Torch):
    """A deliberately wrong peer: y off by 1%."""
    name = "wrong"

    def build(self, p, direction):
        f = super().build(p, direction)
        return lambda x, w, b: f(x, w, b) * 1.01


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


class _WrongWeightGrad(impls.Torch):
    """Right y and dx, dweight 50% too large."""
    name = "wrong-dw"

    def build(self, p, direction):
        f = super().build(p, direction)
        return lambda x, w, b: f(x, _GradScale.apply(w), b)


class _ClobberDy(torch.autograd.Function):
    """Identity whose backward overwrites the incoming gradient in place, as Liger's RMSNorm does."""
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        out = dy.clone()
        dy.mul_(-3.0)
        return out


class _InPlace(impls.Torch):
    name = "in-place"

    def build(self, p, direction):
        f = super().build(p, direction)
        return lambda x, w, b: _ClobberDy.apply(f(x, w, b))


class _Raises(impls.Torch):
    name = "raises"

    def build(self, p, direction):
        if p.shape[-1] > 64:
            raise impls.Unsupported("rows wider than 64")
        return lambda x, w, b: (_ for _ in ()).throw(RuntimeError("kernel exploded\nsecond line"))


def _run(point, direction, impl_list):
    s = runner.Settings("cpu", warmup_ms=0.1, rep_ms=0.5)
    return {r.impl: r for r in report.finalize(runner.run_task(point, direction, impl_list, CpuTimer(), s, seed=1))}


def test_runner_checks_every_implementation_against_the_oracle():
    p = Point("sweep", "ln", "fp32", (16, 64))
    rows = _run(p, "fwd", [impls.Normkit("torch"), impls.Torch(), _Wrong()])
    assert rows["normkit[torch]"].ok == "yes" and rows["normkit[torch]"].rel_err < 1e-6
    assert rows["torch"].ok == "yes"
    bad = rows["wrong"]
    assert bad.ok == "no" and bad.wrong and bad.rel_err == pytest.approx(0.01, rel=1e-3)
    assert "worst output: y" in bad.note
    # a wrong peer never becomes the bar normkit is measured against
    assert rows["normkit[torch]"].best_peer == "torch"
    assert all(r.time_ms > 0 and r.gbps > 0 and r.copy_gbps is None and r.frac_of_copy is None for r in rows.values())


def test_runner_flags_a_wrong_weight_gradient_and_restores_dy_clobbered_in_place():
    p = Point("sweep", "rms", "fp32", (32, 48))
    rows = _run(p, "bwd", [_InPlace(), _WrongWeightGrad(), impls.Normkit(), impls.Torch()])
    assert rows["in-place"].ok == "yes"
    assert rows["wrong-dw"].ok == "no" and "worst output: dweight" in rows["wrong-dw"].note
    assert rows["wrong-dw"].rel_err == pytest.approx(0.5, rel=1e-3)
    # the implementations after the one that overwrote dy are checked on the original dy
    assert rows["normkit"].ok == "yes" and rows["torch"].ok == "yes"
    assert "backend torch" in rows["normkit"].note


def test_runner_records_failures_and_unsupported_cases_without_stopping():
    rows = _run(Point("sweep", "ln", "bf16", (8, 32)), "fwd", [_Raises(), impls.Torch()])
    assert rows["raises"].ok == "" and rows["raises"].gbps is None and rows["raises"].failed
    assert rows["raises"].note == "error: RuntimeError: kernel exploded"
    assert rows["torch"].ok == "yes"
    rows = _run(Point("sweep", "ln", "bf16", (8, 128)), "fwd", [_Raises(), impls.Torch()])
    assert rows["raises"].note == "unsupported: rows wider than 64" and not rows["raises"].failed


def test_groupnorm_runs_through_the_same_machinery():
    p = Point("sweep", "gn", "fp32", (2, 32, 16), 8)
    rows = _run(p, "bwd", [impls.Normkit(), impls.Torch()])
    assert rows["torch"].ok == "yes" and rows["torch"].M == 16 and rows["torch"].N == 64
    import normkit
    if not hasattr(normkit, "group_norm"):
        assert rows["normkit"].note == "unsupported: normkit.group_norm does not exist yet"


def test_groupnorm_suites_cover_the_issue_shapes_in_both_memory_formats():
    pts = plan(("gn",), ("bf16",), ("gn-1d", "gn-2d"), (), lambda d: 2**26)
    one_d = [p for p in pts if p.suite == "gn-1d"]
    assert {p.shape[0] for p in one_d} >= {1, 64} and {p.shape[1] for p in one_d} >= {64, 512}
    assert {p.shape[2] for p in one_d} >= {16, 4096} and {p.groups for p in one_d} == {8}
    two_d = [p for p in pts if p.suite == "gn-2d"]
    assert {p.groups for p in two_d} == {32} and {p.shape[-1] for p in two_d} >= {8, 128}
    assert {p.shape[1] for p in two_d} >= {128, 1280} and {p.shape[0] for p in two_d} >= {1, 32}
    nchw = {p.shape for p in two_d if not p.channels_last}
    assert nchw == {p.shape for p in two_d if p.channels_last}  # every 2D shape in both formats
    assert len({p.label for p in pts}) == len(pts) and all(p.label.endswith("/cl") == p.channels_last for p in pts)


def test_channels_last_point_runs_channels_last_inputs():
    p = Point("gn-2d", "gn", "fp32", (2, 8, 3, 5), 4, True)
    case = runner.Case(p, "bwd", "cpu", 1, seed=0)
    assert case.xs[0].is_contiguous(memory_format=torch.channels_last) and not case.xs[0].is_contiguous()
    assert case.dys[0].is_contiguous(memory_format=torch.channels_last)
    rows = _run(p, "bwd", [impls.Normkit(), impls.Torch()])
    assert rows["normkit"].ok == "yes" and rows["torch"].ok == "yes" and rows["normkit"].shape == "2x8x3x5/g4/cl"


def test_ring_covers_four_l2_sizes_for_small_inputs_and_one_set_for_large():
    l2 = 50 * 2**20
    assert runner.ring_size(Point("sweep", "ln", "bf16", (2**26 // 1024, 1024)), "fwd", l2) == 1
    small = Point("tutorial", "ln", "fp16", (4096, 512))  # 4 MiB: 8 MiB moved per forward
    assert runner.ring_size(small, "fwd", l2) == 25
    assert runner.ring_size(small, "bwd", l2) == 17


# ----------------------------------------------------------------------------- peers

@pytest.mark.parametrize("peer, module", [(impls.Liger, "liger_kernel"), (impls.Quack, "quack")])
def test_missing_or_gpu_only_peers_give_a_skip_reason(peer, module):
    why = peer().why_unavailable("cpu")
    if importlib.util.find_spec(module) is None:
        assert why.startswith("not installed") and module in why
    else:
        assert why == "needs a CUDA GPU"


def test_compile_is_skipped_on_cpu_and_forced_normkit_backends_say_why_they_cannot_run():
    assert "CUDA" in impls.Compile().why_unavailable("cpu")
    assert impls.Normkit("torch").why_unavailable("cpu") is None
    with pytest.raises(impls.Unsupported, match="backend='triton' cannot run ln: .* not on meta"):
        impls.Normkit("triton").resolved_backend(Point("sweep", "ln", "fp32", (2, 2)), "meta")


@pytest.fixture
def dynamo_config():
    """torch._dynamo's config, restored afterwards: Compile.build raises its recompile limits."""
    import torch._dynamo
    cfg = torch._dynamo.config
    with cfg.patch({k: getattr(cfg, k) for k in impls.DYNAMO_LIMITS if hasattr(cfg, k)}):
        yield cfg
    torch._dynamo.reset()


def test_compile_counts_its_graphs_and_flags_a_call_that_ran_eager(dynamo_config):
    p = Point("sweep", "rms", "fp32", (4, 32))
    x, w = torch.randn(4, 32), torch.randn(32)
    impl = impls.Compile(backend="eager")  # dynamo's graph capture without inductor's slow CPU codegen
    fn = impl.build(p, "fwd")
    fn(x, w, None)
    assert impl.after_first_call() is None
    with dynamo_config.patch(disable=True):  # torch.compile becomes a no-op: eager under compile's name
        fn = impl.build(p, "fwd")
        fn(x, w, None)
        assert "did not run" in impl.after_first_call()


# ----------------------------------------------------------------------------- report

def _row(impl, gbps, n=1024, ok="yes", op="ln", d="fwd", dtype="bf16", copy=4000.0, device="cuda", **kw):
    return Row("sweep", op, d, dtype, 2**26 // n, n, f"{2**26 // n}x{n}", impl, device, time_ms=1.0, gbps=gbps,
               copy_gbps=copy, rel_err=1e-3, tol=2e-2, ok=ok, **kw)


def _synthetic():
    return [
        _row("normkit", 3600, n=256), _row("torch", 800, n=256), _row("compile", 3900, n=256),
        _row("normkit", 2000, n=4096), _row("torch", 2500, n=4096), _row("quack", 9000, n=4096, ok="no"),
        _row("normkit", 3000, n=65536), _row("torch", 1500, n=65536), _row("liger", None, n=65536, ok="",
                                                                           note="error: RuntimeError: too wide"),
    ]


def test_finalize_derives_fraction_of_copy_and_ratio_to_the_best_correct_peer():
    rows = {(r.impl, r.N): r for r in report.finalize(_synthetic())}
    assert rows["normkit", 256].frac_of_copy == pytest.approx(0.9)
    assert rows["normkit", 256].best_peer == "compile"
    assert rows["normkit", 256].ratio_to_best_peer == pytest.approx(3600 / 3900)
    # quack's 9000 GB/s was a wrong result: torch is the bar at 4096
    assert rows["normkit", 4096].best_peer == "torch"
    assert rows["normkit", 4096].ratio_to_best_peer == pytest.approx(0.8)
    assert rows["quack", 4096].ratio_to_best_peer == pytest.approx(3.6)
    assert rows["normkit", 65536].ratio_to_best_peer == pytest.approx(2.0)
    assert rows["liger", 65536].ratio_to_best_peer is None and rows["liger", 65536].failed


def test_headline_names_the_worst_points():
    (h,) = report.headline(report.finalize(_synthetic()))
    assert (h["op"], h["dir"], h["dtype"], h["impl"], h["points"], h["wrong"]) == ("ln", "fwd", "bf16", "normkit", 3, 0)
    assert h["frac_worst"] == pytest.approx(0.5) and h["frac_worst_at"] == "16384x4096"
    assert h["frac_median"] == pytest.approx(0.75)
    assert h["ratio_worst"] == pytest.approx(0.8) and h["ratio_worst_at"] == "16384x4096"
    assert h["ratio_worst_peer"] == "torch"
    assert h["ratio_median"] == pytest.approx(3600 / 3900)


def test_csv_round_trip_keeps_rows_and_environment(tmp_path):
    rows = report.finalize(_synthetic())
    env = {"device": "cuda", "gpu": "NVIDIA H200", "copy_gbps": "4000", "skipped.quack": "not installed (x)"}
    report.write_csv(tmp_path / "r.csv", rows, env)
    back, env_back = report.read_csv(tmp_path / "r.csv")
    assert env_back == env
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        for f in ("impl", "op", "dir", "dtype", "M", "N", "shape", "ok", "note", "best_peer", "device", "suite"):
            assert getattr(a, f) == getattr(b, f)
        for f in ("gbps", "copy_gbps", "frac_of_copy", "ratio_to_best_peer", "rel_err", "time_ms"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or y == pytest.approx(x, rel=1e-5)
    host = [HostRow("ln", "bf16", "4x4096", "torch", "cuda", "fwd", 7.9, 20.0)]
    report.write_csv(tmp_path / "h.csv", host, env)
    back_host, _ = report.read_csv(tmp_path / "h.csv")
    assert back_host == host


def test_read_csv_rejects_a_foreign_file(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing"):
        report.read_csv(tmp_path / "x.csv")


def test_merging_runs_recomputes_the_best_peer_across_them(tmp_path):
    env_a = {"device": "cuda", "copy_gbps": "4000", "date": "d1"}
    env_b = {"device": "cuda", "copy_gbps": "4010", "date": "d2"}
    report.write_csv(tmp_path / "a.csv", [_row("normkit", 3000), _row("torch", 1500)], env_a)
    report.write_csv(tmp_path / "b.csv", [_row("quack", 3750, copy=4010.0)], env_b)
    rows, host, env = report.load([tmp_path / "a.csv", tmp_path / "b.csv"])
    nk = next(r for r in rows if r.impl == "normkit")
    assert nk.best_peer == "quack" and nk.ratio_to_best_peer == pytest.approx(0.8)
    assert env["copy_gbps"] == "4000 | 4010" and env["device"] == "cuda" and host == []


def test_summary_lists_wrong_results_first_and_skipped_peers():
    rows = report.finalize(_synthetic())
    md = report.summary_markdown(rows, [HostRow("ln", "bf16", "4x4096", "torch", "cuda", "fwd", 7.9, 21.5)],
                                 {"device": "cuda", "gpu": "NVIDIA H200", "skipped.liger": "not installed (y)"})
    wrong_at = md.index("## Wrong results")
    assert wrong_at < md.index("## normkit against the copy ceiling")
    assert "**quack** ln fwd bf16 16384x4096" in md
    assert "- liger: not installed (y)" in md
    assert "error: RuntimeError: too wide" in md
    assert "| ln | fwd | bf16 | normkit | 3 | 0 | 0.50 (16384x4096) | 0.75 | 0.80 (16384x4096, torch) | 0.92 |" in md
    assert "WRONG 9000" in md and "| 7.9 | 21.5 |" in md


def test_summary_of_a_cpu_run_claims_no_gpu_numbers():
    rows = report.finalize([_row("normkit", 1.5, copy=None, device="cpu"), _row("torch", 3.0, copy=None, device="cpu")])
    md = report.summary_markdown(rows, [], {"device": "cpu"})
    assert "CPU run" in md and "not GPU bandwidth" in md
    assert "| n/a | n/a | 0.50 (65536x1024, torch) |" in md


def test_compare_reports_moves_flips_and_missing_rows():
    old = report.finalize(_synthetic())
    new = report.finalize(_synthetic())
    for r in new:
        if (r.impl, r.N) == ("normkit", 4096):
            r.gbps = 3000.0  # +50%
        if (r.impl, r.N) == ("torch", 256):
            r.gbps = 820.0  # +2.5%: below the threshold
        if (r.impl, r.N) == ("quack", 4096):
            r.ok = "yes"
    new.append(_row("normkit", 100, n=32))
    lines = report.compare(old, new, 0.05, {"copy_gbps": "4000"}, {"copy_gbps": "4100"})
    text = "\n".join(lines)
    assert lines[0] == "copy ceiling: 4000 -> 4100 GB/s"
    assert "normkit ln fwd bf16 16384x4096: 2000 -> 3000 GB/s (+50.0%)" in text
    assert "torch ln fwd bf16 262144x256" not in text
    assert "quack ln fwd bf16 16384x4096: status no -> yes" in text
    assert "1 rows only in the new run" in text
    assert text.index("normkit ln fwd") < text.index("quack ln fwd")
    assert report.compare(old, report.finalize(_synthetic()))[-1].startswith("no GB/s change")


# ----------------------------------------------------------------------------- plots

def test_plots_write_one_valid_png_per_op_direction_dtype(tmp_path):
    import matplotlib.image

    from normkit.bench.plots import plot_all
    rows = _synthetic() + [_row("normkit", 900, d="bwd"), _row("torch", 1000, d="bwd"),
                           _row("normkit", 1.0, dtype="fp32", op="rms", device="cpu", copy=None)]
    paths = plot_all(report.finalize(rows), tmp_path)
    assert sorted(p.name for p in paths) == ["ln_bwd_bf16.png", "ln_fwd_bf16.png", "rms_fwd_fp32.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300


# ----------------------------------------------------------------------------- command line

def test_cli_rejects_bad_arguments_naming_them(capsys):
    with pytest.raises(SystemExit) as e:
        normkit.cli.main(["bench", "--dtypes", "bf8"])
    assert e.value.code == 2
    assert "--dtypes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        normkit.cli.main(["bench", "--widths", "100-200"])
    err = capsys.readouterr().err
    assert "--widths" in err and "powers of two" in err


@pytest.mark.skipif(HAS_CUDA, reason="the CPU fallback runs only where no CUDA GPU is visible")
def test_cpu_end_to_end_quick_run_then_report_and_compare(tmp_path, capsys):
    out = tmp_path / "run"
    rc = normkit.cli.main(["bench", "--quick", "--ops", "ln,rms", "--dtypes", "bf16,fp32", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed.splitlines()[0] == NO_GPU_LINE
    rows, env = report.read_csv(out / "results.csv")
    assert env["device"] == "cpu" and "copy_gbps" not in env
    for peer in ("liger", "quack", "compile"):
        assert env[f"skipped.{peer}"], peer
        assert f"skipped {peer}: " in printed
    assert {r.impl for r in rows} == {"normkit", "torch"}
    assert len(rows) == 2 * 2 * 2 * 2 * 2  # ops x dtypes x widths x dirs x impls
    assert all(r.ok == "yes" and r.device == "cpu" and r.frac_of_copy is None and r.gbps > 0 for r in rows)
    host, _ = report.read_csv(out / "host.csv")
    assert {(h.op, h.impl, h.mode) for h in host} == {(o, i, m) for o in ("ln", "rms") for i in ("normkit", "torch")
                                                     for m in ("fwd", "fwd+bwd")}
    assert all(h.us_per_call > 0 and h.latency_us > 0 for h in host)
    assert "CPU run" in (out / "summary.md").read_text()
    assert len(list((out / "plots").glob("*.png"))) == 2 * 2 * 2

    merged = tmp_path / "merged"
    assert normkit.cli.main(["bench", "--report", str(out), "--out", str(merged), "--no-plots",
                             "--compare", str(out / "results.csv")]) == 0
    printed = capsys.readouterr().out
    assert "no GB/s change" in printed
    assert (merged / "summary.md").read_text() == (out / "summary.md").read_text()
    assert not (merged / "plots").exists()


@pytest.mark.skipif(HAS_CUDA, reason="the CPU fallback runs only where no CUDA GPU is visible")
def test_cpu_run_with_a_forced_backend(tmp_path):
    import os
    out = tmp_path / "forced"
    forced = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    rc = normkit.cli.main(["bench", "--ops", "ln", "--dtypes", "fp32", "--widths", "64", "--rows", "8",
                           "--normkit", f"auto,{forced}", "--peers", "torch", "--no-host", "--no-plots",
                           "--out", str(out)])
    assert rc == 0
    rows, _ = report.read_csv(out / "results.csv")
    assert sorted((r.impl, r.dir) for r in rows) == sorted(
        (i, d) for i in ("normkit", f"normkit[{forced}]", "torch") for d in ("fwd", "bwd"))
    assert all(r.ok == "yes" and r.shape == "8x64" for r in rows)
    assert all(r.note == f"backend {forced}" for r in rows if r.impl == f"normkit[{forced}]")


@pytest.mark.skipif(HAS_CUDA, reason="the CPU fallback runs only where no CUDA GPU is visible")
def test_cpu_groupnorm_run(tmp_path):
    import normkit
    out = tmp_path / "gn"
    assert normkit.cli.main(["bench", "--quick", "--ops", "gn", "--dtypes", "fp32", "--dirs", "fwd",
                             "--no-host", "--no-plots", "--out", str(out)]) == 0
    rows, _ = report.read_csv(out / "results.csv")
    assert {r.shape for r in rows} == {"1x256x32/g8", "1x320x25/g32"}
    assert all(r.ok == "yes" for r in rows if r.impl == "torch")
    if not hasattr(normkit, "group_norm"):
        assert all(r.note.startswith("unsupported") for r in rows if r.impl == "normkit")



@pytest.mark.skipif(HAS_CUDA, reason="the CPU fallback runs only where no CUDA GPU is visible")
def test_a_spent_time_budget_then_resume_completes_the_run(tmp_path, capsys):
    out = tmp_path / "budget"
    args = ["bench", "--quick", "--ops", "ln", "--dtypes", "fp32", "--no-plots", "--out", str(out)]
    assert normkit.cli.main(args + ["--time-budget", "1e-9", "--no-host"]) == 0
    rows, env = report.read_csv(out / "results.csv")
    assert rows == [] and env["incomplete"].startswith("4 of 4 point-directions not run")
    assert "time budget spent" in capsys.readouterr().out
    assert normkit.cli.main(args + ["--resume", "--peers", "torch"]) == 0
    rows, env = report.read_csv(out / "results.csv")
    assert len(rows) == 8 and "incomplete" not in env
    # resuming again with one more implementation runs only that one, and what had failed
    rows[0].ok, rows[0].gbps, rows[0].note = "", None, "error: RuntimeError: CUDA error: an illegal memory access"
    report.write_csv(out / "results.csv", rows, env)
    assert normkit.cli.main(args + ["--resume", "--normkit", "auto,torch", "--peers", "torch"]) == 0
    rows, _ = report.read_csv(out / "results.csv")
    assert len(rows) == 12 and sum(r.impl == "normkit[torch]" for r in rows) == 4
    assert all(r.ok == "yes" for r in rows)
    host, _ = report.read_csv(out / "host.csv")
    assert sorted({h.impl for h in host}) == ["normkit", "normkit[torch]", "torch"]


def test_resume_refuses_results_from_another_device(tmp_path):
    report.write_csv(tmp_path / "results.csv", [_row("normkit", 3000)], {"device": "cuda", "gpu": "NVIDIA H200"})
    if HAS_CUDA:
        pytest.skip("this machine might be an H200")
    with pytest.raises(SystemExit, match="--resume: .* was measured on NVIDIA H200, this is cpu"):
        normkit.cli.main(["bench", "--quick", "--resume", "--out", str(tmp_path)])


def test_cli_parses_widths_ranges_and_no_peers():
    args = normkit.cli.build_parser().parse_args(["bench", "--widths", "256,768,1024-4096", "--peers", "none"])
    assert args.widths == (256, 768, 1024, 2048, 4096) and args.peers == ()
    assert args.dirs == ("fwd", "bwd") and args.normkit == ("auto",) and args.out == "bench-out"


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_cuda_timer_times_the_gpu_work_and_not_the_host():
    import time

    from normkit.bench.timing import CudaTimer
    timer = CudaTimer()
    cycles = int(timer.cycles_per_ms * 0.2)  # 0.2 ms of GPU work per call

    def slow_host_call():
        time.sleep(0.0005)  # 0.5 ms of host overhead before the launch
        torch.cuda._sleep(cycles)

    ms, reps = timer.median_ms([slow_host_call], warmup_ms=2, rep_ms=20)
    assert reps >= 20
    assert ms == pytest.approx(0.2, rel=0.15)


@pytest.mark.gpu
def test_gpu_rel_err_matches_the_oracle_definition():
    ref = torch.randn(1000, 3, dtype=torch.float64, device="cuda")
    out = (ref * 1.001).float()
    expected = reference.rel_err(out, ref)
    assert expected == pytest.approx(1e-3, rel=1e-3)
    assert runner.rel_err(out, ref) == pytest.approx(expected, rel=1e-9)
    out[0, 0] = float("nan")
    assert runner.rel_err(out, ref) == math.inf


@pytest.mark.gpu
def test_gpu_bench_end_to_end(tmp_path, dynamo_config):
    out = tmp_path / "gpu"
    rc = normkit.cli.main(["bench", "--ops", "ln,rms", "--dtypes", "bf16", "--widths", "1024", "--rows", "8192",
                           "--suites", "sweep", "--warmup-ms", "2", "--rep-ms", "10", "--out", str(out)])
    rows, env = report.read_csv(out / "results.csv")
    assert rc == 0, [r.note for r in rows if r.is_normkit]
    assert env["device"] == "cuda" and float(env["copy_gbps"]) > 100
    by = {(r.op, r.dir, r.impl): r for r in rows}
    for op in ("ln", "rms"):
        for d in ("fwd", "bwd"):
            for impl in ("normkit", "torch", "compile"):
                r = by[op, d, impl]
                assert r.ok == "yes" and r.gbps > 0 and 0 < r.frac_of_copy < 1.5, (op, d, impl, r.note)
            assert "did not run" not in by[op, d, "compile"].note
            assert by[op, d, "normkit"].note == "backend triton"
    for peer in ("liger", "quack"):
        assert any(r.impl == peer for r in rows) or env[f"skipped.{peer}"]
    host, _ = report.read_csv(out / "host.csv")
    assert all(h.us_per_call > 0 for h in host if h.impl in ("normkit", "torch"))


def test_gpu_quick_profile_is_five_bf16_points_and_skips_the_compile_peers_host_section():
    from normkit.bench.cli import PROFILES
    prof = PROFILES[("cuda", True)]
    pts = plan(("ln", "rms", "gn"), prof.dtypes, prof.suites, prof.widths, lambda d: prof.numel)
    assert [(p.op, p.shape) for p in pts] == [("ln", (16384, 4096)), ("ln", (1024, 65536)), ("rms", (16384, 4096)),
                                              ("rms", (1024, 65536)), ("gn", (16, 256, 4096))]
    assert {p.dtype for p in pts} == {"bf16"} and all(p.numel == 2**26 for p in pts if p.op != "gn")
    assert "compile" not in prof.host_peers and prof.warmup_ms + prof.rep_ms <= 25


def test_host_loops_are_sized_after_the_first_calls():
    """A key's first calls (a kernel's compile, the host path's plan) must not size its timed loops:
    session 23's host table read its first row 1.5-2.5x slow from 10-call loops sized by a compile."""
    import time as _time

    from normkit.bench.timing import host_overheads
    counts = {"slow first": 0, "steady": 0}

    def make(key):
        def call():
            counts[key] += 1
            if key == "slow first" and counts[key] <= 3:
                _time.sleep(0.02)  # a compile
        return call
    out = host_overheads({k: make(k) for k in counts}, lambda: None, budget_s=0.05, latency_trials=3, rounds=2)
    # same-cost calls get the same loops once warm: far more than the floor of 10 a compile-sized estimate gives
    assert counts["slow first"] > 200 and abs(counts["slow first"] - counts["steady"]) <= 3
    assert out["slow first"][0] < 1000  # microseconds per call: the warm cost, not the compile's
