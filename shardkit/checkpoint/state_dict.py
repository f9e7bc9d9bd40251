"""The public path of the state-dict functions (``shardkit.checkpoint.state_dict``), kept for
users' imports; they live in :mod:`shardkit.checkpoint.state.state_dict` and
:mod:`shardkit.checkpoint.state.full_state_dict`."""

from shardkit.checkpoint.state.full_state_dict import (
    get_full_state_dict,
    set_full_state_dict,
)
from shardkit.checkpoint.state.state_dict import *  # noqa: F403
from shardkit.checkpoint.state.state_dict import __all__ as _STATE_DICT_NAMES

__all__ = [*_STATE_DICT_NAMES, "get_full_state_dict", "set_full_state_dict"]
