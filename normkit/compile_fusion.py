"""normkit under torch.compile (Inductor): step aside where Inductor's code is faster, fuse where
normkit's is, as a measured table says.

A normkit op is one opaque node to Inductor: it cannot fuse the add before it, the activation or the
cast after it, and it replaces a norm Inductor may compile well on its own. So before Inductor
lowers a graph, a pre-grad graph pass (torch._inductor.config.pre_grad_custom_pass; the pre-grad IR
still has torch-level calls such as F.layer_norm and operator.add, and rewriting there lets AOT
autograd derive the backward of whatever is chosen) looks at each norm and decides:

- a normkit op (patched modules, normkit's functions and modules) whose pattern normkit is not
  measured faster at is replaced by torch's own decomposable ops with the same numerics
  (F.layer_norm / F.rms_norm / F.group_norm, the activation, the casts: see _row_norm_composite),
  so the graph holds no normkit op there and Inductor fuses as it would for the unpatched model;
- where normkit's fused op wins, the neighbours it can absorb are folded into one normkit op: the
  residual add before a LayerNorm/RMSNorm (add -> norm: residual=, the sum h returned for its other
  users), a multiply by a weight vector after an unweighted norm (HF's Llama RMSNorm), the activation
  after (norm -> activation), a cast of the output (norm -> cast: out_dtype=);
- torch's own norms (F.layer_norm, F.rms_norm, F.group_norm: unpatched models) are rewritten the
  same way when the user asks: normkit.enable_compile_fusion().

Numerics: the fused ops compute the activation and the cast on the fp32 normalized value, as
Inductor's own fused kernels do (it does not round intermediates to bf16 either); h = x + residual
is rounded to its dtype before it is normalized, as eager torch does.

The table (backends/triton/tuned/compile_<arch>.json, written by benchmarks/compile_table.py on the
device) is keyed by "pattern|dtype|mode|width class": pattern as _pattern_name builds it
("add_rms", "gn_silu", "pw+gn_silu", ...: "pw+" / "+pw" mark a pointwise producer / consumer that
stays outside normkit's op, which Inductor would have fused), dtype of x, mode "fwd" (inference) or
"train" (forward and backward), width class the power of two at or below the normalized width (the
group's size for GroupNorm). A key may end in a size class, "|e16" (see size_class): an entry measured
at that input size, which decides for inputs of that class; a key without one was measured at 2^24
elements. An input whose class has no entry takes the nearest size measured for its pattern, dtype,
mode and width (_lookup). An absent entry, a CPU tensor or an unknown GPU: Inductor's code.
NORMKIT_COMPILE_TABLE=path in the environment reads that table file instead (as use_table(path)).

The pass is installed the first time dynamo traces a normkit op (or by enable_compile_fusion;
NORMKIT_COMPILE_PASS=0 in the environment keeps it out, and normkit's ops opaque as before);
decisions are made when Inductor compiles a graph: after changing them, torch._dynamo.reset().
Other backends (aot_eager, export) run no pre-grad pass: normkit's op stays there.

Inductor's caches (its FX graph cache, AOTAutograd's cache) key compiled graphs on the pass: it is a
module-level CustomGraphPass whose uuid() is a hash of normkit's version, this module's and the torch
backend's source, the tables in use, policy(), use_table() and enable_compile_fusion(), and it pickles
as that id; so a new process compiling the same model with the same settings loads the graphs
compiled before, and a change of any of them compiles anew. (A torch that runs pre-grad passes after
its cache lookup, as 2.13 does, runs no pass on a hit: decisions() then lists nothing for that graph;
2.11 runs the pass first and looks up the rewritten graph.)
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import operator
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ._op_args import GN_FWD, ROW_FUSED_FWD
from .backends import torch_backend

__all__ = ["enable_compile_fusion", "policy", "use_table", "decisions", "wins", "table_path"]

TABLE_DIR = Path(__file__).resolve().parent / "backends" / "triton" / "tuned"
POLICIES = ("table", "normkit", "torch")
_state = {"unpatched": False, "policy": "table", "table": None}  # table: an override {key: entry}
_log: list = []  # the decisions of the graphs compiled since the last decisions(clear=True)


# ----------------------------------------------------------------------------- settings

class _Setting:
    """Sets `_state[key]` now; as a context manager, restores the previous value on exit."""

    def __init__(self, key, value):
        self.key, self.old = key, _state[key]
        _state[key] = value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _state[self.key] = self.old
        return False


def enable_compile_fusion(enabled: bool = True):
    """Let torch.compile (Inductor) rewrite torch's own norms of any model (F.layer_norm, F.rms_norm,
    F.group_norm: unpatched ones) into normkit's fused ops where the table says normkit is faster.
    Patched models and normkit's own calls get this without asking. Usable as a context manager.
    Takes effect for graphs compiled afterwards (torch._dynamo.reset() to recompile)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {enabled!r}")
    install()
    return _Setting("unpatched", enabled)


