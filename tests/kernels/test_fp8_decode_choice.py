"""`benchmarks/fp8_bench.py::decode_choices`: the engine's FP8 decode kernels chosen from a `fp8_sweep.py` result
(`--decode-kernels-from`). Made-up rows in the sweep's row format; no kernel runs (this process never imports
triton)."""

from __future__ import annotations

from benchmarks.fp8_bench import MAX_SWEEP_ERR, decode_choices


def expert(tokens: int, kernel: str, swap_ab: bool, ms: float, block_n: int = 64, err: float = 0.01) -> dict:
    return {"experts": "next-16b", "tokens": tokens, "kernel": kernel, "block_m": 16 if tokens == 1 else 32,
            "block_n": block_n, "swap_ab": swap_ab, "num_warps": 4, "err": err, "ms": ms}


def dense(shape: str, m: int, kernel: str, ms: float, swap_ab: bool | None = True) -> dict:
    tile = None if swap_ab is None else {"block_m": 64, "block_n": 64, "swap_ab": swap_ab}
    return {"shape": shape, "M": m, "kernel": kernel, "tile": tile, "err": 0.003, "ms": ms}


def test_the_experts_decode_tile_is_the_fastest_summed_over_every_decode_size() -> None:
    rows = [expert(64, "w8a16", True, 0.20), expert(1, "w8a16", True, 0.09),
            expert(64, "w8a8", True, 0.12), expert(1, "w8a8", True, 0.10),
            expert(64, "w8a16", False, 0.21), expert(1, "w8a16", False, 0.08),
            expert(64, "w8a8", True, 0.05, block_n=128)]  # fastest at 64, but never measured at T = 1
    chosen = decode_choices(rows)["experts"]
    assert (chosen["kernel"], chosen["swap_ab"], chosen["block_n"], chosen["num_warps"]) == ("w8a8", True, 64, 4)
    assert chosen["tokens"] == [1, 64]
    assert set(chosen["ms_sum"]) == {"w8a16/64/True/4/3", "w8a8/64/True/4/3", "w8a16/64/False/4/3"}
    assert abs(chosen["ms_sum"]["w8a8/64/True/4/3"] - 0.22) < 1e-9


def test_a_sweep_cut_short_compares_the_experts_at_64_tokens() -> None:
    """The sweep's budget stopped it after one T = 1 row: every configuration is compared at T = 64 alone, not the
    one that happens to have both sizes."""
    rows = [expert(64, "w8a16", True, 0.20), expert(64, "w8a8", True, 0.12), expert(64, "w8a16", False, 0.21),
            expert(1, "w8a16", True, 0.09)]
    chosen = decode_choices(rows)["experts"]
    assert (chosen["kernel"], chosen["swap_ab"], chosen["tokens"]) == ("w8a8", True, [64])
    assert len(chosen["ms_sum"]) == 3


def test_a_row_with_a_large_error_or_an_error_message_is_never_chosen() -> None:
    rows = [expert(64, "w8a16", True, 0.20), expert(1, "w8a16", True, 0.09),
            expert(64, "w8a8", True, 0.01, err=MAX_SWEEP_ERR), expert(1, "w8a8", True, 0.01),
            expert(64, "w8a8", False, 0.01, err=float("nan")), expert(1, "w8a8", False, 0.01),
            {"experts": "next-16b", "tokens": 64, "kernel": "w8a16", "error": "CompilationError(...)"}]
    chosen = decode_choices(rows)["experts"]
    assert (chosen["kernel"], chosen["swap_ab"]) == ("w8a16", True)


