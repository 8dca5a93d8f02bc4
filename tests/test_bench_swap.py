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


def test_swap_bench_with_cached_chains_demotes_them_whole():
    """--chain L: HBM is full of cached prefix chains; the promotions' demotions take them whole."""
    rows = swap.run(_args(sizes_kib="64", chain=16))
    assert rows[0]["chain"] == 16 and rows[0]["room_first_ms"] > 0 and rows[0]["pieces_ms"] > 0


@pytest.mark.parametrize("field", ["chain", "mb", "repeat"])
def test_swap_bench_rejects_non_positive_counts(field, capsys):
    parser = argparse.ArgumentParser()
    swap.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([f"--{field}", "0"])
    assert f"argument --{field}: must be a positive integer, got '0'" in capsys.readouterr().err