def policy(name: str):
    """"table" (default): normkit's op where the table says it wins, else Inductor's; "normkit":
    always normkit's (fusing what it can); "torch": never. Usable as a context manager."""
    if name not in POLICIES:
        raise ValueError(f"name: expected one of {POLICIES}, got {name!r}")
    return _Setting("policy", name)


def use_table(table):
    """Use `table` ({key: entry}, or a path to a table json) instead of the file for the GPU (for
    tests and the measurement script); None goes back to the file. Usable as a context manager."""
    if table is not None and not isinstance(table, dict):
        table = _read(Path(table))
    return _Setting("table", None if table is None else dict(table))


def decisions(clear: bool = False) -> list:
    """What the pass decided in the graphs compiled so far: [(pattern key, "normkit" | "inductor")].
    Graphs loaded from Inductor's cache were decided when they were compiled and are not listed."""
    out = list(_log)
    if clear:
        _log.clear()
    return out


# ----------------------------------------------------------------------------- the table

def table_path(arch: str) -> Path:
    return TABLE_DIR / f"compile_{arch}.json"


def _read(path: Path) -> dict:
    data = json.loads(path.read_text())
    if "min_elements" in data:
        warnings.warn(f"{path}: min_elements is no longer read (the table's size classes replaced it: "
                      "compile_fusion.size_class)", stacklevel=2)
    return dict(data.get("entries", data))


# Size classes. The plain entries compare GPU time with the host hidden, at 2^24 elements. A smaller
# input's call is short enough for the host to matter: a kept op costs a few microseconds of host
# time more than Inductor's own kernel (the ops' C++ dispatcher kernels, normkit._host: session 7
# measured ~4 us on an H100 host), and Inductor may fuse the norm into a neighbour's kernel. So
# benchmarks/compile_table.py also measures each pattern at smaller sizes, timing the GPU and the
# back-to-back call (host included), and writes those points under keys with a size class; where a
# size class has no entry the nearest measured size decides. (This replaced a floor, min_elements,
# below which every entry was ignored.)
SIZE_CLASS_STEP = 4   # log2 distance between size classes: a point speaks for sizes within 4x either side
PLAIN_CLASS = 24      # the plain keys' size (2^24 elements) and every class at or above it
ANY_SIZE = -1         # `elements` of a graph compiled for symbolic sizes: it serves every size


SIZE_CLASSES = range(0, PLAIN_CLASS + 1, SIZE_CLASS_STEP)  # the plain keys' class last


def sized_key(plain: str, c: Optional[int]) -> str:
    """The key of size class c for `plain` (the plain key itself for None or PLAIN_CLASS)."""
    return plain if c is None or c >= PLAIN_CLASS else f"{plain}|e{c}"


def size_class(elements) -> Optional[int]:
    """log2 of the size class of an input of `elements` elements: the multiple of SIZE_CLASS_STEP
    nearest log2(elements). None for the plain keys' class (2^22 elements and more) or an unknown
    size (0 / None)."""
    if not elements or elements <= 0:
        return None
    c = SIZE_CLASS_STEP * math.floor(math.log2(elements) / SIZE_CLASS_STEP + 0.5)
    return None if c >= PLAIN_CLASS else c


if os.environ.get("NORMKIT_COMPILE_TABLE"):  # a table file in the GPU's table's place, as use_table(path)
    _state["table"] = _read(Path(os.environ["NORMKIT_COMPILE_TABLE"]))


@functools.lru_cache(maxsize=None)
def _file_table(arch: str) -> dict:
    path = table_path(arch)
    return _read(path) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def _arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def width_class(width: int) -> int:
    """The power of two at or below `width` (the table's width classes)."""
    return 1 << (max(int(width), 1).bit_length() - 1)


LAYOUTS = ("dense", "channels_last", "strided")  # of the norm's input; the tables measured "dense"


def key(pattern: str, dtype: torch.dtype, mode: str, width: int, layout: str = "dense",
        elements: Optional[int] = None) -> str:
    """The table key; a layout other than dense (contiguous rows / NCHW) is part of it, so a layout
    the table has not measured (column-strided rows, views of fused projections, channels_last)
    finds no entry and keeps Inductor's code. `elements` (the input's size) adds its size class
    below 2^22 elements ("|e16"); without it, or at and above, the plain key."""
    k = f"{pattern}|{str(dtype).replace('torch.', '')}|{mode}|{width_class(width)}"
    if layout != "dense":
        k = f"{k}|{layout}"
    return sized_key(k, size_class(elements))


def layout_of(t) -> str:
    """"dense", "channels_last" (a 4-D channels_last tensor) or "strided" (anything else)."""
    try:
        if t.is_contiguous():
            return "dense"
        if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
            return "channels_last"
    except Exception:  # noqa: BLE001 - a symbolic stride that cannot be decided: not dense
        pass
    return "strided"


