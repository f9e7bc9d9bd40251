"""The wire's collectives: identities in one process, and on two real gloo ranks every rank's payload in
rank order (shorter ones zero-padded on the wire, trimmed on arrival) and one agreed failure flag."""

from __future__ import annotations

import pytest
import torch

from shardkit.errors import ConfigurationError, error_record
from shardkit.wire.collectives import (
    all_gather_bytes,
    all_gather_json,
    any_failed,
    decode_json,
    encode_json,
    raise_any_failure,
    rank_world,
)
from tests.support.dist import run_on_ranks


def test_without_a_process_group_this_process_is_rank_0_of_1():
    assert rank_world() == (0, 1)


def test_all_gather_json_without_a_process_group_returns_the_value_itself():
    value = {"step": 3}
    (back,) = all_gather_json(value)
    assert back is value


def test_all_gather_bytes_without_a_process_group_returns_the_payload_itself():
    payload = torch.tensor([1, 2, 3], dtype=torch.uint8)
    (back,) = all_gather_bytes(payload)
    assert back is payload


def test_any_failed_without_a_process_group_is_this_process_flag():
    assert any_failed(True) is True
    assert any_failed(False) is False


def test_json_travels_as_compact_utf8_bytes():
    payload = encode_json({"a": [1, 2.5, None], "b": "é"})
    assert payload.dtype == torch.uint8
    assert bytes(payload.numpy()) == b'{"a":[1,2.5,null],"b":"\\u00e9"}'
    assert decode_json(payload) == {"a": [1, 2.5, None], "b": "é"}


def test_raise_any_failure_returns_when_no_rank_failed_and_sends_nothing_of_this_rank():
    sent = []
    assert raise_any_failure(lambda record: sent.append(record), None) is None
    assert sent == [None]


def test_raise_any_failure_reraises_this_rank_own_exception_itself():
    own = ConfigurationError("no space under /local")
    sent = []
    with pytest.raises(ConfigurationError) as caught:
        raise_any_failure(lambda record: sent.append(record) or (0, record), own, lambda r, t: f"rank {r}: {t}")
    assert caught.value is own
    assert sent == [error_record(own)]


def test_raise_any_failure_on_a_rank_that_did_not_fail_raises_the_first_rank_error_by_its_class():
    other = error_record(ConfigurationError("no space under /local"))
    with pytest.raises(ConfigurationError, match=r"^step 7 failed on rank 1: no space under /local$"):
        raise_any_failure(lambda record: (1, other), None, lambda rank, text: f"step 7 failed on rank {rank}: {text}")
    with pytest.raises(ConfigurationError, match=r"^no space under /local$"):
        raise_any_failure(lambda record: (1, other), None)


def _gather_and_agree() -> dict:
    rank, world = rank_world()
    gathered = all_gather_bytes(torch.arange(rank + 2, dtype=torch.uint8))
    return {
        "rank_world": (rank, world),
        "json": all_gather_json({"rank": rank, "note": "x" * (3 * rank)}),
        "bytes": [g.tolist() for g in gathered],
        "rank_1_failed": any_failed(rank == 1),
        "none_failed": any_failed(False),
    }


def test_two_ranks_gather_every_rank_payload_in_rank_order_and_agree_that_one_failed():
    per_rank = run_on_ranks(2, _gather_and_agree)
    for rank, seen in enumerate(per_rank):
        assert seen == {
            "rank_world": (rank, 2),
            "json": [{"rank": 0, "note": ""}, {"rank": 1, "note": "xxx"}],
            "bytes": [[0, 1], [0, 1, 2]],
            "rank_1_failed": True,
            "none_failed": False,
        }
