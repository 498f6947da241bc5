// One value per load (any row length).
alias XV = T;
alias FV = f32;
const VEC: u32 = 1u;
fn hsum(v: FV) -> f32 { return v; }
fn first_of(v: FV) -> f32 { return v; }