def wins(pattern: str, dtype: torch.dtype, mode: str, width: int, device: torch.device,
         elements: Optional[int] = None, layout: str = "dense") -> bool:
    """Is normkit's op for `pattern` measured faster than Inductor's code (see the module docstring)?
    `elements`: the input's size; its size class's entry decides where the table has one, else the
    nearest size measured (None: the plain entry; ANY_SIZE: a graph for symbolic sizes, normkit only
    where every size measured says so)."""
    return _lookup(pattern, dtype, mode, width, device, elements, layout)[1]


def _lookup(pattern, dtype, mode, width, device, elements, layout) -> tuple[str, bool]:
    """(the key that decided, wins?): the entry of the input's size class, else of the nearest size
    the table measured for this pattern / dtype / mode / width (the plain key counts as class 24; the
    smaller class on a tie), else the plain key."""
    plain = key(pattern, dtype, mode, width, layout)
    if _state["policy"] != "table":
        return plain, _state["policy"] == "normkit"
    table = _state["table"]
    if table is None:
        if device.type != "cuda":
            return plain, False
        table = _file_table(_arch(device.index if device.index is not None else torch.cuda.current_device()))
    if elements == ANY_SIZE:  # one graph for every size: normkit only where it won at every size measured
        found = [table[k] for k in (sized_key(plain, c) for c in SIZE_CLASSES) if k in table]
        return plain, bool(found) and all(e.get("wins") for e in found)
    c = size_class(elements)
    k = _nearest_measured(table, plain, PLAIN_CLASS if c is None and elements else c)
    entry = table.get(k)
    return k, bool(entry and entry.get("wins"))


def _nearest_measured(table: dict, plain: str, c: Optional[int]) -> str:
    if c is None:  # size unknown
        return plain
    for cc in sorted(SIZE_CLASSES, key=lambda cc: (abs(cc - c), cc)):
        if sized_key(plain, cc) in table:
            return sized_key(plain, cc)
    return plain


def _size_hint(t) -> int:
    """t's element count, or ANY_SIZE where it is symbolic: the graph then serves other sizes than the
    one it is compiled for (a dynamic recompile after a second size), so no one size class decides."""
    n = t.numel()
    if isinstance(n, torch.SymInt):
        fixed = getattr(n.node, "maybe_as_int", lambda: None)()
        return ANY_SIZE if fixed is None else int(fixed)
    return int(n)


# ----------------------------------------------------------------------------- torch's ops with normkit's numerics

_ACT = torch_backend._ACTIVATIONS
_FP8_MAX = torch_backend.FP8_MAX


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _no_autocast(x):
    return torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else \
        contextlib.nullcontext()


def _row_norm_composite(*args):
    """normkit::row_norm_fused_fwd in torch's decomposable ops: (y, h, mean, rstd, amax), absent
    outputs as empty tensors. Computes in fp32 (fp64 for fp64), rounds once; plain calls are torch's
    own F.layer_norm / F.rms_norm, exactly what an unpatched module hands Inductor. args: the op's
    (normkit._op_args), never with the modulation or a gate (_site_of leaves those calls alone)."""
    a = ROW_FUSED_FWD.read(*args)
    x, normalized_ndim, weight, bias, eps, rms, activation = a.x, a.normalized_ndim, a.weight, a.bias, a.eps, a.rms, \
        a.activation
    residual, residual_dtype, weight_offset, out_dtype = a.residual, a.residual_dtype, a.weight_offset, a.out_dtype
    out_scale, out_scale_value, want_amax = a.out_scale, a.out_scale_value, a.want_amax
    acc = _acc(x)
    with _no_autocast(x):
        z = x
        h = None
        if residual is not None:
            h = x + residual if x.dtype == residual.dtype == residual_dtype else \
                (x.to(acc) + residual.to(acc)).to(residual_dtype)
            z = h
        k = normalized_ndim
        shape = tuple(z.shape[z.dim() - k:])
        y_dtype = out_dtype or x.dtype
        per_head = any(p is not None and p.dim() > k for p in (weight, bias))
        plain = activation is None and not weight_offset and y_dtype == z.dtype and not per_head and \
            all(p is None or p.dtype == z.dtype for p in (weight, bias)) and not want_amax
        if plain:
            y = F.rms_norm(z, shape, weight, eps) if rms else F.layer_norm(z, shape, weight, bias, eps)
        else:
            zf = z.to(acc)
            w = None if weight is None else weight.to(acc) + weight_offset if weight_offset else \
                (None if weight is None else weight.to(acc))
            b = None if bias is None else bias.to(acc)
            if per_head:  # (heads, *shape): broadcast over the leading dims
                y = F.rms_norm(zf, shape, None, eps) if rms else F.layer_norm(zf, shape, None, None, eps)
                y = y * w if w is not None else y
                y = y + b if b is not None else y
            else:
                y = F.rms_norm(zf, shape, w, eps) if rms else F.layer_norm(zf, shape, w, b, eps)
            if activation is not None:
                y = _ACT[activation](y)
        dims = tuple(range(z.dim() - k, z.dim()))
        zf = z.to(acc)
        if rms:
            mean = zf.new_empty((0,))
            rstd = torch.rsqrt(zf.square().mean(dims) + eps)
        else:
            var, mean = torch.var_mean(zf, dims, correction=0)
            rstd = torch.rsqrt(var + eps)
        amax = y.abs().amax() if want_amax and y.numel() else zf.new_empty((0,) if not want_amax else ())
        if want_amax and not y.numel():
            amax = zf.new_zeros(())
        if y_dtype in _FP8_MAX:
            scale = out_scale.to(acc).reshape(()) if out_scale is not None else out_scale_value
            y = (y * scale).clamp(-_FP8_MAX[y_dtype], _FP8_MAX[y_dtype])
        y = y.to(y_dtype)
    return y, (x.new_empty((0,)) if h is None else h), mean, rstd, amax


