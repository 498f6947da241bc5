// The demo page's script: every normkit kernel on random data, checked against a float64 reference
// written here in plain JavaScript, and seed 000's ladder (one-pass, two-pass, Welford, subgroups,
// vec4) timed on this adapter. Results go into the page and into window.normkitDemo (which
// `normkit export-web --demo` reads). URL options: ?quick (small shapes), ?rows=R&n=N (ladder shape),
// ?wg=W (invocations per workgroup; default 256).
import { ACTIVATIONS, VARIANTS, VERSION, createNormKit, fromF16Bits, requestNormKitDevice, toF16Bits } from "./normkit.js";

const url = new URLSearchParams(location.search);
const QUICK = url.has("quick");
const LADDER = { rows: Number(url.get("rows") ?? (QUICK ? 256 : 1024)), n: Number(url.get("n") ?? 768) };
const WORKGROUP = url.has("wg") ? { workgroupSize: Number(url.get("wg")) } : {};
const BUDGET_S = QUICK ? 0.02 : 0.25;  // per timing sample
const SAMPLES = QUICK ? 3 : 7;
const OFFSET = 1e4;
// per element |y - ref| <= atol + rtol |ref|, as normkit's Python ladder
const TOL = { f32: 1e-5, f16: 2e-3 };
const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------------------- random data

function rng(seed) {  // mulberry32, then Box-Muller: the same data on every run
  let a = seed >>> 0;
  const uniform = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;
  };
  return (count, offset = 0) => {
    const out = new Float32Array(count);
    for (let i = 0; i < count; i++) out[i] = offset + Math.sqrt(-2 * Math.log(uniform())) * Math.cos(2 * Math.PI * uniform());
    return out;
  };
}

// ------------------------------------------------------------------------------- float64 reference

function erf(x) {  // 2/sqrt(pi) e^-x^2 sum 2^k x^(2k+1) / (1 3 ... (2k+1)): positive terms, ~1e-16
  const a = Math.abs(x);
  if (a >= 6) return Math.sign(x);
  let term = a, sum = a;
  for (let k = 1; term > 1e-17 * sum; k++) {
    term *= (2 * a * a) / (2 * k + 1);
    sum += term;
  }
  return Math.sign(x) * (2 / Math.sqrt(Math.PI)) * Math.exp(-a * a) * sum;
}

const ACT = {
  none: (v) => v,
  silu: (v) => v / (1 + Math.exp(-v)),
  mish: (v) => v * Math.tanh(Math.log1p(Math.exp(v))),
  gelu: (v) => 0.5 * v * (1 + erf(v / Math.SQRT2)),
  gelu_tanh: (v) => 0.5 * v * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (v + 0.044715 * v ** 3))),
  relu: (v) => Math.max(v, 0),
};

// normalizes the values at idx[0..len) of x (a row, or a group): two passes in float64
function normalizeSet(x, y, idx, len, rms, eps, scale, shift, act) {
  let mean = 0;
  if (!rms) {
    for (let k = 0; k < len; k++) mean += x[idx(k)];
    mean /= len;
  }
  let q = 0;
  for (let k = 0; k < len; k++) q += (x[idx(k)] - mean) ** 2;
  const rstd = 1 / Math.sqrt(q / len + eps);
  for (let k = 0; k < len; k++) {
    const i = idx(k);
    y[i] = act((x[i] - mean) * rstd * scale(k) + shift(k));
  }
}

function reference(c, x) {
  const y = new Float64Array(x.length), act = ACT[c.activation ?? "none"];
  const w = c.weight, b = c.bias;
  if (c.op !== "group_norm") {
    for (let r = 0; r < c.rows; r++) {
      normalizeSet(x, y, (k) => r * c.n + k, c.n, c.op === "rms_norm", c.eps,
        (k) => (w ? w[k] : 1), (k) => (b ? b[k] : 0), act);
    }
    return y;
  }
  const { batch: B, channels: C, spatial: S, groups: G } = c, cpg = C / G;
  for (let bi = 0; bi < B; bi++) {
    for (let g = 0; g < G; g++) {
      const ch = (k) => g * cpg + Math.floor(k / S);  // k runs over (channel in group, position)
      const idx = c.layout === "nhwc" ? (k) => (bi * S + (k % S)) * C + ch(k) : (k) => (bi * C + ch(k)) * S + (k % S);
      normalizeSet(x, y, idx, cpg * S, false, c.eps, (k) => (w ? w[ch(k)] : 1), (k) => (b ? b[ch(k)] : 0), act);
    }
  }
  return y;
}

