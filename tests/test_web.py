"""normkit.js in a real browser: the exported module runs in headless Chromium on its WebGPU adapter
(SwiftShader in CI) and every result is compared with normkit.reference here in Python.

One browser per test module (per xdist worker): `normkit export-web` writes the package into a
temporary folder, a local HTTP server serves it with a test page that imports the module, and each
test sends its cases (data as base64) to that page over the DevTools protocol. Without Chromium or a
WebGPU adapter the tests skip with the reason; under CI=true that is a failure.

SwiftShader pays for every invocation of a workgroup (~1-2 ms per 256-wide workgroup), so the cases
past 65535 workgroups run on a kit with 8 invocations per workgroup; every other case runs with the
default 256, i.e. the exact kernels a browser gets.
"""
import base64
import hashlib
import itertools
import re
import zlib

import numpy as np
import pytest
import torch

from normkit import reference as ref
from normkit.backends.webgpu import shaders
from normkit.web import export
from normkit.web.browser import BrowserError, Chromium, PageError, find_chromium, serve

from helpers import TOL, assert_close, missing_tool, onepass_conditioning

VARIANTS = list(shaders.VARIANTS.values())
ACTS = [a for a in shaders.activation_codes() if a]
STATS_TOL = 2e-5
# one-pass E[x^2]-E[x]^2 loses digits of the variance of any row whose spread is small next to its
# mean; among 65573 short random rows some are (seed 000's lesson), so its statistics get this bound
STATS_TOL_ONEPASS = 1e-3
BIG_GRID_WG = 8  # workgroup size of the kit that runs the cases past 65535 workgroups
NP = {"f32": np.float32, "f16": np.float16}
TORCH = {"f32": torch.float32, "f16": torch.float16}

# The page: imports the module, makes the kits, and runs cases sent from Python.
HARNESS = r"""<!doctype html><meta charset="utf-8"><title>normkit test page</title>
<script type="module">
import * as normkit from "./normkit.js";
window.normkit = normkit;
const u8 = (s) => Uint8Array.from(atob(s), (ch) => ch.charCodeAt(0));
const f32 = (s) => (s == null ? undefined : new Float32Array(u8(s).buffer));
function b64(typed) {
  const bytes = new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}
window.b64 = b64;
window.setup = (async () => {
  try {
    if (!navigator.gpu) return { error: "navigator.gpu is undefined" };
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) return { error: "navigator.gpu.requestAdapter() returned null" };
    window.adapter = adapter;
    const device = (window.device = await normkit.requestNormKitDevice(adapter));
    device.addEventListener("uncapturederror", (e) => console.error("uncaptured WebGPU error: " + e.error.message));
    window.kits = { 256: await normkit.createNormKit(device), [BIG]: await normkit.createNormKit(device, { workgroupSize: BIG }) };
    const k = window.kits[256], info = adapter.info || {};
    return { vendor: info.vendor, architecture: info.architecture, features: [...device.features].sort(),
             hasSubgroups: k.hasSubgroups, subgroupSize: k.subgroupSize, subgroupsOff: k.subgroupsOff, hasF16: k.hasF16,
             bigHasSubgroups: window.kits[BIG].hasSubgroups };
  } catch (e) {
    return { error: String(e && e.stack || e) };
  }
})();

const USAGE = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
function buffer(d, bytes, made) {  // bytes: Uint8Array, or a size to fill with 0xff (NaN in f32 and f16)
  const data = typeof bytes === "number" ? new Uint8Array(bytes).fill(255) : bytes;
  const b = d.createBuffer({ size: Math.max(16, Math.ceil(data.length / 4) * 4), usage: USAGE });
  const padded = new Uint8Array(b.size);
  padded.set(data);
  d.queue.writeBuffer(b, 0, padded);
  made.push(b);
  return b;
}
async function read(d, b, made) {
  const r = d.createBuffer({ size: b.size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  made.push(r);
  const e = d.createCommandEncoder();
  e.copyBufferToBuffer(b, 0, r, 0, b.size);
  d.queue.submit([e.finish()]);
  await r.mapAsync(GPUMapMode.READ);
  const out = new Uint8Array(r.getMappedRange().slice(0));
  r.unmap();
  return out;
}
const FN = { layer_norm: "layerNorm", rms_norm: "rmsNorm", group_norm: "groupNorm" };
// one case: {op, wg, api: "buffer" | "array", encoder, x (base64 of the stored values), weight, bias, sizes...}
async function runCase(c) {
  const kit = window.kits[c.wg], d = kit.device, fn = FN[c.op];
  const opts = { eps: c.eps, dtype: c.dtype };
  if (c.variant) opts.variant = c.variant;
  if (c.activation) opts.activation = c.activation;
  if (c.api === "array") {
    if (c.weight) opts.weight = f32(c.weight);
    if (c.bias) opts.bias = f32(c.bias);
    const y = c.op === "group_norm"
      ? await kit.groupNorm(f32(c.x), c.groups, { ...opts, channels: c.channels, spatial: c.spatial, layout: c.layout })
      : await kit[fn](f32(c.x), c.n, opts);
    return { y: b64(y) };
  }
  const made = [];
  try {
    const x = buffer(d, u8(c.x), made), y = buffer(d, u8(c.x).length, made);
    const rows = c.op === "group_norm" ? c.batch * c.groups : c.rows;
    const stats = buffer(d, rows * 8, made);
    const args = { ...opts, x, y, stats };
    for (const k of ["rows", "n", "batch", "channels", "spatial", "groups", "layout"]) if (c[k] !== undefined) args[k] = c[k];
    if (c.weight) args.weight = buffer(d, u8(c.weight), made);
    if (c.bias) args.bias = buffer(d, u8(c.bias), made);
    if (c.encoder) args.encoder = d.createCommandEncoder();
    const info = await kit[fn](args);
    if (c.encoder) d.queue.submit([args.encoder.finish()]);
    return { info, y: b64(await read(d, y, made)), stats: b64(await read(d, stats, made)) };
  } finally {
    for (const b of made) b.destroy();
  }
}
window.runCases = async (cases) => {
  const out = [];
  for (const c of cases) {
    try { out.push(await runCase(c)); } catch (e) { out.push({ error: String(e && e.message || e) }); }
  }
  return out;
};
</script>
"""


