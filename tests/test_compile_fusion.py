"""normkit.compile_fusion: under torch.compile, normkit steps aside where its op is not measured
faster than Inductor's code (the graph keeps no normkit op and matches eager within tolerance) and
folds add -> norm, norm -> activation, norm -> cast (and HF's weight multiply) into its fused ops
where the table says it wins, for patched models and, when asked, for unpatched ones.

Most tests run the pass on dynamo's graph and then aot_eager (what Inductor would be handed,
without compiling C++: CI stays quick); two run Inductor itself on the CPU.
"""
import json
import operator

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import normkit
from normkit import compile_fusion as cf
from normkit import reference as ref

from conftest import DEVICE
from helpers import randn

NORMKIT = {torch.ops.normkit.row_norm_fwd.default, torch.ops.normkit.row_norm_fused_fwd.default,
           torch.ops.normkit.group_norm_fwd.default}


@pytest.fixture
def fresh_inductor_cache():
    """An empty cache for Inductor: the pass keys its caches (test_compile_cache.py), and a graph
    compiled by an earlier run would be loaded from them with no decision made (cf.decisions())."""
    from torch._inductor import utils
    with (getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)():
        yield


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    cf.decisions(clear=True)
    yield
    torch._dynamo.reset()


class Rewritten:
    """A dynamo backend: normkit's pass on the graph, then aot_eager; keeps the rewritten graphs."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        cf.rewrite(gm.graph)
        gm.recompile()
        self.graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

    def targets(self):
        return [n.target for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]

    def normkit_nodes(self):
        return [n for g in self.graphs for n in g.graph.nodes if n.op == "call_function" and n.target in NORMKIT]


def _fwd_bwd(fn, args, seed=1):
    out = fn(*args)
    dy = randn(*out.shape, gen=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], dy)
    return [out.detach()] + list(grads)


def _close(got, expected, tol, what=""):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, f"{what}[{i}]"
        assert ref.rel_err(g, e) <= tol, f"{what}[{i}]: {ref.rel_err(g, e):.3g}"


def _t(*shape, grad=True, seed=0, dtype=torch.float32):
    return randn(*shape, gen=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(grad)


# ----------------------------------------------------------------------------- normkit's calls step aside

def _normkit_calls(x, w, b, r, img, gw, gb):
    """normkit's functions as patched models call them: plain, with an activation, fused options."""
    y = normkit.layer_norm(x, 24, w, b)
    y = y + normkit.rms_norm(x, 24, w, 1e-6)
    y = y + normkit.layer_norm(x, 24, w, b, activation="gelu_tanh")
    y2, h = normkit.rms_norm(x, 24, w, residual=r, prenorm=True, weight_offset=1.0)
    g = normkit.group_norm(img, 4, gw, gb, activation="mish")
    return (y.square().sum() + (y2 * h).sum() + g.square().sum()).reshape(1)


def _calls_args():
    return (_t(3, 5, 24), _t(24, seed=1), _t(24, seed=2), _t(3, 5, 24, seed=3), _t(2, 8, 3, 5, seed=4),
            _t(8, seed=5), _t(8, seed=6))


def test_steps_aside_where_the_table_has_no_win():
    """No table entry (a CPU tensor): every normkit op becomes torch's ops; same results."""
    args = _calls_args()
    backend = Rewritten()
    got = _fwd_bwd(torch.compile(_normkit_calls, backend=backend, fullgraph=True), args)
    assert backend.graphs and not backend.normkit_nodes()
    assert {cf._row_norm_plain_composite, cf._row_norm_composite, cf._group_norm_composite} <= set(backend.targets())
    _close(got, _fwd_bwd(_normkit_calls, args), 1e-5)
    assert {d for _, d in cf.decisions()} == {"inductor"} and len(cf.decisions()) == 5


def test_policy_normkit_keeps_the_op_and_eager_bits():
    args = _calls_args()
    backend = Rewritten()
    with cf.policy("normkit"):
        got = _fwd_bwd(torch.compile(_normkit_calls, backend=backend, fullgraph=True), args)
    assert len(backend.normkit_nodes()) == 5
    expected = _fwd_bwd(_normkit_calls, args)
    for g, e in zip(got, expected):  # the very same kernels on the same inputs
        assert torch.equal(g, e)


