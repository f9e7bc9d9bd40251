"""``shardkit.checkpoint.state_dict``: torch's ``torch.distributed.checkpoint.state_dict``, importable as is.

Code written for DCP runs unchanged with this import instead of torch's:
``get_state_dict``, ``get_model_state_dict``, ``get_optimizer_state_dict``,
``set_state_dict``, ``set_model_state_dict``, ``set_optimizer_state_dict`` and
``StateDictOptions`` (torch's own class) have torch 2.13's signatures, options
and return types (:mod:`shardkit.checkpoint.state.dcp_state_dict`).

shardkit's own forms sit beside them: ``get_training_state`` /
``set_training_state`` (the ``{"model": ..., "optim": ...}`` dict of live
tensors that ``save``/``load`` fill in place) and ``get_full_state_dict`` /
``set_full_state_dict`` (:mod:`shardkit.checkpoint.state.training_state`,
:mod:`shardkit.checkpoint.state.full_state_dict`).
"""

from shardkit.checkpoint.state.dcp_state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from shardkit.checkpoint.state.full_state_dict import (
    get_full_state_dict,
    set_full_state_dict,
)
from shardkit.checkpoint.state.training_state import *  # noqa: F403
from shardkit.checkpoint.state.training_state import __all__ as _STATE_DICT_NAMES

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict", *_STATE_DICT_NAMES,
           "get_full_state_dict", "set_full_state_dict"]
