"""The ``ray`` backend: each role group a set of Ray actors with torch.distributed and FSDP2.

``build_ray_groups(cfg, policy_dir, ar_dir) -> WorkerGroups`` returns thin proxies with the
same methods as the local roles, so the controller runs unchanged. Every role is the local
role of ``nla.rl.roles`` itself, built by the same functions (``nla.rl.setup``) with a
``RankGroup`` for its data parallelism; this module adds only the actors, the placement
and which rank answers.

Layout (docs/design.md §4):
1. **policy group**: ``num_policy_workers`` ``RoleHost`` actors, one placement group. Each
   hosts an FSDP2 shard of the trained AV (``policy`` role), of the frozen reference AV
   (``reference`` role: each rank scores its slice of the rollout) and an *unsharded* copy of
   the AV (``rollout`` role): each rank generates its share of the prompts on its own, with no
   collective (``nla.rl.sampling``, item 5: every output row has its own uniforms, so any number
   of generating ranks samples the local run's tokens), and ``sync_weights`` streams the full weights from
   the shards into every copy after each step. A separate copy rather than generating with the
   FSDP module because HF-style decoding makes a data-dependent number of forwards, and FSDP
   forwards are collective.
2. **reconstructor group**: ``num_reconstructor_workers`` actors, own placement group, own
   rendezvous. A reward batch is split over the AR ranks, each scoring its share with the
   live, just-updated weights (as many forwards on every rank), the MSEs joined in rank
   order. AR training rows are repartitioned over the AR ranks, whatever the policy world size.
3. Gradients: each rank takes its contiguous slice of the batch; its micro-batch loss is
   weighted by its share of the *global* batch (the aggregation mode's
   ``micro_batch_weight``), times W because FSDP averages gradients over ranks. The sum is
   then exactly the local backend's gradient, up to float summation order.
4. The driver's torch RNG state travels with each ``generate`` call (to every rank) and rank
   0's advanced state comes back, so a Ray run samples the same tokens as a local run with the
   same seed, and resume restores it.
5. Checkpoints: full model state dicts gathered to rank 0 and written there (plain HF dirs,
   as local); optimizer state as one *full* state dict keyed by parameter names (rank 0
   gathers it, every rank loads it and keeps its shard). It is not interchangeable with the
   local backend's id-keyed optimizer state: resume a run on the backend that wrote it.
6. Which ranks receive which rows of each call, the collective it runs and which rank
   answers: ``nla.rl.distributed.DISPATCH``, read by ``RayRole``; nothing else decides it.
7. PPO's value model (``value`` role) lives on the policy group: each rank an FSDP2 shard of
   it, built from the unsharded policy before sharding, computing and training on its rows.
8. ``backend.sharding: replicate`` (``nla.rl.distributed.Replicas``): each rank holds the whole
   model instead of a shard (1, 3, 5 and 7 less the sharding): forwards and backwards run no
   collective, the ranks all-reduce their summed gradients once per optimiser step (no factor
   W), every rank generates from the policy model itself (no rollout copy, no sync), the AR
   ranks' reward forwards are their update's forwards (``FusedRewardWindow``: each rank
   backpropagates its share of the rewards), and the optimizer state is the same name-keyed
   full state dict, so a run resumes under either.

Failures are loud: a dead actor raises ``RayWorkerError`` naming role and rank and how to
resume; ``groups.close()`` kills every actor and, when nla started Ray, shuts it down.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor

from nla.core import arch
from nla.rl import algorithms as A
from nla.rl import distributed as D
from nla.rl.config import RLConfig
from nla.rl.roles import WorkerGroups
from nla.rl.setup import RLSetupError, build_policy_roles, build_reconstructor_role, load_pair_sidecars
from nla.rl.types import Rollout
from nla.util.threads import resolve_threads

logger = logging.getLogger(__name__)

# Logical CPUs per CPU actor: two groups of 1-2 ranks fit a 2-core machine (tiny models).
CPU_ACTOR_CPUS = 0.5
# Timeout of a group's collectives: a peer that died mid-collective unblocks the others.
COLLECTIVE_TIMEOUT_S = 300


class RayWorkerError(RuntimeError):
    """A Ray actor of a worker group died; the message names role, rank and how to resume."""


# ============================================================================ actors (remote side)
class RoleHost:
    """One actor: joins its group's torch.distributed world and hosts that group's role objects.

    The roles are the local ones (``nla.rl.roles``) built with this rank's ``RankGroup``;
    the host only forwards calls to them by role name.
    """

    def __init__(self, group: str, rank: int, world: int, use_cuda: bool, threads: int) -> None:
        self.group, self.rank, self.world, self.use_cuda = group, rank, world, use_cuda
        # Resolved by the controller (``actor_threads``): Ray sets OMP_NUM_THREADS in its workers.
        torch.set_num_threads(threads)
        self.device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        self.roles: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0's answer becomes the group's MASTER_ADDR/PORT."""
        ip = ray.util.get_node_ip_address()
        return ip, D.free_port(ip)

    def init_group(self, master_addr: str, master_port: int, sharding: str = "fsdp") -> None:
        mesh = D.init_group(self.rank, self.world, master_addr, master_port, self.use_cuda, COLLECTIVE_TIMEOUT_S)
        self.dp = D.rank_group(sharding, self.rank, self.world, mesh)

    def setup(self, build: Callable[..., dict[str, Any]], *args: Any) -> None:
        """``self.roles = build(dp, device, *args)`` (a module-level builder, e.g. ``_policy_roles``)."""
        self.roles = build(self.dp, self.device, *args)

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        args = tuple(self.roles[a.role] if isinstance(a, RoleRef) else a for a in args)
        return getattr(self.roles[role], method)(*args, **kwargs)

    def call_seeded(self, rng_state: Tensor, role: str, method: str, *args: Any, **kwargs: Any
                    ) -> tuple[Any, Tensor]:
        """``call`` from the driver's torch RNG state; returns the result and the advanced state."""
        torch.set_rng_state(rng_state)  # sampling seeds itself from this CPU stream (nla.rl.sampling)
        return self.call(role, method, *args, **kwargs), torch.get_rng_state()


