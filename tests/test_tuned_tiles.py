"""The tuned tile table of the transposed W4A16 kernel: which row counts a swept tile serves, how the launcher
turns it into a config, and how ``bench/kernels.py`` makes the table from a sweep (CPU only; the tiles
themselves run in tests/test_kernels.py on the GPU and compile for Hopper in tests/test_kernel_compile.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.triton.tuned import load_table, tuned_tile
from kernels.triton.w4a16_mma import KERNEL_FLAGS, mma_config

ROOT = Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"


def test_the_shipped_table_holds_whole_tiles_for_swept_row_counts():
    table = load_table("w4a16_mma")
    assert H200 in table
    for shapes in table.values():
        for shape, by_rows in shapes.items():
            k, n = (int(v) for v in shape.split("x"))
            assert k % 128 == 0 and n > 0
            for rows, tile in by_rows.items():
                assert int(rows) in (16, 32, 64, 128, 256)
                assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(tile)
                assert set(tile) <= {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "split", *KERNEL_FLAGS}
                assert tile["BLOCK_M"] <= int(rows) and tile["BLOCK_N"] in (64, 128, 256)


def buckets_of(k: int, n: int) -> list[int]:
    return sorted(int(rows) for rows in load_table("w4a16_mma")[H200][f"{k}x{n}"])


def test_a_swept_tile_serves_the_row_counts_of_its_bucket_only():
    k, n = 4096, 12288  # the 7B qkv: swept tiles at 64, 128 and 256 rows
    assert buckets_of(k, n) == [64, 128, 256]
    by_rows = load_table("w4a16_mma")[H200]["4096x12288"]
    for m, rows in [(33, "64"), (64, "64"), (65, "128"), (100, "128"), (128, "128"), (129, "256"), (256, "256")]:
        assert tuned_tile("w4a16_mma", H200, k, n, m) == by_rows[rows], m
    for m in (1, 16, 32, 257, 4096):  # below the smallest bucket, above the largest: the rule decides
        assert tuned_tile("w4a16_mma", H200, k, n, m) is None, m


def test_row_counts_between_tabled_buckets_get_the_rule():
    # on the H100 the sweep's best beat the rule for the 7B gate/up at 16, 128 and 256 rows only: 17..64 rows
    # keep the rule's tile (the 128-row tile served them 1.4x slower before, session 22)
    h100 = "NVIDIA H100 80GB HBM3"
    k, n = 4096, 22016
    assert sorted(int(rows) for rows in load_table("w4a16_mma")[h100][f"{k}x{n}"]) == [16, 128, 256]
    assert tuned_tile("w4a16_mma", h100, k, n, 16) is not None
    for m in (17, 32, 33, 64):
        assert tuned_tile("w4a16_mma", h100, k, n, m) is None, m
    assert tuned_tile("w4a16_mma", h100, k, n, 65) == load_table("w4a16_mma")[h100][f"{k}x{n}"]["128"]


def test_other_cards_shapes_and_kernels_get_the_rule():
    assert tuned_tile("w4a16_mma", "NVIDIA GeForce RTX 4090", 4096, 12288, 128) is None
    assert tuned_tile("w4a16_mma", H200, 4096, 12289, 128) is None
    assert tuned_tile("w4a16_mma", "", 4096, 12288, 128) is None  # CPU
    assert tuned_tile("no_such_kernel", H200, 4096, 12288, 128) is None


def test_a_tile_becomes_a_config_the_way_the_rule_does():
    tile = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    config = mma_config(100, 4096, 4096, 132, tile)  # BLOCK_M is a cap: 100 rows in two 64-row tiles
    assert config == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "split": 2}  # 128 tiles
    assert mma_config(40, 4096, 4096, 132, tile)["BLOCK_M"] == 64
    wide = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
    assert mma_config(20, 4096, 4096, 132, wide)["BLOCK_M"] == 32  # never wider than the rows need
    assert mma_config(20, 4096, 4096, 132, wide)["split"] == 5  # 32 tiles: 132 SMs in 5 splits (K allows 8)
    # without a tile: the rule (128 rows: 64 columns while one wave holds the tiles, 128 with 8 warps beyond)
    assert mma_config(128, 4096, 4096, 132) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                                "split": 3}
    assert mma_config(128, 28672, 4096, 132)["BLOCK_N"] == 128
    # a tile's switches pass through; a warp-specialized loop keeps one split (Triton splits no other)
    switched = mma_config(64, 4096, 4096, 132, {**tile, "X_TMA": True, "WARP_SPECIALIZE": True})
    assert switched["X_TMA"] and switched["WARP_SPECIALIZE"] and switched["split"] == 1
    assert "X_TMA" not in mma_config(64, 4096, 4096, 132, {**tile, "X_TMA": False})
    # a measured split stands, within the K steps a split must keep (4 of 128 rows: 8 at K = 4096)
    assert mma_config(32, 6144, 4096, 132, {**tile, "split": 5})["split"] == 5
    assert mma_config(32, 6144, 4096, 132, {**tile, "split": 12})["split"] == 8
    assert mma_config(32, 6144, 4096, 132, tile)["split"] == 2  # the rule: 96 tiles fill 132 SMs in 2 splits


def sweep_row(label: str, m: int, config: dict, us: float, rel_error: float = 3e-4) -> dict:
    return {"shape": label, "m": m, "config": config, "us": us, "vs_fp16": 1.0, "fp16_us": us, "shipped_us": 50.0,
            "rel_error": rel_error}


def test_the_table_keeps_a_swept_tile_only_where_it_beat_the_rule_by_more_than_noise(tmp_path):
    """bench/kernels.py --tuned-from: the rule's own row is the baseline; 3% or less is noise; a tile whose
    products were wrong never enters."""
    rule_128 = mma_config(128, 4096, 4096, 132)  # 8B o: 64 tiles, split 3
    narrow = mma_config(128, 4096, 4096, 132, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3})
    rule_64 = mma_config(64, 4096, 4096, 132)
    staged = mma_config(64, 4096, 4096, 132, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2})
    wrong = mma_config(64, 4096, 4096, 132, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3})
    label = "8B o 4096x4096"
    by_tma = mma_config(256, 4096, 4096, 132, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                                "X_TMA": True})
    rule_256 = mma_config(256, 4096, 4096, 132)
    rule_32 = mma_config(32, 4096, 4096, 132)
    more_splits = mma_config(32, 4096, 4096, 132, {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                                   "split": 7})
    assert rule_32["split"] == 3  # 64 tiles: 3 splits fill the 132 SMs once
    rows = [sweep_row(label, 128, rule_128, 20.0), sweep_row(label, 128, narrow, 17.0),  # 15% faster: kept
            sweep_row(label, 256, rule_256, 30.0), sweep_row(label, 256, by_tma, 25.0),  # a switch is kept too
            sweep_row(label, 64, rule_64, 13.0), sweep_row(label, 64, staged, 12.7),  # 2.3%: noise
            sweep_row(label, 64, wrong, 5.0, rel_error=0.5),  # fast and wrong: never
            sweep_row(label, 32, rule_32, 10.0), sweep_row(label, 32, more_splits, 8.0)]  # the rule's tile, more splits
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"w4a16_mma": rows}))
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"Other card": {"1x1": {"64": {}}}}))
    subprocess.run([sys.executable, str(ROOT / "bench/kernels.py"), "--tuned-from", str(sweep), "--device-name",
                    "Test card", "--sms", "132", "--tuned-out", str(table)], check=True, capture_output=True)
    written = json.loads(table.read_text())
    assert written["Other card"] == {"1x1": {"64": {}}}  # other cards' entries stay
    assert written["Test card"] == {"4096x4096": {
        "32": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "split": 7},
        "128": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        "256": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "X_TMA": True}}}


def test_at_16_rows_a_tile_must_beat_the_planes_kernel(tmp_path):
    """At 16 rows the shipped path is the planes kernel: a swept mma tile enters the table (and the launcher then
    takes mma at 9-16 rows) only where it beat the planes kernel's time, not the mma rule's."""
    sys.path.insert(0, str(ROOT))
    from bench.kernels import tuned_table

    label = "8B o 4096x4096"
    rule = mma_config(16, 4096, 4096, 132)
    split = mma_config(16, 4096, 4096, 132, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                             "split": 6})
    beats_rule_only = [{**sweep_row(label, 16, rule, 14.0), "shipped_us": 9.0},
                       {**sweep_row(label, 16, split, 10.0), "shipped_us": 9.0}]
    assert tuned_table(beats_rule_only, 132) == {}
    beats_planes = [{**row, "shipped_us": 12.0} for row in beats_rule_only]
    assert tuned_table(beats_planes, 132)["4096x4096"]["16"]["split"] == 6
    # a re-sweep on a card whose table already has the tile: "shipped" is that tile (10.0), the planes kernel
    # is timed apart, and the tile still beats it
    resweep = [{**row, "shipped_us": 10.0, "planes_us": 12.0} for row in beats_rule_only]
    assert tuned_table(resweep, 132)["4096x4096"]["16"]["split"] == 6
    assert tuned_table([{**row, "planes_us": 10.2} for row in resweep], 132) == {}  # within noise of planes


def test_a_sweep_of_some_shapes_replaces_only_their_entries(tmp_path):
    """A sweep split over device calls (``--mma-shapes``): each call's table replaces the shapes it swept, drops
    a swept shape whose tiles no longer beat the rule, and keeps the rest."""
    sys.path.insert(0, str(ROOT))
    from bench.kernels import write_tuned

    path = tmp_path / "tuned.json"
    tile = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    path.write_text(json.dumps({H200: {"4096x4096": {"64": tile}, "4096x6144": {"128": tile},
                                       "11008x4096": {"64": tile}}}))
    write_tuned(str(path), H200, {"4096x4096": {"256": tile}}, ["4096x4096", "4096x6144"])
    assert json.loads(path.read_text()) == {H200: {"4096x4096": {"256": tile}, "11008x4096": {"64": tile}}}


def test_a_sweep_of_some_rows_replaces_only_those_rows(tmp_path):
    """``--mma-rows 16,32``: the swept rows' entries are replaced (or dropped where no tile beat the rule), the
    shape's other rows and the other shapes stay."""
    sys.path.insert(0, str(ROOT))
    from bench.kernels import write_tuned

    path = tmp_path / "tuned.json"
    old, new = ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": stages} for stages in (3, 5))
    path.write_text(json.dumps({H200: {"4096x4096": {"16": old, "32": old, "128": old}, "4096x6144": {"16": old},
                                       "11008x4096": {"32": old}}}))
    write_tuned(str(path), H200, {"4096x4096": {"16": new}}, ["4096x4096", "4096x6144"], (16, 32))
    assert json.loads(path.read_text()) == {H200: {"4096x4096": {"16": new, "128": old}, "11008x4096": {"32": old}}}


