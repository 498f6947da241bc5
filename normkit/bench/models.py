"""`normkit bench --models`: does patching a real model make it faster, and by how much.

For every model (model_zoo.py), mode (train: forward + backward; infer: forward without grad;
decode: batch-1 greedy decoding with a KV cache) and execution (eager, torch.compile), the variants
(unpatched, normkit.patch, Liger's RMSNorm where Liger patches the model) run side by side:

    per variant: copy the model (same random weights), patch it, [compile it], take a first step
      and compare its loss and gradients (or output) with the unpatched eager model's, warm up
    rounds, the variants taking turns: timed steps back to back, one step queued behind a GPU spin
                                             -> ms per step: median, p10, p90; host enqueue time
    per variant: steps under torch.profiler  -> GPU kernel time per step, the norm kernels' share

Step time is what a training or serving loop sees: CUDA events between steps queued back to back,
so a host-bound step shows its host time and a GPU-bound one its GPU time. The host enqueue time
is the host's time to queue one step while torch.cuda._sleep holds the GPU busy ahead of it.
Kernels count as norm kernels when launched inside a norm layer's forward (a profiler range
around every norm module, eager only), inside the backward of an op recorded there (autograd
sequence numbers), or when their or their op's name says so (norm, rsqrt, ...: the only way to
see norms in Inductor's fused kernels, so under compile the share is a lower bound).
Compiled cases reset dynamo, raise its recompile limits and record that a graph was compiled,
with how many graph breaks and recompiles, so a silent eager fallback shows in the note.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import model_zoo
from .impls import compiled_path_problem, dynamo_counts, first_line, fresh_dynamo
from .model_report import ModelRow, finalize, plot, summary_markdown, write_csv
from .model_zoo import SPECS, Unavailable

NO_GPU_LINE = ("no CUDA GPU: running the models at tiny sizes on the CPU (eager unless --exec says otherwise); "
               "numbers are CPU timings, not GPU step times")
VARIANTS = ("unpatched", "normkit", "liger")
# on request only: normkit.patch(fuse="relaxed") (adaLN modulation fused in bf16/fp16 too, one rounding)
EXTRA_VARIANTS = ("normkit-relaxed",)
EXECS = ("eager", "compile")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORM_RANGE = "normkit_bench::norm_layer"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
OUT_OF_TIME = "not run: time budget spent"


@dataclass(frozen=True)
class Steps:
    warmup: int
    rounds: int  # the variants of a model take turns: each round times every variant once
    per_round: int  # timed steps per variant and round (plus one host trial on a GPU)
    profile: int


STEPS = {("cuda", False): Steps(3, 5, 4, 3), ("cuda", True): Steps(1, 2, 3, 1),
         ("cpu", False): Steps(1, 2, 3, 1), ("cpu", True): Steps(1, 2, 2, 1)}


@dataclass
class Settings:
    device: str
    size: str  # model_zoo preset
    steps: Steps
    dtype: Optional[str] = None  # None: each model's own (CPU: fp32)
    batch: Optional[int] = None
    seq: Optional[int] = None
    compile_backend: str = "inductor"
    seed: int = 0
    spin_cycles_per_ms: float = 0.0


# ----------------------------------------------------------------------------- variants

def why_variant_unavailable(variant: str, spec, device: str) -> Optional[str]:
    if variant != "liger":
        return None
    if spec.liger is None:
        return f"Liger has no apply_liger_kernel_to_* for {spec.name} ({spec.library})"
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger is not installed (liger_kernel is not importable; pip install liger-kernel)"
    if device != "cuda":
        return "Liger's kernels need a CUDA GPU"
    try:
        mod = importlib.import_module("liger_kernel.transformers")
    except Exception as e:  # noqa: BLE001 - a broken install is a skip reason
        return f"Liger failed to import: {first_line(e)}"
    if not hasattr(mod, f"apply_liger_kernel_to_{spec.liger}"):
        return f"this Liger has no apply_liger_kernel_to_{spec.liger}"
    return None


def _apply_liger(spec, model) -> None:
    """Liger's RMSNorm only (rope, SwiGLU/GeGLU and the fused cross-entropy off): the norm-for-norm
    comparison. Liger also rebinds the norm class in transformers' modeling module, which would
    leak into every model built later; that module state is put back."""
    fn = getattr(importlib.import_module("liger_kernel.transformers"), f"apply_liger_kernel_to_{spec.liger}")
    kwargs = {name: name == "rms_norm" for name, p in inspect.signature(fn).parameters.items()
              if isinstance(p.default, bool)}
    saved = {name: dict(vars(mod)) for name, mod in list(sys.modules.items())
             if name.startswith("transformers.models.") and mod is not None}
    try:
        fn(**kwargs, model=model)
    finally:
        for name, before in saved.items():
            mod = sys.modules.get(name)
            for key in [k for k in vars(mod) if k not in before]:
                delattr(mod, key)
            for key, value in before.items():
                if vars(mod).get(key, value) is not value:
                    setattr(mod, key, value)


def apply_variant(variant: str, spec, model) -> int:
    """Patch `model` in place; returns how many norm modules the variant replaced."""
    if variant == "unpatched":
        return 0
    if variant in ("normkit", "normkit-relaxed"):
        import normkit
        return len(normkit.patch(model, fuse="relaxed" if variant == "normkit-relaxed" else getattr(spec, "fuse", True)))
    before = {name: (type(m), m.__dict__.get("forward")) for name, m in model.named_modules()}
    _apply_liger(spec, model)
    return sum(model_zoo.is_norm_module(m) and (type(m), m.__dict__.get("forward")) != before.get(name)
               for name, m in model.named_modules())


# ----------------------------------------------------------------------------- one step of work

class Work:
    """One model in one mode: `step()` runs a step, `prepare()` what must happen between steps
    outside the timing, `outputs()` one step's results to compare, `compile()` swaps in torch.compile."""

    def __init__(self, spec, model, mode: str, batch, size: dict, device: str, gen):
        self.spec, self.model, self.mode, self.batch = spec, model, mode, batch
        model.train(mode == "train")
        self.decoder = model_zoo.Decoder(model, size, device, gen) if mode == "decode" else None
        if mode == "train":
            self.fn = lambda: spec.loss(model, batch)
        elif mode == "infer":
            self.fn = lambda: spec.output(model, batch)

    def compile(self, backend: str) -> None:
        if self.decoder is not None:
            self.decoder.fn = torch.compile(self.decoder.fn, backend=backend, dynamic=False)
        else:
            self.fn = torch.compile(self.fn, backend=backend, dynamic=False)

    def prepare(self) -> None:
        if self.decoder is not None:
            self.decoder.prepare()

    def step(self) -> None:
        if self.mode == "train":
            self.model.zero_grad(set_to_none=True)
            self.fn().backward()
        elif self.mode == "infer":
            with torch.no_grad():
                self.fn()
        else:
            self.decoder.step()

    def outputs(self):
        """train: (loss, {parameter: gradient}); infer: the output; decode: the first token's logits."""
        if self.mode == "train":
            self.model.zero_grad(set_to_none=True)
            loss = self.fn()
            loss.backward()
            return loss.detach().float(), {n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                                           if p.grad is not None}
        if self.mode == "infer":
            with torch.no_grad():
                return self.fn().detach().float().clone()
        return self.decoder.reference()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    return num / den if den > 0 else num


