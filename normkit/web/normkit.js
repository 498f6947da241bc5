// normkit.js: LayerNorm, RMSNorm and GroupNorm (with fused activations) forward on WebGPU.
// An ES module with no dependencies, written by `normkit export-web` (normkit __NORMKIT_VERSION__).
// The WGSL in DATA is normkit's .wgsl files verbatim (normkit/backends/webgpu); shaderSource()
// assembles them exactly as the Python backend does, and normkit's tests check that the two agree.
// Hand-written source: normkit/web/normkit.js; edit that, not the exported copy.

/* normkit:data */

const DEFAULT_WG = DATA.workgroupSize;
const PARAMS_BYTES = DATA.paramsBytes;
const FLAGS = DATA.flags;
const ACT_CODES = DATA.activations;

/** The kernel variants, seed 000's ladder in order: onepass, twopass, welford, then subgroups / vec4. */
export const VARIANTS = Object.freeze(DATA.variants.map((v) => Object.freeze({ ...v })));
/** The fused activations (applied after the affine transform). */
export const ACTIVATIONS = Object.freeze(Object.keys(ACT_CODES).filter((a) => a !== "none"));
export const DTYPES = Object.freeze([...DATA.dtypes]);
export const VERSION = "__NORMKIT_VERSION__";
const BY_NAME = new Map(VARIANTS.map((v) => [v.name, v]));
const OP_NAMES = { layer_norm: "layerNorm", rms_norm: "rmsNorm", group_norm: "groupNorm" };
const BYTES = { f32: 4, f16: 2 };
const DEFAULT_EPS = { layer_norm: 1e-5, rms_norm: 2 ** -23, group_norm: 1e-5 };  // rms: torch's float32 eps
const LAYOUTS = ["nchw", "nhwc"];

// ------------------------------------------------------------------------------- the WGSL

// the generated header; the same lines as header() in normkit/backends/webgpu/shaders.py
function header(v, op, dtype, activation, forBrowser, wg) {
  const enables = [];
  if (dtype === "f16") enables.push("enable f16;");
  if (v.subgroup && forBrowser) enables.push("enable subgroups;");
  return [
    `// normkit ${op} forward, variant ${v.name}, ${dtype} storage, f32 math, ` +
      `activation ${activation ?? "none"}: ${v.about}.`,
    "// Generated from normkit's .wgsl parts (normkit/backends/webgpu); edit those, not this text.",
    ...enables,
    "",
    `alias T = ${dtype};`,
    `const RMS: bool = ${op === "rms_norm"};`,
    `const ACT: u32 = ${ACT_CODES[activation ?? "none"]}u;`,
    `const WG: u32 = ${wg}u;`,
    "",
  ].join("\n");
}

// the .wgsl files after the header; the same list as parts() in shaders.py
function partsOf(v, op) {
  return [`vec${v.width}.wgsl`, "common.wgsl", op === "group_norm" ? "groups.wgsl" : "rows.wgsl",
    "activations.wgsl", v.subgroup ? "reduce_subgroup.wgsl" : "reduce_workgroup.wgsl", `${v.algo}.wgsl`];
}

/**
 * The WGSL of one kernel. forBrowser (default true) adds `enable subgroups;` to subgroup variants;
 * without it the text is what normkit's Python backend compiles through wgpu.
 */
export function shaderSource(op, variant, dtype = "f32", activation = null, { forBrowser = true, workgroupSize = DEFAULT_WG } = {}) {
  const fn = "shaderSource";
  if (!(op in OP_NAMES)) throw new TypeError(`${fn}: op: expected one of ${Object.keys(OP_NAMES).join(", ")}, got ${show(op)}`);
  const v = checkVariantName(fn, variant);
  checkDtypeName(fn, dtype);
  checkActivation(fn, activation);
  checkWorkgroupSize(fn, workgroupSize);
  return [header(v, op, dtype, activation ?? null, forBrowser, workgroupSize), ...partsOf(v, op).map((p) => DATA.wgsl[p])].join("\n");
}

