"""Stateful objects saved global or per rank: exact round trips, a clear error naming a per-rank
object at another world size unless a reshard function decides, and a pickle-free stored form."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardkit.data import ElasticSampler, Stateful, data_state_dict, load_data_state_dict, nest, select_state
from shardkit.data.encode import decode_state, encode_state
from shardkit.errors import ConfigurationError, DataStateError, PerRankStateError


class ShardReader:
    """A user's per-rank loader: which file of its shard it reads and how far it got."""

    def __init__(self) -> None:
        self.file, self.offset = "", 0

    def state_dict(self) -> dict:
        return {"file": self.file, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.file, self.offset = state["file"], state["offset"]


def per_rank_checkpoint(name: str, states: list[dict]) -> dict:
    """What data_state_dict stores for a per-rank object saved by len(states) ranks."""
    entry = {"scope": "per_rank", "world_size": len(states),
             **{f"rank{r}": encode_state(s, f"data.objects.{name}.rank{r}") for r, s in enumerate(states)}}
    return {"data": {"objects": {name: entry}}}


SAVED = [{"file": f"shard-{r}.jsonl", "offset": 100 * r + 7} for r in range(3)]


def test_per_rank_objects_round_trip_at_the_same_world_size():
    checkpoint = per_rank_checkpoint("reader", SAVED)
    for rank in range(3):
        reader = ShardReader()
        load_data_state_dict(checkpoint, objects={"reader": Stateful(reader, scope="per_rank")}, rng=False,
                             rank=rank, world_size=3)
        assert reader.state_dict() == SAVED[rank]


def test_per_rank_state_at_another_world_size_raises_naming_the_object():
    reader = ShardReader()
    with pytest.raises(PerRankStateError) as raised:
        load_data_state_dict(per_rank_checkpoint("reader", SAVED), objects={"reader": Stateful(reader, "per_rank")},
                             rng=False, rank=0, world_size=2)
    assert str(raised.value) == (
        "input-state object 'reader' (ShardReader) was saved per rank by 3 ranks and this run has 2; shardkit "
        "cannot know how its per-rank state maps onto other ranks. Pass Stateful(obj, scope='per_rank', "
        "reshard=fn) with fn(states_by_old_rank, rank, world_size) -> state, or resume on 3 ranks")
    assert reader.state_dict() == {"file": "", "offset": 0}


def test_a_reshard_function_decides_the_state_at_another_world_size():
    def reshard(states, rank, world_size):              # new rank r takes over old ranks r, r+2, ...
        mine = states[rank::world_size]
        return {"file": "+".join(s["file"] for s in mine), "offset": sum(s["offset"] for s in mine)}

    got = []
    for rank in range(2):
        reader = ShardReader()
        load_data_state_dict(per_rank_checkpoint("reader", SAVED),
                             objects={"reader": Stateful(reader, "per_rank", reshard=reshard)},
                             rng=False, rank=rank, world_size=2)
        got.append(reader.state_dict())
    assert got == [{"file": "shard-0.jsonl+shard-2.jsonl", "offset": 214}, {"file": "shard-1.jsonl", "offset": 107}]


def test_select_state_takes_the_single_global_state_at_any_world_size():
    assert select_state("sched", [{"lr": 0.1}], scope="global", rank=3, world_size=5) == {"lr": 0.1}
    assert select_state("r", ["a", "b"], scope="per_rank", rank=1, world_size=2) == "b"
    with pytest.raises(PerRankStateError, match="^r was saved per rank by 2 ranks and this run has 1;"):
        select_state("r", ["a", "b"], scope="per_rank", rank=0, world_size=1)


def test_a_global_scheduler_is_saved_once_and_loads_on_every_rank():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    saved = data_state_dict(objects={"sched": Stateful(sched)}, rng=False)
    assert set(saved["data"]["objects"]["sched"]) == {"scope", "state"}

    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    load_data_state_dict(saved, objects={"sched": Stateful(fresh)}, rng=False, rank=2, world_size=4)
    assert fresh.state_dict() == sched.state_dict() and fresh.last_epoch == 3


def test_an_object_must_say_its_scope_and_have_both_methods():
    with pytest.raises(ConfigurationError, match=r"'reader' \(ShardReader\) must say how it is saved"):
        data_state_dict(objects={"reader": ShardReader()}, rng=False)
    with pytest.raises(ConfigurationError, match="needs an object with state_dict"):
        Stateful(object())
    with pytest.raises(ConfigurationError, match="reshard= only applies to scope='per_rank'"):
        Stateful(ShardReader(), reshard=lambda s, r, w: s[0])
    with pytest.raises(ConfigurationError, match="must be letters, digits"):
        data_state_dict(objects={"my.reader": Stateful(ShardReader())}, rng=False)


def test_a_missing_object_or_sampler_is_named():
    with pytest.raises(DataStateError, match=r"no state for input-state object 'reader' \(ShardReader\)"):
        load_data_state_dict({}, objects={"reader": Stateful(ShardReader())}, rng=False, rank=0, world_size=1)
    with pytest.raises(DataStateError, match="no ElasticSampler position"):
        load_data_state_dict({}, sampler=ElasticSampler(4, global_batch_size=2, rank=0, world_size=1), rng=False)
    with pytest.raises(DataStateError, match="no RNG state"):
        load_data_state_dict({}, rank=0, world_size=1)


def test_stored_state_round_trips_tuples_int_keys_non_finite_floats_and_tensors_without_pickle():
    state = {"betas": (0.9, 0.999), "per_param": {0: {"n": 1}, 1: {"n": 2}}, "$odd": [math.inf, -math.inf],
             "empty": {}, "dotted.key": None, "table": torch.arange(6, dtype=torch.int32).reshape(2, 3),
             "flag": torch.tensor(True)}
    stored = encode_state(state, "x")
    assert set(stored) == {"json", "tensors"} and set(stored["tensors"]) == {"0", "1"}
    json.loads(stored["json"])                          # plain JSON text, no NaN literals
    back = decode_state(json.loads(json.dumps({"json": stored["json"]})) | {"tensors": stored["tensors"]}, "x")
    assert back.keys() == state.keys() and back["betas"] == (0.9, 0.999)
    assert back["per_param"] == {0: {"n": 1}, 1: {"n": 2}} and back["$odd"] == [math.inf, -math.inf]
    assert back["empty"] == {} and back["dotted.key"] is None
    assert torch.equal(back["table"], state["table"]) and back["table"].dtype == torch.int32
    assert torch.equal(back["flag"], state["flag"])
    nan = decode_state(encode_state({"x": math.nan}, "y"), "y")["x"]
    assert math.isnan(nan)


def test_a_value_that_would_need_pickle_is_refused_naming_where_it_sits():
    class Opaque:
        pass

    with pytest.raises(DataStateError, match=r"^reader.cursor\[1\] holds a .*Opaque, which cannot be stored"):
        encode_state({"cursor": [1, Opaque()]}, "reader")


def flatten_like_the_checkpoint(state: dict, prefix: str = "") -> dict:
    """The checkpoint's documented rule: every dict is walked and joined with '.', anything else is a leaf."""
    flat = {}
    for key, value in state.items():
        path = f"{prefix}.{key}" if prefix else key
        flat.update(flatten_like_the_checkpoint(value, path) if isinstance(value, dict) else {path: value})
    return flat


def test_the_checkpoint_form_flattens_to_named_keys_of_json_values_and_tensors_and_nests_back():
    sampler = ElasticSampler(10, global_batch_size=2, rank=0, world_size=1)
    next(iter(sampler))
    saved = data_state_dict(sampler, {"reader": Stateful(ShardReader(), "per_rank"),
                                      "sched": Stateful(ShardReader())})
    flat = flatten_like_the_checkpoint(saved)
    tensors = {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert tensors == {"rng.rank0.torch", "rng.rank0.numpy.key"}
    assert {k: v for k, v in flat.items() if k not in tensors and not k.startswith("rng.rank0.")} == {
        "data.sampler.epoch": 0, "data.sampler.batches": 1, "data.sampler.num_samples": 10,
        "data.sampler.global_batch_size": 2, "data.sampler.seed": 0, "data.sampler.shuffle": True,
        "data.sampler.drop_last": True,
        "data.objects.reader.scope": "per_rank", "data.objects.reader.world_size": 1,
        "data.objects.reader.rank0.json": '{"file":"","offset":0}',
        "data.objects.sched.scope": "global", "data.objects.sched.state.json": '{"file":"","offset":0}',
        "rng.world_size": 1}
    values = {k: v for k, v in flat.items() if k not in tensors}
    assert json.loads(json.dumps(values)) == values     # what a manifest can hold
    rebuilt = nest({**json.loads(json.dumps(values)), **{k: flat[k] for k in tensors}})
    assert flatten_like_the_checkpoint(rebuilt).keys() == flat.keys()
    assert rebuilt["data"] == saved["data"] and torch.equal(rebuilt["rng"]["rank0"]["torch"],
                                                            saved["rng"]["rank0"]["torch"])


def test_a_refused_load_leaves_the_sampler_and_the_rngs_as_they_were():
    sampler = ElasticSampler(10, global_batch_size=2, rank=0, world_size=2)
    checkpoint = per_rank_checkpoint("reader", SAVED)
    checkpoint["data"]["sampler"] = {**sampler.state_dict(), "epoch": 4, "batches": 3}
    checkpoint["rng"] = {"world_size": 1, "rank0": {"python": {"version": 3, "state": [], "gauss": None},
                                                    "torch": torch.zeros(5056, dtype=torch.uint8)}}
    rng_before = torch.get_rng_state()
    with pytest.raises(PerRankStateError):
        load_data_state_dict(checkpoint, sampler, {"reader": Stateful(ShardReader(), "per_rank")},
                             rank=0, world_size=2)
    assert (sampler.epoch, sampler.batches_consumed) == (0, 0)
    assert torch.equal(torch.get_rng_state(), rng_before)