def test_the_dense_kernel_sums_shapes_and_rows_and_skips_tiles_the_engine_does_not_run() -> None:
    rows = [dense("qkvz", 64, "bf16", 0.001), dense("qkvz", 1, "bf16", 0.001)]  # bf16 is the baseline, not a choice
    for shape, scale in (("qkvz", 1.0), ("big", 4.0)):
        for m in (1, 64):
            rows += [dense(shape, m, "w8a8", 0.030 * scale), dense(shape, m, "cublas-block", 0.025 * scale, None),
                     dense(shape, m, "w8a16", 0.001, swap_ab=False)]  # decode_config's tiles are swap-AB
    rows.append(dense("qkvz", 256, "w8a8", 0.0001))  # a prefill size
    chosen = decode_choices(rows)["dense"]
    assert chosen["kernel"] == "cublas-block" and set(chosen["ms_sum"]) == {"w8a8", "cublas-block"}
    assert abs(chosen["ms_sum"]["cublas-block"] - 2 * (0.025 + 0.1)) < 1e-9


def test_the_prefill_tile_and_parts_without_rows() -> None:
    rows = [{"experts": "next-16b", "tokens": 1024, "kernel": "w8a8", "block_m": bm, "block_n": 128,
             "swap_ab": False, "num_warps": warps, "err": 0.04, "ms": ms}
            for bm, warps, ms in ((64, 4, 1.2), (64, 8, 0.57), (128, 8, 3.3))]
    chosen = decode_choices(rows)
    assert set(chosen) == {"experts_prefill"} and set(chosen["experts_prefill"]) == {"small"}  # 256 rows per expert
    prefill = chosen["experts_prefill"]["small"]
    assert (prefill["block_m"], prefill["block_n"], prefill["num_warps"], prefill["tokens"]) == (64, 128, 8, [1024])
    assert prefill["ms_sum"] == {"64/128/128/4/3/0": 1.2, "64/128/128/8/3/0": 0.57, "128/128/128/8/3/0": 3.3}
    assert decode_choices([]) == {}


def test_the_experts_decode_tile_carries_its_pipeline_depth_and_bf16_rows_are_no_choice() -> None:
    """`fp8_sweep.py --quick` times the W8A8 swap-AB tile at several num_stages (and bf16's experts as a
    reference): the stages of the fastest summed tile are chosen; a bf16 row, however fast, is not."""
    rows = []
    for stages, at64, at1 in ((3, 0.132, 0.046), (4, 0.120, 0.045), (5, 0.118, 0.060)):
        rows += [expert(64, "w8a8", True, at64) | {"num_stages": stages},
                 expert(1, "w8a8", True, at1) | {"num_stages": stages}]
    rows += [{"experts": "next-16b", "tokens": tokens, "kernel": "bf16", "err": 0.004, "ms": 0.001}
             for tokens in (1, 64, 1024)]
    chosen = decode_choices(rows)
    experts = chosen["experts"]
    assert (experts["kernel"], experts["swap_ab"], experts["num_stages"]) == ("w8a8", True, 4)
    assert set(experts["ms_sum"]) == {"w8a8/64/True/4/3", "w8a8/64/True/4/4", "w8a8/64/True/4/5"}
    assert chosen["experts_bf16_ms"] == {1: 0.001, 64: 0.001, 1024: 0.001}
    assert "experts_prefill" not in chosen  # bf16 rows are never a prefill tile either


def prefill(tokens: int, block_m: int, warps: int, ms: float, err: float = 0.03, **tile: int) -> dict:
    return {"experts": "next-16b", "tokens": tokens, "kernel": "w8a8", "block_m": block_m, "block_n": 128,
            "swap_ab": False, "num_warps": warps, "num_stages": 3, "err": err, "ms": ms} | tile


