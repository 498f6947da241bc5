// Run once per device: records each invocation's subgroup size and lane, so the host can check
// that subgroups are built from consecutive invocations (what reduce_subgroup.wgsl assumes).

@group(0) @binding(0) var<storage, read_write> seen: array<vec2<u32>, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32) {
    seen[lid] = vec2<u32>(sg_size, sg_lane);
}
