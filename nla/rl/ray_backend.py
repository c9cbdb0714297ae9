"""The ``ray`` backend: each role a group of Ray actors with torch.distributed and FSDP2.

``build_ray_groups(cfg, policy_dir, ar_dir) -> WorkerGroups`` returns thin proxies with the
same methods as the local roles (``nla.rl.workers``), so the controller runs unchanged.

Layout (DESIGN §4):
1. **policy group**: ``num_policy_workers`` actors, one placement group. Each rank holds an
   FSDP2 shard of the AV (trained) and of the frozen reference AV (KL log-probs: each rank
   scores its slice of the rollout). Rank 0 also holds an *unsharded* rollout copy of the AV:
   ``generate`` runs there, and ``sync_weights`` gathers the full state dict from the shards
   (``get_model_state_dict(full_state_dict=True)``) into it after every step. A separate copy
   rather than generating with the FSDP module because HF ``generate`` makes a data-dependent
   number of forwards, and FSDP forwards are collective: every rank would have to generate.
2. **reconstructor group**: ``num_reconstructor_workers`` actors, own placement group, own
   rendezvous. A reward batch goes to *every* AR rank with the same items (collective forward)
   and rank 0's result is used, so rewards always come from the live, just-updated weights.
   AR training rows are repartitioned over the AR ranks, whatever the policy world size.
3. Gradients: each rank takes its contiguous slice of the batch; its micro-batch loss is
   weighted by its token share (``token-mean``) or row share (sequence modes) of the *global*
   batch, times W because FSDP averages gradients over ranks. The sum is then exactly the
   local backend's gradient, up to float summation order.
4. The driver's torch RNG state travels with each ``generate`` call and comes back, so a Ray
   run samples the same tokens as a local run with the same seed, and resume restores it.
5. Checkpoints: full model state dicts written by rank 0 (plain HF dirs, as local);
   optimizer state as one *full* state dict keyed by parameter names (rank 0 gathers it,
   every rank loads it and keeps its shard). It is not interchangeable with the local
   backend's id-keyed optimizer state: resume a run on the backend that wrote it.
6. PPO's value model is not supported on this backend (a clear error at build time).

Failures are loud: a dead actor raises ``RayWorkerError`` naming role and rank and how to
resume; ``groups.close()`` kills every actor and, when nla started Ray, shuts it down.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor

from nla.rl import algorithms as A
from nla.rl import distributed as D
from nla.rl.config import RLConfig
from nla.rl.types import Rollout
from nla.rl.workers import WorkerGroups
from nla.sidecar import NLAConfig

logger = logging.getLogger(__name__)

# Logical CPUs per CPU actor: two groups of 1-2 ranks fit a 2-core machine (tiny models).
CPU_ACTOR_CPUS = 0.5
# Timeout of a group's collectives: a peer that died mid-collective unblocks the others.
COLLECTIVE_TIMEOUT_S = 300


class RayWorkerError(RuntimeError):
    """A Ray actor of a worker group died; the message names role, rank and how to resume."""


# ============================================================================ actors (remote side)
class _RankBase:
    """One rank of one group: joins the group's torch.distributed world and shards its models."""

    def __init__(self, role: str, rank: int, world: int, use_cuda: bool) -> None:
        self.role, self.rank, self.world, self.use_cuda = role, rank, world, use_cuda
        if not use_cuda:
            torch.set_num_threads(1)  # several actors share the cores
        self.device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")

    def pid(self) -> int:
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0's answer becomes the group's MASTER_ADDR/PORT."""
        return ray.util.get_node_ip_address(), D.free_port()

    def init_group(self, master_addr: str, master_port: int) -> None:
        self.mesh = D.init_group(self.rank, self.world, master_addr, master_port, self.use_cuda,
                                 COLLECTIVE_TIMEOUT_S)

    def _chunks(self, n: int, micro_batch_size: int, rows: Tensor | None = None) -> list[Tensor]:
        mine = D.rank_rows(n, self.world, self.rank) if rows is None else rows
        return D.micro_chunks(mine, n, self.world, micro_batch_size)


class PolicyRank(_RankBase):
    """AV shard (trained) + reference shard; rank 0 also holds the unsharded rollout copy."""

    def setup(self, cfg: RLConfig, policy_dir: str, ref_dir: str) -> None:
        from nla.injection import InjectionHook
        from nla.rl.setup import load_av, load_pair_sidecars
        from nla.rl.workers import PolicyLossSettings, RolloutWorker
        from nla.sidecar import verify_tokenizer
        from nla.train.common import build_optimizer, resolve_dtype, warmup_cosine

        torch.manual_seed(cfg.seed)
        dtype = resolve_dtype(cfg.dtype)
        self.cfg = cfg
        self.sidecar, _ = load_pair_sidecars(cfg.av, cfg.ar)
        self.model, self.tokenizer = load_av(policy_dir, self.device, dtype)
        verify_tokenizer(self.sidecar, self.tokenizer)
        self.ref, _ = load_av(ref_dir, self.device, dtype)
        self.ref.eval().requires_grad_(False)
        from nla import arch

        D.shard_model(self.model, arch.decoder_layers(self.model), self.mesh)
        D.shard_model(self.ref, arch.decoder_layers(self.ref), self.mesh)
        self.hook = InjectionHook.from_config(self.model, self.sidecar)
        self.ref_hook = InjectionHook.from_config(self.ref, self.sidecar)
        self.settings = PolicyLossSettings.from_config(cfg)
        total = cfg.steps * cfg.updates_per_rollout
        self.opt = build_optimizer(self.model, cfg.lr, cfg.weight_decay)
        self.sched = warmup_cosine(self.opt, cfg.warmup_steps, total, min_lr_ratio=1.0) if total > 0 else None
        self.skipped_steps = 0
        self.rollout = None
        if self.rank == 0:
            rollout_model, _ = load_av(policy_dir, self.device, dtype)
            self.rollout = RolloutWorker(rollout_model, self.tokenizer, self.sidecar, self.device)

    # -- rollout (rank 0 only)
    def generate(self, rng_state: Tensor, vectors: Tensor, prompt_rows: Tensor, n_samples: int,
                 max_new_tokens: int, temperature: float, top_p: float, greedy: bool) -> tuple[Rollout, Tensor]:
        torch.set_rng_state(rng_state)
        if self.use_cuda:  # sampling draws from the CUDA stream: seed it from the driver's CPU stream
            torch.cuda.manual_seed(int(torch.randint(0, 2**62, (1,))))
        r = self.rollout.generate(vectors, prompt_rows, n_samples, max_new_tokens, temperature, top_p, greedy)
        return r, torch.get_rng_state()

    def sync_rollout(self) -> None:
        """Gather the full AV weights into rank 0's rollout copy (collective)."""
        state = D.full_state_dict(self.model)
        if self.rank == 0:
            D.load_full_into(self.rollout.model, state)

    # -- log-probs
    def _logprobs(self, model: Any, hook: Any, rollout: Rollout, rows: Tensor | None = None) -> Tensor:
        from nla.rl.workers import response_logprobs

        out = []
        with torch.no_grad():
            for chunk in self._chunks(rollout.n, self.settings.micro_batch_size, rows):
                idx = chunk if len(chunk) else torch.zeros(1, dtype=torch.long)  # dummy keeps collectives paired
                lp, _ = response_logprobs(model, hook, rollout.prompt_ids, rollout.response_ids[idx],
                                          rollout.response_mask[idx], rollout.vectors[idx])
                if len(chunk):
                    out.append(lp.cpu())
        L = rollout.response_ids.shape[1]
        return torch.cat(out) if out else torch.zeros(0, L)

    def ref_logprobs(self, rollout: Rollout) -> Tensor:
        """Reference log-probs [n_r, L] of this rank's slice."""
        return self._logprobs(self.ref, self.ref_hook, rollout)

    # -- update
    def update(self, rollout: Rollout, advantages: Tensor, ref_logp: Tensor) -> dict[str, float]:
        """Data-parallel version of ``PolicyWorker.update`` (same loss, global normalisation)."""
        from nla.rl.workers import policy_micro_loss

        s = self.settings
        self.model.train()
        mask = rollout.response_mask.float()
        per_update = rollout.n // s.updates_per_rollout
        old_all = None
        if s.updates_per_rollout > 1:
            old_all = torch.zeros(rollout.n, rollout.response_ids.shape[1])
            for u in range(s.updates_per_rollout):
                rows = torch.arange(u * per_update, (u + 1) * per_update)
                mine = rows[D.rank_rows(per_update, self.world, self.rank)]
                old_all[mine] = self._logprobs(self.model, self.hook, rollout, mine)
        sums: dict[str, float] = {}
        step_sums: dict[str, float] = {}
        for u in range(s.updates_per_rollout):
            rows = torch.arange(u * per_update, (u + 1) * per_update)
            mine = rows[D.rank_rows(per_update, self.world, self.rank)]
            for chunk in D.micro_chunks(mine, per_update, self.world, s.micro_batch_size):
                dummy = len(chunk) == 0
                idx = rows[:1] if dummy else chunk
                loss, m, pm = policy_micro_loss(self.model, self.hook, rollout, idx, advantages, ref_logp, old_all, s)
                # Share of the *global* batch; x W undoes FSDP's average over ranks.
                w = 0.0 if dummy else A.get_loss_agg(s.loss_agg).micro_batch_weight(m.cpu(), mask[rows])
                (loss * (w * self.world)).backward()
                if dummy:
                    continue
                for k, v in pm.items():
                    if math.isfinite(v):
                        sums[k] = sums.get(k, 0.0) + v * w
            for k, v in self._step().items():
                step_sums[k] = step_sums.get(k, 0.0) + v
        total = D.sum_across_ranks(sums)
        total.update(step_sums)  # identical on every rank: the norm is global
        return {k: v / s.updates_per_rollout for k, v in total.items()}

    def _step(self) -> dict[str, float]:
        lr = self.opt.param_groups[0]["lr"]
        stepped, grad_norm = D.dist_step(self.model, self.opt, self.sched, self.cfg.max_grad_norm)
        self.skipped_steps += 0 if stepped else 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": float(self.skipped_steps)}

    # -- checkpoints
    def save_model(self, directory: str, provenance: dict[str, Any]) -> None:
        from nla.sidecar import SIDECAR_NAME, write_sidecar

        self.sync_rollout()
        if self.rank == 0:
            d = Path(directory)
            self.rollout.model.save_pretrained(d, safe_serialization=True)
            self.tokenizer.save_pretrained(d)
            write_sidecar(d / SIDECAR_NAME, self.sidecar.replace(kind="nla_model", role="av"), **provenance)

    def optim_state(self) -> dict[str, Any]:
        full = D.full_optimizer_state(self.model, self.opt)
        return {"format": "full_fqn", "optimizer": full, "scheduler": self.sched.state_dict() if self.sched else None,
                "skipped_steps": self.skipped_steps}

    def load_optim_state(self, state: dict[str, Any]) -> None:
        _check_optim_format(state, "policy")
        D.load_full_optimizer_state(self.model, self.opt, state["optimizer"])
        if self.sched is not None and state.get("scheduler") is not None:
            self.sched.load_state_dict(state["scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class ReconstructorRank(_RankBase):
    """AR shard; rank 0 also holds an unsharded CPU copy used only to write checkpoints."""

    def setup(self, cfg: RLConfig, ar_dir: str) -> None:
        from nla import arch
        from nla.reconstructor import Reconstructor
        from nla.rl.workers import ReconstructorWorker
        from nla.sidecar import verify_tokenizer
        from nla.train.common import resolve_dtype

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        dtype = resolve_dtype(cfg.dtype)
        _, ar_side = _sidecars(cfg)
        ar = Reconstructor.from_pretrained(ar_dir, dtype=dtype).to(self.device)
        if ar.tokenizer is None:
            from nla.rl.setup import load_av

            _, tok = load_av(cfg.av, torch.device("cpu"), dtype)
        else:
            tok = ar.tokenizer
        verify_tokenizer(ar_side, tok)
        D.shard_model(ar, arch.decoder_layers(ar.base), self.mesh)
        # The local worker's encode / predict / score / layout code runs unchanged on the
        # sharded module (its forward is collective, and every rank sees the same batch).
        self.worker = ReconstructorWorker(ar, tok, ar_side, cfg.ar_lr_value, cfg.weight_decay, cfg.warmup_steps,
                                          cfg.steps, cfg.max_grad_norm, cfg.ar_max_length, cfg.micro_batch_size,
                                          self.device)
        self.shadow = Reconstructor.from_pretrained(ar_dir, dtype=dtype) if self.rank == 0 else None

    def mse_batch(self, items: list[tuple[str, Tensor]]) -> Tensor:
        return self.worker.mse_batch(items)

    def layout_check(self, explanations: list[str], golds: Tensor) -> float:
        return self.worker.layout_check(explanations, golds)

    def update(self, explanations: list[str], golds: Tensor) -> dict[str, float]:
        """``ReconstructorWorker.update`` over this rank's share of the rows (mean over all rows)."""
        from nla.reconstructor import reconstruction_loss

        w_ = self.worker
        n = len(explanations)
        w_.ar.train()
        total = 0.0
        for chunk in self._chunks(n, w_.micro_batch_size):
            dummy = len(chunk) == 0
            idx = [0] if dummy else chunk.tolist()
            enc = w_._encode([explanations[i] for i in idx], "right")
            loss, _ = reconstruction_loss(w_.ar, enc["input_ids"].to(self.device),
                                          enc["attention_mask"].to(self.device), golds[idx], w_.scale)
            w = 0.0 if dummy else len(idx) / n
            (loss * (w * self.world)).backward()  # x W undoes FSDP's average over ranks
            total += float(loss.detach()) * w
        lr = w_.opt.param_groups[0]["lr"]
        stepped, grad_norm = D.dist_step(w_.ar, w_.opt, w_.sched, w_.max_grad_norm)
        w_.skipped_steps += 0 if stepped else 1
        loss_sum = D.sum_across_ranks({"ar_loss": total})["ar_loss"]
        return {"ar_grad_norm": grad_norm, "ar_lr": lr, "ar_skipped_steps": float(w_.skipped_steps),
                "ar_loss": loss_sum, "ar_rows": float(n)}

    def save_model(self, directory: str, provenance: dict[str, Any]) -> None:
        state = D.full_state_dict(self.worker.ar)
        if self.rank == 0:
            D.load_full_into(self.shadow, state)
            self.shadow.save_pretrained(directory, self.worker.sidecar, **provenance)

    def optim_state(self) -> dict[str, Any]:
        w_ = self.worker
        return {"format": "full_fqn", "optimizer": D.full_optimizer_state(w_.ar, w_.opt),
                "scheduler": w_.sched.state_dict() if w_.sched else None, "skipped_steps": w_.skipped_steps}

    def load_optim_state(self, state: dict[str, Any]) -> None:
        _check_optim_format(state, "reconstructor")
        w_ = self.worker
        D.load_full_optimizer_state(w_.ar, w_.opt, state["optimizer"])
        if w_.sched is not None and state.get("scheduler") is not None:
            w_.sched.load_state_dict(state["scheduler"])
        w_.skipped_steps = int(state.get("skipped_steps", 0))


def _sidecars(cfg: RLConfig) -> tuple[NLAConfig, NLAConfig]:
    from nla.rl.setup import load_pair_sidecars

    return load_pair_sidecars(cfg.av, cfg.ar)


def _check_optim_format(state: dict[str, Any], role: str) -> None:
    if state.get("format") != "full_fqn":
        raise ValueError(
            f"{role} optimizer state: expected the ray backend's name-keyed format ('full_fqn'), found "
            f"{state.get('format', 'the local backend format')!r}; resume a run with the backend that wrote it"
        )


# ============================================================================ driver side
@dataclass
class _ActorGroup:
    """Actors of one role, in rank order, and their placement group."""

    role: str
    actors: list[Any]
    pg: Any
    pids: list[int] = field(default_factory=list)

    def call(self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` on the given ranks (default all) and wait; a dead actor fails loudly."""
        ranks = list(range(len(self.actors))) if ranks is None else ranks
        # Put big arguments once in the object store instead of once per rank.
        args = tuple(ray.put(a) if isinstance(a, (Rollout, Tensor, list, dict)) else a for a in args)
        refs = {getattr(self.actors[r], method).remote(*args, **kwargs): r for r in ranks}
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
        return [results[r] for r in ranks]


class RayRollout:
    """Proxy: generation on policy rank 0 (the unsharded rollout copy)."""

    def __init__(self, policy_group: _ActorGroup, pad_id: int) -> None:
        self._g, self.pad_id = policy_group, pad_id

    def generate(self, vectors: Tensor, prompt_rows: Tensor, n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False) -> Rollout:
        (out,) = self._g.call("generate", torch.get_rng_state(), vectors, prompt_rows, n_samples, max_new_tokens,
                              temperature, top_p, greedy, ranks=[0])
        rollout, rng = out
        torch.set_rng_state(rng)  # the driver's stream advances exactly as in a local run
        return rollout

    def sync_weights(self, policy: RayPolicy) -> None:
        policy._g.call("sync_rollout")


class RayPolicy:
    """Proxy: the data-parallel AV update over the policy group."""

    def __init__(self, group: _ActorGroup) -> None:
        self._g = group

    def update(self, rollout: Rollout, advantages: Tensor, ref_logp: Tensor) -> dict[str, float]:
        return self._g.call("update", rollout, advantages, ref_logp)[0]

    def save_model(self, directory: Path, tokenizer: Any = None, **provenance: Any) -> None:
        # rank 0 writes with its own copy of the (identical) tokenizer; the path must be
        # visible to it (a shared filesystem on a multi-node cluster).
        self._g.call("save_model", str(directory), provenance)

    def optim_state(self) -> dict[str, Any]:
        return self._g.call("optim_state")[0]

    def load_optim_state(self, state: dict[str, Any]) -> None:
        self._g.call("load_optim_state", state)


class RayReference:
    """Proxy: reference log-probs, each policy rank scoring its slice with its reference shard."""

    def __init__(self, group: _ActorGroup) -> None:
        self._g = group

    def logprobs(self, rollout: Rollout) -> Tensor:
        return torch.cat(self._g.call("ref_logprobs", rollout))


class RayReconstructor:
    """Proxy: live-AR MSEs for the rewards (every AR rank, rank 0's answer) and the data-parallel AR update."""

    def __init__(self, group: _ActorGroup) -> None:
        self._g = group

    @property
    def actors(self) -> list[Any]:
        return self._g.actors

    def mse_batch(self, items: list[tuple[str, Tensor]]) -> Tensor:
        return self._g.call("mse_batch", items)[0]

    def layout_check(self, explanations: list[str], golds: Tensor) -> float:
        return self._g.call("layout_check", explanations, golds)[0]

    def update(self, explanations: list[str], golds: Tensor) -> dict[str, float]:
        if not explanations:
            return {"ar_loss": float("nan"), "ar_rows": 0.0}
        return self._g.call("update", explanations, golds)[0]

    def save_model(self, directory: Path, **provenance: Any) -> None:
        self._g.call("save_model", str(directory), provenance)

    def optim_state(self) -> dict[str, Any]:
        return self._g.call("optim_state")[0]

    def load_optim_state(self, state: dict[str, Any]) -> None:
        self._g.call("load_optim_state", state)


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
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=True)
    else:
        n_actors = cfg.num_policy_workers + cfg.num_reconstructor_workers
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
    from nla.rl.setup import RLSetupError

    n_gpus = int(ray.cluster_resources().get("GPU", 0))
    p, a = cfg.num_policy_workers, cfg.num_reconstructor_workers
    if p + a <= n_gpus:
        return 1.0
    if max(p, a) > n_gpus:
        raise RLSetupError(
            f"num_policy_workers={p} / num_reconstructor_workers={a}: each group needs one GPU per rank but the "
            f"cluster has {n_gpus}; lower the group sizes or add GPUs (ray start --num-gpus on each node)")
    logger.info("ray backend: %d GPU(s) for %d ranks: policy and reconstructor ranks share GPUs (0.5 each)",
                n_gpus, p + a)
    return 0.5


def _make_group(role: str, cls: type, world: int, use_cuda: bool, gpu_fraction: float = 1.0) -> _ActorGroup:
    bundle = {"GPU": gpu_fraction, "CPU": 1} if use_cuda else {"CPU": CPU_ACTOR_CPUS}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK", name=f"nla-{role}")
    ray.get(pg.ready(), timeout=600)
    remote_cls = ray.remote(cls)
    actors = [
        remote_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r),
        ).remote(role, r, world, use_cuda)
        for r in range(world)
    ]
    group = _ActorGroup(role, actors, pg)
    group.pids = group.call("pid")
    addr, port = group.call("rendezvous_address", ranks=[0])[0]
    group.call("init_group", addr, port)
    return group


def build_ray_groups(cfg: RLConfig, policy_dir: str | Path | None = None, ar_dir: str | Path | None = None
                     ) -> RayWorkerGroups:
    """Start the policy and reconstructor actor groups; ``policy_dir`` / ``ar_dir`` override the weights (resume)."""
    from nla import arch
    from nla.rl.setup import RLSetupError

    if cfg.advantage == "gae":
        raise RLSetupError(
            "advantage: 'gae' (PPO) needs the value model, which the ray backend does not run yet; "
            "use backend: local for PPO, or advantage: grpo | drgrpo | reinforce_baseline on ray")
    av_side, ar_side = _sidecars(cfg)
    owns = _start_ray(cfg)
    use_cuda = cfg.device != "cpu" and _cluster_has_gpus()
    groups: list[_ActorGroup] = []
    try:
        frac = _gpu_fraction(cfg) if use_cuda else 0.0
        policy = _make_group("policy", PolicyRank, cfg.num_policy_workers, use_cuda, frac)
        groups.append(policy)
        recon = _make_group("reconstructor", ReconstructorRank, cfg.num_reconstructor_workers, use_cuda, frac)
        groups.append(recon)
        # Both groups load their models at once (each setup blocks on its own collectives only).
        refs = [a.setup.remote(cfg, str(policy_dir or cfg.av), str(cfg.av)) for a in policy.actors]
        refs += [a.setup.remote(cfg, str(ar_dir or cfg.ar)) for a in recon.actors]
        ray.get(refs)
    except BaseException:
        RayWorkerGroups(None, None, None, None, actor_groups=groups, owns_ray=owns).close()
        raise
    tok = arch.load_tokenizer(policy_dir or cfg.av)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    logger.info("ray backend: %d policy rank(s), %d reconstructor rank(s), %s", cfg.num_policy_workers,
                cfg.num_reconstructor_workers, "GPU/NCCL" if use_cuda else "CPU/gloo")
    return RayWorkerGroups(
        rollout=RayRollout(policy, pad_id), policy=RayPolicy(policy), reference=RayReference(policy),
        reconstructor=RayReconstructor(recon), value=None, tokenizer=tok, av_sidecar=av_side, ar_sidecar=ar_side,
        actor_groups=groups, owns_ray=owns,
    )


__all__ = ["RayWorkerError", "RayWorkerGroups", "build_ray_groups"]
