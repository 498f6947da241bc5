"""The fast launcher's cache key must separate every case Triton compiles separately; a key that
merges two of them would reuse a kernel compiled for other assumptions (wrong results or a fault)."""
import itertools

import torch

from normkit.backends.triton.launch import spec_key


def test_integer_specializations_are_distinct():
    # Triton specializes an int on: == 1 (a constant), divisible by 16, and needing 64 bits
    values = [1, 2, 16, 17, 32, 2**31 - 1, 2**31, 2**31 + 16, 0]
    keys = {v: spec_key((v,)) for v in values}
    classes = {v: ("one" if v == 1 else (v % 16 == 0, v >= 2**31)) for v in values}
    for a, b in itertools.combinations(values, 2):
        assert (keys[a] == keys[b]) == (classes[a] == classes[b]), (a, b)


def test_tensor_dtype_and_alignment_matter():
    base = torch.empty(64, dtype=torch.float32)
    assert spec_key((base,)) == spec_key((torch.empty(8, dtype=torch.float32),))
    assert spec_key((base,)) != spec_key((base[1:],))  # 4-byte offset: no longer 16-aligned
    assert spec_key((base,)) != spec_key((base.to(torch.bfloat16),))


def test_other_arguments_key_by_kind():
    assert spec_key((None, 1e-5)) == spec_key((None, 1e-6))
    assert spec_key((None,)) != spec_key((1e-5,))


def test_overrides_win_over_the_tuned_table():
    # the tuner tries candidates through OVERRIDES; a committed table must not mask them
    from normkit.backends.triton import configs

    tuned = configs.tuned_table("sm_90")
    key = next(iter(tuned))
    direction, elem, n = key
    candidate = (1, 1, 1, 0) if tuned[key] != (1, 1, 1, 0) else (1, 1, 2, 0)
    configs.OVERRIDES[key] = candidate
    configs.row_config.cache_clear()
    try:
        cfg = configs.row_config(direction, n, elem, "sm_90")
        assert (cfg.block_m, cfg.split, cfg.num_warps, cfg.programs_per_sm) == candidate
    finally:
        configs.OVERRIDES.pop(key)
        configs.row_config.cache_clear()


def test_a_rows_reg_cap_is_the_maxnreg_its_programs_per_sm_leave():
    """A row's 7th value compiles it with ptxas's maxnreg at the registers that programs_per_sm
    programs of num_warps leave per thread (65536 per SM, a multiple of 8), else no cap."""
    from normkit.backends.triton import configs

    assert (configs.reg_cap_for(8, 2), configs.reg_cap_for(16, 1), configs.reg_cap_for(4, 3)) == (128, 128, 168)
    assert configs.reg_cap_for(8, 1) == 0  # 256 per thread: nothing to cap
    key = ("bwd", 2, 65536)
    try:
        for row, cap in (((1, 16, 8, 2, 1, True, True), 128), ((1, 16, 8, 2, 1, True), 0),
                         ((1, 16, 8, 2, 1, True, False), 0)):
            configs.OVERRIDES[key] = row
            configs.row_config.cache_clear()
            cfg = configs.row_config("bwd", 65536, 2, "sm_90")
            assert cfg.reg_cap == cap and cfg.options == (8, 1) + ((cap,) if cap else ())
    finally:
        configs.OVERRIDES.pop(key, None)
        configs.row_config.cache_clear()


def test_tuned_rows_per_op_and_prefetch():
    """A measured width may hold a row per op; a row's 6th value turns the backward's prefetch on."""
    from normkit.backends.triton import configs

    configs.row_config.cache_clear()
    rms = configs.row_config("bwd", 65536, 2, "sm_90", False, "rms")
    ln = configs.row_config("bwd", 65536, 2, "sm_90", False, "ln")
    assert (rms.split, rms.num_warps, rms.reg_cap, ln.split, ln.num_warps, ln.reg_cap) == (8, 16, 0, 16, 8, 128)
    assert configs.row_config("bwd", 4096, 2, "sm_90").prefetch
    assert not configs.row_config("bwd", 4096, 4, "sm_90").prefetch  # fp32: measured slower for LayerNorm
    assert configs.row_config("bwd", 4096, 2, "sm_90").num_stages == 1
    configs.row_config.cache_clear()


