"""Session 8 check: a modulated LayerNorm and a gated RMSNorm, compiled (normkit's ops kept) vs
eager vs the Python path vs the float64 oracle: max abs difference and the rows that differ."""
import torch

import normkit
from normkit import _host, compile_fusion as cf, reference as ref

bf16 = torch.bfloat16
torch.manual_seed(0)
x, g = torch.randn(4, 64, 1152, device="cuda", dtype=bf16), torch.randn(4, 64, 1152, device="cuda", dtype=bf16)
emb = torch.randn(4, 6 * 1152, device="cuda", dtype=bf16)
w = torch.randn(1152, device="cuda", dtype=bf16)


def ln(x, emb):
    shift, scale = emb[:, :1152], emb[:, 1152:2304]
    return normkit.layer_norm(x, (1152,), None, None, 1e-6, scale=scale, shift=shift)


def ln_contig(x, emb):
    shift, scale = emb[:, :1152].contiguous(), emb[:, 1152:2304].contiguous()
    return normkit.layer_norm(x, (1152,), None, None, 1e-6, scale=scale, shift=shift)


def rms(x, g):
    return normkit.rms_norm(x, (1152,), w, 1e-5, gate=g)


def report(name, fn, args):
    torch._dynamo.reset()
    with cf.policy("normkit"), torch.no_grad():
        eager = fn(*args)
        with _host.python_path():
            py = fn(*args)
        f = torch.compile(fn, fullgraph=True)
        outs = [f(*args) for _ in range(5)]
        s0 = _host.stats()
        comp = f(*args)
        s1 = _host.stats()
    d = {k: s1[k] - s0[k] for k in ("op_served", "op_python", "replays", "python_runs")}
    rows = lambda a, b: (a.float() - b.float()).abs().amax(-1).flatten().nonzero().flatten()[:8].tolist()  # noqa
    print(f"{name}: counters {d}")
    for i, o in enumerate(outs + [comp]):
        print(f"  compiled call {i}: vs eager max {(o.float() - eager.float()).abs().max().item():.3g} rows {rows(o, eager)}")
    print(f"  eager vs python path: max {(eager.float() - py.float()).abs().max().item():.3g} rows {rows(eager, py)}")


report("ln modulated (emb slices)", ln, (x, emb))
report("ln modulated (contiguous tables)", ln_contig, (x, emb))
report("rms gated", rms, (x, g))


# does the STORE_STATS constexpr alone change y's bits? (eager without grad stores no statistics;
# the compiled op always does)
from normkit.backends import triton as tb  # noqa: E402

x2 = x.reshape(-1, 1152)
tables = dict(mod_scale=emb[:, 1152:2304], mod_shift=emb[:, :1152])
for name, kw in (("ln modulated", tables), ("ln plain no weight", {}), ("ln scale only", dict(mod_scale=emb[:, 1152:2304]))):
    y0 = tb.row_norm_fwd_fused(x2, None, None, 1e-6, False, store_stats=False, **kw)[0]
    y1 = tb.row_norm_fwd_fused(x2, None, None, 1e-6, False, store_stats=True, **kw)[0]
    print(f"{name}: store_stats False vs True max {(y0.float() - y1.float()).abs().max().item():.3g}, "
          f"rows {(y0 != y1).any(-1).nonzero().flatten()[:8].tolist()}")