def compare(mode: str, out, ref) -> tuple[float, Optional[float]]:
    """(loss or output relative difference, gradient relative difference over all parameters)."""
    if mode != "train":
        return rel_diff(out, ref), None
    (loss, grads), (ref_loss, ref_grads) = out, ref
    num = den = 0.0
    for name, g_ref in ref_grads.items():
        g = grads.get(name)
        g_ref = g_ref.double()
        num += float("inf") if g is None else torch.linalg.vector_norm(g.double() - g_ref).item() ** 2
        den += torch.linalg.vector_norm(g_ref).item() ** 2
    return rel_diff(loss, ref_loss), (num ** 0.5 / den ** 0.5 if den > 0 else num ** 0.5)


# ----------------------------------------------------------------------------- measuring

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(work: Work, n: int, device: str) -> list[float]:
    """ms per step of n steps queued back to back (CUDA events between them), or host-clocked on CPU."""
    times = []
    if device == "cuda":
        pairs = []
        for _ in range(n):
            work.prepare()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.step()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]
    for _ in range(n):
        work.prepare()
        t0 = time.perf_counter()
        work.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def spin_ms_for(step_ms: float) -> float:
    """How long the GPU spins ahead of a step whose host time is measured: longer than the step,
    since a step's host time cannot exceed its steady-state time unless it waits for the GPU."""
    return min(5000.0, 1.5 * step_ms + 10.0)


