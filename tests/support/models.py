"""Small models shared by the test suite.

``Transformer`` is the parity workhorse: an embedding, a few pre-norm blocks,
a final norm and an output projection, with dims chosen so that dim 0 of most
parameters does *not* divide 2, 3 or 4 ranks (vocab 37, dim 26, ffn 51) while a
few do.  That exercises padding and uneven shards on every world size we test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 37
    dim: int = 26
    n_heads: int = 2
    n_layers: int = 3
    ffn_dim: int = 51
    max_seq_len: int = 16
    tie_embeddings: bool = False
    dropout: float = 0.0


class Attention(nn.Module):
    """Multi-head causal attention.  The head count is read off the projections'
    output width, so the same code runs on a tensor-parallel rank that holds
    ``n_heads / tp`` heads (column-wise q/k/v, row-wise output)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim)
        self.w2 = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs = ModelArgs()) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self) -> None:
        """Re-initialise every submodule in place (used after meta-device construction)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()


def make_batch(args: ModelArgs, batch: int, seed: int, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) for next-token prediction."""
    gen = torch.Generator().manual_seed(seed)
    seq = seq_len or args.max_seq_len
    data = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MLPStack(nn.Module):
    """Three linears whose dim-0 sizes (3, 7, 1) leave some ranks with zero rows."""

    def __init__(self, dim: int = 5) -> None:
        super().__init__()
        self.l0 = nn.Linear(dim, 3)
        self.l1 = nn.Linear(3, 7)
        self.l2 = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))


class WithScalarParameter(nn.Module):
    """A module with a 0-dim parameter, which cannot be sharded."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(3, 3)


class TiedLinears(nn.Module):
    """Two linears sharing one weight (a tied parameter)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def sharded_transformer(fully_shard, seed: int = 0) -> tuple[Transformer, torch.optim.Optimizer, ModelArgs]:
    """``Transformer`` seeded with ``seed``, each block and then the root sharded by ``fully_shard``
    (shardkit's or torch's) on a 1-D mesh over the whole default group, with an AdamW optimizer.

    On every rank of a live process group; the tests that save with one system and load with the
    other build their models here so both sides start from the same layout.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    args = ModelArgs()
    model = Transformer(args)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), args


# ------------------------------------------------------------ tensor parallelism

# For tensor parallelism over 2 ranks: heads and the ffn width split evenly over
# tp (torch's row-wise layer needs an even split of its input features), while
# the TP-local dim-0 sizes (13, 25) and the untouched ones (vocab 37, dim 26)
# still do not divide the data-parallel or the world size.
TP_ARGS = ModelArgs(ffn_dim=50)


def tp_plan(sequence_parallel: bool = False) -> dict:
    """A block's ``parallelize_module`` plan: q/k/v column-wise, the attention
    output row-wise, the MLP column-wise then row-wise; norms stay plain
    parameters.  With ``sequence_parallel`` the block runs on sequence shards
    (its input is cut, its output gathered back to replicated), the norms
    become ``SequenceParallel`` (replicated weights whose gradients come out
    ``Partial``), and attention and MLP gather the sequence at their inputs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    if not sequence_parallel:
        return plan
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {**plan,
            "": PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                         use_local_input=True, output_layouts=(Shard(1),),
                                         desired_output_layouts=(Replicate(),)),
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": gather_sequence, "feed_forward": gather_sequence,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


def parallelize_blocks(model: Transformer, tp_mesh, sequence_parallel: bool = False) -> Transformer:
    """Apply the tensor-parallel plan to every block; embeddings, the final norm
    and the output head stay plain parameters (they are only data-parallel)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers:
        parallelize_module(block, tp_mesh, tp_plan(sequence_parallel))
    return model