def test_forced_backend_is_never_stepped_around():
    x, w = _t(4, 24), _t(24, seed=1)
    backend = Rewritten()
    torch.compile(lambda x, w: normkit.rms_norm(x, 24, w, backend="torch"), backend=backend)(x, w)
    assert len(backend.normkit_nodes()) == 1 and cf.decisions() == []


# ----------------------------------------------------------------------------- patterns

class Unpatched(nn.Module):
    """The patterns in torch's own modules: add -> LayerNorm, HF-style weight * RMSNorm -> linear,
    GroupNorm -> SiLU -> conv, LayerNorm -> cast to bf16."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(24)
        self.rms = nn.RMSNorm(24, elementwise_affine=False, eps=1e-6)
        self.w = nn.Parameter(1 + 0.3 * torch.randn(24))
        self.fc = nn.Linear(24, 24)
        self.gn = nn.GroupNorm(4, 8)
        self.act = nn.SiLU()
        self.conv = nn.Conv2d(8, 8, 1)
        self.ln2 = nn.LayerNorm(24)
        self.fc16 = nn.Linear(24, 24).to(torch.bfloat16)

    def forward(self, x, r, img):
        h = x + r
        a = self.fc(self.ln(h))
        b = self.fc(self.w * self.rms(h))
        c = self.conv(self.act(self.gn(img)))
        d = self.fc16(self.ln2(a).to(torch.bfloat16)).float()
        return (a.sum() + b.sum() + c.sum() + d.sum() + h.sum()).reshape(1)


def _unpatched():
    torch.manual_seed(0)
    m = Unpatched()
    with torch.no_grad():
        for p in (m.ln.weight, m.ln.bias, m.gn.weight, m.gn.bias):
            p.copy_(1 + 0.3 * torch.randn(p.shape))
    return m, (_t(3, 5, 24), _t(3, 5, 24, seed=1), _t(2, 8, 3, 5, seed=2))


# h = x + r feeds both norms: the LayerNorm (first in the graph) folds the add in and hands h on
WIN = {"add_ln|float32|train|16": {"wins": True}, "rms|float32|train|16": {"wins": True},
       "gn_silu|float32|train|16": {"wins": True}, "ln_cast|float32|train|16": {"wins": True},
       "pw+rms|float32|train|16": {"wins": False}}


def test_unpatched_models_untouched_unless_asked():
    m, args = _unpatched()
    backend = Rewritten()
    with cf.use_table(WIN):
        torch.compile(m, backend=backend)(*args)
    assert not backend.normkit_nodes() and cf.decisions() == []


def test_unpatched_patterns_fused_where_the_table_says_normkit_wins():
    m, args = _unpatched()
    backend = Rewritten()
    with cf.use_table(WIN), normkit.enable_compile_fusion():
        got = _fwd_bwd(torch.compile(m, backend=backend, fullgraph=True), args)
    made = dict(cf.decisions())
    assert made == {"add_ln|float32|train|16": "normkit", "rms|float32|train|16": "normkit",
                    "gn_silu|float32|train|16": "normkit", "ln_cast|float32|train|16": "normkit"}, made
    nodes = backend.normkit_nodes()
    assert len(nodes) == 4
    fused = {n.args[2] is not None and n.args[8] is not None for n in nodes
             if n.target is torch.ops.normkit.row_norm_fused_fwd.default}
    assert True in fused  # the add folded in as the residual
    gn = [n for n in nodes if n.target is torch.ops.normkit.group_norm_fwd.default]
    assert gn and gn[0].args[5] == "silu"
    assert torch.nn.functional.silu not in backend.targets()
    _close(got, _fwd_bwd(m, args), 2e-3)  # the bf16 cast is where it rounds


def test_largest_winning_pattern_then_smaller_ones():
    """add -> RMSNorm -> weight: "add_rms" is not in the table, "pw+rms" (the weight folded in, the
    add left to Inductor, which would have fused it: hence "pw+") is."""
    m, args = _unpatched()
    backend = Rewritten()
    table = {"pw+rms|float32|train|16": {"wins": True}}
    with cf.use_table(table), normkit.enable_compile_fusion():
        torch.compile(m, backend=backend)(*args)
    rms = [n for n in backend.normkit_nodes() if n.args[5] is True]
    assert len(rms) == 1 and rms[0].args[8] is None and rms[0].args[2] is not None  # weight, no residual


def test_pointwise_neighbours_are_named_in_the_key():
    """A norm whose input comes from a pointwise op (Inductor would fuse it) is looked up as "pw+";
    one read by a pointwise op as "+pw"."""
    ln = nn.LayerNorm(24)
    backend = Rewritten()
    with normkit.enable_compile_fusion():
        torch.compile(lambda x: ln(x * 2).exp(), backend=backend)(_t(2, 24))
    assert [k for k, _ in cf.decisions()] == ["pw+ln+pw|float32|train|16"]


def test_autocast_regions_are_left_alone():
    ln = nn.LayerNorm(24)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ln(x)

    backend = Rewritten()
    with cf.policy("normkit"), normkit.enable_compile_fusion():
        torch.compile(f, backend=backend)(_t(2, 24))
    assert not backend.normkit_nodes() and cf.decisions() == []


def test_patched_hf_llama_steps_aside_and_fuses_with_the_table():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    report = normkit.patch(model)
    assert report.fused
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))

    def step(m):
        out = m(input_ids=ids, labels=ids, use_cache=False)
        grads = torch.autograd.grad(out.loss, [p for p in m.parameters()])
        return [out.logits.detach()] + list(grads)

    expected = step(model)
    backend = Rewritten()
    _close(step(torch.compile(model, backend=backend, fullgraph=True)), expected, 1e-5, "stepped aside")
    assert not backend.normkit_nodes()
    kinds = {k.split("|")[0] for k, d in cf.decisions()}
    assert {"add_rms"} <= {k.replace("pw+", "").replace("+pw", "") for k in kinds}
    torch._dynamo.reset()
    backend = Rewritten()
    with cf.policy("normkit"):
        _close(step(torch.compile(model, backend=backend, fullgraph=True)), expected, 1e-5, "normkit")
    # every norm is normkit's; with a residual: the fused blocks' post-attention norms, and (folded
    # in by the pass) layer 1's input norm and the final norm, each with the add before it
    nodes = backend.normkit_nodes()
    assert len(nodes) == 5 and sum(len(n.args) > 8 and n.args[8] is not None for n in nodes) == 4


# ----------------------------------------------------------------------------- Inductor itself (CPU)

@pytest.mark.usefixtures("fresh_inductor_cache")
def test_inductor_code_has_no_normkit_op_where_it_steps_aside_and_has_it_where_normkit_wins():
    from torch._inductor.utils import run_and_get_code
    # on the test device: Inductor's Triton code on a GPU, its C++ code on the CPU
    gn = nn.GroupNorm(2, 8).to(DEVICE)
    normkit.patch(gn)
    act = nn.Mish()
    x = _t(2, 8, 6).detach().to(DEVICE).requires_grad_(True)
    f = lambda x: act(gn(x))  # noqa: E731
    expected = _fwd_bwd(f, [x])
    torch._dynamo.reset()
    with cf.use_table({}):  # no entry: Inductor's own code
        out, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert "normkit" not in "\n".join(code)
    _close([out.detach()] + list(torch.autograd.grad(out, [x], randn(*out.shape, gen=torch.Generator().manual_seed(1))
                                                      .to(DEVICE))), expected, 1e-5)
    torch._dynamo.reset()
    with cf.use_table({"gn_mish|float32|train|16": {"wins": True}}):
        out, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert "normkit.group_norm_fwd" in "\n".join(code)
    assert dict(cf.decisions())["gn_mish|float32|train|16"] == "normkit"
    # an entry of the input's size class decides over the plain one, and is the key logged
    torch._dynamo.reset()
    cf.decisions(clear=True)
    sized = f"gn_mish|float32|train|16|e{cf.size_class(x.numel())}"
    with cf.use_table({"gn_mish|float32|train|16": {"wins": True}, sized: {"wins": False}}):
        out, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert "normkit" not in "\n".join(code)
    assert cf.decisions() and all(d == "inductor" for _, d in cf.decisions()), cf.decisions()
    with cf.use_table({"gn_mish|float32|train|16": {"wins": False}, sized: {"wins": True}}):
        torch._dynamo.reset()
        cf.decisions(clear=True)
        out, code = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert "normkit.group_norm_fwd" in "\n".join(code)
    assert cf.decisions() == [(sized, "normkit")], cf.decisions()  # the key that decided


def test_table_file_from_the_environment(tmp_path):
    """NORMKIT_COMPILE_TABLE points the pass at a table file (a measurement's variant of the GPU's)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": {"rms|bfloat16|fwd|4096": {"wins": True},
                                            "rms|bfloat16|fwd|4096|e12": {"wins": False}}}))
    code = ("import torch; from normkit import compile_fusion as cf; cpu = torch.device('cpu'); "
            "print(cf.wins('rms', torch.bfloat16, 'fwd', 5000, cpu), "
            "cf.wins('rms', torch.bfloat16, 'fwd', 5000, cpu, elements=5000))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NORMKIT_COMPILE_TABLE=str(path), PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr[-2000:]


# ----------------------------------------------------------------------------- the table and the pass

def test_table_keys_and_lookup(tmp_path):
    assert [cf.width_class(n) for n in (1, 2, 3, 768, 1024, 4095, 4096)] == [1, 2, 2, 512, 1024, 2048, 4096]
    assert cf.key("add_rms", torch.bfloat16, "train", 4096) == "add_rms|bfloat16|train|4096"
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not cf.wins("rms", torch.bfloat16, "fwd", 4096, cpu)  # no table for the CPU
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": {"rms|bfloat16|fwd|4096": {"wins": True}}}))
    with cf.use_table(path):
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu)
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=5000)  # no entry of its class: the plain one
        assert not cf.wins("rms", torch.bfloat16, "fwd", 8192, cpu)
    # size classes: the multiple of 4 nearest log2(elements); 2^22 and up is the plain keys' class
    sizes = (0, 1, 3, 4096, 5000, (1 << 14) - 1, 1 << 14, 1 << 21, (1 << 22) - 1, 1 << 22, 1 << 30)
    assert [cf.size_class(e) for e in sizes] == [None, 0, 0, 12, 12, 12, 16, 20, 20, None, None]
    assert cf.key("rms", torch.bfloat16, "fwd", 4096, elements=1 << 16) == "rms|bfloat16|fwd|4096|e16"
    assert cf.key("rms", torch.bfloat16, "fwd", 4096, "strided", 1 << 16) == "rms|bfloat16|fwd|4096|strided|e16"
    assert cf.key("rms", torch.bfloat16, "fwd", 4096, elements=1 << 24) == "rms|bfloat16|fwd|4096"
    path.write_text(json.dumps({"entries": {"rms|bfloat16|fwd|4096": {"wins": True},
                                            "rms|bfloat16|fwd|4096|e16": {"wins": False},
                                            "rms|bfloat16|fwd|4096|e12": {"wins": True}}}))
    with cf.use_table(path):
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=1 << 24)
        assert not cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=1 << 16)
        assert not cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=(1 << 14) + 1)
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=5000)
        # class 20: no entry; e16 and the plain key (class 24) are as near: the smaller class decides
        assert not cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=1 << 20)
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=1 << 22)
    path.write_text(json.dumps({"entries": {"rms|bfloat16|fwd|4096": {"wins": False},
                                            "rms|bfloat16|fwd|4096|e16": {"wins": True}}}))
    with cf.use_table(path):  # the nearest measured size: e16 for classes 12 and 20, the plain key at 2^22 on
        assert [cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=e) for e in (1, 5000, 1 << 20, 1 << 22)] == \
            [True, True, True, False]
        # a graph for symbolic sizes serves every size: normkit only where every measured size says so
        assert not cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=cf.ANY_SIZE)
        with cf.policy("torch"):
            assert not cf.wins("rms", torch.bfloat16, "fwd", 5000, cuda)
    path.write_text(json.dumps({"entries": {"rms|bfloat16|fwd|4096|e20": {"wins": True},
                                            "rms|bfloat16|fwd|4096|e16": {"wins": True}}}))
    path.write_text(json.dumps({"min_elements": 1 << 23, "entries": {}}))
    with pytest.warns(UserWarning, match="min_elements is no longer read"), cf.use_table(path):
        pass
    path.write_text(json.dumps({"entries": {"rms|bfloat16|fwd|4096|e20": {"wins": True},
                                            "rms|bfloat16|fwd|4096|e16": {"wins": True}}}))
    with cf.use_table(path):  # no plain entry: inputs of 2^22 and more take the nearest class measured (e20)
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=1 << 26)
        assert cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu, elements=cf.ANY_SIZE)
        assert not cf.wins("rms", torch.bfloat16, "fwd", 5000, cpu)  # size unknown: the plain key, absent
    with cf.policy("normkit"):
        assert cf.wins("anything", torch.float32, "fwd", 1, cpu)
    with pytest.raises(ValueError, match="name"):
        cf.policy("fastest")
    with pytest.raises(TypeError, match="enabled"):
        normkit.enable_compile_fusion("yes")