def host_trial_ms(work: Work, spin_ms: float, cycles_per_ms: float) -> float:
    """ms the host takes to queue one step while the GPU spins `spin_ms` ahead of it (0: GPU idle)."""
    work.prepare()
    torch.cuda.synchronize()
    if spin_ms:
        torch.cuda._sleep(int(cycles_per_ms * spin_ms))
    t0 = time.perf_counter()
    work.step()
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def host_enqueue_ms(work: Work, trials: list, spin_ms: float, cycles_per_ms: float) -> tuple[float, str]:
    """(median host ms per step, a note or ""). When queueing took most of the spin, the step waited
    for the GPU (a sync inside it, or a full launch queue) and the spin measured nothing: the host
    time is then taken with the GPU idle at the step's start instead, and the note says so."""
    ms = statistics.median(trials)
    if ms < 0.8 * spin_ms:
        return ms, ""
    idle = statistics.median(host_trial_ms(work, 0.0, cycles_per_ms) for _ in range(len(trials)))
    return idle, (f"the step waits for the GPU (queueing it took {ms:.1f} of a {spin_ms:.0f} ms GPU spin: a sync, "
                  f"or a full launch queue); host ms measured from an idle GPU instead")


_NORM_WORDS = ("norm", "rsqrt", "welford", "moments", "gammabeta", "computeinternalgradients", "fusedparams")
_NOT_NORM_WORDS = ("vector_norm", "normal")


def is_norm_name(name: str) -> bool:
    n = name.lower()
    return any(w in n for w in _NORM_WORDS) and not any(w in n for w in _NOT_NORM_WORDS)


def norm_ranges(model) -> list:
    """Forward hooks that put every norm module's forward inside a NORM_RANGE profiler range."""
    from torch.autograd.profiler import record_function
    open_ranges = []

    def enter(module, args):
        rf = record_function(NORM_RANGE)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(module, args, out):
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for m in model.modules():
        if model_zoo.is_norm_module(m):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    return handles


def norm_events(events) -> set:
    """ids of the CPU events that are norm work: inside a NORM_RANGE, the backward of an op recorded
    there (same autograd sequence number), or under an op whose name says norm."""
    from torch.autograd import DeviceType
    cpu = [e for e in events if e.device_type == DeviceType.CPU]

    def in_range(e):
        while e is not None:
            if e.name == NORM_RANGE:
                return True
            e = e.cpu_parent
        return False

    seqs = {e.sequence_nr for e in cpu if e.sequence_nr >= 0 and in_range(e)}

    def marks(a) -> bool:
        return (a.name == NORM_RANGE or is_norm_name(a.name)
                or (a.name.startswith(BACKWARD_PREFIX) and a.sequence_nr in seqs))

    memo: dict = {}  # id(event) -> whether it or an ancestor marks norm work
    for e in cpu:
        path = []
        while e is not None and id(e) not in memo:
            path.append(e)
            e = e.cpu_parent
        hit = memo[id(e)] if e is not None else False
        for a in reversed(path):
            hit = hit or marks(a)
            memo[id(a)] = hit
    return {k for k, v in memo.items() if v}


