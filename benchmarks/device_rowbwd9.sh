# Session 9, helper rowbwd9 (issue 24): its one device call, after `source benchmarks/device_env.sh env.txt`.
# The split-row backward candidates (benchmarks/bwd_sweep.py WIDE_ROWS) checked at 16K-256K and timed
# against the library's table (clusters included), bf16; then the RMSNorm + float8 forward
# (benchmarks/fp8_sweep.py) against torch.compile. Each step under its own timeout, tarred as it ends
# (a run cut later keeps what came before).
R=$OUT/rowbwd9
mkdir -p $R
timeout ${BWD_S:-150} python3 benchmarks/bwd_sweep.py --out $R/bwd --parts check,time --dtypes bf16 \
    --widths 16384,32768,65536,131072,262144 --variants new,m2c2kw8,m2c4kw16,m4c2kw16,m2c1kw4 \
    --check-variants "" --check-wide m2c2kw8,m2c4kw16,m4c2kw16,m2c1kw4 > $R/bwd.log 2>&1
echo "bwd rc $?" >> $R/bwd.log
tail -14 $R/bwd.log
tar -C $R -czf $OUT/rowbwd9-bwd.tgz bwd bwd.log && rm -rf $R/bwd $R/bwd.log
timeout ${FP8_S:-110} python3 benchmarks/fp8_sweep.py --out $R/fp8 --widths 2048,4096,5120,8192 \
    --variants enc,hw,compile,hw-amax,compile-amax,bf16 > $R/fp8.log 2>&1
echo "fp8 rc $?" >> $R/fp8.log
tail -8 $R/fp8.log
tar -C $R -czf $OUT/rowbwd9-fp8.tgz fp8 fp8.log && rm -rf $R
