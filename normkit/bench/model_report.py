"""Rows, CSV, markdown summary, issue 14's targets and the PNG of `normkit bench --models`.

The derived columns (speedup over the unpatched model in the same mode and execution, and its
range from the step-time spread) are recomputed by finalize() whenever rows are written or read,
so CSVs of several runs (the device script runs groups of models in separate calls) merge into
one report with `normkit bench --models --report DIR... --out merged/`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import report
from .report import _num, _table

# relative loss / gradient / output difference from the unpatched eager model above which a row is
# listed as differing: a whole model's gradient in bf16 moves by about 1e-2 when one layer rounds
# differently; in fp32 it stays near 1e-5
DIFF_TOL = {"bf16": 5e-2, "fp16": 5e-2, "fp32": 1e-3}
HF = ("llama", "qwen3", "gemma")


@dataclass
class ModelRow:
    model: str
    mode: str  # train, infer, decode
    exec: str  # eager, compile
    variant: str  # unpatched, normkit, liger
    device: str
    dtype: str
    shape: str
    ms: Optional[float] = None  # median ms per step
    ms_p10: Optional[float] = None
    ms_p90: Optional[float] = None
    steps: Optional[int] = None
    speedup: Optional[float] = None  # unpatched ms / this ms, same model, mode and exec
    speedup_lo: Optional[float] = None  # unpatched p10 / this p90
    speedup_hi: Optional[float] = None  # unpatched p90 / this p10
    throughput: Optional[float] = None
    unit: str = ""
    host_ms: Optional[float] = None  # host time to queue one step (GPU held busy ahead of it)
    kernel_ms: Optional[float] = None  # GPU kernel time per step (CPU: aten ops' self time)
    norm_ms: Optional[float] = None
    norm_share: Optional[float] = None
    out_diff: Optional[float] = None  # train: loss; infer: output; decode: first token's logits
    grad_diff: Optional[float] = None
    norms: Optional[int] = None  # norm modules in the model
    patched: Optional[int] = None  # of which the variant replaced
    first_call_s: Optional[float] = None
    note: str = ""

    @property
    def key(self) -> tuple:
        return self.model, self.mode, self.exec, self.variant

    @property
    def ran(self) -> bool:
        return self.ms is not None

    def differs(self, floor=(None, None)) -> bool:
        """A difference above the dtype's tolerance, or above twice `floor` (the unpatched eager model's
        difference from a second run of itself, per value: the model's own run-to-run noise)."""
        tol = DIFF_TOL.get(self.dtype, 1e-3)
        return any(d is not None and not d <= max(tol, 2 * (f or 0))
                   for d, f in zip((self.out_diff, self.grad_diff), floor))

    def line(self) -> str:
        """One line for the progress log."""
        head = f"{self.model} {self.mode} {self.exec} {self.variant}:"
        if not self.ran:
            return f"{head} {self.note}"
        cells = [f"{self.ms:.3g} ms [{self.ms_p10:.3g}-{self.ms_p90:.3g}]"]
        if self.speedup is not None and self.variant != "unpatched":
            cells.append(f"{self.speedup:.2f}x")
        if self.host_ms is not None:
            cells.append(f"host {self.host_ms:.3g} ms")
        if self.kernel_ms is not None:
            cells.append(f"kernels {self.kernel_ms:.3g} ms, norms {_pct(self.norm_share)}")
        cells.append(f"diff {_num(self.out_diff, '.2g')}" + (f"/{_num(self.grad_diff, '.2g')}" if self.grad_diff is not None else ""))
        return f"{head} " + ", ".join(cells) + (f" ({self.note})" if self.note else "")


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{100 * v:.0f}%"


def _dtype_of(rows: list[ModelRow], model: str) -> str:
    return next(r.dtype for r in rows if r.model == model)


def finalize(rows: list[ModelRow]) -> list[ModelRow]:
    base = {(r.model, r.mode, r.exec): r for r in rows if r.variant == "unpatched" and r.ran}
    for r in rows:
        b = base.get((r.model, r.mode, r.exec))
        if b is None or not r.ran:
            r.speedup = r.speedup_lo = r.speedup_hi = None
            continue
        r.speedup = b.ms / r.ms
        r.speedup_lo = b.ms_p10 / r.ms_p90 if r.ms_p90 else None
        r.speedup_hi = b.ms_p90 / r.ms_p10 if r.ms_p10 else None
    return rows


def write_csv(path, rows: list[ModelRow], env: dict) -> Path:
    return report.write_csv(path, finalize(rows), env, cls=ModelRow)


def load(paths) -> tuple[list[ModelRow], dict]:
    """Read models.csv files (or folders holding one) and merge them; a later row replaces an earlier one."""
    rows, envs = {}, []
    for p in map(Path, paths):
        f = p / "models.csv" if p.is_dir() else p
        if not f.exists():
            raise FileNotFoundError(f"--report: {p} holds no models.csv")
        got, env = report.read_csv(f, cls=ModelRow)
        envs.append(env)
        rows.update((r.key, r) for r in got)
    return finalize(list(rows.values())), report.merge_env(envs)