def kernel_times(events, device: str) -> tuple[float, float]:
    """(all kernel time, norm kernel time) in microseconds from a profile's events. On a CPU the
    'kernels' are the self time of the aten ops."""
    from torch.autograd import DeviceType
    norm = norm_events(events)
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if device == "cuda":  # by name over every kernel (some are linked to no op), by op for the rest
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        total = sum(e.time_range.elapsed_us() for e in kernels)
        in_norm = sum(e.time_range.elapsed_us() for e in kernels if is_norm_name(e.name))
        in_norm += sum(k.duration for e in cpu if id(e) in norm for k in e.kernels if not is_norm_name(k.name))
    else:
        ops = [e for e in cpu if e.name.startswith("aten::")]
        total = sum(e.self_cpu_time_total for e in ops)
        in_norm = sum(e.self_cpu_time_total for e in ops if id(e) in norm)
    return total, in_norm


def profile_steps(work: Work, n: int, device: str, ranges: bool) -> tuple[float, float]:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    handles = norm_ranges(work.model) if ranges else []
    try:
        with profile(activities=activities) as prof:
            for _ in range(n):
                work.prepare()
                work.step()
            _sync(device)
    finally:
        for h in handles:
            h.remove()
    return kernel_times(prof.events(), device)


# ----------------------------------------------------------------------------- the variants of one model

@dataclass
class _Case:
    row: ModelRow
    work: Optional[Work] = None
    notes: list = None
    times: list = None
    host: list = None
    recompiles: int = 0
    op_calls: tuple = (0, 0, 0, 0, 0)  # over the timed steps: _op_calls()'s counters, then the steps

    def fail(self, e: BaseException) -> None:
        self.notes.insert(0, f"error: {first_line(e)}")
        self.work = None


def _op_calls() -> tuple:
    """The C++ host path's counters so far: normkit's custom-op calls (compiled code calls them)
    served in C++ and left to Python (the op's implementation or its autograd), then the eager
    calls' plan replays and Python host runs (a key's first calls, or a call no plan can replay)."""
    from .. import _host

    st = _host.stats()
    return (st.get("op_served", 0), st.get("op_python", 0) + st.get("op_autograd_python", 0),
            st.get("replays", 0), st.get("python_runs", 0))


def _start(c: _Case, spec, base, size: dict, batch, ref, s: Settings) -> None:
    """Copy and patch the model, [compile it,] take its first step against the reference, warm up."""
    r = c.row
    model = copy.deepcopy(base)
    r.patched = apply_variant(r.variant, spec, model)
    if r.variant != "unpatched" and not r.patched:
        c.notes.append(f"{r.variant} replaced no norm module: the same model as unpatched")
    c.work = Work(spec, model, r.mode, batch, size, s.device, torch.Generator(s.device).manual_seed(s.seed + 1))
    before = dynamo_counts()
    if r.exec == "compile":
        c.work.compile(s.compile_backend)
    t0 = time.perf_counter()
    out = c.work.outputs()
    _sync(s.device)
    r.first_call_s = time.perf_counter() - t0
    r.out_diff, r.grad_diff = compare(r.mode, out, ref)
    del out
    if r.exec == "compile":
        c.notes.append(compiled_path_problem(before) or "")
    for _ in range(s.steps.warmup):
        c.work.prepare()
        c.work.step()


def _round(c: _Case, s: Settings) -> None:
    """One turn of a variant: timed steps back to back, then one host trial on a GPU."""
    before = dynamo_counts()[0]
    ops = _op_calls()
    c.times += time_steps(c.work, s.steps.per_round, s.device)
    c.op_calls = tuple(a + b - o for a, b, o in zip(c.op_calls, _op_calls() + (s.steps.per_round,), ops + (0,)))
    if s.device == "cuda":
        c.host.append(host_trial_ms(c.work, spin_ms_for(statistics.median(c.times)), s.spin_cycles_per_ms))
    c.recompiles += dynamo_counts()[0] - before


