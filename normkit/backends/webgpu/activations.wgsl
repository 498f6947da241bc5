// The activation after the affine (ACT, set by the header), elementwise in f32, as
// normkit.reference.activation. Written to stay finite for any finite input: exp() arguments are
// clamped where the clamped value no longer changes the f32 result, and tanh is built from
// exp(-2|z|) (some drivers' tanh returns NaN for large |z|).

const ACT_NONE: u32 = 0u;
const ACT_SILU: u32 = 1u;
const ACT_MISH: u32 = 2u;
const ACT_GELU: u32 = 3u;
const ACT_GELU_TANH: u32 = 4u;
const ACT_RELU: u32 = 5u;

fn tanh_safe(z: FV) -> FV {
    let e = exp(-2.0 * abs(z));
    return sign(z) * (1.0 - e) / (1.0 + e);
}

// erf by Abramowitz and Stegun 7.1.26 (absolute error <= 1.5e-7); WGSL has no erf
fn erf_approx(z: FV) -> FV {
    let a = abs(z);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return sign(z) * (1.0 - p * exp(-a * a));
}

fn activate(v: FV) -> FV {
    if ACT == ACT_SILU {
        return v / (1.0 + exp(min(-v, FV(80.0))));  // x * sigmoid(x)
    }
    if ACT == ACT_MISH {
        // x * tanh(softplus(x)) = x * p / (p + 2) with p = e^x (e^x + 2); exact to f32 for x >= 20
        let e = exp(min(v, FV(20.0)));
        let p = e * (e + 2.0);
        return v * p / (p + 2.0);
    }
    if ACT == ACT_GELU {
        return 0.5 * v * (1.0 + erf_approx(v * 0.70710678118654752));
    }
    if ACT == ACT_GELU_TANH {
        return 0.5 * v * (1.0 + tanh_safe(0.79788456080286536 * (v + 0.044715 * v * v * v)));
    }
    if ACT == ACT_RELU {
        return max(v, FV(0.0));
    }
    return v;
}
