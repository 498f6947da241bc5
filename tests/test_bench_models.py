"""`normkit bench --models` on the CPU: option parsing, the tiny CPU run end to end (HF Llama with
decoding, seed 004's 1D U-Net; eager), the profile's attribution of kernels to norm layers, the
report's speedups, targets and merging. The GPU runs are benchmarks/device_models.sh."""
import csv

import pytest
import torch
from torch import nn

import normkit.cli
from normkit.bench import model_report, model_zoo, models
from normkit.bench.model_report import ModelRow

from conftest import HAS_CUDA


def _parse(*argv):
    return normkit.cli.build_parser().parse_args(["bench", *argv])


# ----------------------------------------------------------------------------- options

def test_models_option_alone_picks_the_default_models_and_a_list_picks_those():
    assert _parse().models is None  # the kernel bench
    args = _parse("--models")
    assert args.models == model_zoo.DEFAULT_MODELS
    assert {"llama", "qwen3", "gemma", "vit", "convnext", "resnet50-gn", "unet2d", "unet1d"} == set(args.models)
    args = _parse("--models", "unet1d,llama", "--modes", "decode", "--exec", "compile", "--variants", "normkit",
                  "--model-size", "tiny", "--batch", "3", "--seq", "16", "--steps", "4")
    assert args.models == ("unet1d", "llama") and args.modes == ("decode",) and args.execs == ("compile",)
    assert args.variants == ("normkit",) and (args.model_size, args.batch, args.seq, args.steps) == ("tiny", 3, 16, 4)
    assert _parse("--models").variants == ("unpatched", "normkit", "liger")


@pytest.mark.parametrize("argv, named", [
    (("--models", "llama,bert"), "--models"), (("--models", "llama", "--modes", "serve"), "--modes"),
    (("--models", "llama", "--exec", "jit"), "--exec"), (("--models", "llama", "--variants", "apex"), "--variants"),
    (("--models", "llama", "--model-size", "huge"), "--model-size"), (("--models", "llama", "--batch", "0"), "--batch"),
])
def test_bad_model_options_name_the_option_and_what_was_expected(argv, named, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    err = capsys.readouterr().err
    assert named in err and ("expected" in err or "invalid choice" in err)


def test_every_model_has_both_presets_and_known_modes():
    for spec in model_zoo.SPECS.values():
        assert set(spec.sizes) == {"full", "tiny"}, spec.name
        assert set(spec.modes) <= set(model_zoo.MODES) and "train" in spec.modes, spec.name
    # the training shape: several thousand tokens per step for the HF models
    for name in ("llama", "qwen3", "gemma"):
        s = model_zoo.size_of(model_zoo.SPECS[name], "full")
        assert s["batch"] * s["seq"] >= 4096 and "decode" in model_zoo.SPECS[name].modes
    assert model_zoo.size_of(model_zoo.SPECS["unet1d"], "full")["batch"] == 1


# ----------------------------------------------------------------------------- pieces

def test_norm_modules_are_recognised_by_class_name():
    class LlamaRMSNorm(nn.Module):
        pass

    class Block(nn.Module):  # holds a norm, is not one
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)

    for m in (nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.RMSNorm(4), nn.BatchNorm2d(4), LlamaRMSNorm()):
        assert model_zoo.is_norm_module(m), type(m).__name__
    for m in (nn.Linear(2, 2), nn.Mish(), Block(), model_zoo.Conv1dBlock(4, 8)):
        assert not model_zoo.is_norm_module(m), type(m).__name__
    assert sum(map(model_zoo.is_norm_module, model_zoo.UNet1d(4, (16, 32)).modules())) == 17


@pytest.mark.parametrize("name, norm", [
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>", True),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", True),
    ("row_norm_bwd_kernel", True), ("_rms_norm_forward_kernel", True),
    ("void at::native::RowwiseMomentsCUDAKernel<float>", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", False), ("aten::linalg_vector_norm", False),
    ("void at::native::normal_kernel", False), ("triton_poi_fused_mul_silu_0", False),
])
def test_kernel_names_that_say_norm(name, norm):
    assert models.is_norm_name(name) is norm