class Page:
    """The test page in the module's browser; re-opened if a test navigated away (the demo test)."""

    def __init__(self, browser, url):
        self.browser, self.url = browser, url
        self.info = self.open()

    def open(self) -> dict:
        self.browser.open(f"{self.url}/test.html")
        info = self.browser.evaluate("window.setup", timeout=120)
        if info.get("error"):
            missing_tool(f"Chromium's WebGPU gave no usable adapter: {info['error']}")
        return info

    def evaluate(self, expression: str, timeout: float = 300):
        if self.browser.evaluate("location.pathname") != "/test.html":
            self.open()
        return self.browser.evaluate(expression, timeout=timeout)

    def run(self, cases: list) -> list:
        import json

        return self.evaluate(f"window.runCases({json.dumps(cases)})")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path, why = find_chromium()
    if path is None:
        missing_tool(why)
    folder = tmp_path_factory.mktemp("normkit-web")
    export.export(folder)
    (folder / "test.html").write_text(HARNESS.replace("BIG", str(BIG_GRID_WG)))
    with serve(folder) as url:
        try:
            browser = Chromium(path, timeout=120)
        except BrowserError as e:
            missing_tool(f"Chromium did not start: {e}")
        with browser:
            yield Page(browser, url)


# ----------------------------------------------------------------------------- cases and the oracle

def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def _unb64(s: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=dtype)


def row_case(op, rows, n, *, variant=None, dtype="f32", activation=None, affine=True, api="buffer",
             encoder=False, wg=256, offset=0.0, gen=None):
    x = (torch.randn(rows, n, generator=gen) + offset).numpy().astype(NP[dtype])
    w = torch.randn(n, generator=gen).numpy() if affine else None
    b = torch.randn(n, generator=gen).numpy() if affine and op == "layer_norm" else None
    eps = 1e-5 if op == "layer_norm" else ref.default_rms_eps(torch.float32)
    return dict(op=op, rows=rows, n=n, variant=variant, dtype=dtype, activation=activation, eps=eps, api=api,
                encoder=encoder, wg=wg, x=x, weight=w, bias=b)


def group_case(batch, channels, spatial, groups, layout, *, variant=None, dtype="f32", activation=None,
               affine=True, api="buffer", encoder=False, wg=256, gen=None):
    shape = (batch, channels, spatial) if layout == "nchw" else (batch, spatial, channels)
    offset = 0.0 if variant == "onepass" else 2.0  # one-pass E[x^2]-E[x]^2 loses digits to any offset
    x = (torch.randn(*shape, generator=gen) + offset).numpy().astype(NP[dtype])
    w = torch.randn(channels, generator=gen).numpy() if affine else None
    b = torch.randn(channels, generator=gen).numpy() if affine else None
    return dict(op="group_norm", batch=batch, channels=channels, spatial=spatial, groups=groups, layout=layout,
                variant=variant, dtype=dtype, activation=activation, eps=1e-5, api=api, encoder=encoder, wg=wg,
                x=x, weight=w, bias=b)


