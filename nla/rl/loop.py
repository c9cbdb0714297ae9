"""The RL controller: one loop, written once against the worker-group roles (docs/design.md §4).

Per step, on-policy:
1. sample ``rollout_batch_size`` prompts and generate ``n_samples_per_prompt`` explanations
   each with the current AV weights;
2. score every sample with the *live* AR through the ``RewardService`` (the AR returns
   ``mse_nrm``); ``nla.rl.reward.score_samples`` / ``make_rewards`` (the one place a reward is
   made) charge a failed extraction or truncation the orthogonal MSE at the
   AR's ``mse_scale`` (``failed_mse``), apply the -log variant, DAPO's optional overlong
   punishment and the format penalty;
3. DAPO dynamic sampling (optional): drop groups with zero reward spread and refill;
4. advantages (GRPO / Dr.GRPO / REINFORCE baseline / GAE over the value model);
5. policy update with the KL-to-reference loss term; value update (PPO);
6. AR update on the same rollouts (failed samples skipped); the reward forwards of step 2
   already backpropagated the rollout rows (``ReconstructorWorker.begin_rollout``), so the
   update runs only the replay rows, then steps;
7. log, evaluate, checkpoint, sync weights to the rollout role.

Departures from the published system:
1. HF ``generate`` is batched, not a stream of per-sample callbacks: with
   ``generation_chunk_prompts`` the rollout is generated in chunks and each finished chunk
   goes to the reward batcher (on its own thread) while the next one generates; by default
   the whole rollout is one chunk, scored as ``reward_batch_size`` AR forwards.
2. The step-0 guard compares the AR's left-padded reward layout with its right-padded
   training layout on the first rollout's texts (varied lengths), not on a packed layout.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nla.core.graders import DatasetGrader, faithfulness, grader_for_table, shuffle_sentences
from nla.core.sidecar import NLAConfig
from nla.core.vectors import check_spread, fve_of_mse
from nla.datagen.io import read_parquet, read_vectors
from nla.rl import algorithms as A
from nla.rl.backend import build_groups
from nla.rl.config import STEP0_GUARD_TOL, RLConfig, save_rl_config
from nla.rl.reward import RewardService, RewardSettings, scorable_items, score_samples
from nla.rl.roles import ReconstructorWorker, WorkerGroups
from nla.rl.types import COMPLETED, TRUNCATED, Rollout
from nla.train.checkpoint import (
    capture_rng_state,
    checkpoint_dir_name,
    latest_checkpoint,
    load_state_file,
    prune_checkpoints,
    restore_rng_state,
    seed_everything,
)
from nla.train.data import DataCursor
from nla.train.device import resolve_device
from nla.train.health import StuckRunMonitor, check_finite_loss
from nla.train.rundir import write_input_fingerprints
from nla.util.checkpoint_files import atomic_dir
from nla.util.metrics import MetricsLogger
from nla.util.precision import autocast, keep_heads_fp32, prepare_autocast
from nla.util.threads import adapt_threads, apply_threads

logger = logging.getLogger(__name__)

RL_STATE_FILE = "rl_state.pt"
PLOT_KEYS = ["reward_mean", "fve_nrm", "kl", "response_len", "ar_loss", "fact_recall", "eval_fve_nrm",
             "extraction_fail_rate", "degenerate_rate", "eval_fact_recall"]


class RLGuardError(RuntimeError):
    """Training refused to start (or stopped) because an invariant of the reward path broke."""


@dataclass
class RLData:
    """The RL prompt set: RAW gold vectors [R, d] and, for world data, the true facts per row."""

    vectors: torch.Tensor
    facts: list[list[str]] | None
    path: Path
    grader: DatasetGrader | None = None  # the grader the dataset names (``nla.core.graders.grader_for_table``)
    blocks: torch.Tensor | None = None  # [R] each row's block (activation_layer); None: a dataset without it

    @classmethod
    def load(cls, path: str | Path) -> RLData:
        table = read_parquet(path)
        vecs = torch.from_numpy(read_vectors(table, source=path).copy())
        facts = table.column("facts").to_pylist() if "facts" in table.column_names else None
        if vecs.shape[0] == 0:
            raise ValueError(f"{path}: the RL dataset has no rows")
        blocks = (torch.tensor(table.column("activation_layer").to_pylist(), dtype=torch.long)
                  if "activation_layer" in table.column_names else None)
        return cls(vecs, facts, Path(path), grader_for_table(table), blocks)

    def blocks_for(self, rows: torch.Tensor, sidecar: NLAConfig) -> torch.Tensor | None:
        """[n] the blocks of ``rows`` for a pair of several blocks (``sidecar.layers``); None for a pair of one."""
        if sidecar.layers is None:
            return None
        if self.blocks is None:
            raise ValueError(f"{self.path}: the pair reads several blocks ({list(sidecar.layers)}) but the dataset has no "
                             "activation_layer column; use a dataset built by nla datagen with the same layers")
        return self.blocks[rows]

    def ar_inputs(self, texts: list[str | None], rows: torch.Tensor, sidecar: NLAConfig) -> list[str | None]:
        """What the AR reads for the texts of ``rows``: the explanations themselves (the AR worker puts each
        in the AR template), or for a pair of several blocks each one's AR text with its row's block named
        (``NLAConfig.ar_text``): an explanation alone does not say which block it rebuilds."""
        blocks = self.blocks_for(rows, sidecar)
        if blocks is None:
            return list(texts)
        return [None if t is None else sidecar.ar_text(t, layer=int(k))
                for t, k in zip(texts, blocks.tolist(), strict=True)]


@dataclass
class ReplayData:
    """Data explanations the AR keeps training on during RL (``reconstructor.replay_dataset``)."""

    texts: list[str]
    vectors: torch.Tensor  # [R, d] RAW
    blocks: torch.Tensor | None = None  # [R] activation_layer (the AR text of a pair of several blocks names it)

    @classmethod
    def load(cls, path: str | Path) -> ReplayData:
        table = read_parquet(path)
        if "explanation" not in table.column_names:
            raise ValueError(f"reconstructor.replay_dataset: {path} has no 'explanation' column (found "
                             f"{table.column_names}); use a split with data explanations, e.g. ar_sft.parquet")
        texts = table.column("explanation").to_pylist()
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
        if bad:
            raise ValueError(f"reconstructor.replay_dataset: {path} rows {bad[:10]} have no explanation text")
        blocks = (torch.tensor(table.column("activation_layer").to_pylist(), dtype=torch.long)
                  if "activation_layer" in table.column_names else None)
        return cls(texts, torch.from_numpy(read_vectors(table, source=path).copy()), blocks)

    @classmethod
    def for_run(cls, cfg: RLConfig, width: int) -> ReplayData | None:
        """The run's replay rows (``reconstructor.replay_dataset``), or None when ``replay_fraction`` is 0."""
        if cfg.reconstructor.replay_fraction <= 0:
            return None
        replay = cls.load(cfg.reconstructor.replay_dataset)
        if replay.vectors.shape[1] != width:
            raise ValueError(f"reconstructor.replay_dataset: {cfg.reconstructor.replay_dataset} holds "
                             f"{replay.vectors.shape[1]}-d vectors, the RL data {width}-d")
        return replay

    def sample(self, n_rollout_rows: int, fraction: float, seed: int, step: int, shuffle: bool = False,
               sidecar: NLAConfig | None = None) -> tuple[list[str], torch.Tensor]:
        """Rows so that they make ``fraction`` of an AR update with ``n_rollout_rows`` rollout rows;
        drawn from an RNG keyed on ``(seed, step)`` (a resumed run replays the same rows), with
        ``shuffle`` each text's sentences in a random order from the same RNG. ``sidecar``: the AR's; for a
        pair of several blocks the texts are returned as AR texts with each row's block named."""
        n = int(round(n_rollout_rows * fraction / (1.0 - fraction)))
        if n == 0:
            return [], self.vectors[:0]
        rng = np.random.default_rng([seed, step])
        idx = rng.choice(len(self.texts), size=n, replace=n > len(self.texts))
        texts = [self.texts[i] for i in idx]
        if shuffle:
            texts = [shuffle_sentences(t, rng) for t in texts]
        if sidecar is not None and sidecar.layers is not None:
            if self.blocks is None:
                raise ValueError("reconstructor.replay_dataset: the pair reads several blocks but the replay rows have "
                                 "no activation_layer column; use the run's own ar_sft.parquet")
            texts = [sidecar.ar_text(t, layer=int(self.blocks[i])) for t, i in zip(texts, idx.tolist(), strict=True)]
        return texts, self.vectors[torch.from_numpy(idx)]


