"""The argument lists of normkit's custom ops, LayerNorm/RMSNorm's and GroupNorm's, defined once, as data
(issue 22).

Each op's arguments are a table of (name, schema type, default), in order. From it come:
- the op's schema (normkit._library defines the ops with it: `schema`);
- the positional argument tuple of a call made by name (`call`: the compile pass builds its
  row_norm_fused_fwd and group_norm_fwd nodes with it, normkit._library its calls), every omitted
  argument its default;
- each argument's position (`index`, and `read`, a namedtuple of a call's arguments for the ops'
  Python implementations, fakes, autograd and DTensor sharding rules), handed to the C++ host path once
  when it loads (normkit._host.load_extension -> host.cpp's set_op_args, for the tables in HOST_OPS;
  row_norm_fwd's and row_norm_bwd's arguments lead the fused ops'), so its op kernels read arguments by
  name: a table without a name they read fails the load; an argument they do not read (an option added
  here later) must be None for them to serve a call.
A new option is a row here (and its use where it is computed); no list of positions elsewhere.
HOST_ROW (below) is the same for the C++ host path's eager entry.

A default also goes into the schema for the arguments after the last one without a default (as
Python's parameters take them), so a caller may leave the trailing options out.
"""
from __future__ import annotations

from collections import namedtuple

REQUIRED = object()


class OpArgs:
    """One op's argument table: `args` is ((name, schema type, default or REQUIRED), ...)."""

    def __init__(self, op: str, args: tuple, returns: str):
        self.op = op
        self.args = args
        self.names = tuple(a[0] for a in args)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.returns = returns
        self.defaults = {name: d for name, _, d in args if d is not REQUIRED}
        self.read = namedtuple(f"{op}_args", self.names, defaults=self._trailing_defaults())
        self.call = self._make_call()

    def _trailing_defaults(self) -> tuple:
        out = []
        for _, _, default in reversed(self.args):
            if default is REQUIRED:
                break
            out.append(default)
        return tuple(reversed(out))

    def schema(self) -> str:
        """The op's schema, e.g. "(Tensor x, int normalized_ndim, ..., Tensor? gate=None) -> (Tensor, ...)"."""
        first_default = len(self.args) - len(self._trailing_defaults())
        parts = [f"{ty} {name}" + (f"={_schema_value(d)}" if i >= first_default else "")
                 for i, (name, ty, d) in enumerate(self.args)]
        return f"({', '.join(parts)}) -> {self.returns}"

    def _make_call(self):
        """`call(**given)`: the op's positional arguments of a call made by name; omitted arguments take
        their defaults. Generated from the table as plain Python (keyword-only parameters returned as a
        tuple), so a call reads nothing at run time: torch.compile's trace of it installs no guards on
        the table (a loop over it cost ~70 guard entries per compiled frame)."""
        params = ", ".join(name if d is REQUIRED else f"{name}=_d_{name}" for name, _, d in self.args)
        src = f"def {self.op}_call(*, {params}):\n    return ({', '.join(self.names)},)\n"
        scope = {f"_d_{name}": d for name, _, d in self.args if d is not REQUIRED}
        exec(compile(src, f"<normkit._op_args {self.op}>", "exec"), scope)  # noqa: S102 - built from the table above
        return scope[f"{self.op}_call"]

    def by_position(self, n: int, **by_name) -> tuple:
        """One value per argument a call passed (the first n: the trailing defaults may be left out),
        given by name, None elsewhere: an autograd formula's gradients, a sharding rule's placements."""
        out = [None] * n
        for name, g in by_name.items():
            i = self.index[name]
            if i < n:
                out[i] = g
            elif g is not None:
                raise RuntimeError(f"{self.op}: a value for {name}, which the call did not pass")
        return tuple(out)


def _schema_value(v) -> str:
    return "None" if v is None else str(v)  # bools print True/False and floats 0.0, as schemas write them


_ROW = (("x", "Tensor", REQUIRED), ("normalized_ndim", "SymInt", REQUIRED), ("weight", "Tensor?", REQUIRED),
        ("bias", "Tensor?", REQUIRED), ("eps", "float", REQUIRED), ("rms", "bool", REQUIRED),
        ("activation", "str?", REQUIRED), ("backend", "str?", REQUIRED))