@dataclass(frozen=True)
class RoleRef:
    """An argument naming another role of the same actor (``rollout.sync_weights(policy)``)."""

    role: str


def _policy_roles(dp: D.RankGroup, device: torch.device, cfg: RLConfig, policy_dir: str) -> dict[str, Any]:
    return build_policy_roles(cfg, policy_dir, dp, device)


def _reconstructor_roles(dp: D.RankGroup, device: torch.device, cfg: RLConfig, ar_dir: str) -> dict[str, Any]:
    return {"reconstructor": build_reconstructor_role(cfg, ar_dir, dp, device)}


# ============================================================================ driver side
@dataclass
class _ActorGroup:
    """Actors of one role, in rank order, and their placement group."""

    role: str
    actors: list[Any]
    pg: Any
    pids: list[int] = field(default_factory=list)

    def call(self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on the given ranks (default all) with the same arguments and wait."""
        ranks = list(range(len(self.actors))) if ranks is None else ranks
        # Put big arguments once in the object store instead of once per rank.
        args = tuple(_put(a) for a in args)
        return self.call_each(method, {r: args for r in ranks}, {r: kwargs for r in ranks})

    def call_each(self, method: str, args_of: dict[int, tuple], kwargs_of: dict[int, dict[str, Any]]) -> list[Any]:
        """Call ``method`` on each rank of ``args_of`` with its own arguments; results in rank order.
        A dead actor fails loudly."""
        refs = {getattr(self.actors[r], method).remote(*args, **kwargs_of[r]): r for r, args in args_of.items()}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            # Wait one at a time: a dead rank must surface at once, while its peers may be
            # blocked inside a collective waiting for it.
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                rank = refs[ref]
                try:
                    results[rank] = ray.get(ref)
                except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
                    raise RayWorkerError(
                        f"{self.role} worker rank {rank} (of {len(self.actors)}) died during {method}: "
                        f"{type(exc).__name__}. The run stopped; resume from the last checkpoint with "
                        "`nla rl --resume` (same config and out_dir)"
                    ) from None
        return [results[r] for r in sorted(args_of)]


def _put(a: Any) -> Any:
    return ray.put(a) if isinstance(a, (Rollout, Tensor, list, dict)) else a


def _take(a: Any, rows: Tensor) -> Any:
    """Rows ``rows`` of a batch-aligned argument (a tensor, or a list such as reward items)."""
    return a[rows] if isinstance(a, Tensor) else [a[i] for i in rows.tolist()]


def _join(parts: list[Any], pad_id: int) -> Any:
    """The ranks' results of a ``"cat"`` call joined in rank order."""
    if isinstance(parts[0], Rollout):
        return Rollout.concat(parts, pad_id)
    return torch.cat(parts)


class RayRole:
    """Driver-side stand-in for one role hosted by an actor group.

    Each method of the role is called as ``nla.rl.distributed.DISPATCH[role][method]`` says:
    which rows each rank receives, whether the driver's RNG travels, and whose answer comes
    back. Every rank runs every call (the collectives need them all). A method the table does
    not list is not callable.
    """

    def __init__(self, group: _ActorGroup, role: str, pad_id: int = 0) -> None:
        self._g, self.role, self.pad_id = group, role, pad_id

    @property
    def actors(self) -> list[Any]:
        return self._g.actors

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        table = D.DISPATCH.get(self.role, {})
        if method not in table:
            raise AttributeError(f"{self.role}.{method} is not dispatched on the ray backend "
                                 f"(nla.rl.distributed.DISPATCH lists {sorted(table)})")
        d = table[method]
        return lambda *args, **kwargs: self._dispatch(method, d, args, kwargs)

    def _dispatch(self, method: str, d: D.Dispatch, args: tuple, kwargs: dict[str, Any]) -> Any:
        world = len(self._g.actors)
        args = tuple(RoleRef(a.role) if isinstance(a, RayRole) else a for a in args)
        kwargs_of: dict[int, dict[str, Any]] = {r: kwargs for r in range(world)}
        if d.rows == "split":
            n = len(args[0])
            head = args[: d.split_args]
            rest = tuple(_put(a) for a in args[d.split_args:])
            shares = {r: D.rank_rows(n, world, r) for r in range(world)}
            if not d.every_rank:  # no collective: a rank without rows is not called
                shares = {r: rows for r, rows in shares.items() if len(rows) or r == 0}
            args_of = {r: tuple(_take(a, rows) for a in head) + rest for r, rows in shares.items()}
            if d.share:  # each rank is told where its rows sit in the whole batch
                kwargs_of = {r: {**kwargs, "share": (int(rows[0]) if len(rows) else n, n)}
                             for r, rows in shares.items()}
        else:
            shared = tuple(_put(a) for a in args)
            args_of = {r: shared for r in range(world)}
        if d.seeded:
            rng = torch.get_rng_state()
            out = self._g.call_each("call_seeded", {r: (rng, self.role, method, *a) for r, a in args_of.items()},
                                    kwargs_of)
            torch.set_rng_state(out[0][1])  # the driver's stream advances exactly as in a local run
            results = [res for res, _ in out]
        else:
            results = self._g.call_each("call", {r: (self.role, method, *a) for r, a in args_of.items()}, kwargs_of)
        if d.answer == "cat":
            return _join(results, self.pad_id)
        return results[0] if d.answer == "first" else None


@dataclass
class RayWorkerGroups(WorkerGroups):
    """WorkerGroups whose roles are Ray proxies; ``close`` stops every actor (and Ray if nla started it)."""

    actor_groups: list[_ActorGroup] = field(default_factory=list)
    owns_ray: bool = False
    closed: bool = False

    @property
    def pids(self) -> dict[str, list[int]]:
        return {g.role: list(g.pids) for g in self.actor_groups}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for g in self.actor_groups:
            for a in g.actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as exc:  # already dead: nothing left to stop
                    logger.debug("ray.kill(%s): %r", g.role, exc)
            try:
                remove_placement_group(g.pg)
            except Exception as exc:
                logger.debug("remove_placement_group(%s): %r", g.role, exc)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def _cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


def _start_ray(cfg: RLConfig) -> bool:
    """Connect to (or start) Ray; returns True when this call started/connected it (so close shuts it down)."""
    if ray.is_initialized():
        return False
    if cfg.backend.ray_address:
        ray.init(address=cfg.backend.ray_address, log_to_driver=True)
    else:
        n_actors = cfg.backend.num_policy_workers + cfg.backend.num_reconstructor_workers
        want_gpu = cfg.device in ("auto", "cuda") and torch.cuda.is_available()
        num_cpus = max(1, math.ceil(CPU_ACTOR_CPUS * n_actors)) if not want_gpu else max(2, n_actors)
        ray.init(num_cpus=num_cpus, num_gpus=torch.cuda.device_count() if want_gpu else 0,
                 include_dashboard=False, log_to_driver=True)
    return True


def _gpu_fraction(cfg: RLConfig) -> float:
    """GPUs per actor: a whole one when there are enough, half when policy and AR ranks share GPUs.

    NCCL refuses two ranks of one group on the same GPU, so sharing is only possible for
    groups no larger than the GPU count (one GPU: 1 policy rank + 1 reconstructor rank).
    """
    n_gpus = int(ray.cluster_resources().get("GPU", 0))
    p, a = cfg.backend.num_policy_workers, cfg.backend.num_reconstructor_workers
    if p + a <= n_gpus:
        return 1.0
    if max(p, a) > n_gpus:
        raise RLSetupError(
            f"num_policy_workers={p} / num_reconstructor_workers={a}: each group needs one GPU per rank but the "
            f"cluster has {n_gpus}; lower the group sizes or add GPUs (ray start --num-gpus on each node)")
    logger.info("ray backend: %d GPU(s) for %d ranks: policy and reconstructor ranks share GPUs (0.5 each)",
                n_gpus, p + a)
    return 0.5


def actor_threads(cfg: RLConfig) -> int:
    """Torch threads of each actor: ``cfg.threads``, else ``$OMP_NUM_THREADS`` of the controller, else
    half the cores divided among all the actors of both groups (they share the machine)."""
    return resolve_threads(cfg.threads, processes=cfg.backend.num_policy_workers
                           + cfg.backend.num_reconstructor_workers)


def _make_group(role: str, world: int, use_cuda: bool, gpu_fraction: float = 1.0, threads: int = 1,
                sharding: str = "fsdp") -> _ActorGroup:
    bundle = {"GPU": gpu_fraction, "CPU": 1} if use_cuda else {"CPU": CPU_ACTOR_CPUS}
    # A name Ray refuses twice: two runs sharing one cluster each get their own groups.
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK",
                         name=f"nla-{role}-{uuid.uuid4().hex[:8]}")
    ray.get(pg.ready(), timeout=600)
    remote_cls = ray.remote(RoleHost)
    actors = [
        remote_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r),
        ).remote(role, r, world, use_cuda, threads)
        for r in range(world)
    ]
    group = _ActorGroup(role, actors, pg)
    group.pids = group.call("pid")
    addr, port = group.call("rendezvous_address", ranks=[0])[0]
    group.call("init_group", addr, port, sharding)
    return group