def _wire(c):
    """The case as the page takes it: arrays as base64; the array API takes x as float32."""
    out = {k: v for k, v in c.items() if not isinstance(v, np.ndarray) and v is not None}
    x = c["x"].astype(np.float32) if c["api"] == "array" else c["x"]
    out["x"] = _b64(x)
    for k in ("weight", "bias"):
        if c[k] is not None:
            out[k] = _b64(c[k].astype(np.float32))
    return out


def _oracle(c):
    """(y in x's memory layout, mean or None, rstd), float64 torch tensors."""
    x = torch.from_numpy(c["x"].astype(np.float32) if c["dtype"] == "f32" else c["x"])
    w = None if c["weight"] is None else torch.from_numpy(c["weight"])
    b = None if c["bias"] is None else torch.from_numpy(c["bias"])
    if c["op"] == "layer_norm":
        return ref.layer_norm(x, (c["n"],), w, b, c["eps"], c["activation"])
    if c["op"] == "rms_norm":
        y, rstd = ref.rms_norm(x, (c["n"],), w, c["eps"], c["activation"])
        return y, None, rstd
    nhwc = c["layout"] == "nhwc"
    y, mean, rstd = ref.group_norm(x.transpose(1, 2) if nhwc else x, c["groups"], w, b, c["eps"], c["activation"])
    return (y.transpose(1, 2) if nhwc else y), mean.reshape(-1), rstd.reshape(-1)


def _what(c):
    sizes = f"{c['rows']}x{c['n']}" if c["op"] != "group_norm" else \
        f"{c['batch']}x{c['channels']}x{c['spatial']}/g{c['groups']} {c['layout']}"
    return f"{c['op']} {sizes} {c['variant'] or 'default'} {c['dtype']} {c['activation'] or ''} {c['api']} wg{c['wg']}"


def check(page, cases, expect_variant=None):
    """Runs the cases in the page and compares each with the oracle; returns the page's answers."""
    answers = page.run([_wire(c) for c in cases])
    for c, got in zip(cases, answers):
        what = _what(c)
        assert "error" not in got, f"{what}: {got.get('error')}"
        dtype = c["dtype"]
        y = _unb64(got["y"], NP[dtype] if c["api"] == "buffer" else np.float32)[: c["x"].size].reshape(c["x"].shape)
        y_ref, mean_ref, rstd_ref = _oracle(c)
        onepass = c["variant"] == "onepass"
        kappa = onepass_conditioning(mean_ref, rstd_ref) if onepass else 1.0  # its known error bound
        assert_close(torch.from_numpy(y.copy()), y_ref, TOL[TORCH[dtype]] * kappa, f"{what} y")
        if c["api"] == "buffer":
            stats_tol = STATS_TOL_ONEPASS * kappa if onepass else STATS_TOL
            if c["variant"] is not None:
                assert got["info"]["variant"] == c["variant"], what
            rows = rstd_ref.numel()
            stats = _unb64(got["stats"], np.float32)[: 2 * rows].reshape(rows, 2)
            rstd_ref = rstd_ref.reshape(-1)
            assert_close(torch.from_numpy(stats[:, 1].copy()), rstd_ref, stats_tol, f"{what} rstd")
            mean = torch.from_numpy(stats[:, 0].copy()).double()
            if mean_ref is None:
                assert torch.all(mean == 0), f"{what}: RMSNorm's mean slot should hold 0"
            else:  # in units of the row's spread, as in test_webgpu.py
                err = ((mean - mean_ref.reshape(-1)) * rstd_ref).abs().max().item()
                assert err <= stats_tol, f"{what} mean: error {err:.3g} standard deviations"
    return answers


def _runnable(page, variant, dtype, wg=256):
    """None if the page's kit can run this, else the error the page must give instead."""
    subgroups = page.info["hasSubgroups"] if wg == 256 else page.info["bigHasSubgroups"]
    if variant.subgroup and not subgroups:
        return "needs subgroups"
    if dtype == "f16" and not page.info["hasF16"]:
        return "'f16' needs the device feature 'shader-f16'"
    return None


def _run_or_refuse(page, cases):
    """Runs the runnable cases; for the others, checks the page refuses with the reason."""
    runnable, refused = [], []
    for c in cases:
        why = _runnable(page, shaders.VARIANTS[c["variant"]] if c["variant"] else VARIANTS[0], c["dtype"], c["wg"])
        (refused if why else runnable).append((c, why))
    if runnable:
        check(page, [c for c, _ in runnable])
    for (c, why), got in zip(refused, page.run([_wire(c) for c, _ in refused]) if refused else []):
        assert why in got.get("error", ""), f"{_what(c)}: expected an error saying {why!r}, got {got}"
    return len(runnable)