function probeSource(wg) {
  return `enable subgroups;\nconst WG: u32 = ${wg}u;\n` + DATA.wgsl["subgroup_probe.wgsl"];
}

/** The variant normkit runs by default: Welford, vec4 loads where the shape allows, subgroups where usable. */
function bestVariant(hasSubgroups, op, n, spatial, layout) {
  const sub = hasSubgroups ? "_subgroup" : "";
  const vec4 = BY_NAME.get("welford_vec4" + sub);
  return vec4Blocker(vec4, op, n, spatial, layout) === null ? vec4 : BY_NAME.get("welford" + sub);
}

// why the shape rules out the variant's vec4 loads, or null; as vec4_blocker() in shaders.py
function vec4Blocker(v, op, n, spatial, layout) {
  if (v.width === 1) return null;
  if (op !== "group_norm") {
    return n % 4 === 0 ? null : `variant: '${v.name}' loads vec4s and needs n % 4 == 0, got n = ${n}`;
  }
  if (layout !== "nchw") return `variant: '${v.name}' loads vec4s along the spatial dims and needs layout 'nchw', got '${layout}'`;
  return spatial % 4 === 0 ? null : `variant: '${v.name}' loads vec4s and needs spatial % 4 == 0, got spatial = ${spatial}`;
}

// ------------------------------------------------------------------------------- float16 helpers

const HAS_F16_ARRAY = typeof globalThis.Float16Array === "function";
const f32Scratch = new Float32Array(1);
const u32Scratch = new Uint32Array(f32Scratch.buffer);

/** float32 values to IEEE half bits (round to nearest even), for f16 buffers. */
export function toF16Bits(values) {
  return HAS_F16_ARRAY ? new Uint16Array(new globalThis.Float16Array(values).buffer) : toF16BitsByHand(values);
}

/** IEEE half bits to float32 values. */
export function fromF16Bits(bits) {
  return HAS_F16_ARRAY ? new Float32Array(new globalThis.Float16Array(bits.buffer, bits.byteOffset, bits.length))
    : fromF16BitsByHand(bits);
}

// for browsers without Float16Array (before Chrome 135)
function toF16BitsByHand(values) {
  const out = new Uint16Array(values.length);
  for (let i = 0; i < values.length; i++) {
    f32Scratch[0] = values[i];
    const u = u32Scratch[0];
    const sign = (u >>> 16) & 0x8000;
    const exp = (u >>> 23) & 0xff;
    let mant = u & 0x7fffff;
    if (exp === 0xff) { out[i] = sign | 0x7c00 | (mant ? 0x200 : 0); continue; }  // inf, NaN
    let e = exp - 127 + 15;
    if (e >= 31) { out[i] = sign | 0x7c00; continue; }  // overflow to inf
    if (e <= 0) {  // half subnormal or zero: shift the implicit bit in, round to nearest even
      if (e < -10) { out[i] = sign; continue; }
      mant |= 0x800000;
      const shift = 14 - e;
      let h = mant >>> shift;
      const rest = mant & ((1 << shift) - 1), halfway = 1 << (shift - 1);
      if (rest > halfway || (rest === halfway && (h & 1))) h++;
      out[i] = sign | h;
      continue;
    }
    let h = (e << 10) | (mant >>> 13);
    const rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest === 0x1000 && (h & 1))) h++;  // may carry into the exponent: still right
    out[i] = sign | h;
  }
  return out;
}

function fromF16BitsByHand(bits) {
  const out = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) {
    const h = bits[i], s = h & 0x8000 ? -1 : 1, e = (h >>> 10) & 0x1f, m = h & 0x3ff;
    out[i] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m ? NaN : s * Infinity) : s * (1 + m / 1024) * 2 ** (e - 15);
  }
  return out;
}