@dataclass
class RLResult:
    out_dir: Path
    checkpoint_dir: Path
    metrics: dict[str, Any]
    seconds: float


# ----------------------------------------------------------------------------- pieces of a step
def reward_items(rollout: Rollout, data: RLData | None = None, sidecar: NLAConfig | None = None
                 ) -> list[tuple[str, torch.Tensor]]:
    """(explanation, RAW gold) for the samples the AR scores (extraction succeeded); for a pair of several
    blocks (``sidecar``: the AR's) the explanation's AR text with its row's block named (``RLData.ar_inputs``)."""
    texts = rollout.explanations if data is None or sidecar is None else data.ar_inputs(
        rollout.explanations, rollout.prompt_rows, sidecar)
    return scorable_items(texts, rollout.vectors, rollout.ok)


def reward_settings(cfg: RLConfig) -> RewardSettings:
    """The ``reward`` section (and the generation cap, where the overlong ramp ends) as the reward's settings."""
    r = cfg.reward
    return RewardSettings(log_mse=r.log_mse, overlong_buffer_len=r.overlong_buffer_len,
                          overlong_penalty_factor=r.overlong_penalty_factor,
                          max_response_len=cfg.rollout.max_response_len, format_checks=r.format_checks,
                          format_penalty=r.format_penalty)