@pytest.mark.parametrize("missing", ["--tuned-out", "--sms"])
def test_making_a_table_without_its_card_is_refused(tmp_path, missing):
    args = {"--tuned-from": str(tmp_path / "sweep.json"), "--tuned-out": str(tmp_path / "t.json"),
            "--device-name": H200, "--sms": "132"}
    del args[missing]
    done = subprocess.run([sys.executable, str(ROOT / "bench/kernels.py"), *(v for kv in args.items() for v in kv)],
                          check=False, capture_output=True, text=True)
    assert done.returncode != 0 and "--tuned-from needs" in done.stderr


def test_the_one_row_gemv_table_gives_valid_plans_of_its_grids():
    """kernels/triton/tuned/w4a16_gemv.json: grids (warps an SM, K step) measured at M = 1; each gives the rule a
    plan whose splits are whole K steps, and the grid it names is the one planned (12 warps an SM on the 7B qkv:
    fewer, longer splits than the rule's 24)."""
    from kernels.triton.w4a16_gemv import _k_steps, gemv_plan

    table = load_table("w4a16_gemv")
    assert H200 in table
    for shape, by_rows in table[H200].items():
        k, n = (int(v) for v in shape.split("x"))
        tile = tuned_tile("w4a16_gemv", H200, k, n, 1)
        assert set(by_rows) == {"1"} and set(tile) == {"warps_per_sm", "block_k"} and tile["block_k"] % 64 == 0
        plan = gemv_plan(n, k, 128, 132, norm=True, warps_per_sm=tile["warps_per_sm"], block_k=tile["block_k"])
        k_per_split, splits, block_k = _k_steps(k, 128, plan)
        assert block_k == tile["block_k"] and k_per_split % block_k == 0
        assert splits * plan.num_warps * (n // plan.block_n) <= 2 * tile["warps_per_sm"] * 132
    rule = gemv_plan(12288, 4096, 128, 132, head_dim=128, norm=True)
    tuned = gemv_plan(12288, 4096, 128, 132, head_dim=128, norm=True, warps_per_sm=12)
    assert tuned.split < rule.split


@pytest.mark.parametrize(("k", "n", "head_dim", "norm", "before"), [
    (4096, 12288, 128, True, 32), (4096, 22016, None, True, 13), (4096, 28672, None, True, 10),
    (4096, 6144, 128, True, 32), (4096, 4096, None, False, 32), (14336, 4096, None, False, 32)])
def test_the_one_row_gemv_rule_keeps_its_programs_in_one_wave(k, n, head_dim, norm, before):
    """The rule's grid at 132 SMs fits the warps the SMs hold at the register cap (16 each): the 7B qkv and the
    gate/ups took 1.06-1.45 waves before (``one_wave=False``, the same splits as then), and a program that waits
    for a second wave runs its whole K loop in the launch's tail. Launches already within one wave keep theirs."""
    from kernels.triton.w4a16_gemv import RESIDENT_WARPS, _k_steps, gemv_plan

    capped, uncapped = (gemv_plan(n, k, 128, 132, head_dim, norm, one_wave=wave) for wave in (True, False))
    assert uncapped.split == before
    tiles = n // capped.block_n
    assert tiles * _k_steps(k, 128, capped)[1] * capped.num_warps <= RESIDENT_WARPS * 132
    if tiles * before * uncapped.num_warps <= RESIDENT_WARPS * 132:
        assert capped == uncapped
    else:
        assert capped.split < before


def test_the_dense_gemv_rule_caps_registers_only_where_that_makes_one_wave():
    """The fp16 GEMV's 7B / 8B o and down (1,024 four-warp programs; 924 resident at the 66 registers they take
    uncapped on 132 SMs) are capped at 64 registers, where 1,056 fit; launches with an RMSNorm prologue (which
    spill there), grids of many waves and small ones are not."""
    from kernels.triton.dense_gemv import dense_gemv_plan

    for n, k in ((4096, 4096), (4096, 11008), (4096, 14336)):
        assert dense_gemv_plan(n, k, 132).max_registers == 64
        assert dense_gemv_plan(n, k, 132, one_wave=False).max_registers is None
    for n, k, norm in ((4096, 4096, True), (12288, 4096, False), (576, 1536, False), (22016, 4096, True)):
        assert dense_gemv_plan(n, k, 132, norm=norm).max_registers is None


def gemv_row(k: int, n: int, *grids: tuple) -> dict:
    """A ``bench/gemv.py --x16`` row: grids as (warps an SM or None for the rule's, K step, half2 us, x16 us)."""
    return {"k": k, "n": n, "grids": [
        {"warps_per_sm": warps, "block_k": block_k, "half2_us": half2, "x16_us": x16}
        for warps, block_k, half2, x16 in grids]}


def test_the_gemv_grid_table_serves_both_dots_and_every_launch_of_a_shape():
    """bench/gemv.py --x16 --tuned-out: per weight shape, the grid fastest for the x16 dot summed over the
    launches of that shape, only where it beat the rule's by more than noise and did not slow the half2 dot."""
    sys.path.insert(0, str(ROOT))
    from bench.gemv import gemv_tuned_table

    rows = [
        gemv_row(4096, 4096, (None, 64, 6.0, 6.0), (12, 64, 5.5, 5.0), (16, 64, 7.0, 4.5), (8, 64, 6.0, 4.0)),
        gemv_row(4096, 4096, (None, 64, 6.0, 6.0), (12, 64, 5.5, 5.0), (16, 64, 7.0, 4.5)),  # the 8B o: no 8
        gemv_row(4096, 12288, (None, 64, 10.0, 10.0), (12, 128, 10.0, 9.8)),  # 2%: noise
        gemv_row(576, 960, (None, 64, 3.0, 3.1)),  # a one-step plan: the rule's grid only
    ]
    # 16 warps an SM: the fastest x16 sum but the half2 dot 17% slower; 8: not timed on every launch of the shape
    assert gemv_tuned_table(rows) == {"4096x4096": {"1": {"block_k": 64, "warps_per_sm": 12}}}
    faster = gemv_row(4096, 12288, (None, 64, 10.0, 10.0), (12, 128, 9.0, 9.0))
    assert gemv_tuned_table([faster])["4096x12288"] == {"1": {"block_k": 128, "warps_per_sm": 12}}


def test_the_gemv_grid_table_can_lift_the_one_wave_cap():
    """The rule before its one-wave cap is a grid like the others (``bench/gemv.py --x16`` times it on every
    launch): where it is the fastest, the entry says so (``one_wave: false``, the rule's warps an SM), and
    ``gemv_plan`` given that entry plans the uncapped split (the 8B gate/up's 10 splits, 9 under the cap)."""
    sys.path.insert(0, str(ROOT))
    from bench.gemv import gemv_tuned_table
    from kernels.triton.w4a16_gemv import gemv_plan

    row = gemv_row(4096, 28672, (None, 64, 23.0, 23.0), (12, 64, 23.5, 23.4))
    row["grids"].append({"warps_per_sm": None, "block_k": 64, "one_wave": False, "half2_us": 22.4, "x16_us": 22.0})
    entry = gemv_tuned_table([row])["4096x28672"]["1"]
    assert entry == {"block_k": 64, "one_wave": False}
    assert gemv_plan(28672, 4096, 128, 132, norm=True, **entry) == gemv_plan(28672, 4096, 128, 132, norm=True,
                                                                            one_wave=False)
    assert gemv_plan(28672, 4096, 128, 132, norm=True, **entry).split == 10  # 9 under the cap
    slower = gemv_row(4096, 28672, (None, 64, 23.0, 23.0))
    slower["grids"].append({"warps_per_sm": None, "block_k": 64, "one_wave": False, "half2_us": 23.0,
                            "x16_us": 22.8})  # 1%: noise
    assert gemv_tuned_table([slower]) == {}


def test_the_gemv_grid_table_can_load_the_first_weights_after_the_wait():
    """The rule with its first K step's weights loaded after the PDL wait (``weights_first=False``) is a grid
    ``bench/gemv.py --x16`` times on every launch: where it is faster by more than noise the entry says so and
    ``gemv_plan`` plans it; the rule loads them before the wait."""
    sys.path.insert(0, str(ROOT))
    from bench.gemv import gemv_tuned_table
    from kernels.triton.w4a16_gemv import gemv_plan

    assert gemv_plan(4096, 11008, 128, 132).weights_first
    row = gemv_row(11008, 4096, (None, 64, 11.5, 11.5))
    row["grids"].append({"warps_per_sm": None, "block_k": 64, "weights_first": False, "half2_us": 11.4,
                         "x16_us": 10.9})
    entry = gemv_tuned_table([row])["11008x4096"]["1"]
    assert entry == {"block_k": 64, "weights_first": False}
    assert not gemv_plan(4096, 11008, 128, 132, **entry).weights_first
    row["grids"][-1]["x16_us"] = 11.4  # 1%: noise
    assert gemv_tuned_table([row]) == {}