def test_committed_tables_are_well_formed():
    for path in sorted(cf.TABLE_DIR.glob("compile_*.json")):
        data = json.loads(path.read_text())
        assert "environment" in data and "entries" in data, path
        assert "min_elements" not in data, path  # size classes replaced the floor
        for k, entry in data["entries"].items():
            pattern, dtype, mode, width, *rest = k.split("|")
            assert mode in ("fwd", "train") and getattr(torch, dtype).is_floating_point, k
            assert int(width) == cf.width_class(int(width)) and isinstance(entry["wins"], bool), k
            sized = rest[-1:] if rest and rest[-1].startswith("e") else []
            layout = rest[:len(rest) - len(sized)]
            assert layout == [] or (len(layout) == 1 and layout[0] in cf.LAYOUTS and layout[0] != "dense"), k
            if sized:  # a size class: what key() makes for an input of that many elements
                c = int(sized[0][1:])
                assert cf.size_class(1 << c) == c, k
                assert k == cf.key(pattern, getattr(torch, dtype), mode, int(width), *(layout or ["dense"]), 1 << c), k


def test_install_chains_a_users_pass_and_the_uuid_follows_the_settings():
    import torch._inductor.config as config
    seen = []

    def theirs(graph):
        seen.append(graph)

    theirs.uuid = lambda: "theirs"
    with config.patch(pre_grad_custom_pass=theirs):
        cf.install()
        chained = config.pre_grad_custom_pass
        assert chained.first is theirs and chained.second is cf._pass()
        cf.install()
        assert config.pre_grad_custom_pass is chained  # once
        before = cf._pass().uuid()
        with cf.policy("normkit"):
            assert cf._pass().uuid() != before
        g = torch.fx.Graph()
        g.output(None)
        chained(g)
        assert seen == [g]


