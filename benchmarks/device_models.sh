#!/usr/bin/env bash
# The model benchmark on the device (issue 14): `normkit bench --models`, one group of cases per call
# of at most 10 minutes (torch.compile of a 4-layer LLM's train step takes about a minute, so the
# compiled cases are split by model). Each call writes $OUT/GROUP/: models.csv, models.md,
# models.png, log.txt (with the exact commands, GPU and versions at its top). Cases not started
# within BUDGET seconds (default 420) are listed as not run; run the group again for them.
#
#   bash benchmarks/device_models.sh GROUP [more `normkit bench` options, e.g. --steps 10]
#
#   eager    every model, eager (train, infer, decode; unpatched, normkit, Liger)     ~5 min
#   llama | qwen3 | gemma    that HF model under torch.compile (3 modes x 3 variants)  ~6-8 min each
#   vision   ViT-B/16 and ConvNeXt-T under torch.compile                                 ~6 min
#   conv     ResNet-50-GN, seed 004's 1D U-Net and the 4 ResnetBlock2D under torch.compile
#   unet2d   diffusers' UNet2DModel under torch.compile
#   smoke    `normkit bench --quick` (timed), then every model eager with fewer steps, then
#            the compiled 1D U-Net's inference and Llama's decoding (unpatched, normkit)      ~6 min
#
# Liger and diffusers (pure Python) are installed from liger_kernel-*.whl / diffusers-*.whl found in
# .peersA/, .peersB/ or .whl/ (carry the folder that holds them; /work/shared/device/stage_peer_wheels.sh
# stages them, or `pip download --no-deps liger-kernel==0.8.5 diffusers==0.42.1 -d .whl`). Without
# them the suite runs and says Liger is skipped and unet2d uses its ResnetBlock2D stand-in.
# Merge the groups afterwards: normkit bench --models --report RESULTS/eager RESULTS/llama ... --out RESULTS
set -uo pipefail
cd "$(dirname "$0")/.."
group=${1:?usage: device_models.sh eager|llama|qwen3|gemma|vision|conv|unet2d|smoke [options]}
shift
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:?set OUT to the output folder}/$group
work=/tmp/normkit-models/$group  # parts of a group, merged into $out at the end
mkdir -p "$out" "$work"
log=$out/log.txt
wheels=$(ls .peersA/*.whl .peersB/*.whl .whl/*.whl 2>/dev/null | grep -E '/(liger_kernel|diffusers)-' || true)
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels
fi
{
    echo "# bash benchmarks/device_models.sh $group $*   ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "
import importlib.metadata as m
def v(d):
    try: return m.version(d)
    except m.PackageNotFoundError: return 'not installed'
print(' '.join(f'{d} {v(d)}' for d in ('torch', 'triton', 'transformers', 'timm', 'diffusers', 'liger-kernel')))"
} > "$log" 2>&1
cat "$log"

bench() {  # bench SECONDS ARGS...: one `normkit bench` run under a hard time limit, logged
    local limit=$1; shift
    echo "\$ python3 -m normkit bench $*" | tee -a "$log"
    timeout "$limit" python3 -m normkit bench "$@" 2>&1 | grep -v '^USDT:' | tee -a "$log" | tail -n 25
}

models() {  # models PART BUDGET ARGS...: a --models run into $work/PART
    local part=$1 budget=$2; shift 2
    bench $((budget + 100)) --models "$@" --out "$work/$part" --time-budget "$budget"
}

budget=${BUDGET:-420}  # no new model/mode/exec after this; the one running may take a minute more
case $group in
    eager) models all "$budget" --exec eager "$@" ;;
    llama|qwen3|gemma) models all "$budget" "$group" --exec compile "$@" ;;
    vision) models all "$budget" vit,convnext --exec compile "$@" ;;
    conv) models all "$budget" resnet50-gn,unet1d,resnet-blocks --exec compile "$@" ;;
    unet2d) models all "$budget" unet2d --exec compile "$@" ;;
    smoke)
        start=$(date +%s)
        bench 150 --quick --out "$work/quick" --no-plots
        echo "normkit bench --quick took $(( $(date +%s) - start )) s" | tee -a "$log"
        cp "$work/quick/summary.md" "$out/quick_summary.md"
        cp "$work/quick/host.csv" "$out/quick_host.csv" 2>/dev/null
        models eager "${SMOKE_EAGER:-110}" unet1d,llama,qwen3,gemma,vit,convnext,resnet50-gn,unet2d \
            --quick --exec eager "$@"
        models compile "${SMOKE_COMPILE:-70}" unet1d,llama --modes decode,infer --quick --exec compile \
            --variants unpatched,normkit "$@"
        ;;
    *) echo "unknown group $group" >&2; exit 2 ;;
esac
parts=$(ls -d "$work"/*/models.csv 2>/dev/null | xargs -r -n1 dirname)
if [ -n "$parts" ]; then
    python3 -m normkit bench --models --report $parts --out "$out" 2>&1 | grep -v '^USDT:' | tail -n 2
fi
ls -la "$out"