def test_the_prefill_tile_is_the_fastest_summed_over_phase_a_sizes() -> None:
    """At 256 and 1,024 tokens (phase A's requests prefill 300-1,000): the tile with the least summed ms, not the
    fastest at 1,024 alone; a tile with a broken error is left out."""
    rows = [prefill(256, 64, 8, 0.30), prefill(1024, 64, 8, 0.57),
            prefill(256, 128, 8, 0.20), prefill(1024, 128, 8, 0.60),  # summed .80 against .87
            prefill(256, 64, 4, 0.01, err=1.0), prefill(1024, 64, 4, 0.01, err=1.0),
            expert(64, "w8a8", True, 0.05)]  # a decode row is no prefill tile
    chosen = decode_choices(rows)["experts_prefill"]["small"]
    assert (chosen["block_m"], chosen["block_n"], chosen["num_warps"]) == (128, 128, 8)
    assert chosen["tokens"] == [256, 1024] and set(chosen["ms_sum"]) == {"64/128/128/8/3/0", "128/128/128/8/3/0"}


def test_a_prefill_sweep_cut_short_compares_at_1024_tokens() -> None:
    rows = [prefill(1024, 64, 8, 0.57), prefill(1024, 128, 8, 0.60), prefill(256, 128, 8, 0.20)]
    chosen = decode_choices(rows)["experts_prefill"]["small"]
    assert (chosen["block_m"], chosen["tokens"]) == (64, [1024])