function closeness(y, ref, dtype) {
  let maxErr = 0, bad = 0;
  for (let i = 0; i < y.length; i++) {
    const e = Math.abs(y[i] - ref[i]);
    if (!(e <= TOL[dtype] * (1 + Math.abs(ref[i])))) bad++;
    if (!(e <= maxErr)) maxErr = Number.isNaN(e) ? Infinity : e;
  }
  return { maxErr, bad, ok: bad === 0 };
}

// ------------------------------------------------------------------------------- running

function elements(c) {
  return c.op === "group_norm" ? c.batch * c.channels * c.spatial : c.rows * c.n;
}

function bufferArgs(c) {  // the sizes of a case, as the buffer-level API names them
  const keys = c.op === "group_norm" ? ["batch", "channels", "spatial", "groups", "layout"] : ["rows", "n"];
  const args = { eps: c.eps, dtype: c.dtype, variant: c.variant, activation: c.activation ?? undefined };
  for (const k of keys) args[k] = c[k];
  return args;
}

async function runCase(nk, c, x) {
  const opts = { variant: c.variant, eps: c.eps, dtype: c.dtype, activation: c.activation ?? undefined };
  if (c.weight) opts.weight = c.weight;
  if (c.bias && c.op !== "rms_norm") opts.bias = c.bias;
  if (c.op === "layer_norm") return nk.layerNorm(x, c.n, opts);
  if (c.op === "rms_norm") return nk.rmsNorm(x, c.n, opts);
  return nk.groupNorm(x, c.groups, { ...opts, channels: c.channels, spatial: c.spatial, layout: c.layout });
}

// the data the kernel really sees: f16 cases round x to f16 first
const stored = (x, dtype) => (dtype === "f16" ? fromF16Bits(toF16Bits(x)) : x);

async function check(nk, c, x) {
  const y = await runCase(nk, c, x);
  return closeness(y, reference(c, stored(x, c.dtype)), c.dtype);
}

// seconds per kernel: R calls recorded into one encoder, wall time from submit to completion / R
async function timeIt(device, record) {
  const sample = async (r) => {
    const encoder = device.createCommandEncoder();
    for (let i = 0; i < r; i++) await record(encoder);
    const t0 = performance.now();
    device.queue.submit([encoder.finish()]);
    await device.queue.onSubmittedWorkDone();
    return (performance.now() - t0) / 1000 / r;
  };
  const first = await sample(1);  // also the warm-up
  const r = Math.max(1, Math.min(200, Math.round(BUDGET_S / Math.max(first, 1e-6))));
  const times = [];
  for (let s = 0; s < SAMPLES; s++) times.push(await sample(r));
  times.sort((a, b) => a - b);
  return { median: times[Math.floor(times.length / 2)], min: times[0], max: times[times.length - 1], repeats: r };
}

function whyNot(nk, c) {  // a variant or dtype this adapter or shape cannot run, or null
  const v = VARIANTS.find((v) => v.name === c.variant);
  if (v.subgroup && !nk.hasSubgroups) return `no subgroups (${nk.subgroupsOff})`;
  if (c.dtype === "f16" && !nk.hasF16) return "no shader-f16";
  if (v.width === 4 && c.op !== "group_norm" && c.n % 4) return "n % 4 != 0";
  if (v.width === 4 && c.op === "group_norm" && (c.layout !== "nchw" || c.spatial % 4)) return "vec4 needs NCHW, spatial % 4 == 0";
  return null;
}

// ------------------------------------------------------------------------------- the two parts

async function ladder(nk, device) {
  const { rows, n } = LADDER, random = rng(0);
  const x = random(rows * n), xOff = random(rows * n, OFFSET), w = random(n), b = random(n);
  const bytes = rows * n * 4;
  const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC;
  const [xb, yb, wb, bb] = [bytes, bytes, n * 4, n * 4].map((size) => device.createBuffer({ size, usage }));
  device.queue.writeBuffer(xb, 0, x);
  device.queue.writeBuffer(wb, 0, w);
  device.queue.writeBuffer(bb, 0, b);
  const copy = await timeIt(device, async (enc) => enc.copyBufferToBuffer(xb, 0, yb, 0, bytes));
  const rowsOut = [{ variant: "copy", about: "buffer to buffer copy of x: the ceiling", gbs: (2 * bytes) / copy.median / 1e9, time: copy }];
  for (const v of VARIANTS) {
    const c = { op: "layer_norm", rows, n, eps: 1e-5, dtype: "f32", variant: v.name, weight: w, bias: b };
    const row = { variant: v.name, about: v.about, exact: v.algo !== "onepass" };
    const why = whyNot(nk, c);
    if (why) {
      rowsOut.push({ ...row, skipped: why });
      continue;
    }
    row.time = await timeIt(device, (encoder) => nk.layerNorm({ ...bufferArgs(c), x: xb, y: yb, weight: wb, bias: bb, encoder }));
    row.gbs = (2 * bytes) / row.time.median / 1e9;
    row.ofCopy = copy.median / row.time.median;
    row.check = await check(nk, c, x);
    row.offsetCheck = await check(nk, c, xOff);
    rowsOut.push(row);
    render(rowsOut, []);
  }
  for (const buffer of [xb, yb, wb, bb]) buffer.destroy();
  return rowsOut;
}