# ----------------------------------------------------------------------------- markdown

ENV_KEYS = ("device", "gpu", "driver", "cuda", "torch", "triton", "transformers", "timm", "diffusers", "liger",
            "normkit", "commit", "source_sha1", "date", "hostname", "model_size", "steps", "compile_backend",
            "command", "incomplete")


def _range(lo, hi, spec=".3g") -> str:
    return "" if lo is None or hi is None else f" [{lo:{spec}}-{hi:{spec}}]"


def _table_rows(rows: list[ModelRow]) -> list[list[str]]:
    body = []
    for r in rows:
        if not r.ran:
            continue
        speed = "" if r.variant == "unpatched" or r.speedup is None else (
            f"{'**' if r.speedup_hi is not None and r.speedup_hi < 1 else ''}{r.speedup:.2f}"
            f"{_range(r.speedup_lo, r.speedup_hi, '.2f')}")
        body.append([r.model, r.mode, r.exec, r.variant, f"{r.ms:.3g}{_range(r.ms_p10, r.ms_p90)}", speed,
                     _num(r.throughput, ".4g"), _num(r.host_ms, ".3g"), _num(r.kernel_ms, ".3g"),
                     "" if r.norm_ms is None else f"{r.norm_ms:.3g} ({_pct(r.norm_share)})",
                     _num(r.out_diff, ".2g"), _num(r.grad_diff, ".2g"),
                     "" if r.norms is None else f"{r.patched or 0}/{r.norms}", r.note])
    return body


def summary_markdown(rows: list[ModelRow], env: dict) -> str:
    finalize(rows)
    cuda = env.get("device") == "cuda"
    out = [f"# normkit bench --models: {env.get('gpu') or env.get('device', '?')}", ""]
    if not cuda:
        out += ["**CPU run at tiny sizes: the times are CPU timings, there is no host/GPU split, and "
                "'kernel ms' is the aten ops' self time.**", ""]
    out += _table(["environment", ""], [[k, str(env[k])] for k in ENV_KEYS if env.get(k)])
    out += ["", "## Problems (errors, differences above tolerance)", ""]
    problems = [f"- {' '.join(r.key)}: {r.note}" for r in rows if not r.ran and not r.note.startswith("skipped")]
    # a model whose unpatched eager step differs from a second run of itself beyond the tolerance (kernels
    # that add with atomics, e.g. some attention backwards) sets the floor its other rows are held to
    noisy = {(r.model, r.mode): (r.out_diff, r.grad_diff) for r in rows
             if r.ran and r.variant == "unpatched" and r.exec == "eager" and r.differs()}
    problems += [f"- {' '.join(r.key)}: differs from the unpatched eager model by {_num(r.out_diff, '.2g')} "
                 f"(loss/output), {_num(r.grad_diff, '.2g')} (gradients), above {DIFF_TOL.get(r.dtype, 1e-3):g}"
                 + (" and twice the unpatched model's own run-to-run difference"
                    if (r.model, r.mode) in noisy else "")
                 for r in rows if r.ran and not (r.variant == "unpatched" and r.exec == "eager")
                 and r.differs(noisy.get((r.model, r.mode), (None, None)))]
    out += problems or ["none"]
    out += ["", "## Notes on measured cases", ""]
    out += [f"- {model} {mode}: the unpatched eager model differs from a second run of itself by {_num(o, '.2g')} "
            f"(loss/output), {_num(g, '.2g')} (gradients), above {DIFF_TOL.get(_dtype_of(rows, model), 1e-3):g}: its "
            "kernels are not run-to-run deterministic, so the other rows are held to twice that"
            for (model, mode), (o, g) in noisy.items()]
    out += [f"- {' '.join(r.key)}: {r.note}" for r in rows if r.ran and r.note] or ([] if noisy else ["none"])
    why: dict = {}
    for r in rows:
        if r.note.startswith("skipped"):
            why.setdefault((r.model, r.note[len("skipped: "):]), set()).add(r.variant)
    skipped = [f"- {m} ({', '.join(sorted(v))}): {note}" for (m, note), v in why.items()]
    out += ["", "## Skipped", ""] + (skipped or ["none"])
    out += ["", "## Step time", "",
            "ms per step: median [p10-p90] of steps queued back to back; speedup: unpatched ms over this ms in "
            "the same mode and execution [unpatched p10 / this p90 - unpatched p90 / this p10], **bold** when "
            "slower beyond that range; host ms: time to queue one step while the GPU is held busy; kernel ms: "
            "GPU kernel time per step (torch.profiler), with the norm kernels' time and share (under compile "
            "only kernels named after norms count: a lower bound); diff: relative difference of the loss (train), "
            "output (infer) or first token's logits (decode), and of all gradients, from the unpatched eager model "
            "(for the unpatched eager row: a second run of itself); norms: norm modules replaced / present.", ""]
    out += _table(["model", "mode", "exec", "variant", "ms/step", "speedup", "throughput", "host ms", "kernel ms",
                   "norm ms (share)", "loss/out diff", "grad diff", "norms", "note"], _table_rows(rows))
    units = sorted({f"{r.model}: {r.unit}" for r in rows if r.unit})
    out += ["", "Throughput units: " + "; ".join(units) if units else ""]
    out += ["", "## Issue 14 targets (normkit.patch)", ""] + targets(rows)
    return "\n".join(out) + "\n"