def test_col_sum_block_gives_every_sm_a_program():
    from normkit.backends.triton import configs

    for rows, n, sms in ((528, 1024, 132), (132, 8192, 132), (4, 100, 4), (1, 1, 132), (264, 262144, 132)):
        block_p, block_n, _ = configs.col_sum_block(rows, n, sms)
        lo, hi = configs.COL_SUM_BLOCK_N
        assert lo <= block_n <= hi and block_p * block_n <= configs.COL_SUM_TILE
        assert -(-n // block_n) >= sms or block_n == lo  # as many programs as SMs, or the narrowest block
        assert block_p <= max(1, 1 << (rows - 1).bit_length())  # no step wider than the partial rows



def test_the_statistics_prefetch_is_per_gpu_data():
    """The backward's next-tile statistics prefetch: on wherever measured faster (an H200, both ops), off for
    RMSNorm on an H100 (run S17-11), and off everywhere with the A/B switch."""
    from normkit.backends.triton import configs
    assert configs.prefetch_stats("NVIDIA H200", "rms") and configs.prefetch_stats("NVIDIA H200", "ln")
    assert not configs.prefetch_stats("NVIDIA H100 80GB HBM3", "rms")
    assert configs.prefetch_stats("NVIDIA H100 80GB HBM3", "ln")
    assert configs.prefetch_stats("", "rms")  # the interpreter
    saved = configs.PREFETCH_STATS
    try:
        configs.PREFETCH_STATS = False
        assert not configs.prefetch_stats("NVIDIA H200", "ln")
    finally:
        configs.PREFETCH_STATS = saved


def test_a_tables_looped_rows_walk_the_width_in_chunks(monkeypatch, tmp_path):
    """A measured table's "looped" section sends a width (per op where given) to the looped kernels with its
    chunk, warps and L2 hints, and a register cap where the row names programs per SM; OVERRIDES (the sweeps'
    candidates) still win over it."""
    import json

    from normkit.backends.triton import configs

    raw = {"configs": {"fwd": {"2": {"8192": [1, 1, 8, 0]}}},
           "looped": {"fwd": {"2": {"16384": [2048, 16, True], "32768": {"rms": [4096, 32, False]},
                                     "65536": [4096, 16, True, 3]}}}}
    (tmp_path / "sm_99.json").write_text(json.dumps(raw))
    monkeypatch.setattr(configs, "_TUNED_DIR", str(tmp_path))
    configs.tuned_table.cache_clear()
    configs.row_config.cache_clear()
    try:
        a = configs.row_config("fwd", 16384, 2, "sm_99", False, "ln")
        b = configs.row_config("fwd", 32768, 2, "sm_99", False, "rms")
        c = configs.row_config("fwd", 32768, 2, "sm_99", False, "ln")
        assert (a.looped, a.block_n, a.num_warps, a.evict, a.static_n) == (True, 2048, 16, True, True)
        assert (b.looped, b.block_n, b.num_warps, b.evict) == (True, 4096, 32, False)
        assert not c.looped  # RMSNorm's row only: LayerNorm keeps the default tile
        assert a.reg_cap == b.reg_cap == 0 and len(a.options) == 2
        d = configs.row_config("fwd", 65536, 2, "sm_99", False, "ln")  # 3 programs of 16 warps: 65536 // 1536 -> 40
        assert (d.looped, d.block_n, d.num_warps, d.reg_cap, d.options) == (True, 4096, 16, 40, (16, 1, 40))
        configs.OVERRIDES[("fwd", 2, 16384)] = (1, 1, 8, 0)
        configs.row_config.cache_clear()
        assert not configs.row_config("fwd", 16384, 2, "sm_99", False, "ln").looped
    finally:
        configs.OVERRIDES.pop(("fwd", 2, 16384), None)
        configs.tuned_table.cache_clear()
        configs.row_config.cache_clear()


def test_the_sm90_table_loops_rmsnorms_8k_32k_and_64k_forward():
    """Run S18-5 (H200): RMSNorm's 16-bit forward at 8K and 32K on the looped kernel compiled for its width, with
    L2 hints (0.94 / 0.92 of copy against the tiles' 0.91 / 0.85); runs S20-1 / S20-2: at 64K too, 16K chunks on 32
    warps (0.85-0.86 against the CUDA cluster kernel's 0.78-0.80); LayerNorm there and RMSNorm at 16K keep their
    tiles (the looped LayerNorm lost at every width measured), RMSNorm at 128K its cluster kernel."""
    from normkit.backends.triton import configs

    configs.row_config.cache_clear()
    assert configs.row_config("fwd", 131072, 2, "sm_90", False, "rms").cuda
    for n, chunk, warps in ((8192, 4096, 16), (5000, 4096, 16), (32768, 8192, 32), (65536, 16384, 32)):
        cfg = configs.row_config("fwd", n, 2, "sm_90", False, "rms")
        assert (cfg.looped, cfg.block_n, cfg.num_warps, cfg.evict, cfg.static_n, cfg.cuda) == (
            True, chunk, warps, True, True, False)
    for n, op in ((8192, "ln"), (16384, "rms"), (16384, "ln"), (8192, "rms")):
        cfg = configs.row_config("fwd", n, 4 if (n, op) == (8192, "rms") else 2, "sm_90", False, op)
        assert not cfg.looped, (n, op)