# ----------------------------------------------------------------------------- the adapter

def test_adapter_reports_subgroups_and_the_probe_agrees(page):
    info = page.info
    print(f"adapter: {info}")
    if info["architecture"] == "swiftshader":  # CI's adapter, as Chromium 156 reports it
        assert "subgroups" in info["features"] and "shader-f16" not in info["features"], info
        assert info["hasSubgroups"] and info["subgroupSize"] == 4, info
    assert info["hasSubgroups"] == ("subgroups" in info["features"]), info["subgroupsOff"]
    assert info["hasF16"] == ("shader-f16" in info["features"])
    if info["hasSubgroups"]:
        size = info["subgroupSize"]
        assert 4 <= size <= 128 and size & (size - 1) == 0


# ----------------------------------------------------------------------------- one source of truth

def test_module_builds_exactly_the_python_shaders(page):
    """shaderSource() in the browser returns, for every kernel, the text shaders.source() gives."""
    combos = list(itertools.product(shaders.OPS, shaders.VARIANTS, shaders.DTYPES, [None] + ACTS, (True, False),
                                    (256, BIG_GRID_WG)))
    js = """(async () => {
        const out = [];
        for (const [op, v, dt, act, browser, wg] of %s) {
            const text = window.normkit.shaderSource(op, v, dt, act, {forBrowser: browser, workgroupSize: wg});
            const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
            out.push([...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join(""));
        }
        return out;
    })()""" % str([list(c) for c in combos]).replace("None", "null").replace("True", "true").replace("False", "false")
    digests = page.evaluate(js)
    for (op, v, dt, act, browser, wg), got in zip(combos, digests):
        text = shaders.source(v, op, dt, act, for_browser=browser, workgroup_size=wg)
        assert got == hashlib.sha256(text.encode()).hexdigest(), f"{op} {v} {dt} {act} browser={browser} wg={wg}"
    assert len(digests) == len(combos)


# ----------------------------------------------------------------------------- kernels vs the oracle

ROW_SHAPES = {1: [(1, 1), (7, 1), (5, 7), (17, 31), (3, 257), (2, 1031), (1, 4099)],
              4: [(1, 4), (9, 12), (5, 132), (2, 1028), (1, 4100)]}


@pytest.mark.parametrize("variant", [v.name for v in VARIANTS])
@pytest.mark.parametrize("op", shaders.ROW_OPS)
def test_row_norm_variant_matches_oracle(page, op, variant):
    """Every variant on n = 1, primes, n % 4 != 0 (scalar) and whole vec4s, through both APIs,
    with and without weight/bias, recorded into the caller's encoder or submitted by the kit."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op} {variant}".encode()))  # str hash() varies by process
    v = shaders.VARIANTS[variant]
    cases = []
    for i, (rows, n) in enumerate(ROW_SHAPES[v.width]):
        for dtype in shaders.DTYPES:
            api = "array" if i % 3 == 2 else "buffer"
            cases.append(row_case(op, rows, n, variant=variant, dtype=dtype, affine=i % 2 == 0, api=api,
                                  encoder=i % 2 == 1, gen=gen))
    assert _run_or_refuse(page, cases) > 0 or not page.info["hasSubgroups"]


GROUP_SHAPES = [(1, 4, 1, 2), (2, 6, 7, 3), (3, 10, 13, 5), (2, 32, 64, 8), (1, 3, 5, 1), (2, 8, 12, 8), (1, 12, 20, 4)]


@pytest.mark.parametrize("variant", [v.name for v in VARIANTS])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_group_norm_variant_matches_oracle(page, layout, variant):
    """GroupNorm in both memory layouts on S = 1, primes, one channel per group, one group; the vec4
    variants where spatial % 4 == 0 in NCHW, and a clear refusal elsewhere."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout} {variant}".encode()))
    v = shaders.VARIANTS[variant]
    cases, refused = [], []
    for i, shape in enumerate(GROUP_SHAPES):
        fits = shaders.vec4_blocker(v, "group_norm", 0, shape[2], layout == "nhwc") is None
        for dtype in shaders.DTYPES if fits else ("f32",):
            c = group_case(*shape, layout, variant=variant, dtype=dtype, affine=i % 2 == 0,
                           api="array" if i % 3 == 2 else "buffer", encoder=i % 2 == 1, gen=gen)
            (cases if fits else refused).append(c)
    if cases:
        _run_or_refuse(page, cases)
    for c, got in zip(refused, page.run([_wire(c) for c in refused])):
        assert re.search(r"variant: '\w+' loads vec4s", got.get("error", "")), f"{_what(c)}: {got}"
    assert cases or (v.width == 4 and layout == "nhwc")