/** Not part of the API: what normkit's tests reach inside the module. */
export const _testing = { toF16BitsByHand, fromF16BitsByHand, probeSource };

// ------------------------------------------------------------------------------- argument checks

function show(v) {
  if (v === null || v === undefined) return String(v);
  if (typeof v === "string") return `'${v}'`;
  if (typeof v === "number" || typeof v === "boolean") return String(v);
  return v?.constructor?.name ?? typeof v;
}

function checkKeys(fn, args, allowed) {
  if (args === null || typeof args !== "object") throw new TypeError(`${fn}: expected an object of named arguments, got ${show(args)}`);
  for (const k of Object.keys(args)) {
    if (!allowed.includes(k)) throw new TypeError(`${fn}: unknown argument '${k}' (expected ${allowed.join(", ")})`);
  }
}

function checkInt(fn, name, v, min) {
  if (!Number.isSafeInteger(v) || v < min) {
    throw new RangeError(`${fn}: ${name}: expected an integer >= ${min}, got ${show(v)}`);
  }
  return v;
}

function checkVariantName(fn, variant) {
  const v = BY_NAME.get(variant);
  if (!v) throw new TypeError(`${fn}: variant: expected one of ${[...BY_NAME.keys()].join(", ")}, got ${show(variant)}`);
  return v;
}

function checkDtypeName(fn, dtype) {
  if (!(dtype in BYTES)) throw new TypeError(`${fn}: dtype: expected 'f32' or 'f16', got ${show(dtype)}`);
}

function checkActivation(fn, activation) {
  if (activation !== null && activation !== undefined && !ACTIVATIONS.includes(activation)) {
    throw new TypeError(`${fn}: activation: expected null or one of ${ACTIVATIONS.join(", ")}, got ${show(activation)}`);
  }
}

function checkWorkgroupSize(fn, wg) {
  if (!DATA.workgroupSizes.includes(wg)) {
    throw new RangeError(`${fn}: workgroupSize: expected one of ${DATA.workgroupSizes.join(", ")}, got ${show(wg)}`);
  }
}

function checkEps(fn, eps) {
  if (typeof eps !== "number" || !(eps >= 0) || eps === Infinity) {
    throw new RangeError(`${fn}: eps: expected a finite number >= 0, got ${show(eps)}`);
  }
}

function isBuffer(b) {
  return typeof GPUBuffer !== "undefined" && b instanceof GPUBuffer;
}

function roundUp4(n) {
  return Math.ceil(n / 4) * 4;
}

// ------------------------------------------------------------------------------- the kit

const BUFFER_ARGS = {
  layer_norm: ["x", "y", "rows", "n", "weight", "bias", "eps", "dtype", "activation", "variant", "stats", "encoder"],
  rms_norm: ["x", "y", "rows", "n", "weight", "eps", "dtype", "activation", "variant", "stats", "encoder"],
  group_norm: ["x", "y", "batch", "channels", "spatial", "groups", "weight", "bias", "eps", "dtype", "activation",
    "layout", "variant", "stats", "encoder"],
};
const ARRAY_OPTIONS = {
  layer_norm: ["weight", "bias", "eps", "dtype", "activation", "variant"],
  rms_norm: ["weight", "eps", "dtype", "activation", "variant"],
  group_norm: ["channels", "spatial", "weight", "bias", "eps", "dtype", "activation", "layout", "variant"],
};

class NormKit {
  #layout;
  #pipelineLayout;
  #pipelines = new Map();
  #uniforms = new Map();
  #absent;
  #scratch = null;