function kernelCases(nk) {
  const random = rng(1), cases = [];
  const dtypes = ["f32", "f16"];
  const rowShapes = [{ rows: 37, n: 1031 }, { rows: 37, n: 1028 }];
  const gn = { batch: 2, channels: 40, spatial: 64, groups: 8 };
  for (const op of ["layer_norm", "rms_norm"]) {
    for (const v of VARIANTS) {
      for (const dtype of dtypes) {
        const shape = rowShapes[v.width === 4 ? 1 : 0];
        cases.push({ op, ...shape, variant: v.name, dtype, eps: 1e-5, activation: null });
      }
    }
    for (const activation of ACTIVATIONS) {
      cases.push({ op, ...rowShapes[1], variant: nk.bestVariant(op, { n: rowShapes[1].n }), dtype: "f32", eps: 1e-5, activation });
    }
  }
  for (const layout of ["nchw", "nhwc"]) {
    for (const v of VARIANTS) {
      for (const dtype of dtypes) cases.push({ op: "group_norm", ...gn, layout, variant: v.name, dtype, eps: 1e-5, activation: null });
    }
    for (const activation of ACTIVATIONS) {
      const variant = nk.bestVariant("group_norm", { spatial: gn.spatial, layout });
      cases.push({ op: "group_norm", ...gn, layout, variant, dtype: "f32", eps: 1e-5, activation });
    }
  }
  for (const c of cases) {
    const len = c.op === "group_norm" ? c.channels : c.n;
    c.weight = random(len);
    c.bias = c.op === "rms_norm" ? null : random(len);
    c.x = random(elements(c), 3);
  }
  return cases;
}

async function kernels(nk, progression) {
  const out = [];
  for (const c of kernelCases(nk)) {
    const shape = c.op === "group_norm" ? `${c.batch}x${c.channels}x${c.spatial} /${c.groups} ${c.layout}` : `${c.rows}x${c.n}`;
    const row = { op: c.op, shape, variant: c.variant, dtype: c.dtype, activation: c.activation ?? "none" };
    const why = whyNot(nk, c);
    if (why) row.skipped = why;
    else row.check = await check(nk, c, c.x);
    out.push(row);
    render(progression, out);
  }
  return out;
}

// ------------------------------------------------------------------------------- the page

const fmt = (v, d = 3) => (v === undefined ? "" : Number(v).toPrecision(d));
const esc = (s) => String(s).replace(/[&<>]/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[ch]);
const verdict = (c) => (c.ok ? `<span class="ok">all close</span>` : `<span class="bad">${c.bad} not close</span>`);

function render(progression, kernelRows) {
  const lad = progression.map((r) => r.skipped
    ? `<tr><td>${r.variant}</td><td colspan="5" class="na">n/a: ${esc(r.skipped)}</td><td class="about">${esc(r.about)}</td></tr>`
    : `<tr><td>${r.variant}</td><td class="num">${fmt(r.gbs)}</td><td class="num">${r.ofCopy ? fmt(100 * r.ofCopy, 2) + "%" : ""}</td>` +
      `<td class="num">${r.check ? fmt(r.check.maxErr, 2) + " " + verdict(r.check) : ""}</td>` +
      `<td class="num">${r.offsetCheck ? fmt(r.offsetCheck.maxErr, 2) + " " + verdict(r.offsetCheck) : ""}</td>` +
      `<td class="num">${r.time ? fmt(r.time.median * 1e3) + " [" + fmt(r.time.min * 1e3) + ", " + fmt(r.time.max * 1e3) + "]" : ""}</td>` +
      `<td class="about">${esc(r.about)}</td></tr>`);
  $("ladder").innerHTML = lad.join("");
  $("chart").innerHTML = chart(progression);
  // the kernels that ran, then one line per reason for those that cannot run here
  const skipped = new Map();
  for (const r of kernelRows) if (r.skipped) skipped.set(r.skipped, (skipped.get(r.skipped) ?? 0) + 1);
  $("kernels").innerHTML = kernelRows.filter((r) => !r.skipped).map((r) =>
    `<tr><td>${r.op}</td><td>${r.shape}</td><td>${r.variant}</td><td>${r.dtype}</td><td>${r.activation}</td>` +
    `<td class="num">${fmt(r.check.maxErr, 2)}</td><td>${verdict(r.check)}</td></tr>`).join("") +
    [...skipped].map(([why, count]) => `<tr><td colspan="7" class="na">${count} more not available here: ${esc(why)}</td></tr>`).join("");
}

