"""torch's names for the FSDP state, on shardkit's state objects.

Frameworks reach past the public API into torch's state
(``fully_shard.state(m)._fsdp_param_group.fsdp_params``, ``p._param_fqn``,
``group.force_sum_reduction_for_comms``).  These mixins give shardkit's
:class:`ShardState`, :class:`ParamGroup` and :class:`ShardedParam` the same
names for the same facts, so that code runs unchanged; shardkit itself uses
its own names.  Objects behind the names are shardkit's own (a ``MeshInfo``
is not torch's ``FSDPMeshInfo``): only the attributes listed here are promised.
"""

from __future__ import annotations

from typing import Any

from shardkit.errors import ConflictingSettingError

__all__ = ["TorchStateNames", "TorchParamGroupNames", "TorchParamNames"]


class TorchStateNames:
    """``FSDPState`` names on a ``ShardState``."""

    groups: list
    is_root: bool | None
    ctx: Any
    comm: Any
    _to_run: set

    def lazy_init(self) -> None: ...

    def _lazy_init(self) -> None:
        self.lazy_init()

    @property
    def _state_ctx(self) -> Any:
        """What every state under one root shares (``all_states``, root first)."""
        return self.ctx

    @property
    def _comm_ctx(self) -> Any:
        return self.comm

    @property
    def _modules_to_run_forward(self) -> set:
        """Modules of a grouped call still to run in this forward (empty between forwards)."""
        return self._to_run

    @property
    def _fsdp_param_groups(self) -> list:
        return self.groups

    @property
    def _fsdp_param_group(self) -> Any:
        """The one group of this call, or None (torch asserts when there are several)."""
        if len(self.groups) > 1:
            raise ConflictingSettingError(
                f"Expected at most 1 param group for backward compatibility, but got {len(self.groups)}; "
                "use `_fsdp_param_groups` (plural) to access all param groups"
            )
        return self.groups[0] if self.groups else None

    @property
    def _is_root(self) -> bool | None:
        return self.is_root


class TorchParamGroupNames:
    """``FSDPParamGroup`` names on a ``ParamGroup``."""

    params: list
    fqn: str
    module_fqn: str | None
    comms: Any
    mesh_info: Any

    @property
    def fsdp_params(self) -> list:
        return self.params

    @property
    def _module_fqn(self) -> str | None:
        """The module's FQN under the root (``""`` for the root), known after lazy init."""
        return self.module_fqn

    @property
    def force_sum_reduction_for_comms(self) -> bool:
        return self.comms.force_sum

    @force_sum_reduction_for_comms.setter
    def force_sum_reduction_for_comms(self, enable: bool) -> None:
        self.comms.force_sum = enable

    @property
    def reduce_scatter_max_input_buffers(self) -> int:
        return self.comms.max_input_buffers

    @property
    def _all_gather_comm(self) -> Any:
        return self.comms.all_gather

    @_all_gather_comm.setter
    def _all_gather_comm(self, comm: Any) -> None:
        self.comms.all_gather = comm

    @property
    def _reduce_scatter_comm(self) -> Any:
        return self.comms.reduce_scatter

    @_reduce_scatter_comm.setter
    def _reduce_scatter_comm(self, comm: Any) -> None:
        self.comms.reduce_scatter = comm

    @property
    def _all_reduce_hook(self) -> Any:
        return self.comms.all_reduce_hook

    @property
    def _all_gather_process_group(self) -> Any:
        return self.mesh_info.shard_group

    @property
    def _reduce_scatter_process_group(self) -> Any:
        """The shard group, or the one ``set_separate_reduce_scatter_group`` made."""
        return self.comms.reduce_group(self.mesh_info.shard_group)


class TorchParamNames:
    """``FSDPParam`` names on a ``ShardedParam``."""

    fqn: str
    unsharded_param: Any

    @property
    def _param_fqn(self) -> str:
        return self.fqn

    @property
    def _unsharded_param(self) -> Any:
        return self.unsharded_param
