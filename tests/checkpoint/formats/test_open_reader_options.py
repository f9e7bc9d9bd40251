"""``open_reader``'s options: ``trust_pickle=True`` is honoured by the formats that unpickle and refused by the
others, and an option no reader takes is refused as Python refuses an unknown keyword, never dropped."""

from __future__ import annotations

import argparse

import pytest
import torch

from shardkit.checkpoint.formats import open_reader
from shardkit.errors import ArgumentTypeError, ConfigurationError, UnsafeCheckpoint


@pytest.fixture
def file_with_run_arguments(tmp_path):
    """A torch.save file as many training scripts write it: weights beside the run's ``argparse.Namespace``,
    a class outside ``torch.load``'s ``weights_only`` allowlist."""
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "args": argparse.Namespace(lr=0.1)}, path)
    return str(path)


def test_trust_pickle_true_opens_a_file_the_allowlist_refuses(file_with_run_arguments):
    with pytest.raises(UnsafeCheckpoint, match="trust"):
        open_reader(file_with_run_arguments)
    with open_reader(file_with_run_arguments, trust_pickle=True) as reader:
        assert set(reader.tensors()) == {"model.w"}


def test_trust_pickle_is_refused_for_a_format_that_never_unpickles_a_users_classes(tmp_path):
    import shardkit.checkpoint as skc

    skc.save({"model": {"w": torch.ones(2)}}, str(tmp_path / "native"))
    with pytest.raises(ConfigurationError, match="trust-pickle.*shardkit checkpoint"):
        open_reader(str(tmp_path / "native"), trust_pickle=True)


def test_an_option_no_reader_takes_is_a_type_error_naming_it(file_with_run_arguments):
    with pytest.raises(ArgumentTypeError, match="unexpected keyword argument 'trust_pickles'") as caught:
        open_reader(file_with_run_arguments, trust_pickles=True)
    assert isinstance(caught.value, TypeError)