def _row_norm_plain_composite(x, normalized_ndim, weight, bias, eps, rms, activation, backend):
    """normkit::row_norm_fwd in torch's ops: (y, mean, rstd)."""
    y, _, mean, rstd, _ = _row_norm_composite(x, normalized_ndim, weight, bias, eps, rms, activation, backend)
    return y, mean, rstd


def _group_norm_composite(*args):
    """normkit::group_norm_fwd in torch's ops: (y, mean [B, G], rstd [B, G]). args: the op's (normkit._op_args)."""
    a = GN_FWD.read(*args)
    x, num_groups, weight, bias, eps, activation = a.x, a.num_groups, a.weight, a.bias, a.eps, a.activation
    acc = _acc(x)
    with _no_autocast(x):
        if activation is None and all(p is None or p.dtype == x.dtype for p in (weight, bias)):
            y = F.group_norm(x, num_groups, weight, bias, eps)
        else:
            up = lambda p: None if p is None else p.to(acc)  # noqa: E731
            y = _ACT[activation](F.group_norm(x.to(acc), num_groups, up(weight), up(bias), eps)) if activation else \
                F.group_norm(x.to(acc), num_groups, up(weight), up(bias), eps)
            y = y.to(x.dtype)
        var, mean = torch.var_mean(x.to(acc).reshape(x.shape[0], num_groups, -1), -1, correction=0)
    return y, mean, torch.rsqrt(var + eps)


# ----------------------------------------------------------------------------- the graph pass

_OPS = None


def _ops():
    global _OPS
    if _OPS is None:
        nk = torch.ops.normkit
        _OPS = {nk.row_norm_fwd.default: ("row", _row_norm_plain_composite),
                nk.row_norm_fused_fwd.default: ("row_fused", _row_norm_composite),
                nk.group_norm_fwd.default: ("group", _group_norm_composite)}
    return _OPS


def _torch_norms() -> dict:
    """torch's norm functions as dynamo records them -> (kind, argument names)."""
    ln = ("input", "normalized_shape", "weight", "bias", "eps")
    rms = ("input", "normalized_shape", "weight", "eps")
    gn = ("input", "num_groups", "weight", "bias", "eps")
    return {F.layer_norm: ("ln", ln), torch.layer_norm: ("ln", ln), F.rms_norm: ("rms", rms),
            torch.rms_norm: ("rms", rms), F.group_norm: ("gn", gn), torch.group_norm: ("gn", gn)}


_ACTIVATIONS = {F.silu: "silu", F.mish: "mish", F.relu: "relu", torch.relu: "relu", F.gelu: "gelu"}
_ADDS = (operator.add, torch.add)
_MULS = (operator.mul, torch.mul)
_LINEAR_LIKE = {F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                torch.einsum, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                F.conv_transpose3d, F.scaled_dot_product_attention, F.embedding}
_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten",
                 "contiguous", "expand", "t"}
