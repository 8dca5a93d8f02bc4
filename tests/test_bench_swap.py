"""`dflash2 bench swap` on the host-memory stand-ins: small sizes, every figure present."""

from __future__ import annotations

import argparse

import pytest

from dflash2.bench import swap


def _args(**kw):
    parser = argparse.ArgumentParser()
    swap.add_arguments(parser)
    args = parser.parse_args([])
    args.device, args.mb, args.repeat = "host", 4, 1
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def test_swap_bench_reports_both_ways_of_making_room():
    rows = swap.run(_args(sizes_kib="64,256"))
    assert [r["block_kib"] for r in rows] == [64, 256]
    assert [r["default"] for r in rows] == ["room_first", "pieces"]
    for r in rows:
        assert r["device"] == "host" and r["mb_each_way"] == 4
        assert r["blocks"] * r["block_kib"] * 1024 == 4 << 20
        for key in ("room_first_ms", "pieces_ms", "swap_gbps_room_first", "swap_gbps_pieces", "pieces_vs_room_first"):
            assert r[key] > 0, key


@pytest.mark.parametrize("sizes", ["100", "0", "-64"])
def test_swap_bench_rejects_block_sizes_it_cannot_lay_out(sizes):
    with pytest.raises(ValueError, match="--sizes-kib"):
        swap.run(_args(sizes_kib=sizes))


def test_swap_bench_measures_a_multiple_of_64_that_is_not_a_power_of_two():
    """--help allows any multiple of 64 KiB: 192 KiB took its own size as the arena's page, not a
    power of two, and failed blaming --mb and --repeat. Its pages are 64 KiB now, three a block."""
    (row,) = swap.run(_args(sizes_kib="192"))
    assert row["block_kib"] == 192 and row["blocks"] == (4 << 20) // (192 << 10)
    assert row["mb_each_way"] == 21 * 192 / 1024  # 3.9375: what moved (it was cut to 3)
    assert row["room_first_ms"] > 0 and row["pieces_ms"] > 0
    assert [swap.page_kib(kib * 1024) for kib in (64, 192, 256, 320, 2048)] == [64, 64, 256, 64, 2048]


def test_swap_bench_checks_every_size_before_it_measures_any(monkeypatch):
    """A size whose page the arena cannot take (2 GiB blocks: pages of 2 GiB, past memory.page_kb's
    1 GiB) is refused naming --sizes-kib, before the sizes ahead of it are measured and thrown
    away (it was found after them, blamed on --mb and --repeat)."""
    measured = []
    monkeypatch.setattr(swap, "_measure", lambda mgr, block_bytes, *a: measured.append(block_bytes))
    with pytest.raises(ValueError, match=r"^--sizes-kib: 2097152 KiB blocks need pages of 2097152 KiB"):
        swap.run(_args(sizes_kib="64,2097152"))
    assert measured == []


def test_swap_bench_names_the_tiers_options_and_the_size_when_tiers_do_not_fit():
    with pytest.raises(ValueError, match=r"^--mb 100000000 --repeat 1: memory.hbm_capacity_mb: .*"
                                         r"\(with --sizes-kib 64\)$"):
        swap.run(_args(sizes_kib="64", mb=100000000))


def test_swap_bench_with_cached_chains_demotes_them_whole():
    """--chain L: HBM is full of cached prefix chains; the promotions' demotions take them whole."""
    rows = swap.run(_args(sizes_kib="64", chain=16))
    assert rows[0]["chain"] == 16 and rows[0]["room_first_ms"] > 0 and rows[0]["pieces_ms"] > 0
    # A chain longer than HBM holds is laid out as long as HBM: reported so, not as asked (a review).
    (row,) = swap.run(_args(sizes_kib="64", chain=1 << 20))
    assert 16 < row["chain"] < 1 << 20, row


def test_swap_bench_with_cached_chains_demotes_chains_in_every_promotion(monkeypatch):
    """--chain L --repeat 3: every timed promotion makes its room from the cached chains. HBM full
    with twice one promotion's blocks gave chains to the first two only; the four after demoted the
    bench's own promoted sets (loose blocks it holds), and the medians timed those (a review)."""
    import numpy as np

    from dflash2.tiers import Tier

    measure, downs = swap._measure, []

    def watched(mgr, block_bytes, per, sets, chain=1):
        placement, promoted = mgr.placement, []
        real = placement.promote

        def promote(rows, dst=Tier.HBM, *a, **kw):
            before = np.flatnonzero(mgr.table.cols.tier == int(Tier.HBM))
            ok = real(rows, dst, *a, **kw)
            down = np.setdiff1d(before, np.flatnonzero(mgr.table.cols.tier == int(Tier.HBM)))
            downs.append((len(down), int(np.isin(down, promoted).sum())))
            promoted.extend(np.asarray(rows).tolist())
            return ok
        placement.promote = promote
        return measure(mgr, block_bytes, per, sets, chain)
    monkeypatch.setattr(swap, "_measure", watched)
    (row,) = swap.run(_args(sizes_kib="64", chain=16, repeat=3))
    assert row["chain"] == 16
    assert downs == [(64, 0)] * 6, downs  # (4 MiB of 64 KiB blocks each, none of the bench's own)


@pytest.mark.parametrize("field", ["chain", "mb", "repeat"])
def test_swap_bench_rejects_non_positive_counts(field, capsys):
    parser = argparse.ArgumentParser()
    swap.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([f"--{field}", "0"])
    assert f"argument --{field}: must be a positive integer, got '0'" in capsys.readouterr().err
