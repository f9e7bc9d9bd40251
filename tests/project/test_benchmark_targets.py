"""The definitions both save/load benchmarks judge their targets by (benchmarks/checkpoint_targets.py)."""

from __future__ import annotations

import os

import pytest

from benchmarks import checkpoint_targets as targets


def write_files(folder, sizes: dict[str, int]) -> None:
    os.makedirs(folder / "data")
    for name, size in sizes.items():
        (folder / "data" / name).write_bytes(b"x" * size)


def test_the_floor_deals_every_data_file_to_one_rank_and_evens_the_bytes(tmp_path):
    write_files(tmp_path, {"t-0-0.safetensors": 700, "t-0-1.safetensors": 300, "t-1-0.safetensors": 600,
                           "t-1-1.safetensors": 400, "notes.txt": 5000})
    shares = [targets.floor_files(str(tmp_path), rank, 2) for rank in range(2)]
    names = [[os.path.basename(p) for p in share] for share in shares]
    assert names == [["t-0-0.safetensors", "t-0-1.safetensors"], ["t-1-0.safetensors", "t-1-1.safetensors"]]
    assert [targets.read_sequentially(share, block=256) for share in shares] == [1000, 1000]
    assert len(targets.floor_files(str(tmp_path), 0, 1)) == 4


def test_the_floor_refuses_a_checkpoint_without_data_files(tmp_path):
    os.makedirs(tmp_path / "data")
    with pytest.raises(SystemExit, match="no data files under .*data: the floor would read nothing"):
        targets.floor_files(str(tmp_path), 0, 2)


def test_the_default_load_is_timed_beside_the_other_mode_named_for_what_it_is():
    def verifying(state, url, *, verify_first: bool = True): ...

    def one_pass(state, url, *, verify_first: bool = False): ...

    assert targets.load_modes(verifying) == {"default": {}, "one pass": {"verify_first": False}}
    assert targets.load_modes(one_pass) == {"default": {}, "all-or-nothing": {"verify_first": True}}
    assert "here is all or nothing" in targets.describe_modes(verifying)
    assert "here is one verified pass" in targets.describe_modes(one_pass)


def test_a_ratio_is_the_median_over_the_other_median_and_judged_against_the_limit():
    ours, dcp = [1.0, 3.0, 2.0, 9.0, 2.0], [2.0, 2.0, 4.0, 2.0, 1.0]
    verdict = targets.judged("load/dcp", ours, dcp)
    assert (verdict.value, verdict.limit, verdict.word) == (1.0, 1.0, "MET")
    assert targets.per_round_ratio(ours, dcp) == 1.5  # rounds: 0.5 1.5 0.5 4.5 2.0
    assert targets.judged("save/dcp", ours, dcp).word == "MISSED"


def test_a_target_a_script_cannot_measure_says_so_and_where(capsys):
    verdict = targets.not_measured("hsdp/bytes", "needs 4 ranks; run benchmarks/checkpoint.py")
    assert verdict.word == "NOT MEASURED"
    targets.print_verdicts([verdict], rounds=2)
    out = capsys.readouterr().out
    assert "ONLY 2 ROUNDS: a smoke run" in out
    assert "HSDP 2x2 default load: bytes asked of storage / the checkpoint's bytes" in out
    assert "NOT MEASURED: needs 4 ranks; run benchmarks/checkpoint.py" in out


def test_a_load_that_filled_wrong_values_misses_its_target_whatever_its_figure():
    verdict = targets.Verdict("bytes", 1.0, 1.05, met_also_requires=False)
    assert verdict.word == "MISSED"