def build_ray_groups(cfg: RLConfig, policy_dir: str | Path | None = None, ar_dir: str | Path | None = None
                     ) -> RayWorkerGroups:
    """Start the policy and reconstructor actor groups; ``policy_dir`` / ``ar_dir`` override the weights (resume)."""
    av_side, ar_side = load_pair_sidecars(cfg.av, cfg.ar)
    if av_side.layers is not None:
        raise RLSetupError(f"backend: ray does not train a pair of several blocks ({list(av_side.layers)}) yet: its "
                           "rollout dispatch carries no block a prompt (issue 59); use backend: local")
    owns = _start_ray(cfg)
    use_cuda = cfg.device != "cpu" and _cluster_has_gpus()
    groups: list[_ActorGroup] = []
    try:
        frac = _gpu_fraction(cfg) if use_cuda else 0.0
        threads = actor_threads(cfg)
        sharding = cfg.backend.sharding
        policy = _make_group("policy", cfg.backend.num_policy_workers, use_cuda, frac, threads, sharding)
        groups.append(policy)
        recon = _make_group("reconstructor", cfg.backend.num_reconstructor_workers, use_cuda, frac, threads, sharding)
        groups.append(recon)
        # Both groups load their models at once (each setup blocks on its own collectives only).
        refs = [a.setup.remote(_policy_roles, cfg, str(policy_dir or cfg.av)) for a in policy.actors]
        refs += [a.setup.remote(_reconstructor_roles, cfg, str(ar_dir or cfg.ar)) for a in recon.actors]
        ray.get(refs)
    except BaseException:
        RayWorkerGroups(None, None, None, None, actor_groups=groups, owns_ray=owns).close()
        raise
    tok = arch.load_tokenizer(policy_dir or cfg.av)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    logger.info("ray backend: %d policy rank(s), %d reconstructor rank(s), %s, %s", cfg.backend.num_policy_workers,
                cfg.backend.num_reconstructor_workers, "GPU/NCCL" if use_cuda else "CPU/gloo", cfg.backend.sharding)
    return RayWorkerGroups(
        rollout=RayRole(policy, "rollout", pad_id), policy=RayRole(policy, "policy"),
        reference=RayRole(policy, "reference"), reconstructor=RayRole(recon, "reconstructor"),
        value=RayRole(policy, "value") if A.get_advantage_estimator(cfg.loss.advantage).needs_values else None,
        tokenizer=tok, av_sidecar=av_side, ar_sidecar=ar_side,
        actor_groups=groups, owns_ray=owns,
    )


__all__ = ["RayWorkerError", "RayWorkerGroups", "build_ray_groups"]