_VIEW_FUNCTIONS = {torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.flatten}
_FLOAT_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ev(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _hint(s) -> Optional[int]:
    if isinstance(s, int):
        return s
    try:
        from torch.fx.experimental.symbolic_shapes import hint_int
        return int(hint_int(s))
    except Exception:
        return None


def _args(node, names, defaults=()) -> dict:
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    for n, v in zip(names[len(names) - len(defaults):], defaults):
        out.setdefault(n, v)
    return out


def _is_linear_like(node) -> bool:
    t = node.target
    if node.op == "call_function":
        return t in _LINEAR_LIKE or getattr(t, "__name__", None) == "linear" or t in _ops() or \
            t in _torch_norms()
    return False


def _view_input(node):
    """The tensor a pure view/move node reads, else None."""
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        return node.args[0]
    if node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        return node.args[0]
    if node.op == "call_function" and node.target is F.dropout:
        a = _args(node, ("input", "p", "training", "inplace"), (0.5, True, False))
        if a["p"] == 0 or a["training"] is False:
            return a["input"]
    return None


def _blocking_producer(node) -> bool:
    """True when Inductor could not have fused `node` (the tensor's producer) into the norm's
    kernel either: a graph input, a matmul/conv/attention/norm, or a view of one."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 16:
        if node.op in ("placeholder", "get_attr"):
            return True
        if node.op == "call_function" and node.target is operator.getitem:
            base = node.args[0]
            return isinstance(base, torch.fx.Node) and (_is_linear_like(base) or base.op == "placeholder")
        if _is_linear_like(node):
            return True
        node = _view_input(node)
        seen += 1
    return False


def _blocking_consumers(node, depth=0) -> bool:
    """True when every user of `node` is something Inductor could not have fused with the norm."""
    for user in node.users:
        if user.op == "output" or _is_linear_like(user):
            continue
        if depth < 8 and _view_input(user) is node:
            if _blocking_consumers(user, depth + 1):
                continue
        return False
    return True


class _Site:
    """One norm in the graph and the neighbours folded into it."""

    def __init__(self, **kw):
        self.node = self.origin = self.kind = self.x = None
        self.ndim = self.groups = 0
        self.weight = self.bias = self.residual = self.residual_dtype = self.activation = self.out_dtype = None
        self.eps = None
        self.weight_offset = 0.0
        self.fixed = False      # fp8 / amax / explicit scale: decided as is, never grown
        self.y = None           # the node holding y (getitem 0, or the torch call itself)
        self.add = None         # absorbed producer add
        self.chain = []         # absorbed consumers, in order: (node, the fields it sets)
        self.__dict__.update(kw)

    def copy(self, **kw):
        s = _Site(**self.__dict__)
        s.chain = list(self.chain)
        s.__dict__.update(kw)
        return s

    @property
    def out(self):
        return self.chain[-1][0] if self.chain else self.y

    def absorb(self, node, **changes) -> "_Site":
        s = self.copy(**changes)
        s.chain.append((node, changes))
        return s


def _site_of(node) -> Optional[_Site]:
    if node.op != "call_function":
        return None
    op = _ops().get(node.target)
    if op is not None:
        kind = op[0]
        schema = [a.name for a in node.target._schema.arguments]
        a = _args(node, schema)
        if a.get("backend") is not None:  # the user forced a backend: theirs to choose
            return None
        if a.get("mod_scale") is not None or a.get("mod_shift") is not None or a.get("gate") is not None:
            return None  # adaLN modulation, a gate: normkit's op stays (no composite or fused rewrite carries them)
        users = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        y = users.get(0)
        if y is None:
            return None
        if kind == "group":
            return _Site(node=node, origin="normkit", kind="gn", x=a["input" if "input" in a else "x"],
                         groups=a["num_groups"], weight=a["weight"], bias=a["bias"], eps=a["eps"],
                         activation=a["activation"], y=y)
        site = _Site(node=node, origin="normkit", kind="rms" if a["rms"] else "ln", x=a["x"],
                     ndim=a["normalized_ndim"], weight=a["weight"], bias=a["bias"], eps=a["eps"],
                     activation=a["activation"], y=y)
        if kind == "row_fused":
            site.residual, site.residual_dtype = a["residual"], a["residual_dtype"]
            site.weight_offset, site.out_dtype = a["weight_offset"], a["out_dtype"]
            site.fixed = a["out_scale"] is not None or a["out_scale_value"] is not None or a["want_amax"] or \
                any(i in users for i in (2, 3, 4)) or (1 in users and site.residual is None)
        else:
            site.fixed = any(i in users for i in (1, 2))  # statistics used: the kernel-level API
        return site
    if not _state["unpatched"]:
        return None
    norm = _torch_norms().get(node.target)
    if norm is None:
        return None
    kind, names = norm
    a = _args(node, names, (None, None, None) if kind != "rms" else (None, None))
    x = a["input"]
    if not isinstance(_ev(x), torch.Tensor):
        return None
    if kind == "gn":
        if not isinstance(a["num_groups"], int):
            return None
        return _Site(node=node, origin="torch", kind="gn", x=x, groups=a["num_groups"], weight=a["weight"],
                     bias=a["bias"], eps=1e-5 if a["eps"] is None else a["eps"], y=node)
    shape = a["normalized_shape"]
    shape = (shape,) if isinstance(shape, int) else shape
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) for s in shape):
        return None
    eps = a["eps"]
    if kind == "ln" and eps is None:
        eps = 1e-5
    if kind == "rms" and eps is None:
        from .reference import default_rms_eps
        eps = default_rms_eps(_ev(x).dtype)
    return _Site(node=node, origin="torch", kind=kind, x=x, ndim=len(shape), weight=a.get("weight"),
                 bias=a.get("bias"), eps=eps, y=node)


def _sole_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _same_tensor_meta(a, b) -> bool:
    ea, eb = _ev(a), _ev(b)
    return isinstance(ea, torch.Tensor) and isinstance(eb, torch.Tensor) and ea.shape == eb.shape and \
        ea.device == eb.device


def _grow(site: _Site) -> _Site:
    """The largest site: absorb the producer add and the consumer chain where normkit can."""
    if site.fixed:
        return site
    if site.kind != "gn" and site.residual is None:
        p = site.x
        if isinstance(p, torch.fx.Node) and p.op in ("call_function", "call_method") and \
                (p.target in _ADDS or p.target == "add") and len(p.args) == 2 and not p.kwargs:
            a, b = p.args
            if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and _same_tensor_meta(a, p) and \
                    _same_tensor_meta(b, p) and _ev(a).dtype in _KERNEL_DTYPES and _ev(b).dtype in _KERNEL_DTYPES:
                site = site.copy(x=a, residual=b, residual_dtype=_ev(p).dtype, add=p)
    while True:
        out = site.out
        user = _sole_user(out)
        if user is None:
            return site
        changes = _consumer(site, out, user)
        if changes is None:
            return site
        site = site.absorb(user, **changes)


def _consumer(site: _Site, out, user) -> Optional[dict]:
    """What folding `user` (the sole user of the site's output) into normkit's op changes, or None."""
    if site.kind != "gn" and site.weight is None and not site.activation and site.out_dtype is None and \
            site.ndim == 1 and user.op in ("call_function", "call_method") and \
            (user.target in _MULS or user.target == "mul") and len(user.args) == 2 and not user.kwargs:
        w = user.args[1] if user.args[0] is out else user.args[0]
        ew, ey, ex = _ev(w), _ev(out), _ev(site.x)
        if isinstance(ew, torch.Tensor) and ew.dim() == 1 and ew.shape[0] == ex.shape[-1] and \
                ew.dtype in _KERNEL_DTYPES and ew.device == ey.device:  # y * w: w is the norm's weight
            promoted = torch.promote_types(ew.dtype, ey.dtype)
            return {"weight": w, "out_dtype": None if promoted == ex.dtype else promoted}
    if not site.activation and user.op == "call_function" and user.target in _ACTIVATIONS and \
            user.args and user.args[0] is out:
        if user.target is F.gelu:
            name = {"none": "gelu", "tanh": "gelu_tanh"}.get(_args(user, ("input", "approximate")).get("approximate",
                                                                                                       "none"))
        else:
            name = None if _args(user, ("input", "inplace")).get("inplace") else _ACTIVATIONS[user.target]
        return None if name is None else {"activation": name}
    if site.kind != "gn" and site.out_dtype is None and user.op == "call_method" and not user.kwargs:
        dtype = _FLOAT_CASTS.get(user.target) if len(user.args) == 1 else None
        if user.target == "to" and len(user.args) == 2 and isinstance(user.args[1], torch.dtype):
            dtype = user.args[1]
        if dtype in _KERNEL_DTYPES:
            return {"out_dtype": dtype}
    return None


def _variants(site: _Site):
    """The grown site, then smaller ones: consumers dropped from the end, then the add."""
    for with_add in ((True, False) if site.add is not None else (False,)):
        for k in range(len(site.chain), -1, -1):
            yield with_add, k


def _shrink(base: _Site, grown: _Site, with_add: bool, k: int) -> _Site:
    s = base.copy()
    if with_add:
        s = s.copy(x=grown.x, residual=grown.residual, residual_dtype=grown.residual_dtype, add=grown.add)
    for node, changes in grown.chain[:k]:
        s = s.absorb(node, **changes)
    return s


def _pattern_name(site: _Site) -> str:
    name = ("add_" if site.residual is not None else "") + site.kind
    if site.activation:
        name += "_" + site.activation
    x_dtype = _ev(site.x).dtype
    if site.out_dtype is not None and site.out_dtype != x_dtype and site.kind != "gn":
        name += "_cast"
    producers = [site.x] + ([site.residual] if site.residual is not None else [])
    if not all(_blocking_producer(p) for p in producers):
        name = "pw+" + name
    if not _blocking_consumers(site.out):
        name += "+pw"
    return name


def _width(site: _Site) -> Optional[int]:
    ev = _ev(site.x)
    dims = ev.shape[ev.dim() - site.ndim:] if site.kind != "gn" else ev.shape[2:]
    sizes = [_hint(s) for s in dims]
    if any(s is None for s in sizes):
        return None
    n = math.prod(sizes)
    if site.kind == "gn":
        c = _hint(ev.shape[1])
        n = None if c is None else n * (c // site.groups)
    return n


def _decide(site: _Site) -> tuple[str, bool]:
    ev = _ev(site.x)
    out = _ev(site.y)
    mode = "train" if (isinstance(out, torch.Tensor) and out.requires_grad) else "fwd"
    width = _width(site)
    name = _pattern_name(site)
    layout = layout_of(ev)
    if width is None:
        return key(name, ev.dtype, mode, 1, layout), False
    return _lookup(name, ev.dtype, mode, width, ev.device, _size_hint(ev), layout)


def _replace(graph, site: _Site) -> None:
    """Rewrite the graph so one normkit op computes `site` (its add, norm and chain)."""
    ev_x = _ev(site.x)
    insert_at = site.out
    with graph.inserting_before(insert_at):
        if site.kind == "gn":
            op = graph.call_function(torch.ops.normkit.group_norm_fwd.default, GN_FWD.call(
                x=site.x, num_groups=site.groups, weight=site.weight, bias=site.bias, eps=float(site.eps),
                activation=site.activation, backend=None))
        else:
            op = graph.call_function(torch.ops.normkit.row_norm_fused_fwd.default, ROW_FUSED_FWD.call(
                x=site.x, normalized_ndim=site.ndim, weight=site.weight, bias=site.bias, eps=float(site.eps),
                rms=site.kind == "rms", activation=site.activation, backend=None, residual=site.residual,
                residual_dtype=site.residual_dtype if site.residual is not None else None,
                weight_offset=float(site.weight_offset or 0.0),
                out_dtype=site.out_dtype if site.out_dtype not in (None, ev_x.dtype) else None))
        y = graph.call_function(operator.getitem, (op, 0))
        h = graph.call_function(operator.getitem, (op, 1)) if site.add is not None else None
    for new, old in ((op, site.node), (y, site.out)):
        new.meta.update({k: v for k, v in old.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                    "source_fn_stack")})
    y.meta["example_value"] = _ev(site.out)
    site.out.replace_all_uses_with(y)
    if h is not None:
        h.meta["example_value"] = _ev(site.add)
        site.add.replace_all_uses_with(h)  # the site's own use is about to go
    if site.origin == "normkit":  # its other outputs (h of a fused call) from the new op
        index = {0: 0, 1: 2, 2: 3} if site.node.target is torch.ops.normkit.row_norm_fwd.default else None
        for user in list(site.node.users):
            if user is site.y or user.target is not operator.getitem:
                continue
            if user.users:
                with graph.inserting_before(insert_at):
                    new = graph.call_function(operator.getitem, (op, user.args[1] if index is None else
                                                                 index[user.args[1]]))
                new.meta.update(user.meta)
                user.replace_all_uses_with(new)
            graph.erase_node(user)
    dead = [n for n, _ in reversed(site.chain)] + ([site.y] if site.y is not site.node else []) + [site.node]
    if site.add is not None:
        dead.append(site.add)
    for node in dead:
        if not node.users and node.graph is graph:
            graph.erase_node(node)


def rewrite(graph: torch.fx.Graph) -> int:
    """The pass: decide every norm of `graph` (see the module docstring). Returns the number of
    normkit ops left in it."""
    in_autocast = set()
    depth = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.amp._enter_autocast:
            depth += 1
        elif node.op == "call_function" and node.target is torch.amp._exit_autocast:
            depth -= 1
        elif depth:
            in_autocast.add(node)
    kept = 0
    for node in list(graph.nodes):
        if node.graph is not graph:
            continue
        site = _site_of(node) if node not in in_autocast else None
        if site is None or not isinstance(_ev(site.x), torch.Tensor):
            continue
        grown = _grow(site)
        chosen = None
        for with_add, k in _variants(grown):
            candidate = _shrink(site, grown, with_add, k)
            name, win = _decide(candidate)
            if win:
                chosen = candidate
                _log.append((name, "normkit"))
                break
        if chosen is None:
            _log.append((_decide(site)[0], "inductor"))
            if site.origin == "normkit":  # step aside: torch's ops with normkit's numerics
                site.node.target = _ops()[site.node.target][1]
            continue
        kept += 1
        if chosen.origin == "normkit" and chosen.add is None and not chosen.chain:
            continue  # the op as it is
        _replace(graph, chosen)
    _sort(graph)
    return kept


def _sort(graph) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort
    stable_topological_sort(graph)


# ----------------------------------------------------------------------------- installing the pass

def _source_hash() -> str:
    """normkit's version and the source of what the pass emits and decides with (this file and the
    torch backend its composites call), hashed once: the code this process runs."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        import sys
        h = hashlib.sha256(str(getattr(sys.modules.get("normkit"), "__version__", "")).encode())
        for path in (Path(__file__), Path(torch_backend.__file__)):
            h.update(path.read_bytes())
        _SOURCE_HASH = h.hexdigest()
    return _SOURCE_HASH


_SOURCE_HASH = None


def _tables_in_use():
    """What the pass decides from: the override, or the tables of every GPU (as wins() reads them);
    nothing under policy "normkit" / "torch", which consult no table."""
    if _state["policy"] != "table":
        return None
    if _state["table"] is not None:
        return {"override": _state["table"]}
    return {p.stem: _file_table(p.stem[len("compile_"):]) for p in sorted(TABLE_DIR.glob("compile_*.json"))}


def _uuid() -> str:
    """The identity of normkit's pass as the settings stand now, the key Inductor's FX graph cache and
    AOTAutograd's cache file compiled graphs under: normkit's version, the source of this module and of
    the torch backend, the measured tables in use, policy(), use_table() and enable_compile_fusion().
    Equal settings give equal ids in any process; a change of any of them a new one."""
    settings = {"source": _source_hash(), "unpatched": _state["unpatched"], "policy": _state["policy"],
                "tables": _tables_in_use()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=repr).encode()).hexdigest()