def fill_rewards(rollout: Rollout, scored_mse: list[float], cfg: RLConfig, scale: float | None) -> None:
    """Set ``rollout.mse``, ``rollout.degenerate`` and ``rollout.rewards`` (``nla.rl.reward.score_samples``)
    from the AR's ``mse_nrm`` of the rollout's ok samples; ``scale``: the AR's ``mse_scale``."""
    s = score_samples(scored_mse, rollout.ok, rollout.vectors, rollout.explanations, rollout.lengths, scale,
                      reward_settings(cfg))
    rollout.mse, rollout.degenerate, rollout.rewards = s.mse, s.degenerate, s.rewards


def score_rollout(rollout: Rollout, service: RewardService, cfg: RLConfig, scale: float | None,
                  data: RLData | None = None, sidecar: NLAConfig | None = None) -> None:
    """Score a whole rollout with the live AR (blocking); ``scale``: the AR's ``mse_scale``; ``data`` and
    ``sidecar`` as in ``reward_items``."""
    fill_rewards(rollout, service.score(reward_items(rollout, data, sidecar)), cfg, scale)


def generate_and_score(groups: WorkerGroups, cfg: RLConfig, data: RLData, rows: torch.Tensor,
                       service: RewardService) -> tuple[Rollout, float, float]:
    """Generate for ``rows`` and score; returns (rollout, generation seconds, reward seconds: submitting,
    which scores there with an inline service, plus waiting).

    With ``generation_chunk_prompts`` set, prompts are generated in chunks and each chunk is
    submitted to the reward service as soon as it is done, so the AR's forwards run while the
    next chunk generates (on separate devices or Ray actors that hides the reward time). A
    local CPU AR scores inline (``scores_inline``): each chunk is scored when it is submitted.
    """
    G = cfg.rollout.n_samples_per_prompt
    size = cfg.rollout.generation_chunk_prompts or len(rows)
    pending, t_gen, t_wait = [], 0.0, 0.0
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        t0 = time.perf_counter()
        ro = cfg.rollout
        blocks = data.blocks_for(chunk, groups.ar_sidecar)
        r = groups.rollout.generate(data.vectors[chunk], chunk, G, ro.max_response_len, ro.temperature, ro.top_p,
                                    **({} if blocks is None else {"blocks": blocks}))
        t1 = time.perf_counter()
        t_gen += t1 - t0
        pending.append((r, service.submit(reward_items(r, data, groups.ar_sidecar))))  # an inline service scores here
        t_wait += time.perf_counter() - t1
    t0 = time.perf_counter()
    for r, fut in pending:
        fill_rewards(r, fut.result(), cfg, groups.ar_sidecar.mse_scale_value())
    t_wait += time.perf_counter() - t0
    out = pending[0][0] if len(pending) == 1 else Rollout.concat([r for r, _ in pending], groups.rollout.pad_id)
    return out, t_gen, t_wait