def _finish(c: _Case, spec, size: dict, s: Settings) -> None:
    r, times = c.row, c.times
    r.ms = statistics.median(times)
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    r.ms_p10, r.ms_p90, r.steps = q[0], q[-1], len(times)
    r.throughput = (1 if r.mode == "decode" else spec.items(size)) / (r.ms / 1e3)
    if c.host:
        r.host_ms, note = host_enqueue_ms(c.work, c.host, spin_ms_for(r.ms), s.spin_cycles_per_ms)
        c.notes.append(note)
    if s.steps.profile:
        total, norm = profile_steps(c.work, s.steps.profile, s.device, ranges=r.exec == "eager")
        r.kernel_ms, r.norm_ms = total / s.steps.profile / 1e3, norm / s.steps.profile / 1e3
        r.norm_share = norm / total if total > 0 else None
    if c.recompiles:
        c.notes.append(f"dynamo compiled {c.recompiles} more graph(s) while timed: recompiles")
    served, python, replays, runs, steps = c.op_calls
    if served or python:  # the compiled code kept normkit's ops: where their calls ran
        c.notes.append(f"normkit op calls per step: {served / steps:g} in C++, {python / steps:g} in Python")
    elif replays or runs:  # eager: how many calls the C++ host path replayed, how many ran its Python
        c.notes.append(f"host path per step: {replays / steps:g} plan replays, {runs / steps:g} Python runs")


def run_variants(spec, base, size: dict, mode: str, exe: str, variants, batch, ref, s: Settings,
                 dtype: str) -> list[ModelRow]:
    """Every variant of one model, mode and execution. The variants are built and warmed up one
    after another, then take turns in rounds of timed steps, so that a drift of the machine (clocks,
    other load) over the minutes a model takes falls on all of them alike."""
    norms = sum(map(model_zoo.is_norm_module, base.modules()))
    cases = [_Case(ModelRow(spec.name, mode, exe, v, s.device, dtype, shape_of(spec, size, mode),
                            unit=f"{'tokens' if mode == 'decode' else spec.unit}/s", norms=norms), notes=[], times=[],
                   host=[]) for v in variants]
    if exe == "compile":
        fresh_dynamo()  # one reset per model and mode: the variants' compiled code must live side by side
    for c in cases:
        why = why_variant_unavailable(c.row.variant, spec, s.device)
        if why:
            c.notes.append(f"skipped: {why}")
            continue
        try:
            _start(c, spec, base, size, batch, ref, s)
        except Exception as e:  # noqa: BLE001 - one variant failing must not stop the others
            c.fail(e)
    live = [c for c in cases if c.work is not None]
    for _ in range(s.steps.rounds):
        for c in live:
            try:
                if c.work is not None:
                    _round(c, s)
            except Exception as e:  # noqa: BLE001
                c.fail(e)
    for c in live:
        try:
            if c.work is not None:
                _finish(c, spec, size, s)
        except Exception as e:  # noqa: BLE001
            c.fail(e)
            c.row.ms = None
    for c in cases:
        c.row.note = "; ".join(n for n in c.notes if n)
        c.work = None
    if s.device == "cuda":
        torch.cuda.empty_cache()
    return [c.row for c in cases]


# ----------------------------------------------------------------------------- the suite

def _build(spec, size: dict, s: Settings, dtype: str):
    torch.manual_seed(s.seed)
    model = spec.build(size, s.device).to(DTYPES[dtype])
    if spec.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model_zoo.randomize_norms(model, torch.Generator(s.device).manual_seed(s.seed))
    return model


def _batch(spec, size, s: Settings, dtype: str, mode: str):
    if mode == "decode":
        return None
    batch = spec.batch(size, s.device, DTYPES[dtype], torch.Generator(s.device).manual_seed(s.seed + 2))
    if spec.channels_last:
        batch = {k: v.to(memory_format=torch.channels_last) if v.dim() == 4 else v for k, v in batch.items()}
    return batch


def shape_of(spec, size: dict, mode: str) -> str:
    return spec.decode_shape(size) if mode == "decode" else spec.shape(size)