function chart(rows) {
  // the kernels' bars share one scale; the copy gets a bar on it only when it is not far off the scale
  const kernels = rows.filter((r) => r.gbs !== undefined && r.variant !== "copy");
  const copy = rows.find((r) => r.variant === "copy");
  if (!kernels.length) return "";
  const top = Math.max(...kernels.map((r) => r.gbs));
  const timed = copy && copy.gbs <= 3 * top ? [copy, ...kernels] : kernels;
  const max = Math.max(...timed.map((r) => r.gbs)), barH = 26, left = 190, width = 520, h = timed.length * barH + 48;
  const note = timed[0] === copy ? "grey: the copy ceiling" : `a buffer copy runs at ${fmt(copy.gbs)} GB/s here, off this scale`;
  const bars = timed.map((r, i) => {
    const y = 10 + i * barH, w = Math.max(1, (r.gbs / max) * width);
    const cls = r.variant === "copy" ? "copy" : r.offsetCheck && !r.offsetCheck.ok ? "fail" : "pass";
    return `<text x="${left - 8}" y="${y + 17}" text-anchor="end">${r.variant}</text>` +
      `<rect class="${cls}" x="${left}" y="${y + 3}" width="${w.toFixed(1)}" height="${barH - 8}"/>` +
      `<text x="${left + w + 6}" y="${y + 17}">${fmt(r.gbs)} GB/s</text>`;
  });
  return `<svg width="${left + width + 110}" height="${h}" role="img" aria-label="GB/s per variant">${bars.join("")}` +
    `<text x="${left}" y="${h - 22}" class="legend">red: wrong on rows offset by 1e4 (E[x²] − E[x]² cancels)</text>` +
    `<text x="${left}" y="${h - 6}" class="legend">${note}</text></svg>`;
}

async function main() {
  const demo = (window.normkitDemo = { done: false, version: VERSION, quick: QUICK, ladderShape: LADDER });
  try {
    if (!navigator.gpu) throw new Error("this browser has no WebGPU (navigator.gpu is undefined)");
    const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
    if (!adapter) throw new Error("navigator.gpu.requestAdapter() found no adapter");
    const device = await requestNormKitDevice(adapter);
    const nk = await createNormKit(device, WORKGROUP);
    demo.workgroupSize = nk.workgroupSize;
    const info = adapter.info ?? {};
    demo.adapter = { vendor: info.vendor, architecture: info.architecture, description: info.description };
    demo.features = { subgroups: nk.hasSubgroups, subgroupSize: nk.subgroupSize, f16: nk.hasF16 };
    $("adapter").textContent = `${[info.vendor, info.architecture, info.description].filter(Boolean).join(" / ") || "unknown adapter"}; ` +
      `subgroups: ${nk.hasSubgroups ? "yes, size " + nk.subgroupSize : "no"}; shader-f16: ${nk.hasF16 ? "yes" : "no"}; ` +
      `normkit ${VERSION}; workgroup size ${nk.workgroupSize}; ladder ${LADDER.rows} x ${LADDER.n} f32` + (QUICK ? " (quick)" : "");
    $("status").textContent = "running the ladder...";
    demo.progression = await ladder(nk, device);
    $("status").textContent = "checking every kernel...";
    demo.kernels = await kernels(nk, demo.progression);
    const failed = demo.kernels.filter((r) => r.check && !r.check.ok).map((r) => `${r.op} ${r.variant} ${r.dtype} ${r.activation}`);
    for (const r of demo.progression) {
      if (r.exact && r.check && !(r.check.ok && r.offsetCheck.ok)) failed.push(`ladder ${r.variant}`);
    }
    demo.failed = failed;
    demo.ok = failed.length === 0;
    const ran = demo.kernels.filter((r) => r.check).length;
    $("status").textContent = demo.ok
      ? `done: ${ran} kernels all close to the float64 reference (${demo.kernels.length - ran} not available here)`
      : `done, with failures: ${failed.join("; ")}`;
    $("status").className = demo.ok ? "ok" : "bad";
  } catch (e) {
    demo.error = String(e?.stack ?? e);
    demo.ok = false;
    $("status").textContent = `error: ${e?.message ?? e}`;
    $("status").className = "bad";
  }
  demo.done = true;
  document.title = `normkit demo: ${demo.ok ? "done" : "failed"}`;
}

main();