@pytest.mark.parametrize("op", shaders.OPS)
def test_activations_match_oracle(page, op):
    gen = torch.Generator().manual_seed(7)
    cases = []
    for act in ACTS:
        if op == "group_norm":
            cases.append(group_case(2, 12, 16, 4, "nchw", activation=act, gen=gen))
            cases.append(group_case(2, 12, 9, 3, "nhwc", activation=act, api="array", gen=gen))
        else:
            cases.append(row_case(op, 6, 36, activation=act, gen=gen))
            cases.append(row_case(op, 5, 37, activation=act, api="array", gen=gen))
    check(page, cases)


def test_offset_rows_break_only_onepass_layer_norm(page):
    """Seed 000's lesson, on the exact kernels a browser runs: rows offset by 1e4."""
    gen = torch.Generator().manual_seed(3)
    for op in shaders.ROW_OPS:
        for v in VARIANTS:
            if _runnable(page, v, "f32"):
                continue
            c = row_case(op, 8, 768, variant=v.name, affine=False, offset=1e4, gen=gen)
            y = _unb64(page.run([_wire(c)])[0]["y"], np.float32).reshape(8, 768)
            err = ref.rel_err(torch.from_numpy(y.copy()), _oracle(c)[0])
            if v.name == "onepass" and op == "layer_norm":
                assert err > 1e-2, f"onepass LayerNorm on offset rows: expected a large error, got {err:.3g}"
            else:
                assert err <= TOL[torch.float32], f"{v.name} {op} on offset rows: relative error {err:.3g}"


@pytest.mark.parametrize("variant", [v.name for v in VARIANTS])
@pytest.mark.parametrize("op", shaders.OPS)
def test_more_rows_than_one_grid_dimension(page, op, variant):
    """Past 65535 workgroups the dispatch folds into 2-D (on the small-workgroup kit, see the top)."""
    v = shaders.VARIANTS[variant]
    if _runnable(page, v, "f32", BIG_GRID_WG):
        pytest.skip(f"{variant} cannot run on this adapter: {_runnable(page, v, 'f32', BIG_GRID_WG)}")
    gen = torch.Generator().manual_seed(11)
    if op == "group_norm":  # batch x groups = 65574 workgroups
        c = group_case(2, 32787, 4, 32787, "nchw", variant=variant, wg=BIG_GRID_WG, gen=gen)
    else:
        c = row_case(op, 65573, 4 if v.width == 4 else 3, variant=variant, wg=BIG_GRID_WG, gen=gen)
    got = check(page, [c])[0]
    assert got["info"]["workgroups"] == [65535, 2]


# ----------------------------------------------------------------------------- choices the kit makes

def test_default_variant_follows_features_and_width(page):
    """No variant given: Welford, vec4 when the shape allows, subgroups where the device has them;
    the same choice as shaders.best_variant in Python."""
    gen = torch.Generator().manual_seed(5)
    cases = [row_case("layer_norm", 3, 1028, gen=gen), row_case("rms_norm", 3, 1031, gen=gen),
             group_case(2, 8, 16, 4, "nchw", gen=gen), group_case(2, 8, 15, 4, "nchw", gen=gen),
             group_case(2, 8, 16, 4, "nhwc", gen=gen)]
    answers = check(page, cases)
    for c, got in zip(cases, answers):
        gn = c["op"] == "group_norm"
        want = shaders.best_variant(c.get("n", 0), page.info["hasSubgroups"], c["op"], c.get("spatial", 1),
                                    gn and c["layout"] == "nhwc")
        assert got["info"]["variant"] == want.name, _what(c)
    names = [got["info"]["variant"] for got in answers]
    sub = "_subgroup" if page.info["hasSubgroups"] else ""
    assert names == [f"welford_vec4{sub}", f"welford{sub}", f"welford_vec4{sub}", f"welford{sub}", f"welford{sub}"]


def test_pipelines_compile_on_first_use(page):
    kernels = page.evaluate("""(async () => {
        const nk = await window.normkit.createNormKit(window.device);
        const before = nk.compiledKernels.length;
        await nk.rmsNorm(new Float32Array(64).fill(1.5), 16);
        await nk.rmsNorm(new Float32Array(64).fill(2.5), 16);
        return [before, nk.compiledKernels];
    })()""")
    sub = "_subgroup" if page.info["hasSubgroups"] else ""
    assert kernels == [0, [f"rms_norm/welford_vec4{sub}/f32/none"]]


