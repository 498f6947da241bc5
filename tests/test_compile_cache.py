"""normkit's Inductor pass and Inductor's caches (issue 25): the pass is a module-level
CustomGraphPass that pickles and has a uuid() following what it does, so a new process compiling the
same patched model loads it from the FX graph cache and AOTAutograd's cache instead of compiling it
again (torch 2.11 pickled the pass into the cache key and bypassed the caches on a local class, with
"Can't pickle local object '_pass.<locals>.NormkitPass'" on every compile).

One test compiles a tiny patched model (CPU, Inductor) in two fresh processes that share a cache
directory; the others are quick checks of the id, the pickling and the graph targets.
"""
import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import normkit
from normkit import compile_fusion as cf

ROOT = Path(__file__).resolve().parents[1]

# The LayerNorm keeps normkit's op (the table says it wins), the RMSNorm after the residual add steps
# aside (no entry: torch's ops through normkit's composite): both paths of the pass are in the graph.
TABLE = {"ln|float32|train|32": {"wins": True}}

CHILD = r'''
import json, sys
import torch
from torch import nn
from torch._dynamo.utils import counters
import normkit
from normkit import compile_fusion as cf
import torch._inductor.config as config

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.lin = nn.Linear(32, 32)
        self.rms = nn.RMSNorm(32)

    def forward(self, x):
        return self.rms(self.lin(self.ln(x)) + x)

torch.manual_seed(0)
model = Tiny()
normkit.patch(model)
x = torch.randn(4, 32)
table = json.loads(sys.argv[1])
report = []
for policy in sys.argv[2:]:
    torch._dynamo.reset()
    counters.clear()
    cf.decisions(clear=True)
    model.zero_grad()
    xg = x.clone().requires_grad_(True)
    with cf.use_table(table), cf.policy(policy):
        y = torch.compile(model, backend="inductor")(xg)
        y.sum().backward()
        uuid = cf._pass().uuid()
    try:  # newer torch (2.13, not 2.11): a pass with a uuid runs "late", after the cache lookup, on a miss
        from torch._inductor.codecache import resolve_pre_grad_pass_timing as timing
    except ImportError:  # before: every compile runs them, then looks the rewritten graph up
        timing = lambda: "early"
    report.append({"policy": policy, "uuid": uuid, "timing": timing(),
                   "installed": config.pre_grad_custom_pass is cf._pass(),
                   "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
                   "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
                   "decisions": cf.decisions(),
                   "result": [t.double().sum().item() for t in (y, xg.grad, model.ln.weight.grad,
                                                                model.rms.weight.grad)]})
print("REPORT " + json.dumps(report))
'''


def _compile_in_a_fresh_process(tmp_path, *policies):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.pop("NORMKIT_COMPILE_PASS", None)
    proc = subprocess.run([sys.executable, str(script), json.dumps(TABLE), *policies], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for bad in ("pickle", "uuid()", "bypass"):  # "Failed to pickle cache key", "Can't pickle local object ..."
        assert bad not in proc.stderr.lower(), proc.stderr[-4000:]
    line = [s for s in proc.stdout.splitlines() if s.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


def test_a_second_process_loads_the_compiled_graphs_from_the_caches(tmp_path):
    (first,) = _compile_in_a_fresh_process(tmp_path, "table")
    assert first["installed"]  # by dynamo tracing normkit's op, as in any use
    assert dict(first["decisions"]) == {"ln|float32|train|32": "normkit", "pw+rms|float32|train|32": "inductor"}
    assert first["inductor"].get("fxgraph_cache_miss", 0) > 0 and not first["inductor"].get("fxgraph_cache_bypass")
    assert not first["aot"].get("autograd_cache_bypass")

    again, changed = _compile_in_a_fresh_process(tmp_path, "table", "torch")
    # same model, same settings: everything from the caches, the same numbers; the pass ran again
    # only where torch runs it before looking the graph up
    assert again["uuid"] == first["uuid"] == _uuid_with(TABLE, "table")
    assert again["inductor"].get("fxgraph_cache_hit", 0) > 0, again
    assert not again["inductor"].get("fxgraph_cache_miss") and not again["inductor"].get("fxgraph_cache_bypass")
    assert again["aot"].get("autograd_cache_hit", 0) > 0 and not again["aot"].get("autograd_cache_bypass"), again
    assert again["decisions"] == ([] if again["timing"] == "late" else first["decisions"])
    assert again["result"] == first["result"]
    # another policy: another id, compiled anew (and decided anew)
    assert changed["uuid"] != first["uuid"]
    assert changed["inductor"].get("fxgraph_cache_miss", 0) > 0 and not changed["inductor"].get("fxgraph_cache_hit")
    assert {d for _, d in changed["decisions"]} == {"inductor"}


def _uuid_with(table, policy):
    with cf.use_table(table), cf.policy(policy):
        return cf._pass().uuid()


# ----------------------------------------------------------------------------- the id

def test_uuid_follows_the_settings_and_only_them(monkeypatch):
    base = cf._pass().uuid()
    assert cf._pass().uuid() == base and cf.NormkitPass().uuid() == base  # stable
    with cf.use_table({"rms|float32|fwd|64": {"wins": True}}):
        winning = cf._pass().uuid()
        with cf.use_table({"rms|float32|fwd|64": {"wins": True}}):  # an equal table: the same id
            assert cf._pass().uuid() == winning
    with cf.use_table({"rms|float32|fwd|64": {"wins": False}}):
        losing = cf._pass().uuid()
    with cf.use_table({"rms|float32|fwd|64": {"wins": True}, "rms|float32|fwd|64|e12": {"wins": False}}):
        floored = cf._pass().uuid()  # a size class's entry added
    with cf.use_table({}):
        empty = cf._pass().uuid()
    assert len({base, winning, losing, floored, empty}) == 5
    with cf.policy("normkit"):
        normkit_ = cf._pass().uuid()
        with cf.use_table({}):  # no table is read under policy "normkit"
            assert cf._pass().uuid() == normkit_
    with cf.policy("torch"):
        torch_ = cf._pass().uuid()
    with normkit.enable_compile_fusion():
        unpatched = cf._pass().uuid()
    assert len({base, normkit_, torch_, unpatched}) == 4
    assert cf._pass().uuid() == base  # each setting restored
    monkeypatch.setattr(cf, "_SOURCE_HASH", "another version of the code")
    assert cf._pass().uuid() != base
    monkeypatch.setattr(cf, "_SOURCE_HASH", None)
    monkeypatch.setattr(normkit, "__version__", "0.0.0+other")
    assert cf._pass().uuid() != base  # the version is in the source hash


def test_the_pass_is_a_picklable_custom_graph_pass():
    pytest.importorskip("torch._inductor.custom_graph_pass")  # torch >= 2.5
    from torch._inductor.codecache import FxGraphCachePickler
    from torch._inductor.custom_graph_pass import CustomGraphPass
    ours = cf._pass()
    # what torch 2.11 does with it: pickle the inductor config, the pass in it, into the cache key
    pickler = lambda: FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))  # noqa: E731
    key = pickler().dumps({"pre_grad_custom_pass": ours})
    assert isinstance(ours, CustomGraphPass) and type(ours).__qualname__ == "NormkitPass"
    assert pickle.loads(pickle.dumps(ours)) is ours and copy.deepcopy(ours) is ours
    assert pickler().dumps({"pre_grad_custom_pass": cf.NormkitPass()}) == key
    with cf.policy("torch"):
        assert pickler().dumps({"pre_grad_custom_pass": ours}) != key