  constructor(device, workgroupSize, subgroupSize, subgroupsOff) {
    this.device = device;
    /** invocations per workgroup (one workgroup normalizes one row or group) */
    this.workgroupSize = workgroupSize;
    /** the subgroup size the probe saw (null when the subgroup variants are off) */
    this.subgroupSize = subgroupSize;
    /** why the subgroup variants cannot run here (null when they can) */
    this.subgroupsOff = subgroupsOff;
    this.hasF16 = device.features.has("shader-f16");
    const types = ["uniform", "read-only-storage", "storage", "read-only-storage", "read-only-storage", "storage"];
    this.#layout = device.createBindGroupLayout({
      label: "normkit",
      entries: types.map((type, binding) => ({ binding, visibility: GPUShaderStage.COMPUTE, buffer: { type } })),
    });
    this.#pipelineLayout = device.createPipelineLayout({ label: "normkit", bindGroupLayouts: [this.#layout] });
    this.#absent = device.createBuffer({ label: "normkit: no weight/bias", size: 16, usage: GPUBufferUsage.STORAGE });
  }

  get hasSubgroups() {
    return this.subgroupsOff === null;
  }

  /** The kernels compiled so far ("op/variant/dtype/activation"): pipelines are built on first use. */
  get compiledKernels() {
    return [...this.#pipelines.keys()];
  }

  /** The variant a call with these sizes runs by default. */
  bestVariant(op, { n = 1, spatial = 1, layout = "nchw" } = {}) {
    if (!(op in OP_NAMES)) throw new TypeError(`bestVariant: op: expected one of ${Object.keys(OP_NAMES).join(", ")}, got ${show(op)}`);
    if (op === "group_norm") n = spatial;  // only spatial and layout matter
    return bestVariant(this.hasSubgroups, op, n, spatial, layout).name;
  }

  /**
   * LayerNorm of each row. Buffer level: layerNorm({x, y, rows, n, weight, bias, eps, dtype, activation,
   * variant, stats, encoder}) records into `encoder` (or submits itself). Array level:
   * await layerNorm(float32Array, n, {weight, bias, eps, activation, variant, dtype}) -> Float32Array.
   */
  layerNorm(a, n, options) {
    return ArrayBuffer.isView(a) || Array.isArray(a) ? this.#onArray("layer_norm", a, n, options) : this.#record("layer_norm", a, n);
  }

  /** RMSNorm of each row; the arguments of layerNorm without bias. */
  rmsNorm(a, n, options) {
    return ArrayBuffer.isView(a) || Array.isArray(a) ? this.#onArray("rms_norm", a, n, options) : this.#record("rms_norm", a, n);
  }

  /**
   * GroupNorm of x [batch, channels, spatial] (layout 'nchw') or [batch, spatial, channels] ('nhwc').
   * Buffer level: groupNorm({x, y, batch, channels, spatial, groups, weight, bias, eps, activation,
   * layout, variant, stats, encoder}). Array level: await groupNorm(float32Array, groups, {channels,
   * spatial, weight, bias, eps, activation, layout}) -> Float32Array (batch = length / (channels * spatial)).
   */
  groupNorm(a, groups, options) {
    return ArrayBuffer.isView(a) || Array.isArray(a) ? this.#onArray("group_norm", a, groups, options) : this.#record("group_norm", a, groups);
  }

  // ----------------------------------------------------------------------------- buffer level

  // the checked call: every size and flag the kernel needs
  #plan(op, args) {
    const fn = OP_NAMES[op];
    checkKeys(fn, args, BUFFER_ARGS[op]);
    const dtype = args.dtype ?? "f32";
    checkDtypeName(fn, dtype);
    if (dtype === "f16" && !this.hasF16) {
      throw new TypeError(`${fn}: dtype: 'f16' needs the device feature 'shader-f16', which this device does not have ` +
        "(request it in requestDevice({requiredFeatures}) where the adapter offers it, or use 'f32')");
    }
    checkActivation(fn, args.activation);
    const eps = args.eps ?? DEFAULT_EPS[op];
    checkEps(fn, eps);
    let rows, n, paramLen, groups = 0, spatial = 1, layout = "nchw";
    if (op === "group_norm") {
      const batch = checkInt(fn, "batch", args.batch, 0);
      const channels = checkInt(fn, "channels", args.channels, 1);
      spatial = checkInt(fn, "spatial", args.spatial, 1);
      groups = checkInt(fn, "groups", args.groups, 1);
      if (channels % groups) throw new RangeError(`${fn}: groups: expected a divisor of channels = ${channels}, got ${groups}`);
      layout = args.layout ?? "nchw";
      if (!LAYOUTS.includes(layout)) throw new TypeError(`${fn}: layout: expected 'nchw' or 'nhwc', got ${show(layout)}`);
      rows = batch * groups;
      n = (channels / groups) * spatial;
      paramLen = channels;
    } else {
      rows = checkInt(fn, "rows", args.rows, 0);
      n = checkInt(fn, "n", args.n, 1);
      paramLen = n;
    }
    let v;
    if (args.variant === undefined || args.variant === null) {
      v = bestVariant(this.hasSubgroups, op, n, spatial, layout);
    } else {
      v = checkVariantName(fn, args.variant);
      if (v.subgroup && !this.hasSubgroups) throw new TypeError(`${fn}: variant: '${v.name}' needs subgroups, but ${this.subgroupsOff}`);
      const why = vec4Blocker(v, op, n, spatial, layout);
      if (why) throw new RangeError(`${fn}: ${why}`);
    }
    const bytes = rows * n * BYTES[dtype];
    const limit = this.device.limits.maxStorageBufferBindingSize;
    for (const name of ["x", "y"]) this.#checkBuffer(fn, name, args[name], bytes, `${rows * n} ${dtype} values`, limit);
    if (args.x === args.y) {
      throw new TypeError(`${fn}: y: expected a different buffer from x (WebGPU cannot bind one buffer for reading and writing in one dispatch)`);
    }
    if (op === "rms_norm" && args.bias !== undefined) throw new TypeError(`${fn}: bias: rmsNorm has no bias`);
    let flags = op === "group_norm" && layout === "nhwc" ? FLAGS.channels_last : 0;
    for (const name of ["weight", "bias"]) {
      if (args[name] === undefined || args[name] === null) continue;
      const what = op === "group_norm" ? `${paramLen} f32 values (one per channel)` : `${paramLen} f32 values (one per column)`;
      this.#checkBuffer(fn, name, args[name], paramLen * 4, what, limit);
      flags |= FLAGS[name];
    }
    if (args.stats !== undefined) {
      this.#checkBuffer(fn, "stats", args.stats, rows * 8, `${rows} (mean, rstd) f32 pairs`, limit);
      if (args.stats === args.x || args.stats === args.y) throw new TypeError(`${fn}: stats: expected a buffer other than x and y`);
    }
    if (args.encoder !== undefined && !(typeof GPUCommandEncoder !== "undefined" && args.encoder instanceof GPUCommandEncoder)) {
      throw new TypeError(`${fn}: encoder: expected a GPUCommandEncoder or undefined, got ${show(args.encoder)}`);
    }
    return { fn, v, dtype, activation: args.activation ?? null, eps, rows, n, paramLen, groups, spatial, flags, bytes };
  }

  #checkBuffer(fn, name, b, bytes, what, limit) {
    if (!isBuffer(b)) throw new TypeError(`${fn}: ${name}: expected a GPUBuffer, got ${show(b)}`);
    if (!(b.usage & GPUBufferUsage.STORAGE)) throw new TypeError(`${fn}: ${name}: expected a buffer with GPUBufferUsage.STORAGE`);
    const need = roundUp4(bytes);
    if (b.size < need) {
      throw new RangeError(`${fn}: ${name}: buffer of ${b.size} bytes is too small for ${what}: needs ${need} bytes`);
    }
    if (need > limit) {
      throw new RangeError(`${fn}: ${name}: ${need} bytes is more than this device binds at once ` +
        `(maxStorageBufferBindingSize = ${limit}); request a higher limit in requestDevice or split the work`);
    }
  }

  async #record(op, args, extra) {
    if (extra !== undefined) throw new TypeError(`${OP_NAMES[op]}: expected one object of named arguments (or a Float32Array and sizes)`);
    const p = this.#plan(op, args);
    const info = { variant: p.v.name, dtype: p.dtype, activation: p.activation, workgroups: [0, 0] };
    if (p.rows === 0) return info;
    const pipeline = await this.#pipeline(op, p.v, p.dtype, p.activation);
    const gx = Math.min(p.rows, DATA.maxGridX), gy = Math.ceil(p.rows / gx);
    const stats = args.stats ?? this.#scratchStats(p.rows * 8);
    const bind = (buffer, size) => ({ buffer, offset: 0, size });
    const param = (b) => (b ? bind(b, p.paramLen * 4) : bind(this.#absent, 16));
    const entries = [
      bind(this.#uniform(p, op), PARAMS_BYTES), bind(args.x, roundUp4(p.bytes)), bind(args.y, roundUp4(p.bytes)),
      param(args.weight), param(args.bias), bind(stats, p.rows * 8),
    ].map((resource, binding) => ({ binding, resource }));
    const group = this.device.createBindGroup({ label: `normkit ${p.fn}`, layout: this.#layout, entries });
    const encoder = args.encoder ?? this.device.createCommandEncoder({ label: `normkit ${p.fn}` });
    const pass = encoder.beginComputePass({ label: `normkit ${p.fn} ${p.v.name}` });
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, group);
    pass.dispatchWorkgroups(gx, gy);
    pass.end();
    if (args.encoder === undefined) this.device.queue.submit([encoder.finish()]);
    info.workgroups = [gx, gy];
    return info;
  }

  // uniform buffers are immutable once written, so one per distinct parameter set is shared
  #uniform(p, op) {
    const key = [op, p.rows, p.n, p.eps, p.flags, p.groups, p.spatial].join("/");
    let u = this.#uniforms.get(key);
    if (!u) {
      if (this.#uniforms.size >= 1024) this.#uniforms.clear();  // dropped, not destroyed: pending work keeps them
      u = this.device.createBuffer({ label: "normkit params", size: PARAMS_BYTES, usage: GPUBufferUsage.UNIFORM, mappedAtCreation: true });
      const range = u.getMappedRange();
      new Uint32Array(range).set([p.rows, p.n, 0, p.flags, p.groups, p.spatial, 0, 0]);
      new Float32Array(range, 8, 1)[0] = p.eps;
      u.unmap();
      this.#uniforms.set(key, u);
    }
    return u;
  }

  #scratchStats(bytes) {
    if (!this.#scratch || this.#scratch.size < bytes) {
      this.#scratch = this.device.createBuffer({ label: "normkit stats", size: Math.max(256, roundUp4(bytes)), usage: GPUBufferUsage.STORAGE });
    }
    return this.#scratch;
  }

  #pipeline(op, v, dtype, activation) {
    const key = `${op}/${v.name}/${dtype}/${activation ?? "none"}`;
    let p = this.#pipelines.get(key);
    if (!p) {
      p = this.#compile(key, shaderSource(op, v.name, dtype, activation, { workgroupSize: this.workgroupSize }));
      this.#pipelines.set(key, p);
    }
    return p;
  }

  async #compile(label, code, layout = this.#pipelineLayout) {
    const module = this.device.createShaderModule({ label, code });
    try {
      return await this.device.createComputePipelineAsync({ label, layout, compute: { module, entryPoint: "main" } });
    } catch (e) {
      const info = await module.getCompilationInfo();
      const lines = info.messages.map((m) => `${m.type} at ${m.lineNum}:${m.linePos}: ${m.message}`);
      throw new Error(`normkit: WGSL kernel '${label}' did not build on this device: ${e.message}` +
        (lines.length ? "\n" + lines.join("\n") : ""));
    }
  }

  // ----------------------------------------------------------------------------- array level

  async #onArray(op, data, size, options = {}) {
    const fn = OP_NAMES[op];
    if (!(data instanceof Float32Array)) {
      throw new TypeError(`${fn}: x: expected a Float32Array (or GPU buffers in an object of named arguments), got ${show(data)}`);
    }
    checkKeys(`${fn} options`, options, ARRAY_OPTIONS[op]);
    const { weight, bias, dtype = "f32", ...rest } = options;
    const args = { ...rest, dtype };
    if (op === "group_norm") {
      args.groups = size;
      args.channels = checkInt(fn, "channels", options.channels, 1);
      args.spatial = options.spatial ?? data.length / args.channels;
      checkInt(fn, "spatial", args.spatial, 1);
      args.batch = data.length / (args.channels * args.spatial);
      if (!Number.isInteger(args.batch)) {
        throw new RangeError(`${fn}: x: length ${data.length} is not a multiple of channels x spatial = ${args.channels * args.spatial}`);
      }
    } else {
      args.n = checkInt(fn, "n", size, 1);
      args.rows = data.length / args.n;
      if (!Number.isInteger(args.rows)) throw new RangeError(`${fn}: x: length ${data.length} is not a multiple of n = ${args.n}`);
    }
    const paramLen = op === "group_norm" ? args.channels : args.n;
    if (data.length === 0) return new Float32Array(0);
    const d = this.device, made = [];
    const buffer = (size, usage, label) => {
      const b = d.createBuffer({ label: `normkit ${label}`, size: Math.max(16, roundUp4(size)), usage });
      made.push(b);
      return b;
    };
    const upload = (values, name) => {
      if (values === undefined || values === null) return undefined;
      if (!(values instanceof Float32Array || Array.isArray(values)) || values.length !== paramLen) {
        throw new RangeError(`${fn}: ${name}: expected ${paramLen} values (a Float32Array or array), got ` +
          (values?.length === undefined ? show(values) : `${values.length}`));
      }
      const b = buffer(paramLen * 4, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST, name);
      d.queue.writeBuffer(b, 0, Float32Array.from(values));
      return b;
    };
    try {
      checkDtypeName(fn, dtype);
      const raw = dtype === "f16" ? toF16Bits(data) : data;
      const bytes = roundUp4(raw.byteLength);
      const padded = new Uint8Array(bytes);
      padded.set(new Uint8Array(raw.buffer, raw.byteOffset, raw.byteLength));
      args.x = buffer(bytes, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST, "x");
      args.y = buffer(bytes, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC, "y");
      args.weight = upload(weight, "weight");
      if (op !== "rms_norm") args.bias = upload(bias, "bias");
      else if (bias !== undefined) throw new TypeError(`${fn}: bias: rmsNorm has no bias`);
      const read = buffer(bytes, GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST, "read-back");
      d.queue.writeBuffer(args.x, 0, padded);
      args.encoder = d.createCommandEncoder({ label: `normkit ${fn}` });
      await this.#record(op, args);
      args.encoder.copyBufferToBuffer(args.y, 0, read, 0, bytes);
      d.queue.submit([args.encoder.finish()]);
      await read.mapAsync(GPUMapMode.READ);
      const out = read.getMappedRange().slice(0, raw.byteLength);
      read.unmap();
      return dtype === "f16" ? fromF16Bits(new Uint16Array(out)) : new Float32Array(out);
    } finally {
      for (const b of made) b.destroy();
    }
  }
}

