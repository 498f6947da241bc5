// Four values per load (the host checks that rows split into whole vec4s).
alias XV = vec4<T>;
alias FV = vec4<f32>;
const VEC: u32 = 4u;
fn hsum(v: FV) -> f32 { return v.x + v.y + v.z + v.w; }
fn first_of(v: FV) -> f32 { return v.x; }