def test_f16_conversion_by_hand_matches_numpy(page):
    """The module's float16 <-> float32 helpers for browsers without Float16Array."""
    values = np.concatenate([
        np.random.default_rng(0).standard_normal(4000).astype(np.float32) * np.float32(3000),
        np.array([0, -0.0, 65504, 65519.99, 65520, -70000, 1e-8, 2.98e-8, 2.99e-8, 5.96e-8, 6e-5, 6.1e-5, 1 + 2**-11,
                  1 + 3 * 2**-11, np.inf, -np.inf, 2**-24, 2**-25, 1.5 * 2**-25], np.float32)])
    js = f"""(() => {{
        const t = window.normkit._testing;
        const x = new Float32Array(Uint8Array.from(atob("{_b64(values)}"), (c) => c.charCodeAt(0)).buffer);
        const all = new Uint16Array(65536).map((_, i) => i);
        return [window.b64(t.toF16BitsByHand(x)), window.b64(t.fromF16BitsByHand(all)),
                window.b64(window.normkit.toF16Bits(x))];
    }})()"""
    bits, back, native = page.evaluate(js)
    with np.errstate(over="ignore"):  # the values past 65504 are there to overflow to inf
        want = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(_unb64(bits, np.uint16), want)
    assert np.array_equal(_unb64(native, np.uint16), want)
    all_halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    got = _unb64(back, np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(all_halves))
    assert np.array_equal(got[~np.isnan(got)], all_halves[~np.isnan(all_halves)])


# ----------------------------------------------------------------------------- errors that name the argument

ERRORS = r"""(async () => {
  const { createNormKit } = window.normkit, nk = window.kits[256], d = window.device;
  const buf = (size, usage = GPUBufferUsage.STORAGE) => d.createBuffer({ size, usage });
  const x = buf(64), y = buf(64), small = buf(16);
  const plainDevice = await (await navigator.gpu.requestAdapter()).requestDevice();  // no features, default limits
  const plain = await createNormKit(plainDevice);
  const huge = plainDevice.createBuffer({ size: 2 ** 27 + 16, usage: GPUBufferUsage.STORAGE });
  const hugeY = plainDevice.createBuffer({ size: 2 ** 27 + 16, usage: GPUBufferUsage.STORAGE });
  const ln = { x, y, rows: 2, n: 8 };
  const gn = { x, y, batch: 1, channels: 4, spatial: 4, groups: 2 };
  const calls = {
    x_not_buffer: () => nk.layerNorm({ ...ln, x: {} }),
    x_not_storage: () => nk.layerNorm({ ...ln, x: buf(64, GPUBufferUsage.COPY_DST) }),
    x_too_small: () => nk.layerNorm({ ...ln, x: small }),
    y_is_x: () => nk.layerNorm({ ...ln, y: x }),
    n_zero: () => nk.layerNorm({ ...ln, n: 0 }),
    rows_fraction: () => nk.rmsNorm({ ...ln, rows: 1.5 }),
    dtype: () => nk.layerNorm({ ...ln, dtype: "f64" }),
    f16_missing: () => plain.layerNorm({ ...ln, dtype: "f16" }),
    subgroups_missing: () => plain.layerNorm({ ...ln, variant: "welford_subgroup" }),
    vec4_width: () => nk.layerNorm({ x, y, rows: 1, n: 7, variant: "welford_vec4" }),
    variant_name: () => nk.layerNorm({ ...ln, variant: "threepass" }),
    activation: () => nk.layerNorm({ ...ln, activation: "tanh" }),
    eps: () => nk.layerNorm({ ...ln, eps: -1 }),
    eps_nan: () => nk.groupNorm({ ...gn, eps: NaN }),
    weight_small: () => nk.layerNorm({ ...ln, weight: small }),
    rms_bias: () => nk.rmsNorm({ ...ln, bias: small }),
    stats_small: () => nk.layerNorm({ ...ln, rows: 4, n: 4, stats: small }),
    stats_is_y: () => nk.layerNorm({ ...ln, stats: y }),
    encoder: () => nk.layerNorm({ ...ln, encoder: {} }),
    unknown: () => nk.layerNorm({ ...ln, weigth: small }),
    groups: () => nk.groupNorm({ ...gn, groups: 3 }),
    layout: () => nk.groupNorm({ ...gn, layout: "chw" }),
    gn_vec4_nhwc: () => nk.groupNorm({ ...gn, layout: "nhwc", variant: "welford_vec4" }),
    gn_vec4_spatial: () => nk.groupNorm({ ...gn, spatial: 3, variant: "welford_vec4" }),
    gn_weight_small: () => nk.groupNorm({ ...gn, channels: 8, groups: 2, spatial: 2, weight: small }),
    binding_limit: () => plain.layerNorm({ x: huge, y: hugeY, rows: 2 ** 25 + 1, n: 1 }),
    array_length: () => nk.layerNorm(new Float32Array(10), 3),
    array_type: () => nk.layerNorm(new Float64Array(8), 4),
    array_weight: () => nk.layerNorm(new Float32Array(6), 3, { weight: [1, 2] }),
    array_option: () => nk.layerNorm(new Float32Array(6), 3, { wieght: [1, 2, 3] }),
    array_gn_channels: () => nk.groupNorm(new Float32Array(12), 2),
    array_gn_length: () => nk.groupNorm(new Float32Array(12), 2, { channels: 4, spatial: 2 }),
    create_device: () => createNormKit("gpu"),
    create_wg: () => createNormKit(d, { workgroupSize: 100 }),
    shader_op: () => window.normkit.shaderSource("batch_norm", "welford"),
  };
  const out = {};
  for (const [name, call] of Object.entries(calls)) {
    try { await call(); out[name] = "no error"; } catch (e) { out[name] = `${e.name}: ${e.message}`; }
  }
  plainDevice.destroy();
  return out;
})()"""