// ------------------------------------------------------------------------------- creation

/**
 * A NormKit on `device` (a GPUDevice), or, without one, on a new device from the default adapter with
 * the features normkit can use ('subgroups', 'shader-f16') and the adapter's largest buffer limits.
 * Kernels compile on first use; where the device has 'subgroups', a small probe kernel runs once to
 * check how the device forms subgroups. options.workgroupSize: invocations per row (default 256; a
 * power of two from 4 to 256; software adapters such as SwiftShader run smaller workgroups faster).
 */
export async function createNormKit(device, { workgroupSize = DEFAULT_WG, ...unknown } = {}) {
  const fn = "createNormKit";
  checkKeys(fn, unknown, []);
  if (device === undefined) {
    device = await requestNormKitDevice();
  } else if (typeof GPUDevice === "undefined" || !(device instanceof GPUDevice)) {
    throw new TypeError(`${fn}: device: expected a GPUDevice or undefined, got ${show(device)}`);
  }
  checkWorkgroupSize(fn, workgroupSize);
  const most = Math.min(device.limits.maxComputeInvocationsPerWorkgroup, device.limits.maxComputeWorkgroupSizeX);
  if (workgroupSize > most) throw new RangeError(`${fn}: workgroupSize: this device runs at most ${most} invocations per workgroup, got ${workgroupSize}`);
  const [size, off] = device.features.has("subgroups")
    ? await probeSubgroups(device, workgroupSize)
    : [null, "the device has no 'subgroups' feature (request it in requestDevice({requiredFeatures}) where the adapter offers it)"];
  return new NormKit(device, workgroupSize, size, off);
}