def test_profile_attributes_forward_and_backward_of_norm_layers_and_nothing_else():
    from torch.profiler import ProfilerActivity, profile

    class PythonRMSNorm(nn.Module):  # unfused, like HF's: its backward ops have generic names
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    model = nn.Sequential(nn.Linear(16, 16), PythonRMSNorm(16), nn.Linear(16, 16), nn.LayerNorm(16))
    x = torch.randn(4, 16)
    handles = models.norm_ranges(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    for h in handles:
        h.remove()
    events = prof.events()
    norm = models.norm_events(events)
    backward = {e.name[len(models.BACKWARD_PREFIX):]: id(e) in norm for e in events
                if e.name.startswith(models.BACKWARD_PREFIX)}
    for name in ("PowBackward0", "MeanBackward1", "RsqrtBackward0", "NativeLayerNormBackward0"):
        assert backward[name], name
    assert not backward["AddmmBackward0"] and not backward["SumBackward0"]
    assert {e.name for e in events if e.name.startswith("aten::addmm")}.isdisjoint(
        {e.name for e in events if id(e) in norm})
    total, in_norm = models.kernel_times(events, "cpu")
    assert 0 < in_norm < total
    model_without = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model_without(x).sum().backward()
    assert models.kernel_times(prof.events(), "cpu")[1] == 0


def test_liger_is_skipped_with_the_reason():
    why = models.why_variant_unavailable("liger", model_zoo.SPECS["unet1d"], "cpu")
    assert "no apply_liger_kernel_to_" in why
    why = models.why_variant_unavailable("liger", model_zoo.SPECS["llama"], "cpu")
    assert "not installed" in why or "CUDA" in why
    assert models.why_variant_unavailable("normkit", model_zoo.SPECS["llama"], "cpu") is None


# ----------------------------------------------------------------------------- end to end on the CPU

@pytest.mark.skipif(HAS_CUDA, reason="the CPU variant; on a GPU the device script runs the suite")
def test_cpu_run_of_two_tiny_models_end_to_end(tmp_path, capsys):
    out = tmp_path / "m"
    rc = normkit.cli.main(["bench", "--models", "llama,unet1d", "--steps", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == models.NO_GPU_LINE
    assert rc == 0, printed
    rows, env = model_report.load([out])
    by = {r.key: r for r in rows}
    expected = {(m, mode, "eager", v) for m, modes in (("llama", ("train", "infer", "decode")),
                                                      ("unet1d", ("train", "infer")))
                for mode in modes for v in models.VARIANTS}
    assert set(by) == expected
    for (m, mode, _, v), r in by.items():
        if v == "liger":
            assert not r.ran and r.note.startswith("skipped: "), r.note
            continue
        assert r.ran and r.note == "", (r.key, r.note)
        assert r.ms_p10 <= r.ms <= r.ms_p90 and r.steps == 2 and r.throughput > 0
        assert r.kernel_ms > 0 and 0 < r.norm_share < 1, r.key  # the norms' ops are found, and not only them
        assert r.out_diff <= 1e-5 and (r.grad_diff is None) == (mode != "train")
        assert r.grad_diff is None or r.grad_diff <= 1e-4
        assert r.patched == (r.norms if v == "normkit" else 0)
        assert r.speedup is not None and r.unit.endswith("/s")
    assert by["llama", "train", "eager", "unpatched"].norms == 5  # 2 layers x 2 + the final norm
    assert by["unet1d", "infer", "eager", "normkit"].norms == 17
    assert by["llama", "decode", "eager", "normkit"].unit == "tokens/s"
    assert by["llama", "train", "eager", "unpatched"].speedup == 1.0
    md = (out / "models.md").read_text()
    assert "CPU run" in md and "## Issue 14 targets" in md and "| llama | decode | eager | normkit |" in md
    assert "Liger is not installed" in md or "CUDA GPU" in md
    assert (out / "models.png").stat().st_size > 0
    assert env["device"] == "cpu" and env["model_size"] == "tiny"


# ----------------------------------------------------------------------------- report

def _r(model, mode, exe, variant, ms, p10=None, p90=None, **kw):
    return ModelRow(model, mode, exe, variant, "cuda", "bf16", "s", ms, p10 or ms, p90 or ms, 10, **kw)


def test_speedup_and_its_range_come_from_the_unpatched_row_of_the_same_mode_and_exec():
    rows = model_report.finalize([
        _r("llama", "train", "eager", "unpatched", 40.0, 39.0, 41.0), _r("llama", "train", "eager", "normkit", 35.0, 34.0, 36.0),
        _r("llama", "train", "compile", "unpatched", 30.0), _r("llama", "train", "compile", "normkit", 32.0, 31.5, 32.5),
        _r("llama", "train", "eager", "liger", 36.0), ModelRow("llama", "decode", "eager", "normkit", "cuda", "bf16", "s")])
    by = {r.key: r for r in rows}
    nk = by["llama", "train", "eager", "normkit"]
    assert nk.speedup == pytest.approx(40 / 35) and nk.speedup_lo == pytest.approx(39 / 36)
    assert nk.speedup_hi == pytest.approx(41 / 34)
    assert by["llama", "train", "compile", "normkit"].speedup == pytest.approx(30 / 32)
    assert by["llama", "decode", "eager", "normkit"].speedup is None
    lines = "\n".join(model_report.targets(rows))
    assert "slower beyond the spread: llama train compile 0.94" in lines
    assert "llama eager train >= 1.10: 1.14 (met)" in lines
    assert "llama eager train at least as fast as Liger: 1.03 (met)" in lines
    assert "qwen3 eager train >= 1.10: not measured" in lines
    md = model_report.summary_markdown(rows, {"device": "cuda", "gpu": "H200"})
    assert "**0.94" in md  # slower beyond the spread is bold


def test_differences_above_tolerance_are_listed_as_problems():
    bad = _r("vit", "train", "eager", "normkit", 10.0, out_diff=1e-3, grad_diff=0.2)
    ok = _r("vit", "train", "eager", "unpatched", 10.0, out_diff=0.0, grad_diff=0.0)
    assert bad.differs() and not ok.differs()
    md = model_report.summary_markdown([ok, bad], {"device": "cuda"})
    assert "vit train eager normkit: differs from the unpatched eager model" in md


def test_a_model_that_differs_from_itself_sets_the_floor_its_variants_are_held_to():
    # DiT training on the device (session 10): the unpatched step's gradients differ from a second run by 0.41
    # (kernels that are not run-to-run deterministic); normkit's 0.45 is that noise, 0.9 is not
    ref = _r("dit", "train", "eager", "unpatched", 10.0, out_diff=0.0056, grad_diff=0.41)
    noise = _r("dit", "train", "eager", "normkit", 10.0, out_diff=0.0056, grad_diff=0.45)
    wrong = _r("dit", "train", "eager", "normkit-relaxed", 10.0, out_diff=0.0, grad_diff=0.9)
    md = model_report.summary_markdown([ref, noise, wrong], {"device": "cuda"})
    problems = md.split("## Problems")[1].split("## Notes")[0]
    assert "dit train eager normkit-relaxed: differs" in problems and "twice the unpatched" in problems
    assert "dit train eager normkit:" not in problems and "dit train eager unpatched" not in problems
    assert "dit train: the unpatched eager model differs from a second run of itself by 0.0056" in md


def test_report_merges_model_csvs_of_several_groups(tmp_path, capsys):
    env = {"device": "cuda", "gpu": "H200"}
    model_report.write_csv(tmp_path / "a" / "models.csv", [_r("llama", "train", "eager", "unpatched", 40.0),
                                                          _r("llama", "train", "eager", "normkit", 20.0)], env)
    model_report.write_csv(tmp_path / "b" / "models.csv", [_r("vit", "infer", "compile", "unpatched", 10.0),
                                                          _r("vit", "infer", "compile", "normkit", 12.5)], env)
    out = tmp_path / "merged"
    rc = normkit.cli.main(["bench", "--models", "--report", str(tmp_path / "a"), str(tmp_path / "b" / "models.csv"),
                           "--out", str(out), "--no-plots"])
    assert rc == 0
    with open(out / "models.csv") as f:
        body = [line for line in f if not line.startswith("#")]
    rows = list(csv.DictReader(body))
    assert {(r["model"], r["variant"], r["speedup"]) for r in rows} == {
        ("llama", "unpatched", "1.0"), ("llama", "normkit", "2.0"), ("vit", "unpatched", "1.0"), ("vit", "normkit", "0.8")}
    assert "# gpu: H200" in (out / "models.csv").read_text()
    assert normkit.cli.main(["bench", "--models", "--report", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "holds no models.csv" in capsys.readouterr().err


@pytest.mark.skipif(HAS_CUDA, reason="the CPU variant; on a GPU the device script runs the suite")
def test_compiled_variants_side_by_side_each_compile_a_graph_and_do_not_recompile_while_timed(tmp_path):
    import torch._dynamo
    out = tmp_path / "c"
    try:  # dynamo's "eager" backend: graph capture, guards and recompiles without inductor's slow CPU codegen
        rc = normkit.cli.main(["bench", "--models", "resnet-blocks", "--modes", "infer", "--exec", "compile",
                               "--compile-backend", "eager", "--variants", "unpatched,normkit", "--steps", "2",
                               "--out", str(out), "--no-plots"])
    finally:
        torch._dynamo.reset()
    assert rc == 0
    rows, _ = model_report.load([out])
    assert [(r.variant, r.ran, r.note) for r in rows] == [("unpatched", True, ""), ("normkit", True, "")]
    assert rows[1].patched == rows[1].norms == 4 and rows[1].out_diff <= 1e-5


@pytest.mark.parametrize("name", ["whisper-encoder", "t5-encoder", "dit", "sd15-unet", "sd3"])
def test_encoder_and_dit_cases_build_patch_and_match(name):
    """The model benchmark's Whisper-style encoder (column-strided LayerNorm rows), T5 encoder
    (T5LayerNorm, recognised by computation) and DiT (adaLN-Zero's LayerNorm): tiny, on the CPU,
    every norm patched, the patched step's loss equal to the unpatched one's."""
    import copy

    import normkit
    spec = model_zoo.SPECS[name]
    size = model_zoo.size_of(spec, "tiny")
    torch.manual_seed(0)
    model = spec.build(size, "cpu")
    model_zoo.randomize_norms(model, torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    report = normkit.patch(model, fuse=spec.fuse)
    norms = [n for n, m in plain.named_modules() if model_zoo.is_norm_module(m)]
    assert norms and set(report) == set(norms) and not report.skipped, str(report)
    if name in ("dit", "sd3"):  # the benchmark exercises the fused adaLN modulation
        assert any("adaLN" in what for what in report.fused.values()), str(report)
    batch = spec.batch(size, "cpu", torch.float32, torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, expected = spec.loss(model, batch), spec.loss(plain, batch)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got.item(), expected.item())


def test_relaxed_variant_fuses_the_modulation_in_bf16_where_the_default_does_not(monkeypatch):
    """The bench's normkit-relaxed variant is normkit.patch(fuse="relaxed"): DiT's adaLN modulation
    runs in normkit's kernel in bf16, where the default variant keeps the module's own roundings."""
    from normkit import _cpu
    from normkit.bench import models as bench_models
    spec = model_zoo.SPECS["dit"]
    size = model_zoo.size_of(spec, "tiny")
    # every normkit row norm call on CPU tensors is offered to the CPU fast path first (by the public functions,
    # the patched modules' forwards and the fused blocks, all with positional arguments): its scale argument
    # (the 14th) says whether the modulation reached normkit
    real, modulated = _cpu.row_norm, []
    monkeypatch.setattr(_cpu, "row_norm", lambda *a: modulated.append(len(a) > 13 and a[13] is not None) or real(*a))
    calls = {}
    for variant in ("normkit", "normkit-relaxed"):
        modulated.clear()
        torch.manual_seed(0)
        model = spec.build(size, "cpu").to(torch.bfloat16)
        assert bench_models.apply_variant(variant, spec, model) > 0
        batch = spec.batch(size, "cpu", torch.bfloat16, torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.isfinite(spec.loss(model, batch))
        calls[variant] = sum(modulated)
    assert calls["normkit"] == 0 and calls["normkit-relaxed"] > 0, calls


def test_a_variant_that_fails_records_its_error_and_the_others_still_run(tmp_path, monkeypatch):
    real = models.apply_variant

    def apply_variant(variant, spec, model):
        if variant == "normkit":
            raise RuntimeError("patching broke")
        return real(variant, spec, model)

    monkeypatch.setattr(models, "apply_variant", apply_variant)
    out = tmp_path / "f"
    normkit.cli.main(["bench", "--models", "unet1d", "--modes", "infer", "--variants", "unpatched,normkit",
                      "--steps", "2", "--out", str(out), "--no-plots"])
    rows, _ = model_report.load([out])
    by = {r.variant: r for r in rows}
    assert by["unpatched"].ran and by["unpatched"].note == ""
    assert not by["normkit"].ran and by["normkit"].note.startswith("error: ") and "patching broke" in by["normkit"].note
