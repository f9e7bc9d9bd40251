"""The JSON spelling of plain values that checkpoint values and input state share."""

from __future__ import annotations

import math

import pytest
import torch

from shardkit.wire.json_values import FLOAT_TAG, NON_FINITE, encode_scalar, is_json_scalar, is_tagged_float


@pytest.mark.parametrize("value", [None, True, 0, 3, 2.5, "text"])
def test_finite_scalars_are_spelled_as_themselves(value):
    assert is_json_scalar(value)
    encoded = encode_scalar(value)
    assert encoded == value
    assert type(encoded) is type(value)


@pytest.mark.parametrize("value, spelling", [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_a_non_finite_float_is_spelled_as_a_tagged_string(value, spelling):
    assert encode_scalar(value) == {"$float": spelling}
    assert is_tagged_float(encode_scalar(value))


def test_the_tag_and_its_spellings_are_the_ones_files_hold():
    assert FLOAT_TAG == "$float"
    assert NON_FINITE == ("nan", "inf", "-inf")


@pytest.mark.parametrize("value", [[1], {"a": 1}, (1,), torch.ones(1), object()])
def test_containers_tensors_and_objects_are_not_scalars(value):
    assert not is_json_scalar(value)


@pytest.mark.parametrize("value", [{"$float": "1.5"}, {"$float": "nan", "other": 1}, {"float": "nan"}, "nan"])
def test_only_a_lone_tag_with_a_non_finite_spelling_reads_as_a_float(value):
    assert not is_tagged_float(value)
