"""The two FQN rules: the eager name drops every wrapper part, the compile hooks' rule drops ``_orig_mod``
alone."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from shardkit.wire.fqn import WRAPPER_PARTS, eager_fqn, without_compile_parts

WRAPPED = "layers.0._checkpoint_wrapped_module._orig_mod.mlp._fsdp_wrapped_module._dp_wrapped_module.weight"


def test_the_eager_name_drops_every_wrapper_part():
    assert eager_fqn(WRAPPED) == "layers.0.mlp.weight"


def test_the_compile_rule_drops_only_the_compile_part():
    assert without_compile_parts(WRAPPED) == \
        "layers.0._checkpoint_wrapped_module.mlp._fsdp_wrapped_module._dp_wrapped_module.weight"


def test_a_part_that_only_contains_a_wrapper_name_is_kept():
    assert eager_fqn("my_orig_mod._orig_mod_x.weight") == "my_orig_mod._orig_mod_x.weight"
    assert without_compile_parts("my_orig_mod._orig_mod_x.weight") == "my_orig_mod._orig_mod_x.weight"


def test_the_wrapper_parts_are_the_names_torch_wrappers_register():
    assert WRAPPER_PARTS == ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_dp_wrapped_module")


def test_the_eager_name_of_a_checkpoint_wrapped_parameter_is_its_state_dict_key():
    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))
    names = [eager_fqn(name) for name, _ in model.named_parameters()]
    assert names == list(model.state_dict()) == ["0.weight", "0.bias"]