EXPECTED = {
    "x_not_buffer": r"^TypeError: layerNorm: x: expected a GPUBuffer, got Object$",
    "x_not_storage": r"layerNorm: x: expected a buffer with GPUBufferUsage.STORAGE",
    "x_too_small": r"^RangeError: layerNorm: x: buffer of 16 bytes is too small for 16 f32 values: needs 64 bytes$",
    "y_is_x": r"layerNorm: y: expected a different buffer from x",
    "n_zero": r"^RangeError: layerNorm: n: expected an integer >= 1, got 0$",
    "rows_fraction": r"rmsNorm: rows: expected an integer >= 0, got 1.5",
    "dtype": r"layerNorm: dtype: expected 'f32' or 'f16', got 'f64'",
    "f16_missing": r"layerNorm: dtype: 'f16' needs the device feature 'shader-f16', which this device does not have",
    "subgroups_missing": r"layerNorm: variant: 'welford_subgroup' needs subgroups, but the device has no 'subgroups' feature",
    "vec4_width": r"layerNorm: variant: 'welford_vec4' loads vec4s and needs n % 4 == 0, got n = 7",
    "variant_name": r"layerNorm: variant: expected one of onepass, twopass, welford, .*got 'threepass'",
    "activation": r"layerNorm: activation: expected null or one of silu, mish, gelu, gelu_tanh, relu, got 'tanh'",
    "eps": r"layerNorm: eps: expected a finite number >= 0, got -1",
    "eps_nan": r"groupNorm: eps: expected a finite number >= 0, got NaN",
    "weight_small": r"layerNorm: weight: buffer of 16 bytes is too small for 8 f32 values \(one per column\): needs 32 bytes",
    "rms_bias": r"rmsNorm: unknown argument 'bias'|rmsNorm: bias: rmsNorm has no bias",
    "stats_small": r"layerNorm: stats: buffer of 16 bytes is too small for 4 \(mean, rstd\) f32 pairs: needs 32 bytes",
    "stats_is_y": r"layerNorm: stats: expected a buffer other than x and y",
    "encoder": r"layerNorm: encoder: expected a GPUCommandEncoder or undefined, got Object",
    "unknown": r"layerNorm: unknown argument 'weigth' \(expected x, y, rows, n, weight, bias",
    "groups": r"groupNorm: groups: expected a divisor of channels = 4, got 3",
    "layout": r"groupNorm: layout: expected 'nchw' or 'nhwc', got 'chw'",
    "gn_vec4_nhwc": r"groupNorm: variant: 'welford_vec4' loads vec4s along the spatial dims and needs layout 'nchw'",
    "gn_vec4_spatial": r"groupNorm: variant: 'welford_vec4' loads vec4s and needs spatial % 4 == 0, got spatial = 3",
    "gn_weight_small": r"groupNorm: weight: buffer of 16 bytes is too small for 8 f32 values \(one per channel\)",
    "binding_limit": r"layerNorm: x: 134217732 bytes is more than this device binds at once "
                     r"\(maxStorageBufferBindingSize = 134217728\)",
    "array_length": r"layerNorm: x: length 10 is not a multiple of n = 3",
    "array_type": r"layerNorm: x: expected a Float32Array .*got Float64Array",
    "array_weight": r"layerNorm: weight: expected 3 values \(a Float32Array or array\), got 2",
    "array_option": r"layerNorm options: unknown argument 'wieght'",
    "array_gn_channels": r"groupNorm: channels: expected an integer >= 1, got undefined",
    "array_gn_length": r"groupNorm: x: length 12 is not a multiple of channels x spatial = 8",
    "create_device": r"createNormKit: device: expected a GPUDevice or undefined, got 'gpu'",
    "create_wg": r"createNormKit: workgroupSize: expected one of 4, 8, 16, 32, 64, 128, 256, got 100",
    "shader_op": r"shaderSource: op: expected one of layer_norm, rms_norm, group_norm, got 'batch_norm'",
}