/** A device with the features and limits normkit can use, from `adapter` or the default one. */
export async function requestNormKitDevice(adapter) {
  if (adapter === undefined) {
    if (typeof navigator === "undefined" || !navigator.gpu) {
      throw new Error("createNormKit: this browser has no WebGPU (navigator.gpu is undefined; it needs a secure context: https or localhost)");
    }
    adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
    if (!adapter) throw new Error("createNormKit: navigator.gpu.requestAdapter() found no WebGPU adapter");
  }
  const requiredFeatures = ["subgroups", "shader-f16"].filter((f) => adapter.features.has(f));
  const requiredLimits = {};
  for (const k of ["maxStorageBufferBindingSize", "maxBufferSize"]) requiredLimits[k] = adapter.limits[k];
  return adapter.requestDevice({ label: "normkit", requiredFeatures, requiredLimits });
}

// Checks that subgroups are consecutive invocations of one power-of-two size >= 4, as
// reduce_subgroup.wgsl assumes (the Python runner makes the same check). Returns [size, null] or [null, why].
async function probeSubgroups(device, WG) {
  let pipeline;
  try {
    const module = device.createShaderModule({ label: "normkit subgroup probe", code: probeSource(WG) });
    pipeline = await device.createComputePipelineAsync({ label: "normkit subgroup probe", layout: "auto", compute: { module, entryPoint: "main" } });
  } catch (e) {
    return [null, `the subgroup probe kernel did not build: ${e.message}`];
  }
  const out = device.createBuffer({ size: WG * 8, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
  const read = device.createBuffer({ size: WG * 8, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const group = device.createBindGroup({ layout: pipeline.getBindGroupLayout(0), entries: [{ binding: 0, resource: { buffer: out } }] });
  const encoder = device.createCommandEncoder();
  const pass = encoder.beginComputePass();
  pass.setPipeline(pipeline);
  pass.setBindGroup(0, group);
  pass.dispatchWorkgroups(1);
  pass.end();
  encoder.copyBufferToBuffer(out, 0, read, 0, WG * 8);
  device.queue.submit([encoder.finish()]);
  await read.mapAsync(GPUMapMode.READ);
  const seen = new Uint32Array(read.getMappedRange().slice(0));
  read.unmap();
  out.destroy();
  read.destroy();
  const size = seen[0];
  let ok = size >= 4 && size <= WG && (size & (size - 1)) === 0;
  for (let lid = 0; ok && lid < WG; lid++) ok = seen[2 * lid] === size && seen[2 * lid + 1] === lid % size;
  if (!ok) {
    const sizes = [...new Set(seen.filter((_, i) => i % 2 === 0))].sort((a, b) => a - b);
    return [null, `the device does not build subgroups from consecutive invocations of one power-of-two size >= 4 (saw sizes ${sizes.join(", ")})`];
  }
  return [size, null];
}