# the fused options, after the plain op's arguments; the ones the adaLN modulation and the gated norm added last
_FUSED = (("residual", "Tensor?", None), ("residual_dtype", "ScalarType?", None), ("weight_offset", "float", 0.0),
          ("out_dtype", "ScalarType?", None), ("out_scale", "Tensor?", None), ("out_scale_value", "float?", None),
          ("want_amax", "bool", False), ("mod_scale", "Tensor?", None), ("mod_shift", "Tensor?", None),
          ("gate", "Tensor?", None))
_ROW_BWD = (("dy", "Tensor", REQUIRED), ("x", "Tensor", REQUIRED), ("normalized_ndim", "SymInt", REQUIRED),
            ("weight", "Tensor?", REQUIRED), ("bias", "Tensor?", REQUIRED), ("mean", "Tensor", REQUIRED),
            ("rstd", "Tensor", REQUIRED), ("rms", "bool", REQUIRED), ("activation", "str?", REQUIRED),
            ("dweight_dtype", "ScalarType?", REQUIRED), ("dbias_dtype", "ScalarType?", REQUIRED),
            ("backend", "str?", REQUIRED))
_FUSED_BWD = (("weight_offset", "float", REQUIRED), ("dh", "Tensor?", REQUIRED), ("dx_dtype", "ScalarType", REQUIRED),
              ("dres_dtype", "ScalarType?", REQUIRED), ("mod_scale", "Tensor?", None), ("mod_shift", "Tensor?", None),
              ("dscale_dtype", "ScalarType?", None), ("dshift_dtype", "ScalarType?", None), ("gate", "Tensor?", None))

_GN = (("x", "Tensor", REQUIRED), ("num_groups", "SymInt", REQUIRED), ("weight", "Tensor?", REQUIRED),
       ("bias", "Tensor?", REQUIRED), ("eps", "float", REQUIRED), ("activation", "str?", REQUIRED),
       ("backend", "str?", REQUIRED))
_GN_BWD = (("dy", "Tensor", REQUIRED), ("x", "Tensor", REQUIRED), ("num_groups", "SymInt", REQUIRED),
           ("weight", "Tensor?", REQUIRED), ("bias", "Tensor?", REQUIRED), ("mean", "Tensor", REQUIRED),
           ("rstd", "Tensor", REQUIRED), ("activation", "str?", REQUIRED), ("dweight_dtype", "ScalarType?", REQUIRED),
           ("dbias_dtype", "ScalarType?", REQUIRED), ("backend", "str?", REQUIRED),
           # the forward's eps: the torch backend's CPU kernel recomputes the activation's input with the
           # forward's bits (torch's kernel again); None: from the statistics. The GPU kernels do not need it
           ("eps", "float?", None))

ROW_FWD = OpArgs("row_norm_fwd", _ROW, "(Tensor, Tensor, Tensor)")
ROW_FUSED_FWD = OpArgs("row_norm_fused_fwd", _ROW + _FUSED, "(Tensor, Tensor, Tensor, Tensor, Tensor)")
ROW_BWD = OpArgs("row_norm_bwd", _ROW_BWD, "(Tensor, Tensor, Tensor)")
ROW_FUSED_BWD = OpArgs("row_norm_fused_bwd", _ROW_BWD + _FUSED_BWD,
                       "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
GN_FWD = OpArgs("group_norm_fwd", _GN, "(Tensor, Tensor, Tensor)")
GN_BWD = OpArgs("group_norm_bwd", _GN_BWD, "(Tensor, Tensor, Tensor)")
OPS = {a.op: a for a in (ROW_FWD, ROW_FUSED_FWD, ROW_BWD, ROW_FUSED_BWD, GN_FWD, GN_BWD)}
# the tables the C++ host path's op kernels read their arguments by (normkit._host.load_extension)
HOST_OPS = (ROW_FUSED_FWD, ROW_FUSED_BWD, GN_FWD, GN_BWD)

# The C++ host path's eager entry, normkit._host.fast.row_norm, in the order normkit.functional._via_host
# passes its arguments (the public functions' own: normalized_shape as given, out_scale a float or a
# tensor, autocast whether to apply torch's contract): a call passes the first HOST_ROW_LENGTHS[0]
# (a plain call), the first [1] (fused options), or all (the modulation or a gate). host.cpp reads
# them by these positions (handed over at load); tests/test_host.py checks _via_host's order.
HOST_ROW = ("x", "normalized_shape", "weight", "bias", "eps", "rms", "activation", "backend", "residual", "prenorm",
            "residual_dtype", "weight_offset", "out_dtype", "out_scale", "return_amax", "autocast", "mod_scale",
            "mod_shift", "gate")
HOST_ROW_LENGTHS = (8, 16, 19)
