"""Session 9 check (GPU): is test_models' maskformer-bf16 failure one unlucky sample or systematic, and
which patched norms cause it? Runs the test's own check with the model's initial weights drawn from
several seeds, patching both norm types, only GroupNorm, only LayerNorm; prints each failure line."""
import dataclasses
import sys



sys.path.insert(0, "tests")
import normkit  # noqa: E402
import test_models as tm  # noqa: E402

fam0 = tm.FAMILIES["maskformer"]
real_patch = normkit.patch


def only_ops(model, ops, **kw):
    report = real_patch(model, ops=ops, **kw)
    report.skipped.clear()  # the other norm type, left alone on purpose here
    return report


for only in (None, "GroupNorm", "LayerNorm"):
    for seed in (0, 1, 2, 3, 4):
        tm.FAMILIES["maskformer"] = fam0 if only is None else dataclasses.replace(fam0, norms={only: fam0.norms[only]})
        ops = None if only is None else {"GroupNorm": ("group_norm",), "LayerNorm": ("layer_norm",)}[only]
        tm.normkit.patch = real_patch if ops is None else (lambda m, ops=ops, **kw: only_ops(m, ops, **kw))
        try:
            tm._check_draw("maskformer", "bf16", seed)
            print(f"patched {only or 'both'} seed {seed}: pass")
        except AssertionError as e:
            # with one norm type patched, the other (torch's) leaves its rounding noise in gradients that
            # are zero in exact arithmetic, which the test holds to a floor: those lines are not shown
            lines = [f for f in str(e).splitlines()[0].split("; ") if "zero in exact arithmetic" not in f]
            print(f"patched {only or 'both'} seed {seed}: FAIL " + "; ".join(lines)[:500])
