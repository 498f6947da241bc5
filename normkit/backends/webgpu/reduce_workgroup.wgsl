// Workgroup reduction: a shared-memory tree (Harris), log2(WG) steps with a barrier each.
// Works on any adapter. combine() must be associative; Acc and combine come from the algorithm.

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32,
        @builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    kernel(row_of(wg, nwg), lid, 0u, 0u);  // no subgroups here
}

var<workgroup> tree: array<Acc, WG>;

fn reduce(v: Acc, lid: u32, sg_size: u32, sg_lane: u32) -> Acc {
    tree[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            tree[lid] = combine(tree[lid], tree[lid + s]);
        }
        workgroupBarrier();
    }
    let total = tree[0];
    workgroupBarrier();  // tree may be reused by a following reduce()
    return total;
}