def grade_facts(rollout: Rollout, facts: list[list[str]] | None, grader: DatasetGrader | None = None
                ) -> dict[str, float]:
    """Fact recall / precision of the extracted explanations against the rows' truth
    (``nla.core.graders.faithfulness``, the definition ``nla eval`` uses: a failed sample claims
    nothing); {} without facts or a grader that grades them. Logged, never a reward."""
    if facts is None:
        return {}
    truth = [facts[int(r)] for r in rollout.prompt_rows.tolist()]
    f = faithfulness(rollout.explanations, truth, grader)
    return {} if f is None or f.recall is None else {"fact_recall": f.recall, "fact_precision": f.precision}


def collect_rollout(groups: WorkerGroups, cfg: RLConfig, data: RLData, cursor: DataCursor,
                    service: RewardService) -> tuple[Rollout, Rollout, dict[str, float]]:
    """Generate + score, with DAPO dynamic sampling when enabled.

    Returns (the rollout to train the policy on, every scored sample of the step for the AR
    update, metrics).
    """
    G = cfg.rollout.n_samples_per_prompt
    parts, everything = [], []
    kept_groups, rounds, first_zero_frac = 0, 0, None
    t_gen = t_rew = 0.0
    while True:
        rows = torch.from_numpy(cursor.next_indices(cfg.rollout.rollout_batch_size - kept_groups)).long()
        r, dt_gen, dt_rew = generate_and_score(groups, cfg, data, rows, service)
        t_gen += dt_gen
        t_rew += dt_rew
        everything.append(r)
        spread = A.dynamic_sampling_mask(r.rewards, G)  # [b]
        if first_zero_frac is None:
            first_zero_frac = float((~spread).float().mean())
        if not cfg.rollout.dynamic_sampling:
            parts.append(r)
            break
        keep = spread.repeat_interleave(G)
        if keep.any():
            parts.append(r.select(keep))
            kept_groups += int(spread.sum())
        if kept_groups >= cfg.rollout.rollout_batch_size or rounds >= cfg.rollout.max_refill_rounds:
            break
        rounds += 1
    pad = groups.rollout.pad_id
    train = Rollout.concat(parts, pad) if parts else everything[0].select(torch.zeros(everything[0].n, dtype=torch.bool))
    allr = Rollout.concat(everything, pad)
    metrics = {"time_generate": t_gen, "time_reward": t_rew, "zero_spread_frac": first_zero_frac or 0.0,
               "refill_rounds": float(rounds), "train_groups": float(train.n // G)}
    return train, allr, metrics


def advantages(train: Rollout, cfg: RLConfig, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [N, L], returns or None) of the ``loss.advantage`` estimator; whitened over the
    rollout's response tokens when ``loss.whiten_advantages`` (verl's GAE and cleanrl's
    ``norm_adv`` always do; here an option, off by default: ``nla.rl.algorithms`` departure 11)."""
    mask = train.response_mask.float()
    est = A.get_advantage_estimator(cfg.loss.advantage)
    adv, returns = est(train.rewards, mask, group_size=cfg.rollout.n_samples_per_prompt, values=values,
                       gamma=cfg.loss.gamma, lam=cfg.loss.lam)
    if cfg.loss.whiten_advantages:
        adv = A.masked_whiten(adv, mask)
    return adv, returns


def rollout_metrics(r: Rollout, baseline: float) -> dict[str, float]:
    """Logged metrics of a scored rollout. ``mse_nrm`` / ``fve_nrm`` charge failed samples their
    cost (``fill_rewards``), the definition ``nla eval`` uses, so the names mean one number."""
    mse = r.mse
    m = {
        "reward_mean": float(r.rewards.mean()),
        "reward_std": float(r.rewards.std()) if r.n > 1 else 0.0,
        "response_len": float(r.lengths.float().mean()),
        "truncation_rate": float((r.status == TRUNCATED).float().mean()),
        "extraction_fail_rate": float((r.status != COMPLETED).float().mean()),
    }
    if r.degenerate is not None:
        m["degenerate_rate"] = float(r.degenerate.float().mean())
    if mse.numel():
        m["mse_nrm"] = float(mse.mean())
        m["fve_nrm"] = fve_of_mse(mse, baseline)
    return m


# ----------------------------------------------------------------------------- checkpointing
def save_checkpoint(root: Path, step: int, groups: WorkerGroups, cfg: RLConfig, cursor: DataCursor,
                    keep_last: int) -> Path:
    final = root / checkpoint_dir_name(step)
    with atomic_dir(final) as tmp:
        groups.policy.save_model(tmp / "av", stage="rl", rl_step=step, parent_av=str(cfg.av),
                                 parent_ar=str(cfg.ar), lr=cfg.optimiser.lr)
        groups.reconstructor.save_model(tmp / "ar", stage="rl", rl_step=step, parent_ar=str(cfg.ar),
                                        lr=cfg.ar_lr_value)
        state: dict[str, Any] = {
            "step": step, "cursor": cursor.state_dict(), "rng": capture_rng_state(), "reference": str(cfg.av),
            "policy": groups.policy.optim_state(), "reconstructor": groups.reconstructor.optim_state(),
        }
        if groups.value is not None:
            state["value"] = groups.value.optim_state()
            groups.value.save_model(tmp / "value_model.pt")
        torch.save(state, tmp / RL_STATE_FILE)
        save_rl_config(cfg, tmp / "rl_config.yaml")
        write_input_fingerprints(tmp, cfg.to_dict())
    prune_checkpoints(root, keep_last)
    return final


def latest_rl_checkpoint(out_dir: Path) -> Path | None:
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return None
    cands = sorted(p for p in root.iterdir() if p.is_dir() and (p / RL_STATE_FILE).is_file())
    return cands[-1] if cands else latest_checkpoint(root)


def check_run_provenance(cfg: RLConfig, av_sidecar: Any, ar_sidecar: Any) -> None:
    """The AV, the AR and the RL, eval and replay datasets must record one subject, layer and
    tokenizer (``nla.core.provenance``); a dataset without a sidecar has nothing to compare."""
    from nla.core.provenance import Provenance, check_provenance
    from nla.core.sidecar import load_sidecar, sidecar_path_for

    paths = [("dataset", cfg.dataset), ("eval_dataset", cfg.eval_dataset),
             ("reconstructor.replay_dataset", cfg.reconstructor.replay_dataset
              if cfg.reconstructor.replay_fraction > 0 else None)]
    parts = [Provenance.of(f"{name} {path}", load_sidecar(path)) for name, path in paths
             if path and sidecar_path_for(path).is_file()]
    parts += [Provenance.of(f"the AV {cfg.av}", av_sidecar), Provenance.of(f"the AR {cfg.ar}", ar_sidecar)]
    check_provenance(parts, allow=cfg.allow_mixed_provenance, context="rl")


def check_rollout_rows(cfg: RLConfig, rows: int) -> None:
    """A step draws ``rollout_batch_size`` distinct prompts: the RL dataset must hold that many."""
    if cfg.rollout.rollout_batch_size > rows:
        raise ValueError(
            f"rollout.rollout_batch_size: {cfg.rollout.rollout_batch_size} prompts per step, but {cfg.dataset} holds "
            f"{rows} rows; at most {rows} (every prompt once per step)")


def restore_checkpoint(ckpt: Path, groups: WorkerGroups, cfg: RLConfig, cursor: DataCursor) -> int:
    """Load an RL checkpoint's optimiser, value-model, cursor and RNG state into a run; returns its step.
    (The weights themselves were loaded when the groups were built from ``ckpt``.)"""
    state = load_state_file(ckpt / RL_STATE_FILE, "RL state")
    if state["reference"] != str(cfg.av):
        raise ValueError(f"--resume: the checkpoint's reference AV is {state['reference']} but av is {cfg.av}")
    cursor.load_state_dict(state["cursor"])
    groups.policy.load_optim_state(state["policy"])
    groups.reconstructor.load_optim_state(state["reconstructor"])
    if groups.value is not None and "value" in state:
        groups.value.load_model(ckpt / "value_model.pt")
        groups.value.load_optim_state(state["value"])
    restore_rng_state(state["rng"])
    logger.info("resuming RL from %s at step %d", ckpt, int(state["step"]))
    return int(state["step"])


# ----------------------------------------------------------------------------- the loop
def step0_guard(groups: WorkerGroups, rollout: Rollout, tol: float, data: RLData | None = None) -> float:
    """Refuse to train when the padded reward path and the AR training layout disagree."""
    texts = [e if e is not None else t for e, t in zip(rollout.explanations, rollout.texts, strict=True)]
    # Varied lengths make the check meaningful: add truncated/short variants of the texts.
    texts = texts[:16] + [t[: max(1, len(t) // 3)] for t in texts[:8]]
    if data is not None:  # a pair of several blocks reads AR texts (RLData.ar_inputs)
        texts = data.ar_inputs(texts, torch.cat([rollout.prompt_rows[:16], rollout.prompt_rows[:8]]), groups.ar_sidecar)
    golds = torch.cat([rollout.vectors[:16], rollout.vectors[:8]])
    diff = groups.reconstructor.layout_check(texts, golds)
    if not diff <= tol:
        raise RLGuardError(
            f"step-0 guard: the AR's padded reward path and its training layout disagree (max relative MSE "
            f"difference {diff:.3g} > step0_guard_tol {tol:g}); rewards would not match what the AR learns. "
            "Check last-token indexing and position ids under padding, or the AR tokenizer's padding token"
        )
    return diff


def evaluate(groups: WorkerGroups, cfg: RLConfig, data: RLData, baseline: float,
             service: RewardService) -> dict[str, float]:
    """Greedy decode of up to ``eval_max_rows`` held-out vectors, scored by the live AR."""
    n = min(cfg.eval_max_rows, data.vectors.shape[0])
    rows = torch.arange(n)
    blocks = data.blocks_for(rows, groups.ar_sidecar)
    r = groups.rollout.generate(data.vectors[rows], rows, 1, cfg.rollout.max_response_len, greedy=True,
                                **({} if blocks is None else {"blocks": blocks}))
    score_rollout(r, service, cfg, groups.ar_sidecar.mse_scale_value(), data, groups.ar_sidecar)
    m = rollout_metrics(r, baseline)
    m.update(grade_facts(r, data.facts, data.grader))
    return {f"eval_{k}": v for k, v in m.items() if k in ("fve_nrm", "mse_nrm", "reward_mean", "fact_recall",
                                                           "fact_precision", "extraction_fail_rate",
                                                           "degenerate_rate")}


def scores_inline(groups: WorkerGroups) -> bool:
    """Whether the reward service should score on the loop's own thread: an AR in this process
    on the CPU (a second thread of torch ops there slows every op; ``RewardService``)."""
    ar = groups.reconstructor
    return isinstance(ar, ReconstructorWorker) and torch.device(ar.device).type == "cpu"


def ar_rows(everything: Rollout, replay: ReplayData | None, cfg: RLConfig, step: int, data: RLData | None = None,
            sidecar: NLAConfig | None = None) -> tuple[list[str], torch.Tensor, int]:
    """The AR update's rows: every extracted sample of the step, in rollout order (the reward window's
    rows come first), then the replay rows; returns (texts, RAW golds, number of replay rows). The texts
    are what ``reward_items`` scored (``data``, ``sidecar``: a pair of several blocks reads AR texts)."""
    ok = everything.ok
    texts = everything.explanations if data is None or sidecar is None else data.ar_inputs(
        everything.explanations, everything.prompt_rows, sidecar)
    exps = [e for e, k in zip(texts, ok.tolist(), strict=True) if k]
    golds = everything.vectors[ok]
    if replay is None:
        return exps, golds, 0
    r_texts, r_golds = replay.sample(len(exps), cfg.reconstructor.replay_fraction, cfg.seed, step,
                                     cfg.reconstructor.shuffle_sentences, sidecar)
    return exps + r_texts, torch.cat([golds, r_golds.to(golds.dtype)]), len(r_texts)


def rl_step(groups: WorkerGroups, cfg: RLConfig, data: RLData, cursor: DataCursor, service: RewardService,
            replay: ReplayData | None, step: int, baseline: float, *, guard: bool) -> dict[str, float]:
    """One RL step (steps 1-6 of the module docstring); returns its metrics. ``guard``: run the
    step-0 guard on this step's rollout."""
    # This step's rewards are the AR update's forward (ReconstructorWorker.begin_rollout).
    groups.reconstructor.begin_rollout()
    train, everything, m = collect_rollout(groups, cfg, data, cursor, service)
    if guard:
        tol = cfg.reward.step0_guard_tol
        m["step0_guard_diff"] = step0_guard(groups, everything, STEP0_GUARD_TOL[cfg.autocast or cfg.dtype] if tol is None else tol,
                                            data)
    m.update(rollout_metrics(everything, baseline))
    m.update(grade_facts(everything, data.facts, data.grader))
    t1 = time.perf_counter()
    if train.n:
        ref_logp = groups.reference.logprobs(train)
        values = groups.value.values(train) if groups.value is not None else None
        adv, returns = advantages(train, cfg, values)
        m.update(groups.policy.update(train, adv, ref_logp))
        if groups.value is not None:
            m.update(groups.value.update(train, values, returns))
            m["explained_variance"] = A.explained_variance(values, returns, train.response_mask.float())
    m["time_policy"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    exps, golds, n_replay = ar_rows(everything, replay, cfg, step, data, groups.ar_sidecar)
    if replay is not None:
        m["ar_replay_rows"] = float(n_replay)
    m.update(groups.reconstructor.update(exps, golds))
    m["time_ar"] = time.perf_counter() - t2
    return m


def run_rl(cfg: RLConfig, *, resume: bool = False, groups: WorkerGroups | None = None) -> RLResult:
    """Run (or resume) RL; returns the last checkpoint and final metrics."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = out / "checkpoints"
    seed_everything(cfg.seed)
    apply_threads(cfg.threads)
    data = RLData.load(cfg.dataset)
    eval_data = RLData.load(cfg.eval_dataset) if cfg.eval_dataset else None
    ckpt = latest_rl_checkpoint(out) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no RL checkpoint under {root}; run without --resume to start fresh")
    # rl.autocast: the step's forwards in bf16, the heads in fp32 (nla.util.precision); prepared before the
    # roles are built, ahead of any matmul of theirs (torch settles its bf16 kernels at the first one)
    amp_device = resolve_device(cfg.device)
    prepare_autocast(cfg.autocast, amp_device, "RLConfig.autocast")
    owns_groups = groups is None
    if groups is None:
        groups = build_groups(cfg, ckpt / "av" if ckpt else None, ckpt / "ar" if ckpt else None)
    if cfg.autocast is not None:
        for model in (groups.policy.model, groups.reference.model, groups.rollout.model, groups.reconstructor.ar):
            keep_heads_fp32(model)
    # Building the groups may draw from the RNG (local backends initialise heads in-process,
    # remote ones do not): re-seed so a seeded run samples the same tokens on any backend.
    seed_everything(cfg.seed)
    if groups.av_sidecar.d_model != data.vectors.shape[1]:
        raise ValueError(
            f"d_model: {cfg.dataset} holds {data.vectors.shape[1]}-d vectors but the AV sidecar says "
            f"{groups.av_sidecar.d_model}; use the RL parquet built for this subject model and layer"
        )
    check_run_provenance(cfg, groups.av_sidecar, groups.ar_sidecar)
    scale = groups.ar_sidecar.mse_scale_value()
    baseline = check_spread(data.vectors, scale, f"dataset {cfg.dataset}").raw_mean
    eval_baseline = (check_spread(eval_data.vectors, scale, f"eval_dataset {cfg.eval_dataset}").raw_mean
                     if eval_data else baseline)
    check_rollout_rows(cfg, data.vectors.shape[0])
    cursor = DataCursor(n=data.vectors.shape[0], seed=cfg.seed)
    replay = ReplayData.for_run(cfg, data.vectors.shape[1])
    step = restore_checkpoint(ckpt, groups, cfg, cursor) if ckpt is not None else 0
    save_rl_config(cfg, out / "rl_config.yaml")
    stop = min(cfg.steps, cfg.stop_after_steps or cfg.steps)
    metrics_log = MetricsLogger(out, "rl", tensorboard=cfg.tensorboard)
    # The live AR's bound method: every reward comes from its current weights (no copy).
    service = RewardService(groups.reconstructor.mse_batch, cfg.reward.reward_batch_size,
                            cfg.reward.reward_flush_seconds, cfg.reward.reward_timeout_seconds,
                            inline=scores_inline(groups))
    last_ckpt, final, stuck = ckpt, {}, StuckRunMonitor("rl")
    bar = tqdm(total=stop, initial=step, desc="rl", disable=not cfg.progress)
    try:
        while step < stop:
            adapt_threads()
            t0 = time.perf_counter()
            with autocast(amp_device, cfg.autocast):
                m = rl_step(groups, cfg, data, cursor, service, replay, step, baseline,
                            guard=step == 0 and ckpt is None)
            if m.get("ar_rows", 0) > 0:
                check_finite_loss("rl (AR update)", step + 1, {"loss": m["ar_loss"]},
                                  f"reconstructor.lr={cfg.ar_lr_value:g}", last_ckpt)
            groups.rollout.sync_weights(groups.policy)
            step += 1
            stuck.observe(step, grad_norm=m.get("grad_norm"), failure_rate=m.get("extraction_fail_rate"))
            if eval_data is not None and (step % cfg.eval_every == 0 or step == stop):
                m.update(evaluate(groups, cfg, eval_data, eval_baseline, service))
            m["time_step"] = time.perf_counter() - t0
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # this process's GPU high-water mark
                m["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if step % cfg.log_every == 0 or step == stop:
                metrics_log.log(step, **m)
            final.update(m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", fve=f"{m.get('fve_nrm', float('nan')):.3f}")
            if step % cfg.checkpointing.save_every == 0 or step == stop:
                last_ckpt = save_checkpoint(root, step, groups, cfg, cursor, cfg.checkpointing.keep_last)
    finally:
        bar.close()
        service.close()
        if owns_groups:
            groups.close()
        metrics_log.plot(out / "rl_curves.png", PLOT_KEYS, title="RL")
        metrics_log.close()
    final["stuck_warnings"] = stuck.warnings
    from nla.util.numerics import cpu_paths

    (out / "rl_summary.json").write_text(json.dumps({"step": step, **final, "cpu_paths": cpu_paths()}, indent=2,
                                                    default=float))
    return RLResult(out, last_ckpt, {"step": step, **final}, time.perf_counter() - t_start)
