// Subgroup reduction: an xor butterfly inside each subgroup, one shared slot per subgroup, then
// every subgroup reads all slots and runs the butterfly again. One barrier instead of log2(WG).
//
// Robustness: a lane only reads lane ^ m with m < subgroup_size, so no shuffle reaches past the
// subgroup's end (lavapipe wraps such reads around; the spec leaves them undefined). combine() is
// symmetric bit for bit, so every lane of a butterfly ends with the same value, and every subgroup
// computes the same total. Works for any power-of-two subgroup size from 4 (WGSL's minimum) to WG.
// Slots are indexed lid / subgroup_size: the host checks once per device (subgroup_probe.wgsl) that
// the adapter builds subgroups from consecutive invocations, and turns the subgroup variants off if not.

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32,
        @builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(subgroup_size) sg_size: u32,
        @builtin(subgroup_invocation_id) sg_lane: u32) {
    kernel(row_of(wg, nwg), lid, sg_size, sg_lane);
}

var<workgroup> slots: array<Acc, WG / 4u>;

fn butterfly(v: Acc, sg_size: u32) -> Acc {
    var a = v;
    for (var m = sg_size >> 1u; m > 0u; m >>= 1u) {
        a = combine(a, subgroupShuffleXor(a, m));
    }
    return a;
}

fn reduce(v: Acc, lid: u32, sg_size: u32, sg_lane: u32) -> Acc {
    let mine = butterfly(v, sg_size);
    if sg_lane == 0u {
        slots[lid / sg_size] = mine;
    }
    workgroupBarrier();
    // lane l folds slots l, l + size, ... in a fixed order, so all subgroups agree
    var a = acc_zero();
    for (var j = sg_lane; j < WG / sg_size; j += sg_size) {
        a = combine(a, slots[j]);
    }
    let total = butterfly(a, sg_size);
    workgroupBarrier();  // slots may be reused by a following reduce()
    return total;
}