def cases(models, modes, execs, variants) -> list[tuple]:
    return [(m, mode, e, v) for m in models for mode in modes if mode in SPECS[m].modes for e in execs for v in variants]


def run_suite(models, modes, execs, variants, s: Settings, progress=None, deadline: Optional[float] = None,
              env: Optional[dict] = None, saved=None) -> list[ModelRow]:
    """Every (model, mode, exec, variant) case; a model that cannot be built gives rows that say why.
    saved(rows) is called after each model, mode and execution (a run cut short keeps its rows)."""
    rows = []
    todo = cases(models, modes, execs, variants)
    for name in models:
        spec = SPECS[name]
        mine = [c for c in todo if c[0] == name]
        if not mine:
            continue
        size = model_zoo.size_of(spec, s.size, s.batch, s.seq)
        dtype = s.dtype or (spec.dtype if s.device == "cuda" else "fp32")

        def skip_all(note, cs):
            for _, mode, e, v in cs:
                rows.append(ModelRow(name, mode, e, v, s.device, dtype, shape_of(spec, size, mode), note=note))
            if progress:
                progress.step(len(cs), f"{name}: {note}")

        def attempt(fn, what, cs):
            """fn(), or None after rows that say why the cases cs cannot run."""
            try:
                return fn()
            except Unavailable as e:
                skip_all(f"skipped: {e}", cs)
            except Exception as e:  # noqa: BLE001 - one model failing must not stop the suite
                skip_all(f"error: {what}: {first_line(e)}", cs)
            return None

        if deadline is not None and time.time() > deadline:
            skip_all(OUT_OF_TIME, mine)
            continue
        base = attempt(lambda: _build(spec, size, s, dtype), "building the model", mine)
        if base is None:
            continue
        for mode in dict.fromkeys(c[1] for c in mine):
            here = [c for c in mine if c[1] == mode]
            batch = _batch(spec, size, s, dtype, mode)
            ref = attempt(lambda: Work(spec, copy.deepcopy(base), mode, batch, size, s.device,
                                       torch.Generator(s.device).manual_seed(s.seed + 1)).outputs(),
                          "the unpatched eager reference", here)
            if ref is None:
                continue
            for e in dict.fromkeys(c[2] for c in here):
                group = [c for c in here if c[2] == e]
                if deadline is not None and time.time() > deadline:
                    skip_all(OUT_OF_TIME, group)
                    continue
                done = run_variants(spec, base, size, mode, e, [c[3] for c in group], batch, ref, s, dtype)
                rows += done
                if progress:
                    for row in done:
                        progress.step(1, row.line())
                if saved:
                    saved(rows)
            del ref, batch
        del base
        if s.device == "cuda":
            torch.cuda.empty_cache()
    if env is not None and any(r.note == OUT_OF_TIME for r in rows):
        env["incomplete"] = f"{sum(r.note == OUT_OF_TIME for r in rows)} cases not run (time budget)"
    return finalize(rows)


# ----------------------------------------------------------------------------- command line