def targets(rows: list[ModelRow]) -> list[str]:
    """Each target of issue 14 part 3 with what this run measured."""
    by = {r.key: r for r in rows if r.ran}
    nk = [r for r in rows if r.variant == "normkit" and r.ran and r.speedup is not None]
    out = []
    if not nk:
        return ["no normkit row with an unpatched row beside it: nothing to judge"]
    slower = [r for r in nk if r.speedup_hi is not None and r.speedup_hi < 1]
    within = [r for r in nk if r.speedup < 1 and r not in slower]
    out.append(f"- never slower (speedup >= 1.00 within the spread): {len(nk) - len(slower)} of {len(nk)} cases met"
               + (f"; slower beyond the spread: " + ", ".join(f"{r.model} {r.mode} {r.exec} {r.speedup:.2f}"
                                                               for r in slower) if slower else "")
               + (f"; below 1 within the spread: " + ", ".join(f"{r.model} {r.mode} {r.exec} {r.speedup:.2f}"
                                                                for r in within) if within else ""))

    def status(v, goal):
        return "not measured" if v is None else (f"{v:.2f} (met)" if v >= goal else f"{v:.2f} (short of {goal:.2f})")

    for m in HF:
        r = by.get((m, "train", "eager", "normkit"))
        out.append(f"- {m} eager train >= 1.10: {status(r.speedup if r else None, 1.10)}")
    for e in ("eager", "compile"):
        r = by.get(("unet1d", "infer", e, "normkit"))
        out.append(f"- unet1d batch-1 infer, {e}, >= 1.10: {status(r.speedup if r else None, 1.10)}")
    comp = by.get(("unet1d", "infer", "compile", "unpatched"))
    best = min((by[k] for k in (("unet1d", "infer", e, "normkit") for e in ("eager", "compile")) if k in by),
               key=lambda r: r.ms, default=None)
    out.append("- unet1d batch-1 infer, fastest normkit vs torch.compile of the unpatched model: "
               + (status(comp.ms / best.ms, 1.0) + f" ({best.exec} {best.ms:.3g} ms vs {comp.ms:.3g} ms)"
                  if comp and best else "not measured"))
    n, lg = by.get(("llama", "train", "eager", "normkit")), by.get(("llama", "train", "eager", "liger"))
    out.append("- llama eager train at least as fast as Liger: "
               + (status(lg.ms / n.ms, 1.0) + f" ({n.ms:.3g} vs {lg.ms:.3g} ms)" if n and lg else "not measured"))
    for m in HF:
        for e in ("eager", "compile"):
            r = by.get((m, "decode", e, "normkit"))
            out.append(f"- {m} decode {e} tokens/s at least torch's: {status(r.speedup if r else None, 1.0)}")
    return out


# ----------------------------------------------------------------------------- PNG

def plot(rows: list[ModelRow], path) -> list[Path]:
    """Speedup over the unpatched model per model and mode, one panel per execution, one bar per
    variant, the p10-p90 range as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finalize(rows)
    shown = [r for r in rows if r.variant != "unpatched" and r.speedup is not None]
    if not shown:
        return []
    execs = list(dict.fromkeys(r.exec for r in shown))
    groups = list(dict.fromkeys((r.model, r.mode) for r in shown))
    variants = list(dict.fromkeys(r.variant for r in shown))
    fig, axes = plt.subplots(len(execs), 1, figsize=(max(6, 0.9 * len(groups) + 2), 3.6 * len(execs)), squeeze=False)
    width = 0.8 / len(variants)
    for ax, e in zip(axes[:, 0], execs):
        for i, v in enumerate(variants):
            xs, ys, err = [], [], [[], []]
            for j, g in enumerate(groups):
                r = next((r for r in shown if (r.model, r.mode) == g and r.exec == e and r.variant == v), None)
                if r is None:
                    continue
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                ys.append(r.speedup)
                err[0].append(max(0.0, r.speedup - (r.speedup_lo or r.speedup)))
                err[1].append(max(0.0, (r.speedup_hi or r.speedup) - r.speedup))
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=v)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(groups)), [f"{m}\n{mode}" for m, mode in groups], fontsize=8)
        ax.set_ylabel("speedup over unpatched")
        ax.set_title(f"{e}" + (" (CPU timings)" if all(r.device == "cpu" for r in shown) else ""))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