class NormkitPass:
    """normkit's pre-grad pass, an Inductor CustomGraphPass (registered as one by _pass(): importing
    Inductor here would cost seconds at `import normkit`). Module-level, so it pickles; it pickles as
    its uuid(), so a torch that pickles its config into the cache key (2.11) keys on the settings too;
    unpickled (or deep-copied) it is this process's pass."""

    def __call__(self, graph):
        rewrite(graph)

    def uuid(self) -> str:
        return _uuid()

    def __reduce__(self):
        return _the_pass, (self.uuid(),)

    def __repr__(self):
        return "<normkit.compile_fusion.NormkitPass>"


def _the_pass(pass_id=None):
    """What a pickled NormkitPass loads as (the uuid it was pickled with only keyed the pickle)."""
    return _pass()


class Chain:
    """normkit's pass after one the user installed. Its uuid is both ids (None if the user's pass has
    none: then Inductor does not cache on it, and names the user's pass); it pickles as its two passes."""

    def __init__(self, first, second):
        self.first, self.second = first, second
        name = getattr(first, "__qualname__", None) or type(first).__qualname__
        self.__qualname__ = f"{name} (chained before normkit's pass)"  # how Inductor names a pass

    def __call__(self, graph):
        self.first(graph)
        self.second(graph)

    def uuid(self):
        first = self.first.uuid() if callable(getattr(self.first, "uuid", None)) else None
        return None if first is None else (first, self.second.uuid())

    def __reduce__(self):
        return Chain, (self.first, self.second)