def test_the_prefill_tiles_are_chosen_per_bucket_of_rows_per_expert_and_set_in_the_kernel_module(
        tmp_path, monkeypatch) -> None:
    """`fp8_sweep.py --prefill` rows (with rows_per_expert, group_m, stages and the down GEMM's width): the
    small bucket (up to `PREFILL_SMALL_ROWS` rows per expert) and the large one each get their own fastest tile
    summed over their sizes, and `choose_decode_kernels` sets both in `fp8_tiles.PREFILL_TILES` (what
    `triton_fp8_moe` launches)."""
    import json

    from benchmarks.fp8_bench import choose_decode_kernels
    from hybridcache.kernels.gemm import fp8_tiles

    grouped = dict(group_m=8, num_stages=4, down_block_n=256)
    rows = []
    for tokens, plain_ms, grouped_ms in ((1024, 0.50, 0.60), (4096, 2.0, 1.5), (16384, 8.0, 6.0)):
        rows += [prefill(tokens, 64, 8, plain_ms, rows_per_expert=tokens // 4),
                 prefill(tokens, 128, 8, grouped_ms, rows_per_expert=tokens // 4, **grouped)]
    chosen = decode_choices(rows)["experts_prefill"]
    assert (chosen["small"]["block_m"], chosen["small"]["group_m"], chosen["small"]["tokens"]) == (64, 0, [1024])
    large = chosen["large"]
    assert (large["block_m"], large["group_m"], large["num_stages"], large["down_block_n"]) == (128, 8, 4, 256)
    assert large["tokens"] == [4096, 16384] and large["ms_sum"] == {"64/128/128/8/3/0": 10.0, "128/128/256/8/4/8": 7.5}
    sweep = tmp_path / "fp8_sweep.json"
    sweep.write_text(json.dumps({"rows": rows}))
    monkeypatch.setattr(fp8_tiles, "PREFILL_TILES", {"small": fp8_tiles.PrefillTile(block_m=16),
                                                      "large": fp8_tiles.PrefillTile(block_m=16)})
    choose_decode_kernels(str(sweep))
    assert fp8_tiles.PREFILL_TILES["small"] == fp8_tiles.PrefillTile(64, 128, 128, 8, 3, 0)
    assert fp8_tiles.PREFILL_TILES["large"] == fp8_tiles.PrefillTile(128, 128, 256, 8, 4, 8)


def shaped(n: int, k: int, m: int, kernel: str, ms: float) -> dict:
    return {"shape": f"next-16b {n}x{k}", "N": n, "K": k, "M": m, "kernel": kernel, "err": 0.003, "ms": ms,
            "tile": None if kernel == "cublas-block" else {"block_m": 64, "block_n": 64, "swap_ab": True}}


def test_rows_that_name_their_weight_shape_choose_the_dense_kernel_per_shape() -> None:
    """Per shape, Triton up to the most rows at which it won at every M measured; a shape where cuBLAS wins at
    the smallest M is left out (cuBLAS), even where Triton wins at a larger one; the bf16 rows and the routed
    experts' row-wise rows of `fp8_sweep.py --rowwise` are no candidates."""
    rows = []
    for n, k, triton_16, triton_64 in ((512, 4096, 0.005, 0.006), (4096, 4096, 0.010, 0.030),
                                       (12288, 4096, 0.030, 0.020)):
        rows += [shaped(n, k, 16, "w8a8", triton_16), shaped(n, k, 16, "cublas-block", 0.012),
                 shaped(n, k, 64, "w8a8", triton_64), shaped(n, k, 64, "cublas-block", 0.025),
                 shaped(n, k, 64, "bf16", 0.001)]
    rows += [{"experts": "next-16b", "tokens": 64, "kernel": "per-channel (engine's)", "err": 0.04, "ms": 0.01},
             {"experts": "next-16b", "tokens": 1, "kernel": "block (engine's)", "err": 0.04, "ms": 0.01}]
    chosen = decode_choices(rows)
    assert chosen["dense_shapes"] == {"512x4096": 64, "4096x4096": 16}
    assert "dense" not in chosen and "experts" not in chosen


def test_kernel_variants_set_the_library_choices_for_one_run_and_restore_them(monkeypatch) -> None:
    """`fp8_bench.kernel_variant`: fp8-rowexp re-quantises the experts, fp8-blockexp keeps them block-scaled with
    every dense decode GEMM on cuBLAS and the shared expert on its own (the kernels before session 41),
    fp8-unfused runs the shared expert on its own without split-K, fp8-fastacc the row-wise GEMMs with fast
    accumulation, fp8-nosplitk no split-K, fp8-s42 session 42's MoE decode launches; other runs keep the
    library's (or a sweep's) choices."""
    from benchmarks.fp8_bench import kernel_variant
    from hybridcache.kernels.gemm import fp8_decode_choice, fp8_tiles, triton_block_fp8

    def choices():
        return (fp8_tiles.EXPERTS_PER_CHANNEL, dict(triton_block_fp8.DECODE_TRITON_SHAPES), fp8_tiles.SHARED_AS_EXPERT,
                fp8_tiles.ROWWISE_FAST_ACCUM, (dict(triton_block_fp8.DECODE_SPLIT_K), fp8_decode_choice.MEASURE))

    monkeypatch.setattr(triton_block_fp8, "DECODE_SPLIT_K", {(64, 256): triton_block_fp8.SplitK()})  # as a sweep sets
    library = choices()
    no_split = ({}, False)
    with kernel_variant("fp8-blockexp"):
        assert choices()[:3] == (False, {}, False) and choices()[4] == no_split
    with kernel_variant("fp8-rowexp"):
        assert fp8_tiles.EXPERTS_PER_CHANNEL is True
        assert library[1:] == choices()[1:]
    with kernel_variant("fp8-unfused"):
        assert choices() == (library[0], library[1], False, library[3], no_split)
    with kernel_variant("fp8-fastacc"):
        assert choices() == (*library[:3], True, library[4])
    with kernel_variant("fp8-nosplitk"):
        assert choices() == (*library[:4], no_split)
    from hybridcache.kernels.gemm import triton_fp8_moe

    token_scales = triton_fp8_moe.DECODE_TOKEN_SCALES
    for variant in ("fp8-groupscale", "fp8-unfused", "fp8-blockexp"):
        with kernel_variant(variant):
            assert triton_fp8_moe.DECODE_TOKEN_SCALES is False
    assert token_scales is triton_fp8_moe.DECODE_TOKEN_SCALES
    monkeypatch.setattr(fp8_tiles, "DECODE_TILES", {(2048, 4096, 32): fp8_tiles.DecodeTile(64)})  # as measured
    def moe_decode():
        return triton_fp8_moe.SHARED_SORT, triton_fp8_moe.DECODE_PROLOGUE, dict(fp8_tiles.DECODE_TILES)

    s43 = moe_decode()
    with kernel_variant("fp8-s42"):  # session 42's MoE decode launches
        assert moe_decode() == (False, False, {}) and library == choices()
    assert moe_decode() == s43 and all(s43[:2]) and s43[2]
    with kernel_variant("fp8"):
        assert library == choices()
    assert library == choices()


def splitk_row(n: int, m: int, ms: float, config: tuple | None = None, err: float = 0.003) -> dict:
    row = {"shape": f"next-16b {n}", "N": n, "K": 4096, "M": m, "splitk_sweep": True, "err": err, "ms": ms,
           "kernel": "library" if config is None else "w8a8-splitk"}
    if config is not None:
        row["tile"] = dict(zip(("block_n", "split_k", "num_warps", "num_stages"), config, strict=True))
    return row


def test_the_split_k_launch_is_chosen_per_shape_where_it_beats_the_library(tmp_path, monkeypatch) -> None:
    """`fp8_sweep.py --splitk` rows: per shape the split-K launch with the least ms summed over the row counts,
    kept where it beats the library's kernel's sum (and none with a large error); shapes where the library wins
    are left out; the rows choose no dense kernel otherwise; `choose_decode_kernels` sets `DECODE_SPLIT_K`; a
    sweep at 64 rows only chooses from 33 rows on."""
    import json

    from benchmarks.fp8_bench import choose_decode_kernels
    from hybridcache.kernels.gemm import triton_block_fp8

    rows = [splitk_row(4096, 64, 0.017), splitk_row(4096, 16, 0.015),
            splitk_row(4096, 64, 0.008, (64, 4, 4, 4)), splitk_row(4096, 16, 0.009, (64, 4, 4, 4)),
            splitk_row(4096, 64, 0.007, (128, 2, 8, 4)), splitk_row(4096, 16, 0.011, (128, 2, 8, 4)),
            splitk_row(4096, 64, 0.001, (64, 8, 4, 4), err=0.5), splitk_row(4096, 16, 0.001, (64, 8, 4, 4)),
            splitk_row(12288, 64, 0.019), splitk_row(12288, 16, 0.018),
            splitk_row(12288, 64, 0.025, (64, 2, 4, 4)), splitk_row(12288, 16, 0.020, (64, 2, 4, 4)),
            {**splitk_row(12288, 64, 0.0, None), "kernel": "bf16", "ms": 0.001}]
    chosen = decode_choices(rows)
    assert list(chosen["dense_splitk"]) == ["4096x4096"]
    assert chosen["dense_splitk"]["4096x4096"] | {"library_ms_sum": 0} == {
        "block_n": 64, "split_k": 4, "num_warps": 4, "num_stages": 4, "min_rows": 1, "rows": [16, 64],
        "ms_sum": 0.017, "library_ms_sum": 0}
    assert "dense" not in chosen and "dense_shapes" not in chosen
    sweep = tmp_path / "fp8_sweep.json"
    sweep.write_text(json.dumps({"rows": rows}))
    monkeypatch.setattr(triton_block_fp8, "DECODE_SPLIT_K", {})
    monkeypatch.setattr(triton_block_fp8, "DECODE_TRITON_SHAPES", dict(triton_block_fp8.DECODE_TRITON_SHAPES))
    choose_decode_kernels(str(sweep))
    want = {(4096, 4096): triton_block_fp8.SplitK(64, 4, 4, 4)}
    assert want == triton_block_fp8.DECODE_SPLIT_K
    only_64 = [r for r in rows if r["M"] == 64]  # a sweep at 64 rows: from 33 (its BLOCK_M's first row count)
    assert decode_choices(only_64)["dense_splitk"]["4096x4096"]["min_rows"] == 33
