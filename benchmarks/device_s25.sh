#!/usr/bin/env bash
# Session 25 (issues 22, 24), one device call each (carry .whl), files in one archive in $OUT:
#   bash benchmarks/device_s25.sh ab      the wide forward's cluster kernels without the per-row float divisions
#                                         (LayerNorm: 12 a row per thread, RMSNorm 1), this tree against the tree in
#                                         ab_old/ (`git archive 6790857 normkit`, untracked, made by hand before the call)
#                                         in turn twice: `normkit bench` LN / RMS forward, bf16 and fp32, 32K-256K, the
#                                         CUDA backend forced; then the CUDA backend's cluster tests and test_row_norm
#   bash benchmarks/device_s25.sh gnroute NCHW GroupNorm's routes re-measured after S24-6 (DivBy): Triton's kernels (default)
#                                         against the cluster kernels at every group size (cluster, cluster-128), bf16
#                                         both directions, then fp32 where the cluster is not routed today
#   bash benchmarks/device_s25.sh tests   the GPU test files (the CUDA backend's apart); the host table; S25-2's GroupNorm
#                                         routes against session 24's (once; again after the models)
#   bash benchmarks/device_s25.sh hostops torch.profiler's host events of LN / RMS fwd+bwd, normkit and torch
#                                         (host_ops_profile.py); the Whisper encoder and SD-1.5 batch 2 again
#   bash benchmarks/device_s25.sh models  the CUDA backend's row cluster tests; issue 22's eager model cases; compiled
#                                         Llama decode
set -uo pipefail
source "$(dirname "$0")/device_env.sh" env.txt
# gn_nchw NAME SECONDS BUDGET VARIANTS DTYPE SHAPES: gn_sweep.py on NCHW groups, both directions, a copy of the same
# bytes as the peer, into $OUT/NAME (and NAME.log); its exit status and table lines
gn_nchw() {
    timeout "$2" python3 benchmarks/gn_sweep.py --out "$OUT/$1" --acts - --peers copy --variants "$4" --dtypes "$5" \
        --layouts nchw --dirs fwd,bwd --budget "$3" --shapes "$6" > "$OUT/$1.log" 2>&1
    echo "$1 rc $?"; grep -E "^(bf16|fp32|copy|budget)|FAIL|rror" "$OUT/$1.log" | cut -c1-300
}
# gn_route_ab REP: S25-2's new GroupNorm routes (default) against session 24's (s24-routes) where they differ
gn_route_ab() {
    gn_nchw "gnroute-ab-$1" 70 55 default,s24-routes bf16 32x256x56x56,8x640x32x32,8x320x64x64,4x128x128x128,8x1280x16x16
}
case "${1:-ab}" in
ab)
    [ -d ab_old/normkit ] || { echo "ab_old/normkit missing"; exit 2; }
    for rep in 1 2; do
        for side in new old; do
            pp="$PWD:/tmp/site"; [ "$side" = old ] && pp="$PWD/ab_old:/tmp/site"
            echo "== $side rep $rep"
            PYTHONPATH="$pp" NORMKIT_HOST=0 bench 95 --ops ln,rms --dtypes bf16,fp32 --dirs fwd \
                --widths 32768,65536,131072,262144 --normkit cuda --peers none --no-host --out "$OUT/ab-$side-$rep"
            grep -v "^#" "$OUT/ab-$side-$rep/results.csv" | cut -d, -f2,4,6,8,13,16,18,21 | grep -v "^op"
        done
    done
    gpu_tests 170 cluster.log -n 14 tests/test_cuda_backend.py tests/test_row_norm.py -k "cluster or row_norm"
    ;;
gnroute)
    gn_nchw gnroute-bf16 330 300 default,cluster,cluster-128 bf16 \
        8x320x64x64,16x640x32x32,32x256x56x56,8x640x32x32,4x128x128x128,8x1280x16x16,1x320x64x64
    gn_nchw gnroute-fp32 150 130 default,cluster,cluster-128 fp32 4x128x128x128,8x1280x16x16,2x512x128x128
    ;;
tests)
    gpu_tests 330 tests.log -n 14 ${GPU_TEST_FILES/tests\/test_cuda_backend.py/} tests/test_row_norm.py \
        tests/test_fusion_autograd.py
    bench 80 --host-only --host-cases all --ops ln,rms,gn,rms+add+pre,ln+add+pre --peers torch --out "$OUT/host"
    grep -E "^\| (ln|rms) \| bf16 \| 4x4096 \| (normkit|torch) \| fwd \|" "$OUT/host/summary.md"
    gn_route_ab 1
    ;;
models)
    final_models
    gn_route_ab 2
    ;;
hostops)  # where the plain LayerNorm's fwd+bwd host time goes (S25-3: 1.03x torch's); issue 22's eager cases again
    PYTHONPATH="$PYTHONPATH:$PWD/benchmarks" timeout 120 python3 benchmarks/host_ops_profile.py 2>&1 | grep -v -i warn \
        | tee "$OUT/hostops.txt"
    mkdir -p /tmp/keep && cp -r "$OUT/." /tmp/keep/
    bash benchmarks/device_s19.sh eager2 > /tmp/s19-eager2.log 2>&1; tail -12 /tmp/s19-eager2.log
    cp -r /tmp/keep/. "$OUT/"
    ;;
esac
tar czf "/tmp/s25-${1:-ab}.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/s25-${1:-ab}.tgz" "$OUT/"
