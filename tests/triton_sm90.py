"""Compile the row-norm Triton kernels for sm_90 without a GPU (Triton's own ptxas), one variant per
fused flag and path, so code the interpreter accepts but the compiler would not is caught on CPU.
Run in a process without TRITON_INTERPRET (tests/test_fusion.py does): `python tests/triton_sm90.py`."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from normkit.backends.triton import kernels  # noqa: E402

# argument name -> signature type; None: absent (a constexpr None), 1: a unit stride/count (Triton
# specializes it away); everything not listed is an int32
FWD_ARGS = dict(X="*bf16", R="*bf16", Y="*bf16", H="*fp32", W="*fp32", B="*fp32", MEAN="*fp32", RSTD="*fp32",
                AMAX="*i32", SCALE="*fp32", SYNC="*i32", SCRATCH="*fp32", MS="*fp32", MT="*bf16", eps="fp32",
                w_offset="fp32", scale="fp32")
BWD_ARGS = dict(DY="*bf16", X="*bf16", DH="*fp32", W="*fp32", B="*fp32", MEAN="*fp32", RSTD="*fp32", DX="*bf16",
                DRES="*fp32", DW_PART="*fp32", DB_PART="*fp32", SYNC="*i32", SCRATCH="*fp32", MS="*fp32", MT="*bf16",
                DS_PART="*fp32", DT_PART="*fp32", w_offset="fp32")


def _source(fn, types, constexprs, absent=(), units=()):
    sig, consts = {}, {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name], consts[name] = "constexpr", constexprs[name]
        elif name in absent:
            sig[name], consts[name] = "constexpr", None
        elif name in units:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = types.get(name, "i32")
    return ASTSource(fn, sig, consts)


def variants():
    """(name, ASTSource, num_warps)."""
    out = []
    gated_fwd = [((True, False, 0, False, True, 0, "tile", 0), True), ((False, False, 1, True, False, 2, "split", 0), True),
                 ((True, False, 0, False, False, 0, "looped", 0), True)]
    for (rms, res, fp8, amax, per_row, act, path, mod), gate in [(v, False) for v in [
            (False, False, 0, False, False, 0, "tile", 0), (True, True, 1, True, False, 2, "tile", 0),
            (False, True, 2, True, True, 4, "tile", 0), (True, True, 1, True, True, 3, "split", 0),
            (False, True, 0, False, False, 0, "split", 0), (False, True, 1, True, True, 5, "looped", 0),
            (True, False, 0, True, False, 1, "looped", 0), (False, False, 0, False, False, 0, "tile", 3),
            (True, True, 1, True, False, 2, "split", 1), (False, False, 0, False, False, 4, "looped", 2),
            (True, False, 3, True, False, 0, "tile", 0), (False, False, 4, False, False, 0, "split", 0)]] + gated_fwd:
        cx = dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, PER_ROW_W=per_row, ACT=act, HAS_RES=res,
                  STORE_H=res, H_ROUND=1 if res else 0, FP8=fp8, SCALE_PTR=fp8 == 2, WANT_AMAX=amax,
                  BLOCK_M=4 if path == "tile" else 1, BLOCK_N=1024, SPLIT=4 if path == "split" else 1,
                  LOOPED=path == "looped", PERSISTENT=path == "split",
                  LOOP_POLICY_1="evict_last" if path == "looped" else "", LOOP_POLICY_2="evict_first" if path == "looped" else "",
                  N_STATIC=4099 if path == "looped" and not fp8 else 0, HAS_MS=bool(mod & 1), HAS_MT=bool(mod & 2),
                  HAS_GATE=gate)
        types = dict(FWD_ARGS, Y="*u8" if fp8 else "*bf16")
        absent = [n for n, on in (("R", res or gate), ("H", res), ("AMAX", amax), ("SCALE", fp8 == 2), ("MS", mod & 1),
                                  ("MT", mod & 2)) if not on]
        absent += [] if per_row else ["w_offset"]  # the launch passes None for a weight offset of 0: a constexpr
        units = ["INNER", "sx_c", "W_ROWS"] if not per_row else ["sx_c"]
        out.append((f"fwd rms={rms} res={res} fp8={fp8} amax={amax} per_row={per_row} mod={mod} gate={gate} {path}",
                    _source(kernels.row_norm_fwd_kernel, types, cx, absent, units), 8))
    gated_bwd = [((True, False, False, True, 0, "tile", "*bf16", 0), True),
                 ((False, False, False, False, 2, "split", "*bf16", 0), True),
                 ((True, False, False, False, 0, "looped", "*fp32", 0), True)]
    for (rms, dh, dres, per_row, act, path, dy, mod), gate in [(v, False) for v in [
            (False, False, False, False, 0, "tile", "*bf16", 0), (True, True, True, True, 2, "tile", "*fp8e4nv", 0),
            (False, True, True, False, 4, "split", "*fp8e5", 0), (True, True, False, True, 3, "looped", "*fp32", 0),
            (False, False, False, False, 0, "tile", "*bf16", 3), (True, True, True, False, 2, "tile", "*bf16", 1),
            (False, False, False, False, 5, "looped", "*bf16", 3)]] + gated_bwd:
        cx = dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, PER_ROW_W=per_row, WANT_DW=True, WANT_DB=not rms, ACT=act,
                  HAS_DH=dh, HAS_DRES=dres, HAS_MS=bool(mod & 1), HAS_MT=bool(mod & 2), WANT_DS=bool(mod & 1),
                  WANT_DT=bool(mod & 2), BLOCK_M=4 if path == "tile" else 2 if path == "split" and dh else 1, BLOCK_N=1024,
                  SPLIT=4 if path == "split" else 1, LOOPED=path == "looped", HAS_GATE=gate, PREFETCH=path == "tile",
                  PREFETCH_STATS=True)
        absent = [n for n, on in (("DH", dh or gate), ("DRES", dres or gate), ("MS", mod & 1), ("MT", mod & 2), ("DS_PART", mod & 1),
                                  ("DT_PART", mod & 2)) if not on]
        out.append((f"bwd rms={rms} dh={dh} dres={dres} per_row={per_row} mod={mod} gate={gate} {path} dy={dy}",
                    _source(kernels.row_norm_bwd_kernel, dict(BWD_ARGS, DY=dy), cx, absent, ["sdy_c", "sx_c"]), 8))
        if path == "split" and not gate:  # a table row's reg_cap: ptxas maxnreg (configs.reg_cap_for)
            out.append((out[-1][0] + " maxnreg=128", out[-1][1], (8, 128)))
    return out


GN_ARGS = dict(X="*bf16", Y="*bf16", W="*bf16", B="*bf16", MEAN="*fp32", RSTD="*fp32", SYNC="*i32", SCRATCH="*fp32",
               DY="*bf16", DX="*bf16", DW_PART="*fp32", DB_PART="*fp32", eps="fp32")


def group_norm_looped():
    """(name, ASTSource, (num_warps, maxnreg)): GroupNorm's looped kernels, the slot kernels on the tile the table
    gives them (configs.GN_LOOPED_SLOTS) and the plain ones, forward and backward, with an activation, specialized
    as a launch is: those the table takes must fit without spilling (the slot kernels hold two tiles and two sums
    per thread)."""
    from normkit.backends.triton import configs, group_norm
    out = []
    for d, fn in (("fwd", group_norm.group_norm_fwd_kernel), ("bwd", group_norm.group_norm_bwd_kernel)):
        cfg = configs.group_config(d, 20, 1024, 2, False, 2.0)  # a looped NCHW group of 1024 positions, as planned
        for slots in (True, False):
            cx = dict(HAS_W=True, HAS_B=True, ACT=1, BLOCK_R=cfg.block_r, BLOCK_S=cfg.block_s, KS=1, SPLIT=1,
                      LOOPED=True, SLOTS=slots)
            if d == "bwd":
                cx.update(WANT_DW=True, WANT_DB=True)
            src = _source(fn, GN_ARGS, cx, ["SYNC", "SCRATCH"], ["stride_s"])
            src.attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(src.signature)  # as a launch specializes
                         if src.signature[k].startswith("*") or k in ("S", "stride_b", "stride_c")}
            # slot kernels the table does not take (the backward's, measured level): compiled, 8 bytes of stack allowed
            taken = not slots or cfg.slots
            out.append((f"group norm {d} looped {'slots' if slots else 'plain'} [{cfg.block_r}, {cfg.block_s}] x "
                        f"{cfg.num_warps} warps" + (", no spills" if taken else ""), src, (cfg.num_warps, None)))
    return out


def table_rows():
    """(name, ASTSource, (num_warps, maxnreg)): the sm_90 table's looped forward rows, and its 16-bit backward rows that
    carry a register cap,
    plain LayerNorm / RMSNorm with the parameters in x's dtype (the models' case), aligned and 16-divisible as a launch
    specializes them: ptxas must fit them under the cap without spilling (a spill would undo what the cap buys)."""
    from normkit.backends.triton import configs
    out = []
    for n in (1024, 2048, 4096, 8192):
        for rms in (False, True):
            cfg = configs.row_config("bwd", n, 2, "sm_90", op="rms" if rms else "ln")
            if cfg.cuda or not cfg.reg_cap:
                continue
            cx = dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, PER_ROW_W=False, WANT_DW=True, WANT_DB=not rms, ACT=0,
                      HAS_DH=False, HAS_DRES=False, HAS_MS=False, HAS_MT=False, WANT_DS=False, WANT_DT=False,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=cfg.split, LOOPED=False, HAS_GATE=False,
                      PREFETCH=cfg.prefetch, PREFETCH_STATS=configs.PREFETCH_STATS)
            src = _source(kernels.row_norm_bwd_kernel, dict(BWD_ARGS, W="*bf16", B="*bf16"), cx,
                          ["DH", "DRES", "MS", "MT", "DS_PART", "DT_PART"] + (["B"] if rms else []),
                          ["sdy_c", "sx_c", "INNER", "W_ROWS"])
            src.attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(src.signature)
                         if src.signature[k].startswith("*") or k in ("M", "N", "sdy_o", "sx_o", "sdy_i", "sx_i")}
            out.append((f"table row bwd bf16 {'rms' if rms else 'ln'} {n}: {cfg.block_m}x{cfg.block_n} x "
                        f"{cfg.num_warps} warps, maxnreg={cfg.reg_cap}, no spills", src, (cfg.num_warps, cfg.reg_cap)))
    for n in (8192, 32768, 65536):  # the table's looped forward rows (RMSNorm, a kernel per width), parameters in x's dtype
        cfg = configs.row_config("fwd", n, 2, "sm_90", op="rms")
        if not cfg.looped:
            continue
        cx = dict(IS_RMS=True, HAS_W=True, HAS_B=False, PER_ROW_W=False, ACT=0, HAS_RES=False, STORE_H=False,
                  H_ROUND=0, FP8=0, SCALE_PTR=False, WANT_AMAX=False, BLOCK_M=1, BLOCK_N=cfg.block_n, SPLIT=1,
                  LOOPED=True, PERSISTENT=True, HAS_MS=False, HAS_MT=False, HAS_GATE=False,
                  LOOP_POLICY_1="evict_last" if cfg.evict else "", LOOP_POLICY_2="evict_first" if cfg.evict else "",
                  N_STATIC=n if cfg.static_n else 0)
        src = _source(kernels.row_norm_fwd_kernel, dict(FWD_ARGS, W="*bf16"), cx,
                      ["R", "H", "AMAX", "SCALE", "MS", "MT", "B", "w_offset"], ["INNER", "sx_c", "W_ROWS"])
        src.attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(src.signature)
                     if src.signature[k].startswith("*") or k in ("M", "N", "sx_o", "sx_i")}
        out.append((f"table row fwd bf16 rms {n}: looped {cfg.block_n} x {cfg.num_warps} warps, width compiled in, "
                    f"no spills", src, (cfg.num_warps, None)))
    return out


def _spilled_bytes(kernel) -> int:
    """The compiled kernel's stack frame (ptxas spills to it), by the cuobjdump Triton ships."""
    import os
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def main() -> int:
    failed = 0
    for name, src, warps in variants() + table_rows() + group_norm_looped():
        warps, maxnreg = warps if isinstance(warps, tuple) else (warps, None)
        t0 = time.time()
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
                num_warps=warps, num_stages=1, enable_fp_fusion=True, **({"maxnreg": maxnreg} if maxnreg else {})))
            if name.endswith("no spills") and _spilled_bytes(kernel):
                raise RuntimeError(f"ptxas spilled {_spilled_bytes(kernel)} bytes under maxnreg={maxnreg}")
            print(f"ok {name} ({time.time() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 - report every variant
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {e}")
    print(f"{'ALL OK' if not failed else f'{failed} FAILED'} (triton {triton.__version__}, sm_90)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
