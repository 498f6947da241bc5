"""GroupNorm with the fused activation, forward and backward, NCHW and channels_last, against the
float64 oracle (Triton under the interpreter on CPU, compiled on a GPU; and the torch path)."""
import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit import reference as ref

from conftest import DEVICE
from helpers import DTYPES, TOL, assert_close, param_tol, randn

ACTIVATIONS = [None, "silu", "mish", "gelu", "gelu_tanh", "relu"]


def channels_last(x):
    """x in channels-innermost memory order, same shape (torch's channels_last for 4-D)."""
    perm = (0,) + tuple(range(2, x.dim())) + (1,)
    inv = (0, x.dim() - 1) + tuple(range(1, x.dim() - 1))
    return x.permute(perm).contiguous().permute(inv)


def check_gn(x, groups, w, b, act, backend="triton", what=""):
    leaves = {k: t.requires_grad_(True) for k, t in (("x", x), ("w", w), ("b", b)) if t is not None}
    y = normkit.group_norm(x, groups, w, b, 1e-5, activation=act, backend=backend)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.stride() == x.stride(), f"{what}: output memory format {y.stride()} != input {x.stride()}"
    assert_close(y, ref.group_norm(x, groups, w, b, 1e-5, act)[0], TOL[x.dtype], f"{what} y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    grads = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))
    dx_ref, dw_ref, db_ref = ref.group_norm_backward(dy, x, groups, w, b, 1e-5, act)
    assert_close(grads["x"], dx_ref, TOL[x.dtype], f"{what} dx")
    if w is not None:
        assert_close(grads["w"], dw_ref, param_tol(w.dtype, x.dtype), f"{what} dweight")
    if b is not None:
        assert_close(grads["b"], db_ref, param_tol(b.dtype, x.dtype), f"{what} dbias")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("fmt", ["nchw", "channels_last"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activations_and_formats(act, fmt, backend, poison):
    x = randn(3, 16, 5, 7, device=DEVICE)
    if fmt == "channels_last":
        x = channels_last(x)
    check_gn(x, 4, randn(16, device=DEVICE), randn(16, device=DEVICE), act, backend, f"{act} {fmt}")


# configuration overrides that force a path on the small test input (3 x 12 x 35, groups of 3 x 35)
STAGED_ALL = {"GN_STAGED_MIN_NUMEL": 0, "GN_STAGED_NCHW_MAX_GROUPS_PER_SM": float("inf"),
              "GN_STAGED_CL_MAX_GROUP_CHANNELS": {"fwd": 1 << 30, "bwd": 1 << 30},
              "GN_STAGED_TILE": {2: 16, 4: 16}, "GN_STAGED_STATS_TILE": {2: (16, 4), 4: (16, 4)},
              "GN_STAGED_MAX_SUB": 2, "GN_STAGED_PROGRAMS_PER_SM": {"fwd": 1e-3, "bwd": 1e-3}, "GN_STAGED_FINALIZE_TILE": 1}
# every group looped, whatever its size and the group count (no one-tile groups, no two-kernel split)
LOOPED_ALL = {"GN_LOOPED_MIN_GROUPS_PER_SM": {"fwd": 0, "bwd": 0},
              "GN_ONE_TILE_MAX": {(d, b): {"nchw": 0, "cl": 0} for d in ("fwd", "bwd") for b in (2, 4)},
              "GN_SPLIT2_LAYOUTS": {(d, b): () for d in ("fwd", "bwd") for b in (2, 4)}}
FORCED_PATHS = {
    # looped (a program per group walking tiles; forward and backward) on tiles of 16 elements:
    # 3 x 3 tiles per group with ragged edges on both axes
    "looped": {**LOOPED_ALL, "GN_LOOPED_TILE": {(d, b): (16, 4) for d in ("fwd", "bwd") for b in (2, 4)},
               "GN_LOOPED_SLOTS": {}},
    # the same with the first pass accumulating per element slot (ragged slots: counts differ per column)
    # (channels_last groups keep the plain looped kernels on the same tiles)
    "looped-slots": {**LOOPED_ALL, "GN_LOOPED_SLOTS": {(d, b): (1 << 30, (16, 4)) for d in ("fwd", "bwd") for b in (2, 4)},
                     "GN_LOOPED_TILE": {(d, b): (16, 4) for d in ("fwd", "bwd") for b in (2, 4)}},
    # staged (stats, finalize, apply) for every input and layout: apply on 16-element tiles, stats
    # accumulating per element slot on 32-element tiles grouped into spans of 2 tiles with a ragged
    # last span (and a ragged last tile), the finalize one span at a time
    "staged": {**STAGED_ALL, "GN_STAGED_STATS_TILE": {2: (32, 2), 4: (32, 2)}},
    # the same with the stats reducing each 16-element tile across threads (no slots)
    "staged-tiles": {**STAGED_ALL, "GN_STAGED_SLOTS": {"fwd": False, "bwd": False}},
    # staged with a narrow weight-gradient reduction over several programs (4 x 4 blocks, 1 warp)
    # and slot stats
    "staged-colsum": {**STAGED_ALL, "GN_COL_SUM": (4, 4, 1)},
    # two-kernel split (a program per slice: partials, then merge and apply) on 16-element
    # slices: 3 x 3 slices per group (35 positions: a ragged last slice), whatever the group count
    "split2": {"GN_SPLIT2_TILE": {(d, b): (16, 4) for d in ("fwd", "bwd") for b in (2, 4)},
               "GN_SPLIT2_LAYOUTS": {(d, b): ("nchw", "cl") for d in ("fwd", "bwd") for b in (2, 4)},
               "GN_SPLIT2_MIN_TILES": {"fwd": 2, "bwd": 2}, "GN_SPLIT2_MIN_GROUPS_PER_SM": {"fwd": 0, "bwd": 0},
               "GN_SPLIT2_MAX_GROUPS_PER_SM": {"fwd": 1e9, "bwd": 1e9}, "GN_SPLIT2_MIN_S": {"fwd": 0, "bwd": 0},
               "GN_STAGED_MIN_NUMEL": 1 << 62},
}


@pytest.fixture(params=list(FORCED_PATHS))
def forced_path(request, monkeypatch):
    from normkit.backends.triton import clear_caches, configs
    for name, value in FORCED_PATHS[request.param].items():
        monkeypatch.setattr(configs, name, value)
    clear_caches()
    yield request.param
    monkeypatch.undo()
    clear_caches()


def _assert_path_taken(path, x, dtype, act):
    from normkit.backends.triton import _gn_plan, _staged_plan
    x3 = x.view(3, 12, 35) if x.is_contiguous() else x.permute(0, 2, 3, 1).reshape(3, 35, 12).transpose(1, 2)
    for direction, extra in (("fwd", None), ("bwd", (True, True))):
        staged = _staged_plan(direction, x3, 3)[0]
        if path.startswith("staged"):
            assert staged is not None and staged.n_sub > 1 and staged.block_p == 1
            assert staged.slots == (path != "staged-tiles")
            continue
        cfg = _gn_plan(direction, 3, 35, dtype, x.device, (True, True, act, extra), 12, not x.is_contiguous())[0]
        assert staged is None and (cfg.block_r, cfg.block_s) == (1, 16)
        assert cfg.looped if path.startswith("looped") else cfg.two_kernel
        assert cfg.slots == (path == "looped-slots" and x.is_contiguous())  # the slot kernels: NCHW groups


@pytest.mark.parametrize("fmt", ["nchw", "channels_last"])
@pytest.mark.parametrize("act", [None, "mish"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forced_paths(dtype, act, fmt, forced_path, poison):
    x = randn(3, 12, 5, 7, dtype=dtype, device=DEVICE)
    if fmt == "channels_last":
        x = channels_last(x)
    what = f"{forced_path} {fmt} {act}"
    check_gn(x, 4, randn(12, device=DEVICE), randn(12, device=DEVICE), act, what=what)
    check_gn(x.detach().clone(), 3, None, None, act, what=f"{what} no affine")
    if dtype == torch.float32:  # groups offset by 1e4: shifted, exactly merged statistics keep the digits
        xo = x.detach() + 1e4
        y = normkit.group_norm(xo, 4, None, None, 1e-5, activation=act)
        assert_close(y, ref.group_norm(xo, 4, None, None, 1e-5, act)[0], 1e-5, f"{what} offset")
    _assert_path_taken(forced_path, x, dtype, act)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape, groups", [((2, 8, 16), 8), ((1, 64, 33), 8), ((2, 32, 4, 4), 32),
                                           ((3, 12), 2), ((2, 12, 3, 2, 5), 4), ((1, 10, 300), 5)])
def test_shapes_and_dtypes(shape, groups, dtype, poison):
    x = randn(*shape, dtype=dtype, device=DEVICE)
    p_dtype = torch.float32 if dtype != torch.float16 else torch.float16
    c = shape[1]
    check_gn(x, groups, randn(c, dtype=p_dtype, device=DEVICE), randn(c, dtype=p_dtype, device=DEVICE), "silu",
             what=f"{shape} G={groups} {dtype}")
    if x.dim() >= 3:
        check_gn(channels_last(randn(*shape, dtype=dtype, device=DEVICE)), groups, None, None, None,
                 what=f"{shape} channels_last, no affine")


def test_split2_ragged_channel_slices_nan_and_offset_groups(monkeypatch):
    """The two-kernel split with slices of 2 of a group's 5 channels (the last one ragged): the
    float64 oracle, a NaN confined to its group, groups offset by 1e4, bitwise weight gradients."""
    from normkit.backends.triton import _gn_plan, clear_caches, configs
    monkeypatch.setattr(configs, "GN_SPLIT2_TILE", {(d, b): (64, 4) for d in ("fwd", "bwd") for b in (2, 4)})
    monkeypatch.setattr(configs, "GN_SPLIT2_LAYOUTS", {(d, b): ("nchw", "cl") for d in ("fwd", "bwd") for b in (2, 4)})
    monkeypatch.setattr(configs, "GN_SPLIT2_MIN_GROUPS_PER_SM", {"fwd": 0, "bwd": 0})
    monkeypatch.setattr(configs, "GN_SPLIT2_MAX_GROUPS_PER_SM", {"fwd": 1e9, "bwd": 1e9})
    monkeypatch.setattr(configs, "GN_SPLIT2_MIN_S", {"fwd": 0, "bwd": 0})
    monkeypatch.setattr(configs, "GN_STAGED_MIN_NUMEL", 1 << 62)
    clear_caches()
    try:
        cfg = _gn_plan("fwd", 5, 8, torch.float32, torch.device(DEVICE), (True, True, None, None), 4)[0]
        assert cfg.two_kernel and (cfg.block_r, cfg.block_s) == (2, 8)
        for fmt in ("nchw", "channels_last"):
            x = randn(2, 10, 2, 4, device=DEVICE)
            x = channels_last(x) if fmt == "channels_last" else x
            check_gn(x, 2, randn(10, device=DEVICE), randn(10, device=DEVICE), "silu", what=f"split2 {fmt}")
            xo = x.detach() + 1e4
            assert_close(normkit.group_norm(xo, 2, backend="triton"), ref.group_norm(xo, 2)[0], 1e-5, f"split2 {fmt} offset")
            xn = x.detach().clone()
            xn[1, 6, 1, 2] = float("nan")  # batch 1, group 1
            y = normkit.group_norm(xn, 2, activation="mish", backend="triton")
            assert torch.isnan(y[1, 5:]).all() and not torch.isnan(y[0]).any() and not torch.isnan(y[1, :5]).any()
            xg = x.detach().requires_grad_(True)
            w = randn(10, device=DEVICE).requires_grad_(True)
            b = randn(10, device=DEVICE).requires_grad_(True)
            dy = randn(*x.shape, device=DEVICE)
            g1, g2 = (torch.autograd.grad(normkit.group_norm(xg, 2, w, b, activation="silu", backend="triton"),
                                          [w, b], dy) for _ in range(2))
            assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])
    finally:
        monkeypatch.undo()
        clear_caches()


# looped on 256-element tiles whose channel block may shrink to a quarter of the tile's to pad the group's
# channels least: groups of 3 channels take blocks of 1 (4 with the full block), whatever the group count
LOOPED_MINPAD = {**LOOPED_ALL, "GN_LOOPED_TILE": {(d, b): (256, 4) for d in ("fwd", "bwd") for b in (2, 4)},
                 "GN_LOOPED_MIN_BLOCK_FRACTION": {(d, b): 0.25 for d in ("fwd", "bwd") for b in (2, 4)},
                 "GN_STAGED_MIN_NUMEL": 1 << 62}


@pytest.mark.parametrize("path", ["looped", "looped-slots", "looped-minpad", "staged"])
@pytest.mark.parametrize("hw", [(1, 1), (1, 13), (5, 7)], ids=["hw1", "hw13", "hw35"])
def test_walks_awkward_shapes(path, hw, monkeypatch):
    """The looped walk (16-element tiles, with and without the slot kernels; 256-element ones with the
    least-padding channel block) and the staged path with one position (HW = 1), a prime number of
    positions, both layouts: the float64 oracle (forward and backward), a NaN confined to its group, groups offset by 1e4."""
    from normkit.backends.triton import _gn_plan, clear_caches, configs
    for name, value in (LOOPED_MINPAD if path == "looped-minpad" else FORCED_PATHS[path]).items():
        monkeypatch.setattr(configs, name, value)
    clear_caches()
    try:
        if path in ("looped", "looped-slots"):
            cfg = _gn_plan("fwd", 3, hw[0] * hw[1], torch.float32, torch.device(DEVICE), (True, True, None, None), 8)[0]
            assert cfg.looped and cfg.slots == (path == "looped-slots"), f"expected the {path} path: {cfg}"
        if path == "looped-minpad":
            for fraction, block_r in ((0.25, 1), (1.0, 4)):
                monkeypatch.setattr(configs, "GN_LOOPED_MIN_BLOCK_FRACTION", {(d, b): fraction for d in ("fwd", "bwd")
                                                                              for b in (2, 4)})
                clear_caches()
                cfg = _gn_plan("bwd", 3, hw[0] * hw[1], torch.float32, torch.device(DEVICE), (True, True, None, (True, True)), 8)[0]
                assert cfg.looped and cfg.block_r == block_r, f"fraction {fraction}: {cfg}, expected blocks of {block_r}"
        for fmt in ("nchw", "channels_last"):
            x = randn(2, 12, *hw, device=DEVICE)
            x = channels_last(x) if fmt == "channels_last" else x
            what = f"{path} {hw} {fmt}"
            check_gn(x, 4, randn(12, device=DEVICE), randn(12, device=DEVICE), "silu", what=what)
            xo = x.detach() + 1e4
            assert_close(normkit.group_norm(xo, 4, backend="triton"), ref.group_norm(xo, 4)[0], 1e-5, f"{what} offset")
            xn = x.detach().clone()
            xn[1, 7, 0, hw[1] - 1] = float("nan")  # batch 1, group 2 (channels 6-8)
            y = normkit.group_norm(xn, 4, backend="triton")
            assert torch.isnan(y[1, 6:9]).all(), f"{what}: NaN did not reach its group"
            assert not torch.isnan(y[0]).any() and not torch.isnan(y[1, :6]).any() and not torch.isnan(y[1, 9:]).any(), \
                f"{what}: NaN leaked out of its group"
    finally:
        monkeypatch.undo()
        clear_caches()


def test_channels_last_is_read_in_place():
    from normkit.functional import _bcs, _is_channels_last

    x = randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    assert _is_channels_last(x)
    assert _bcs(x, True).data_ptr() == x.data_ptr()
    y = normkit.group_norm(x.to(DEVICE), 2, backend="triton")
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_module_is_a_torch_drop_in():
    theirs = torch.nn.GroupNorm(4, 12)
    with torch.no_grad():
        theirs.weight.copy_(randn(12))
        theirs.bias.copy_(randn(12))
    ours = normkit.GroupNorm(4, 12, activation="mish")
    assert isinstance(ours, torch.nn.GroupNorm)
    ours.load_state_dict(theirs.state_dict())
    x = randn(2, 12, 9)
    expected = F.mish(theirs(x)).detach()
    assert_close(ours.to(DEVICE)(x.to(DEVICE)), expected, TOL[torch.float32], "module")
    assert "activation='mish'" in repr(ours)


def test_offset_groups_keep_precision():
    x = 1e4 + randn(2, 8, 512, device=DEVICE)
    y = normkit.group_norm(x, 2, backend="triton")
    assert_close(y, ref.group_norm(x, 2)[0], 1e-5, "offset groups")


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("act", [None, "silu", "relu"])
@pytest.mark.parametrize("offset", [0.0, 50.0], ids=["centred", "offset"])
def test_bias_without_weight_trains(offset, act, backend):
    """A bias and no weight under autograd: the oracle's gradients in both layouts (torch's own CPU
    backward kernel fails on it, "tensor does not have a device"; normkit takes the bias gradient apart)."""
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = (randn(2, 8, 5, 3, device=DEVICE) + offset).to(memory_format=fmt).requires_grad_(True)
        b = randn(8, device=DEVICE).requires_grad_(True)
        y = normkit.group_norm(x, 4, None, b, activation=act, backend=backend)
        assert_close(y, ref.group_norm(x, 4, None, b, 1e-5, act)[0], TOL[x.dtype], f"y {fmt}")
        dy = randn(*x.shape, device=DEVICE)
        dx, db = torch.autograd.grad(y, [x, b], dy)
        dx_ref, _, db_ref = ref.group_norm_backward(dy, x, 4, None, b, 1e-5, act)
        assert_close(dx, dx_ref, TOL[x.dtype], f"dx {fmt}")
        assert_close(db, db_ref, param_tol(b.dtype, x.dtype), f"dbias {fmt}")


def test_weight_gradients_are_bitwise_reproducible():
    x = randn(4, 16, 50, device=DEVICE).requires_grad_(True)
    w = randn(16, device=DEVICE).requires_grad_(True)
    b = randn(16, device=DEVICE).requires_grad_(True)
    dy = randn(4, 16, 50, device=DEVICE)
    g1 = torch.autograd.grad(normkit.group_norm(x, 4, w, b, activation="silu"), [w, b], dy)
    g2 = torch.autograd.grad(normkit.group_norm(x, 4, w, b, activation="silu"), [w, b], dy)
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])