def test_errors_name_the_argument(page):
    got = page.evaluate(ERRORS)
    assert set(got) == set(EXPECTED)
    wrong = {k: got[k] for k, pattern in EXPECTED.items() if not re.search(pattern, got[k])}
    assert not wrong, "\n".join(f"{k}: got {v!r}, expected /{EXPECTED[k]}/" for k, v in wrong.items())


def test_a_page_error_reaches_python_with_its_message(page):
    with pytest.raises(PageError, match="layerNorm: n: expected an integer >= 1"):
        page.evaluate("window.kits[256].layerNorm(new Float32Array(4), 0)")


# ----------------------------------------------------------------------------- the demo page

def test_demo_page_runs_every_kernel_and_the_ladder(page):
    """index.html as a user opens it (small shapes, workgroups of 16 to keep SwiftShader quick)."""
    page.browser.open(f"{page.url}/index.html?quick&rows=64&wg=16")
    page.browser.evaluate("""new Promise((resolve) => {
        const poll = () => (window.normkitDemo && window.normkitDemo.done) ? resolve(true) : setTimeout(poll, 100);
        poll();
    })""", timeout=600)
    demo = page.browser.evaluate("window.normkitDemo")
    assert demo.get("error") is None, demo.get("error")
    assert demo["ok"], demo["failed"]
    ladder = {r["variant"]: r for r in demo["progression"]}
    assert list(ladder) == ["copy"] + [v.name for v in VARIANTS]
    for name, r in ladder.items():
        if r.get("skipped"):
            assert "subgroups" in r["skipped"] and not page.info["hasSubgroups"], r
            continue
        assert r["gbs"] > 0
        if name == "copy":
            continue
        assert r["check"]["ok"], r
        assert r["offsetCheck"]["ok"] == (name != "onepass"), r  # one-pass fails the rows + 1e4
    ran = [k for k in demo["kernels"] if k.get("check")]
    assert len(ran) >= 40 and all(k["check"]["ok"] for k in ran)
    assert {k["op"] for k in ran} == set(shaders.OPS)
    assert {k["activation"] for k in ran} == {"none", *ACTS}
    assert all(("shader-f16" in k["skipped"]) or ("NCHW" in k["skipped"]) or ("subgroups" in k["skipped"])
               for k in demo["kernels"] if k.get("skipped"))
    assert page.browser.evaluate("document.title") == "normkit demo: done"
    assert "all close" in page.browser.evaluate("document.getElementById('status').textContent")


# ----------------------------------------------------------------------------- the package (no browser)

def test_export_web_writes_a_self_contained_package(tmp_path):
    import json

    from normkit import __version__
    from normkit.cli import main

    assert main(["export-web", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["normkit.js", "normkit.d.ts", "package.json", "index.html", "demo.js", "README.md"])
    js = (tmp_path / "normkit.js").read_text()
    assert not re.search(r"^\s*import\b|\brequire\(|\bfetch\(", js, re.M), "the module must have no dependencies"
    for name in sorted(p.name for p in shaders.HERE.glob("*.wgsl")):  # every .wgsl file, verbatim
        assert f'"{name}": String.raw`{(shaders.HERE / name).read_text()}`' in js, name
    assert "/* normkit:data */" not in js and "__NORMKIT_VERSION__" not in js
    assert f'export const VERSION = "{__version__}"' in js
    package = json.loads((tmp_path / "package.json").read_text())
    assert package["type"] == "module" and package["main"] == "./normkit.js" and package["types"] == "./normkit.d.ts"
    assert package["version"] == __version__
    dts = (tmp_path / "normkit.d.ts").read_text()
    variants = re.search(r"export type Variant =([^;]*);", dts).group(1)
    assert set(re.findall(r'"(\w+)"', variants)) == set(shaders.VARIANTS)
    assert set(re.findall(r'"(\w+)"', re.search(r"export type Activation =([^;]*);", dts).group(1))) == set(ACTS)
    for name in ("createNormKit", "requestNormKitDevice", "shaderSource", "toF16Bits", "fromF16Bits"):
        assert re.search(rf"^export (async )?function {name}\(", js, re.M) and f"export function {name}(" in dts, name
    html = (tmp_path / "index.html").read_text()
    assert '<script type="module" src="./demo.js">' in html