def add_arguments(parser) -> None:
    from .cli_args import _list_of, _positive
    g = parser.add_argument_group("model benchmark (normkit bench --models)")
    g.add_argument("--models", nargs="?", const=",".join(model_zoo.DEFAULT_MODELS),
                   type=_list_of(tuple(SPECS), "models"),
                   help="run the model benchmark instead of the kernel sweep: the models to run, "
                        f"from {', '.join(SPECS)} (alone: {','.join(model_zoo.DEFAULT_MODELS)})")
    g.add_argument("--modes", type=_list_of(model_zoo.MODES, "modes"), default=model_zoo.MODES,
                   help="train (forward + backward), infer (forward, no grad), decode (HF models: batch-1 greedy "
                        "decoding with a KV cache); default: all a model has")
    g.add_argument("--exec", dest="execs", type=_list_of(EXECS, "executions"),
                   help="eager and/or compile (torch.compile); default GPU: eager,compile, CPU: eager")
    g.add_argument("--variants", type=_list_of(VARIANTS + EXTRA_VARIANTS, "variants"), default=VARIANTS,
                   help="unpatched, normkit (normkit.patch), liger (Liger's RMSNorm where Liger patches the model), "
                        "normkit-relaxed (normkit.patch(fuse='relaxed'): adaLN modulation fused in 16-bit too); "
                        "default: unpatched,normkit,liger")
    g.add_argument("--model-size", choices=("tiny", "full"),
                   help="model sizes: full (realistic widths, the GPU default) or tiny (the CPU default)")
    g.add_argument("--model-dtype", choices=tuple(DTYPES), help="default: each model's own on a GPU, fp32 on a CPU")
    g.add_argument("--batch", type=_positive(int), help="batch size of every model (default: its preset's)")
    g.add_argument("--seq", type=_positive(int), help="tokens per sequence of the HF models' train/infer steps")
    g.add_argument("--steps", type=_positive(int),
                   help="timed steps per case, taken in rounds in which the variants alternate "
                        "(default GPU 20 in 5 rounds, quick 6 in 2, CPU 6 in 2)")
    g.add_argument("--rounds", type=_positive(int),
                   help="rounds the timed steps are taken in (default GPU 5, quick 2, CPU 2): more rounds "
                        "spread a host-bound case's drift over every variant alike")
    g.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")


def run(args, device: str, start: float) -> int:
    from .cli_args import _Progress
    from .environment import _version, collect
    from .timing import spin_cycles_per_ms

    steps = STEPS[(device, args.quick)]
    rounds = args.rounds or steps.rounds
    total = args.steps or steps.rounds * steps.per_round
    steps = Steps(steps.warmup, rounds, -(-total // rounds), steps.profile)
    s = Settings(device, args.model_size or ("full" if device == "cuda" else "tiny"), steps, args.model_dtype,
                 args.batch, args.seq, args.compile_backend, args.seed)
    execs = args.execs or (EXECS if device == "cuda" else ("eager",))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = collect(device)
    env.update({name: _version(dist) for name, dist in (("transformers", "transformers"), ("timm", "timm"),
                                                          ("diffusers", "diffusers"))})
    if Path(sys.argv[0]).name in ("normkit", "__main__.py"):  # not when called from Python (tests)
        env["command"] = "normkit " + " ".join(sys.argv[1:])
    env.update(model_size=s.size, steps=f"{steps.warmup} warm-up, {steps.rounds} rounds of {steps.per_round} timed "
                                          f"(+1 host trial on a GPU) per variant, {steps.profile} profiled",
               compile_backend=s.compile_backend)
    if device == "cuda":
        s.spin_cycles_per_ms = spin_cycles_per_ms()
    todo = cases(args.models, args.modes, execs, args.variants)
    progress = _Progress(len(todo))
    deadline = start + args.time_budget if args.time_budget else None
    rows = run_suite(args.models, args.modes, execs, args.variants, s, progress, deadline, env,
                     saved=lambda rows: write_csv(out / "models.csv", rows, env))
    progress.close()
    _write(args, out, rows, env)
    errors = [r for r in rows if r.note.startswith("error") and r.variant == "normkit"]
    if errors:
        print(f"{len(errors)} normkit cases failed; see {out / 'models.md'}", file=sys.stderr)
    return 1 if errors else 0


def _write(args, out: Path, rows, env) -> None:
    write_csv(out / "models.csv", rows, env)
    (out / "models.md").write_text(summary_markdown(rows, env))
    written = [out / "models.csv", out / "models.md"]
    if not args.no_plots:
        try:
            written += plot(rows, out / "models.png")
        except ImportError as e:  # matplotlib is optional (pip install normkit[bench])
            print(f"plot skipped: {e}")
    print(f"wrote {len(written)} files under {out}/ (summary: {out / 'models.md'})")


def report_only(args) -> int:
    """--models --report DIR...: merge models.csv files into one CSV, summary and PNG under --out."""
    from .model_report import load
    try:
        rows, env = load(args.report)
    except (OSError, ValueError) as e:
        print(f"--report: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(args, out, rows, env)
    return 0