def _module_level_pass(graph):
    pass


def test_a_chain_is_keyed_when_the_users_pass_is():
    pytest.importorskip("torch._inductor.custom_graph_pass")  # torch >= 2.5
    from torch._inductor.custom_graph_pass import CustomGraphPass
    import torch._inductor.config as config
    with config.patch(pre_grad_custom_pass=_module_level_pass):
        cf.install()
        chained = config.pre_grad_custom_pass
    assert isinstance(chained, cf.Chain) and isinstance(chained, CustomGraphPass)
    assert chained.uuid() is None  # the user's pass has no id: theirs, named so in Inductor's warning
    assert "_module_level_pass" in chained.__qualname__
    again = pickle.loads(pickle.dumps(chained))
    assert again.first is _module_level_pass and again.second is cf._pass()
    _module_level_pass.uuid = lambda: "theirs"
    try:
        assert chained.uuid() == ("theirs", cf._pass().uuid())
    finally:
        del _module_level_pass.uuid


def test_install_appends_to_a_list_of_passes():
    import torch._inductor.config as config
    with config.patch(pre_grad_custom_pass=[_module_level_pass]):
        cf.install()
        cf.install()
        assert config.pre_grad_custom_pass == [_module_level_pass, cf._pass()]


def test_rewritten_graphs_pass_aot_autograds_cacheability_check():
    """A torch that runs the pass before AOTAutograd's cache lookup (2.11) checks the rewritten graph:
    the composites that stand in for normkit's op where it steps aside are marked cacheable."""
    pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe
    import torch._inductor.config as config
    graphs = []

    def backend(gm, example_inputs):
        cf.rewrite(gm.graph)
        gm.recompile()
        graphs.append(gm)
        return gm.forward

    ln, rms = torch.nn.LayerNorm(16), torch.nn.RMSNorm(16)
    normkit.patch(ln)
    normkit.patch(rms)
    torch._dynamo.reset()
    with cf.use_table({}):
        torch.compile(lambda x: rms(ln(x) + x), backend=backend, fullgraph=True)(torch.randn(3, 16))
    torch._dynamo.reset()
    composites = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and
                  n.target in (cf._row_norm_composite, cf._row_norm_plain_composite)]
    assert composites  # normkit stepped aside
    cf.install()
    for g in graphs:
        for node in g.graph.nodes:
            check_node_safe(node)
    marked = config.unsafe_marked_cacheable_functions
    with config.patch(unsafe_marked_cacheable_functions={k: v for k, v in marked.items()
                                                         if not k.startswith("normkit.")}):
        with pytest.raises(BypassAOTAutogradCache):
            check_node_safe(composites[0])
