// TypeScript declarations for normkit.js (written by `normkit export-web`).
// Needs the WebGPU types (@webgpu/types) for GPUDevice, GPUBuffer and GPUCommandEncoder.

export type Variant =
  | "onepass"
  | "twopass"
  | "welford"
  | "welford_subgroup"
  | "welford_vec4"
  | "welford_vec4_subgroup";
export type Activation = "silu" | "mish" | "gelu" | "gelu_tanh" | "relu";
export type DType = "f32" | "f16";
export type Op = "layer_norm" | "rms_norm" | "group_norm";
export type Layout = "nchw" | "nhwc";
export type WorkgroupSize = 4 | 8 | 16 | 32 | 64 | 128 | 256;

export interface VariantInfo {
  readonly name: Variant;
  /** the statistics: "onepass" (E[x^2] - E[x]^2, loses rows with a large offset), "twopass" or "welford" */
  readonly algo: "onepass" | "twopass" | "welford";
  /** values per load: 4 needs n % 4 == 0 (GroupNorm: layout "nchw" and spatial % 4 == 0) */
  readonly width: 1 | 4;
  /** reduces with subgroup shuffles: needs the device feature "subgroups" */
  readonly subgroup: boolean;
  readonly about: string;
}

/** Seed 000's ladder in order: one-pass, two-pass, Welford, then the subgroup and vec4 variants. */
export const VARIANTS: readonly VariantInfo[];
export const ACTIVATIONS: readonly Activation[];
export const DTYPES: readonly DType[];
export const VERSION: string;

/** What every buffer-level call shares. */
interface BufferCall {
  /** input, in the dtype's storage (f32 or f16), with GPUBufferUsage.STORAGE */
  x: GPUBuffer;
  /** output, same size and layout as x; must be a different buffer */
  y: GPUBuffer;
  /** f32 values, one per column (LayerNorm/RMSNorm) or per channel (GroupNorm) */
  weight?: GPUBuffer;
  /** default 1e-5 (RMSNorm: 2^-23, torch's float32 default) */
  eps?: number;
  /** storage type of x and y (math and statistics are f32); "f16" needs the feature "shader-f16" */
  dtype?: DType;
  /** applied after the affine transform, in the same kernel */
  activation?: Activation | null;
  /** force a variant (default: Welford, vec4 where the shape allows, subgroups where the device has them) */
  variant?: Variant;
  /** receives (mean, rstd) as two f32 per row (per sample and group for GroupNorm); mean is 0 for RMSNorm */
  stats?: GPUBuffer;
  /** record into this encoder (no pass may be open); without it the call submits on its own */
  encoder?: GPUCommandEncoder;
}

export interface RowNormCall extends BufferCall {
  /** rows of x, each n contiguous values */
  rows: number;
  n: number;
}

export interface LayerNormCall extends RowNormCall {
  bias?: GPUBuffer;
}

export interface GroupNormCall extends BufferCall {
  batch: number;
  channels: number;
  /** values per channel (H x W) */
  spatial: number;
  /** divides channels */
  groups: number;
  bias?: GPUBuffer;
  /** "nchw" (default): x is [batch, channels, spatial]; "nhwc": [batch, spatial, channels] */
  layout?: Layout;
}

/** What a buffer-level call ran. */
export interface CallInfo {
  variant: Variant;
  dtype: DType;
  activation: Activation | null;
  /** the dispatch: [x, y] workgroups (rows past 65535 fold into y) */
  workgroups: [number, number];
}

interface ArrayOptions {
  weight?: Float32Array | number[];
  eps?: number;
  /** "f16" rounds x to f16 on the way in (needs "shader-f16"); the result is still a Float32Array */
  dtype?: DType;
  activation?: Activation | null;
  variant?: Variant;
}

export interface LayerNormOptions extends ArrayOptions {
  bias?: Float32Array | number[];
}

export interface GroupNormOptions extends ArrayOptions {
  channels: number;
  /** default: x.length / channels (batch 1); batch is x.length / (channels * spatial) */
  spatial?: number;
  bias?: Float32Array | number[];
  layout?: Layout;
}

export interface NormKit {
  readonly device: GPUDevice;
  readonly workgroupSize: WorkgroupSize;
  readonly hasSubgroups: boolean;
  readonly hasF16: boolean;
  /** the subgroup size the probe kernel saw, or null */
  readonly subgroupSize: number | null;
  /** why the subgroup variants are off here, or null */
  readonly subgroupsOff: string | null;
  /** the kernels compiled so far, as "op/variant/dtype/activation" (pipelines are built on first use) */
  readonly compiledKernels: string[];

  /** the variant a call of these sizes runs by default */
  bestVariant(op: Op, sizes?: { n?: number; spatial?: number; layout?: Layout }): Variant;

  /** Records LayerNorm of each row of x into y. Rejects with an error naming the argument on bad input. */
  layerNorm(call: LayerNormCall): Promise<CallInfo>;
  /** LayerNorm of each row of n values; returns a new Float32Array. */
  layerNorm(x: Float32Array, n: number, options?: LayerNormOptions): Promise<Float32Array>;

  rmsNorm(call: RowNormCall): Promise<CallInfo>;
  rmsNorm(x: Float32Array, n: number, options?: ArrayOptions): Promise<Float32Array>;

  groupNorm(call: GroupNormCall): Promise<CallInfo>;
  /** GroupNorm of x [batch, channels, spatial] (or [batch, spatial, channels] with layout "nhwc") in `groups` groups. */
  groupNorm(x: Float32Array, groups: number, options: GroupNormOptions): Promise<Float32Array>;
}

/**
 * A NormKit on `device`, or on a new device with the features normkit uses ("subgroups",
 * "shader-f16") where the adapter has them. Runs a small probe kernel where subgroups are enabled.
 */
export function createNormKit(device?: GPUDevice, options?: { workgroupSize?: WorkgroupSize }): Promise<NormKit>;

/** A device with the features and limits normkit can use, from `adapter` or the default adapter. */
export function requestNormKitDevice(adapter?: GPUAdapter): Promise<GPUDevice>;

/** The WGSL of one kernel (forBrowser: with `enable subgroups;` where needed; default true). */
export function shaderSource(
  op: Op,
  variant: Variant,
  dtype?: DType,
  activation?: Activation | null,
  options?: { forBrowser?: boolean; workgroupSize?: WorkgroupSize },
): string;

/** float32 values to IEEE half bits (round to nearest even). */
export function toF16Bits(values: Float32Array | number[]): Uint16Array;
/** IEEE half bits to float32 values. */
export function fromF16Bits(bits: Uint16Array): Float32Array;