def test_pass_installed_when_dynamo_traces_a_normkit_op():
    import torch._inductor.config as config
    with config.patch(pre_grad_custom_pass=None):
        torch.compile(lambda x: normkit.rms_norm(x, 8), backend="aot_eager")(torch.randn(2, 8))
        assert config.pre_grad_custom_pass is cf._pass()


def test_rewrite_leaves_other_graphs_alone():
    g = torch.fx.symbolic_trace(lambda x: (x + 1).relu()).graph
    before = [(n.op, n.target) for n in g.nodes]
    assert cf.rewrite(g) == 0 and [(n.op, n.target) for n in g.nodes] == before
    assert operator.add in [n.target for n in g.nodes]


def test_measurement_script_tiny_run_writes_a_table_the_pass_reads(tmp_path):
    """benchmarks/compile_table.py --tiny: CPU points through the pass (aot_eager), the table and its
    markdown; the keys are the pass's own and the table loads through use_table."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_table.py"
    spec = importlib.util.spec_from_file_location("compile_table", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path), "--tiny"]) == 0
    table = json.loads((tmp_path / "compile_table.json").read_text())
    # 4096-element row inputs (size class 12), a 384-element GroupNorm input (class 8): keys with the class
    assert set(table["entries"]) == {f"{p}|float32|{m}|{w}|e{c}" for p, w, c in (
        ("add_rms", 64, 12), ("ln_gelu", 64, 12), ("pw+gn_silu", 32, 8)) for m in ("fwd", "train")}
    for entry in table["entries"].values():
        point = entry["points"][0]
        assert point["normkit_ms"] > 0 and point["inductor_ms"] > 0
        assert point["normkit_call_us"] > 0 and point["inductor_call_us"] > 0  # small inputs: the call timed too
        assert entry["wins"] == (point["ratio"] <= script.WIN_RATIO and point["call_ratio"] <= 1.0)
    assert "| add_rms | float32 | train | 64 | e12 |" in (tmp_path / "compile_table.md").read_text()
    with cf.use_table(tmp_path / "compile_table.json"):
        key = "add_rms|float32|train|64|e12"
        assert cf.wins("add_rms", torch.float32, "train", 64, torch.device("cpu"), elements=4096) == \
            table["entries"][key]["wins"]
        assert not cf.wins("add_rms", torch.float32, "train", 64, torch.device("cpu"))  # no plain entry
    # --write-table's merge: this run's keys replace the old ones, the others stay
    old = {"environment": {"date": "before"}, "entries": {key: {"wins": "old"}, "rms|float32|fwd|64": {"wins": True}}}
    script.write_table(tmp_path / "gpu.json", table, old)
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert merged["entries"][key] == table["entries"][key] and merged["entries"]["rms|float32|fwd|64"] == {"wins": True}
    assert [r["date"] for r in merged["runs"]] == ["before", table["environment"]["date"]]
    # --elements / --winners-of: points at each size for the classes a table gives normkit, one per input
    import types
    args = types.SimpleNamespace(dtypes=["bfloat16"], modes=["fwd"], patterns=["rms", "gn"], widths=[2048, 65536],
                                 gn_shapes=((8, 320, 64 * 64, 32),), tiny=False, elements=[4096, 1 << 24],
                                 winners={"rms|bfloat16|fwd|2048", "rms|bfloat16|fwd|65536", "gn|bfloat16|fwd|32768"})
    points = script.plan(args)
    assert points == [dict(pattern="rms", dtype="bfloat16", mode="fwd", width=2048, elements=4096),
                      dict(pattern="rms", dtype="bfloat16", mode="fwd", width=2048),
                      dict(pattern="rms", dtype="bfloat16", mode="fwd", width=65536, elements=4096),
                      dict(pattern="rms", dtype="bfloat16", mode="fwd", width=65536),
                      dict(pattern="gn", dtype="bfloat16", mode="fwd", shape=[8, 320, 4096, 32])], points
    args.winners = None  # every class; GroupNorm's shape has no batch at 4096 elements (one sample is 2^20)
    assert len(script.plan(args)) == 5


def test_layouts_the_table_did_not_measure_keep_inductors_code():
    """The table measured dense inputs: a column-strided LayerNorm input ([B, C, T] permuted to
    [B, T, C], as Whisper's encoder has) and a channels_last GroupNorm input are looked up under
    their layout, find no entry, and keep Inductor's code even where the dense entry wins."""
    ln, gn = nn.LayerNorm(24), nn.GroupNorm(4, 8)
    table = {"ln+pw|float32|train|16": {"wins": True}, "gn+pw|float32|train|16": {"wins": True}}

    def f(x, img):
        return ln(x.permute(0, 2, 1)).sum((1, 2)) + gn(img).sum((1, 2, 3))

    x = _t(2, 24, 5)
    img = _t(2, 8, 3, 5, seed=1).detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    backend = Rewritten()
    with cf.use_table(table), normkit.enable_compile_fusion():
        got = _fwd_bwd(torch.compile(f, backend=backend), (x, img))
    assert dict(cf.decisions()) == {"ln+pw|float32|train|16|strided": "inductor",
                                    "gn+pw|float32|train|16|channels_last": "inductor"}, cf.decisions()
    assert not backend.normkit_nodes()
    _close(got, _fwd_bwd(f, (x, img)), 1e-5)
    torch._dynamo.reset()
    cf.decisions(clear=True)
    with cf.use_table(table), normkit.enable_compile_fusion():  # the same norms on dense inputs: normkit's
        torch.compile(f, backend=Rewritten())(x.detach().permute(0, 2, 1).contiguous().permute(0, 2, 1),
                                              img.detach().contiguous())
    assert set(d for _, d in cf.decisions()) == {"normkit"}, cf.decisions()


def test_a_graph_for_symbolic_sizes_is_decided_for_every_size():
    """After a second batch size dynamo recompiles with a symbolic batch: that graph serves every later
    size, so the size class of the size it was compiled for must not decide; normkit's op stays only
    where every size the table measured says normkit."""
    ln = nn.LayerNorm(24).to(DEVICE)
    normkit.patch(ln)
    plain = "ln|float32|fwd|16"
    for sized_wins, kept in ((True, True), (False, False)):
        torch._dynamo.reset()
        cf.decisions(clear=True)
        table = {plain: {"wins": True}, f"{plain}|e12": {"wins": sized_wins}}
        backend = Rewritten()
        compiled = torch.compile(ln, backend=backend)
        with cf.use_table(table), torch.no_grad():
            for batch in (170, 171, 3):  # 170 x 24 = 4080 elements: class 12; then a symbolic batch
                compiled(_t(batch, 24).to(DEVICE))
        made = cf.decisions()
        assert len(made) == 2 and made[0] == (f"{plain}|e12", "normkit" if sized_wins else "inductor"), made
        assert made[1] == (plain, "normkit" if kept else "inductor"), made  # the dynamic graph: every size