def test_activation_on_row_norms():
    x, w, b = randn(4, 100, device=DEVICE), randn(100, device=DEVICE), randn(100, device=DEVICE)
    for act in ACTIVATIONS[1:]:
        xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = normkit.layer_norm(xg, 100, wg, bg, activation=act, backend="triton")
        assert_close(y, ref.layer_norm(x, (100,), w, b, 1e-5, act)[0], TOL[torch.float32], f"ln {act}")
        dy = randn(4, 100, device=DEVICE)
        got = torch.autograd.grad(y, [xg, wg, bg], dy)
        for g, r, name in zip(got, ref.layer_norm_backward(dy, x, (100,), w, b, 1e-5, act), "xwb"):
            assert_close(g, r, 1e-4, f"ln {act} d{name}")
        y = normkit.rms_norm(x, 100, w, activation=act, backend="triton")
        assert_close(y, ref.rms_norm(x, (100,), w, None, act)[0], TOL[torch.float32], f"rms {act}")


@pytest.mark.parametrize("call, arg", [
    (lambda: normkit.group_norm(randn(2, 6, 4), 4), "num_groups"),
    (lambda: normkit.group_norm(randn(2, 6, 4), 0), "num_groups"),
    (lambda: normkit.group_norm(randn(6), 3), "x"),
    (lambda: normkit.group_norm(randn(2, 6, 4), 3, randn(5)), "weight"),
    (lambda: normkit.group_norm(randn(2, 6, 4), 3, None, randn(6, 1)), "bias"),
    (lambda: normkit.group_norm(randn(2, 6, 4), 3, activation="swish"), "activation"),
    (lambda: normkit.layer_norm(randn(2, 6), 6, activation="tanh"), "activation"),
    (lambda: normkit.GroupNorm(4, 6), "num_groups"),
])
def test_bad_input_names_the_argument(call, arg):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert arg in str(info.value), str(info.value)