_PASS = None


def _pass() -> NormkitPass:
    """normkit's pass object; on first use registers the classes as Inductor's CustomGraphPass
    (torch >= 2.5; an older torch takes them as plain callables)."""
    global _PASS
    if _PASS is None:
        try:
            from torch._inductor.custom_graph_pass import CustomGraphPass
        except ImportError:
            pass
        else:
            CustomGraphPass.register(NormkitPass)
            CustomGraphPass.register(Chain)
        _PASS = NormkitPass()
    return _PASS


def _composites_cacheable(config) -> None:
    """Where normkit's op steps aside the pass calls a composite (a Python function of this module)
    that AOT autograd traces. A torch that runs the pre-grad pass before AOTAutograd's cache lookup
    (2.11) checks every graph target and bypasses that cache for a function it does not know; list the
    composites, keyed by this module's source, in its config for such functions."""
    marked = getattr(config, "unsafe_marked_cacheable_functions", None)
    if not isinstance(marked, dict):
        return  # a torch without the setting
    names = {f"{f.__module__}.{f.__name__}": _source_hash() for f in
             (_row_norm_composite, _row_norm_plain_composite, _group_norm_composite)}
    if any(marked.get(k) != v for k, v in names.items()):
        config.unsafe_marked_cacheable_functions = {**marked, **names}


def install() -> None:
    """Put normkit's pass into torch._inductor.config.pre_grad_custom_pass (after any pass there)."""
    import torch._inductor.config as config
    ours = _pass()
    _composites_cacheable(config)
    current = config.pre_grad_custom_pass
    if current is ours or getattr(current, "second", None) is ours:
        return
    if isinstance(current, (list, tuple)):  # a torch that runs a list of passes (2.13; not 2.11)
        if ours not in current:
            config.pre_grad_custom_pass = [*current, ours]
        return
    config.pre_grad_custom_pass = ours if current is None else Chain(current, ours)


def traced() -> bool:
    """Called where dynamo traces a normkit op. Marked as torch.compiler.assume_constant_result
    marks a function (without importing dynamo here), so dynamo runs it once per trace instead of
    tracing it: the pass is in place before Inductor compiles the graph."""
    if os.environ.get("NORMKIT_COMPILE_PASS", "1") != "0":
        install()
    return True


traced._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets
