"""Data parallelism for the worker roles: which rows a rank takes, cross-rank sums, which rank answers.

The roles of ``nla.rl.roles`` are written once against a ``DataParallel`` object:

- ``DataParallel()`` (the local backend): one rank that owns every row; sums are the local
  values; optimizer state is the optimizer's own ``state_dict``; the module itself is saved.
- ``RankGroup(rank, world)`` (the Ray backend, one per actor after ``init_group``): rank ``r``
  takes its contiguous slice of each batch (``rank_rows``), metric sums are all-gathered,
  gradients are scaled by W (FSDP averages them over ranks), optimizer state and weights are
  gathered into full, name-keyed state dicts on rank 0, and rank 0 answers.

Which rows each rank of a Ray group receives for each role method, which collective the
call runs and which rank answers is one table, ``DISPATCH``: the Ray proxies read it and
nothing else (no rank checks scattered through the backends).

Pure helpers (``rank_rows``, ``micro_chunks``) decide which rows a rank owns and how it
splits them; every rank of a group must run the *same number* of forwards and backwards,
because FSDP2 all-gathers parameters in each forward and reduce-scatters gradients in each
backward (collectives). A rank with fewer rows than micro-batches runs a zero-weight dummy
micro-batch instead of skipping it (``micro_chunks`` returns empty chunks for those).

Notation: n rows in the global batch, W ranks (world size), r this rank.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from nla.rl.config import SHARDINGS

logger = logging.getLogger(__name__)


def rank_rows(n: int, world: int, rank: int) -> Tensor:
    """The contiguous rows [n_r] of a global batch of ``n`` that rank ``rank`` of ``world`` owns.

    Sizes differ by at most one (``torch.tensor_split``); every row is owned by exactly one rank.
    """
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank_rows: need 0 <= rank < world, found rank={rank}, world={world}")
    return torch.tensor_split(torch.arange(n), world)[rank]


def micro_chunks(rows: Tensor, n: int, world: int, micro_batch_size: int) -> list[Tensor]:
    """Split this rank's ``rows`` into K chunks, K equal on every rank of the group.

    K = ceil(ceil(n / W) / micro_batch_size): the micro-batch count of the largest rank slice.
    Chunks may be empty on a smaller rank; the caller then runs a zero-weight dummy forward.
    """
    if micro_batch_size <= 0:
        raise ValueError(f"micro_chunks: micro_batch_size must be positive, found {micro_batch_size}")
    k = max(1, math.ceil(math.ceil(n / world) / micro_batch_size))
    return list(torch.tensor_split(rows, k))


class DataParallel:
    """One process that owns every row (the local backend). See the module docstring."""

    rank: int = 0
    world: int = 1
    optim_format: str = "local"
    # Whether the models are sharded over the ranks: then no rank can generate alone (each
    # decode step would be a collective) and every policy rank samples from an unsharded copy.
    shards: bool = False

    @property
    def answers(self) -> bool:
        """Whether this rank returns results and writes files (rank 0)."""
        return self.rank == 0

    @property
    def grad_scale(self) -> float:
        """Factor on each backward so the averaged gradient of the group is the sum over its ranks."""
        return float(self.world)

    def shard(self, model: nn.Module, layers: nn.ModuleList) -> nn.Module:
        """Shard ``model`` over the group (each block in ``layers``, then the root); local: as it is."""
        return model

    def my_rows(self, rows: Tensor) -> Tensor:
        """This rank's contiguous share of ``rows`` (a batch's row indices)."""
        return rows[rank_rows(len(rows), self.world, self.rank)]

    def micro_chunks(self, mine: Tensor, n: int, micro_batch_size: int) -> list[Tensor]:
        """``mine`` (from ``my_rows`` of a batch of ``n``) in K chunks, K the same on every rank."""
        return micro_chunks(mine, n, self.world, micro_batch_size)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum metric dicts over the ranks (keys may differ)."""
        return dict(values)

    def max_count(self, value: int) -> int:
        """The largest ``value`` over the ranks (collective): e.g. the forward count all ranks must run."""
        return int(value)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a picklable object), in rank order, on every rank (collective)."""
        return [value]

    def reduce_gradients(self, module: nn.Module) -> None:
        """Combine the ranks' accumulated gradients before the optimiser step: nothing to do in
        one process, nor under FSDP (its backward reduce-scatters); ``Replicas`` all-reduces."""

    def copy_full_weights(self, src: nn.Module, dst: nn.Module) -> None:
        """Copy ``src``'s full weights (sharded or not) into the unsharded module ``dst`` on this rank.

        Sharded, every rank runs it (one all-gather per tensor, in state-dict order) and every
        rank's ``dst`` ends up with the full weights; the peak extra memory is one tensor.
        """
        if src is not dst:
            load_full_into(dst, dict(_plain_items(src, src.state_dict().items())))

    def full_state_dict(self, module: nn.Module) -> dict[str, Tensor] | None:
        """The module's full weights for saving, on the answering rank; None means "the module's own"."""
        return None

    def load_full_state_dict(self, module: nn.Module, state: dict[str, Tensor]) -> None:
        """Load a full (unsharded) state dict into the module; sharded, each rank keeps its shard."""
        module.load_state_dict(state)

    def optim_state_dict(self, module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return opt.state_dict()

    def load_optim_state_dict(self, module: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        opt.load_state_dict(state)


class RankGroup(DataParallel):
    """Rank ``rank`` of a ``world``-rank torch.distributed group whose models are FSDP2-sharded."""

    optim_format = "full_fqn"
    shards = True

    def __init__(self, rank: int, world: int, mesh: Any = None) -> None:
        if world <= 0 or not 0 <= rank < world:
            raise ValueError(f"RankGroup: need 0 <= rank < world, found rank={rank}, world={world}")
        self.rank, self.world, self.mesh = rank, world, mesh

    def shard(self, model: nn.Module, layers: nn.ModuleList) -> nn.Module:
        return shard_model(model, layers, self.mesh)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        return sum_across_ranks(values)

    def gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def max_count(self, value: int) -> int:
        import torch.distributed as dist

        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.long, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def copy_full_weights(self, src: nn.Module, dst: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        target = dst.state_dict()
        gathered = ((name, value.full_tensor() if isinstance(value, DTensor) else value)  # collective per tensor
                    for name, value in src.state_dict().items())
        with torch.no_grad():
            for name, full in _plain_items(src, gathered):
                if name not in target:
                    raise RuntimeError(f"weight sync: {name!r} of the sharded model is not in the unsharded copy; "
                                       "both must be built from the same checkpoint")
                target[name].copy_(full)

    def full_state_dict(self, module: nn.Module) -> dict[str, Tensor] | None:
        return full_state_dict(module)  # collective; empty on ranks other than 0

    def load_full_state_dict(self, module: nn.Module, state: dict[str, Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))

    def optim_state_dict(self, module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(module, opt)

    def load_optim_state_dict(self, module: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load_full_optimizer_state(module, opt, state)


class Replicas(RankGroup):
    """Rank ``rank`` of a group whose ranks each hold the *whole* model (``backend.sharding:
    replicate``): data parallelism without sharding.

    Forwards and backwards run no collective: each rank accumulates the gradients of its own
    micro-batches, and ``reduce_gradients`` sums them over the ranks in one all-reduce per
    optimiser step (a flat buffer) before clipping, so every rank steps the same AdamW on the
    same summed gradient and the replicas stay equal. FSDP2 all-gathers every block in each
    forward and again in each backward, and reduce-scatters in each backward: on a small model
    over gloo that traffic is most of a policy update (BENCHMARKS "RL step: local vs Ray
    backend"). The price is memory: every rank holds the model, its gradients and AdamW's state.

    Why our own all-reduce and not torch's ``DistributedDataParallel``: DDP wraps the module
    (the roles hold and hook the model itself) and reduces after every backward unless each
    accumulation step runs under its ``no_sync`` context; the roles accumulate K micro-batches
    and need exactly one reduction per optimiser step. torch's composable ``replicate`` is a
    private API (``torch.distributed._composable``).

    Optimizer state is saved in the ``full_fqn`` format (name-keyed, as FSDP's), so a run
    resumes under either sharding.
    """

    shards = False

    @property
    def grad_scale(self) -> float:
        return 1.0  # gradients are summed over the ranks, not averaged

    def shard(self, model: nn.Module, layers: nn.ModuleList) -> nn.Module:
        """Nothing is sharded; rank 0's weights are broadcast so every replica starts equal
        (every rank loaded the same checkpoint; the broadcast also covers fresh adapter inits)."""
        import torch.distributed as dist

        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
        return model

    def reduce_gradients(self, module: nn.Module) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            return
        # A parameter no micro-batch reached has no gradient on this rank: zeros, so the flat
        # buffers of every rank have the same layout.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)  # SUM
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
            p.grad = g

    # This rank holds the full weights: copied, saved and loaded as in one process. The
    # optimizer state stays RankGroup's (name-keyed, gathered on rank 0).
    copy_full_weights = DataParallel.copy_full_weights
    full_state_dict = DataParallel.full_state_dict
    load_full_state_dict = DataParallel.load_full_state_dict


def rank_group(sharding: str, rank: int, world: int, mesh: Any = None) -> RankGroup:
    """The data-parallel group of ``backend.sharding``: ``"fsdp"`` (FSDP2, each rank holds a
    shard) or ``"replicate"`` (each rank holds the whole model; one gradient all-reduce per step)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"backend.sharding: expected one of {sorted(SHARDINGS)}, found {sharding!r}")
    return (RankGroup if sharding == "fsdp" else Replicas)(rank, world, mesh)


@dataclass(frozen=True)
class Dispatch:
    """How a remote backend calls one role method on the ranks of its group.

    rows: ``"split"``: each rank receives only its contiguous share (``rank_rows``) of the
    first ``split_args`` positional arguments (batch-aligned: prompts, reward items);
    ``"all"``: every rank receives the same arguments (put once in the object store) and reads
    its own rows from them where the method says so (``DataParallel.my_rows``).
    answer: ``"cat"``: the ranks' results joined in rank order (a Rollout by ``Rollout.concat``,
    tensors by ``torch.cat``); ``"first"``: rank 0's result (every rank ran the call, whose
    collectives need them all); ``"none"``.
    collective: what the ranks do together during the call (documentation; docs/ray.md's table).
    seeded: the driver's torch RNG state travels to every rank and rank 0's advanced state comes
    back, so the driver's stream advances as in a local run.
    share: (split only) each rank is also told ``share=(index of its first row, rows of the
    whole batch)``.
    every_rank: (split only) False for a call without collectives: a rank whose share is empty
    is not called.
    """

    rows: str
    answer: str
    collective: str
    split_args: int = 1
    seeded: bool = False
    share: bool = False
    every_rank: bool = True


# Every role method a remote backend calls, and how. Every rank of the role's group runs every
# call (FSDP forwards and gathers are collectives).
DISPATCH: dict[str, dict[str, Dispatch]] = {
    "rollout": {
        # each rank samples its prompts' groups; every output row has its own uniforms
        # (nla.rl.sampling, item 5), so any split samples the whole batch's tokens
        "generate": Dispatch("split", "cat", "none", split_args=2, seeded=True, share=True, every_rank=False),
        "sync_weights": Dispatch("all", "none", "all-gather of each policy tensor into every rank's rollout copy"),
    },
    "policy": {
        "update": Dispatch("all", "first", "FSDP forward/backward per micro-batch; metric sums"),
        "save_model": Dispatch("all", "none", "full state dict gathered to rank 0, which writes"),
        "optim_state": Dispatch("all", "first", "full optimizer state gathered to rank 0"),
        "load_optim_state": Dispatch("all", "none", "every rank keeps its shard"),
    },
    "reference": {
        "logprobs": Dispatch("all", "cat", "FSDP forward per micro-batch (each rank its rows)"),
    },
    "value": {
        "values": Dispatch("all", "cat", "FSDP forward per micro-batch (each rank its rows)"),
        "update": Dispatch("all", "first", "FSDP forward/backward per micro-batch; metric sums"),
        "save_model": Dispatch("all", "none", "full state dict gathered to rank 0, which writes"),
        "load_model": Dispatch("all", "none", "every rank loads the full state dict into its shard"),
        "optim_state": Dispatch("all", "first", "full optimizer state gathered to rank 0"),
        "load_optim_state": Dispatch("all", "none", "every rank keeps its shard"),
    },
    "reconstructor": {
        "begin_rollout": Dispatch("all", "none", "none"),
        "mse_batch": Dispatch("split", "cat", "FSDP forwards, as many on every rank (max of the shares)"),
        "layout_check": Dispatch("all", "first", "FSDP forwards on every row"),
        "update": Dispatch("all", "first", "FSDP forward/backward per micro-batch; metric sums"),
        "save_model": Dispatch("all", "none", "full state dict gathered to rank 0, which writes"),
        "optim_state": Dispatch("all", "first", "full optimizer state gathered to rank 0"),
        "load_optim_state": Dispatch("all", "none", "every rank keeps its shard"),
    },
}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the group's rendezvous port).

    The probe binds ``host`` (the address the group will rendezvous on), never all interfaces.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_group(rank: int, world: int, master_addr: str, master_port: int, use_cuda: bool,
               timeout_s: float = 300.0) -> Any:
    """Join this process's torch.distributed group and return its 1-D device mesh.

    gloo on CPU, NCCL on GPU. MASTER_ADDR/PORT are per group (each actor is its own process),
    so the policy and reconstructor groups rendezvous independently.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK="0")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(0)  # Ray pins one GPU per actor: it is always device 0 here
    # A finite timeout: a peer that died mid-collective unblocks the survivors instead of hanging them.
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh("cuda" if use_cuda else "cpu", (world,))


def shard_model(model: nn.Module, layers: nn.ModuleList, mesh: Any) -> nn.Module:
    """FSDP2: shard each decoder block, then the root (embeddings, head, value head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded state dict on rank 0 (CPU), empty on other ranks. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state keyed by parameter names, on rank 0 (CPU). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full (name-keyed) optimizer state on every rank; each keeps its own shard. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def _plain_items(src: nn.Module, items: Iterable[tuple[str, Tensor]]) -> Iterable[tuple[str, Tensor]]:
    """``src``'s (name, full tensor) pairs as a plain model's: a LoRA policy's adapters merged in
    (``nla.core.lora.merged_items``), so the rollout copy is the plain AV."""
    from nla.core.lora import has_lora, lora_scaling, merged_items

    return merged_items(items, lora_scaling(src)) if has_lora(src) else items


def load_full_into(target: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a full state dict into an unsharded module; only tied weights may be missing."""
    missing, unexpected = target.load_state_dict(state, strict=False)
    tied = set(getattr(target, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied]
    if unexpected or really_missing:
        raise RuntimeError(
            f"weight sync: the sharded model's full state dict does not match the unsharded copy "
            f"(missing {really_missing[:5]}, unexpected {unexpected[:5]}); both must be built from the same checkpoint"
        )


def sum_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Sum metric dicts over the group (keys may differ: a non-finite metric is left out locally)."""
    import torch.distributed as dist

    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, values)
    out: dict[str, float] = {}
    for d in gathered:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


__all__ = [
    "DISPATCH", "DataParallel", "Dispatch", "RankGroup", "Replicas", "free_port", "full_optimizer_state",
    "full_state_dict", "init_group", "load_full_into", "load_full_optimizer_state", "micro_chunks", "rank_group",
    "rank_rows", "shard_model", "sum_across_ranks",
]
