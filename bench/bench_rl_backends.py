"""RL step time: local backend vs Ray backend layouts, measured in the same run on the same setup.

The setup is the RL test's tiny task (the world tiny subject model, d=64, as AV and AR base;
four class-prototype vectors; partly warm-started AV and AR built here in ~20 s), so what is
measured is the *overhead* of the Ray backend (actor calls, object store, collectives,
weight sync through a full state dict) on a model small enough that compute is cheap.
Each layout runs ``--steps`` RL steps; the first step (step-0 guard, warm-up) is dropped
and the median of the rest is reported, with the time to build the worker groups.

    .venv/bin/python -m bench.bench_rl_backends [--steps 6] [--layouts local,1x1,1x2,2x2]

A layout ``PxA`` is the ray backend with P policy ranks and A reconstructor ranks, each group
FSDP2-sharded; ``PxAr`` the same with ``backend.sharding: replicate`` (every rank the whole
model, one gradient all-reduce per optimiser step).

``--from-run RUN_DIR`` measures a real RL step instead: the RL stage of a quickstart run
(``RUN_DIR/rl/rl_config.yaml``: its warm-started AV and AR, its dataset and batch, e.g. the
default world's 16 prompts x 8 samples), every process at one torch thread, and prints the
rollout's samples/s and the step time of each layout as ratios against the first layout::

    .venv/bin/python -m bench.bench_rl_backends --from-run runs/quickstart-default --layouts 1x1,2x1,2x2

``--rollout-only CALLS`` times the rollout alone (issue 23's "rollout samples/s with 2 policy
ranks / 1 rank"): each layout's groups generate the same batch (the first ``--prompts`` rows of
the run's RL set, seed k for call k, so every layout samples the same tokens) ``CALLS`` times,
the first call dropped. Every layout's workers are up at once and the calls are taken in turn,
call by call, so each ratio compares neighbouring calls under the same load (this machine's
speed drifts by a quarter within minutes); no RL step runs between calls, so the policy and its
response lengths do not drift as they do from step to step::

    .venv/bin/python -m bench.bench_rl_backends --from-run runs/quickstart-default \
        --layouts 1x1r,2x2r --prompts 128 --rollout-only 6 --repeat 3

With ``--rollout-only``, a layout ``procK`` is the machine's ceiling for a K-rank rollout: K
plain OS processes (no Ray, no collectives, no object store), each at one torch thread with
its own local-backend copy of the AV, generate their contiguous shares of the same batch
(``nla.rl.distributed.rank_rows``, the shares the Ray ranks get, with the same RNG state, so
the same tokens) at the same moment, started together by a barrier; a call's time is the
slowest process's. ``proc2 / proc1`` is what two ranks could gain here if the backend cost
nothing; ``2x2r / 1x1r`` against it is what the Ray backend keeps of that::

    .venv/bin/python -m bench.bench_rl_backends --from-run runs/quickstart-default \
        --layouts proc1,proc2,1x1r,2x2r --prompts 128 --rollout-only 5 --repeat 2

Several runs side by side (e.g. the same-model pair against a cross-model one, issue 24), in
rounds taken in turn so the machine's drift hits every row alike::

    .venv/bin/python -m bench.bench_rl_backends --from-run runs/quickstart-default \
        runs/quickstart-default-pair-default-d64 --layouts local --repeat 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from nla.core.sidecar import NLAConfig, write_sidecar
from nla.core.templates import (
    AV_PLACEHOLDER,
    DEFAULT_AR_TEMPLATE,
    DEFAULT_AV_TEMPLATE,
    DEFAULT_INJECTION_CHAR,
)
from nla.datagen.io import vectors_to_arrow
from nla.rl.backend import build_groups
from nla.rl.config import RLConfig
from nla.rl.loop import run_rl
from nla.util.metrics import read_metrics

WORDS = ["cat", "dog", "bird", "fish"]
D = 64


def _vectors(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    protos = np.random.default_rng(0).normal(size=(len(WORDS), D))
    cls = np.arange(n) % len(WORDS)
    return (protos[cls] + 0.1 * np.random.default_rng(seed).normal(size=(n, D))).astype(np.float32), cls


def build_pair(root: Path) -> dict[str, str]:
    """Warm-started AV + AR checkpoints and an RL parquet on the world tiny subject model."""
    from nla.core.arch import load_tokenizer
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.train.config import ARTrainConfig, AVTrainConfig
    from nla.world import build_world

    base = build_world("tiny", progress=False).subject_dir
    side = NLAConfig.from_tokenizer(
        load_tokenizer(base), kind="nla_dataset", role=None, d_model=D, layer_index=1,
        av_template=DEFAULT_AV_TEMPLATE, ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR,
        injection_scale=8.0, base_model=str(base))
    vec, cls = _vectors(64, seed=1)
    texts = [f"the {WORDS[c]} is happy" for c in cls]
    msgs = [[{"role": "user", "content": DEFAULT_AV_TEMPLATE.format(injection_char=AV_PLACEHOLDER)}]] * len(vec)
    common = {"activation_vector": vectors_to_arrow(vec), "doc_id": pa.array(range(len(vec)), pa.int64())}
    av_ds, ar_ds, rl_ds = root / "av_sft.parquet", root / "ar_sft.parquet", root / "rl.parquet"
    pq.write_table(pa.table({**common, "prompt": pa.array(msgs), "explanation": pa.array(texts),
                             "response": pa.array([f"<explanation>\n{t}\n</explanation>" for t in texts])}), av_ds)
    pq.write_table(pa.table({**common, "prompt": pa.array([side.ar_text(t) for t in texts]),
                             "explanation": pa.array(texts)}), ar_ds)
    rl_vec, _ = _vectors(32, seed=2)
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(rl_vec),
                             "doc_id": pa.array(range(32), pa.int64())}), rl_ds)
    for p in (av_ds, ar_ds, rl_ds):
        write_sidecar(p, side)
    quiet = dict(tensorboard=False, progress=False, save_every=1000, warmup_steps=5, lr=3e-3)
    av = train_av(AVTrainConfig(dataset=str(av_ds), out_dir=str(root / "av"), max_steps=40, batch_size=8,
                                log_every=10, eval_every=40, eval_fraction=0.25, smoke_num=1,
                                smoke_max_new_tokens=8, **quiet))
    ar = train_ar(ARTrainConfig(dataset=str(ar_ds), out_dir=str(root / "ar"), max_steps=150, batch_size=16,
                                log_every=50, eval_every=150, eval_fraction=0.25, **quiet))
    return {"av": str(av.checkpoint_dir), "ar": str(ar.checkpoint_dir), "dataset": str(rl_ds)}


def _backend(layout: str) -> dict:
    """``local``, ``PxA`` (Ray, FSDP2) or ``PxAr`` (Ray, ``backend.sharding: replicate``)."""
    if layout == "local":
        return {"name": "local"}
    sharding = "replicate" if layout.endswith("r") else "fsdp"
    p, a = (int(x) for x in layout.rstrip("r").split("x"))
    return {"name": "ray", "num_policy_workers": p, "num_reconstructor_workers": a, "sharding": sharding}


def run_config(run_dir: Path, out: Path, layout: str, steps: int, prompts: int | None = None) -> RLConfig:
    """The RL stage of a quickstart run, for ``steps`` steps on ``layout``, one thread per process."""
    import yaml

    raw = yaml.safe_load((run_dir / "rl" / "rl_config.yaml").read_text())
    # the run's config names its inputs relative to the quickstart's working directory
    for section, key in ((None, "av"), (None, "ar"), (None, "dataset"), (None, "eval_dataset"),
                         ("reconstructor", "replay_dataset")):
        d = raw if section is None else raw[section]
        if d.get(key) and not Path(d[key]).is_absolute():
            d[key] = str(run_dir.parent.parent / d[key])
    if prompts:
        raw["rollout"]["rollout_batch_size"] = prompts
    cfg = RLConfig.from_dict(raw)
    return cfg.replace(out_dir=str(out), steps=steps, eval_every=10_000, tensorboard=False, progress=False,
                       threads=1, checkpointing=dict(save_every=10_000), backend=_backend(layout))


def measure(pair: dict[str, str] | RLConfig, out: Path, layout: str, steps: int, batch: tuple[int, int]
            ) -> dict[str, float]:
    if isinstance(pair, RLConfig):
        cfg = pair
    else:
        cfg = RLConfig.from_dict(dict(
            **pair, out_dir=str(out), steps=steps, eval_every=10_000, tensorboard=False, progress=False, seed=0,
            rollout=dict(rollout_batch_size=batch[0], n_samples_per_prompt=batch[1], max_response_len=24),
            optimiser=dict(micro_batch_size=16, lr=3e-4), reconstructor=dict(lr=1e-3),
            checkpointing=dict(save_every=10_000), backend=_backend(layout)))
    t0 = time.perf_counter()
    groups = build_groups(cfg)
    t_build = time.perf_counter() - t0
    try:
        run_rl(cfg, groups=groups)
    finally:
        groups.close()
    recs = [r for r in read_metrics(out / "rl.jsonl") if "time_step" in r][1:]  # drop the warm-up step
    med = {k: statistics.median(r[k] for r in recs)
           for k in ("time_step", "time_generate", "time_reward", "time_policy", "time_ar", "response_len")}
    med["build"] = t_build
    med["samples"] = statistics.median(r["train_groups"] for r in recs) * cfg.rollout.n_samples_per_prompt
    return med


class _GroupsRollout:
    """A layout's worker groups (local or Ray), kept alive across calls."""

    def __init__(self, cfg: RLConfig) -> None:
        from nla.rl.loop import RLData

        data = RLData.load(cfg.dataset)
        rows = torch.arange(min(cfg.rollout.rollout_batch_size, len(data.vectors)))
        self.vectors, self.rows, self.ro = data.vectors[rows], rows, cfg.rollout
        self.groups = build_groups(cfg)

    def call(self, k: int) -> dict[str, float]:
        torch.manual_seed(k)
        ro = self.ro
        t0 = time.perf_counter()
        r = self.groups.rollout.generate(self.vectors, self.rows, ro.n_samples_per_prompt, ro.max_response_len,
                                         ro.temperature, ro.top_p)
        return {"seconds": time.perf_counter() - t0, "samples": float(r.n), "tokens": float(r.response_mask.sum())}

    def close(self) -> None:
        self.groups.close()


def _proc_worker(rank: int, world: int, cfg: RLConfig, commands, barrier, results) -> None:
    """One process of a ``procK`` layout: its share of the batch for every call it is sent, one thread."""
    from nla.rl.backend import build_local_groups
    from nla.rl.distributed import rank_rows
    from nla.rl.loop import RLData

    torch.set_num_threads(1)
    data = RLData.load(cfg.dataset)
    B = min(cfg.rollout.rollout_batch_size, len(data.vectors))
    mine = rank_rows(B, world, rank)
    ro = cfg.rollout
    groups = build_local_groups(cfg)
    share = (int(mine[0]) if len(mine) else 0, B)
    results.put(("ready", rank))
    while (k := commands.get()) is not None:
        torch.manual_seed(k)
        barrier.wait()  # every process starts call k together
        t0 = time.perf_counter()
        r = groups.rollout.generate(data.vectors[mine], mine, ro.n_samples_per_prompt, ro.max_response_len,
                                    ro.temperature, ro.top_p, share=share)
        results.put((rank, k, time.perf_counter() - t0, float(r.n), float(r.response_mask.sum())))
    groups.close()


class _ProcRollout:
    """The ``proc{world}`` layout: ``world`` plain processes; a call's time is the slowest one's."""

    def __init__(self, cfg: RLConfig, world: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world, barrier, self.results = world, ctx.Barrier(world), ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        local = cfg.replace(backend={"name": "local"})
        self.procs = [ctx.Process(target=_proc_worker, args=(r, world, local, self.commands[r], barrier,
                                                              self.results)) for r in range(world)]
        for p in self.procs:
            p.start()
        self._gather(world)  # every process has loaded its models

    def _gather(self, n: int) -> list[tuple]:
        import queue

        got = []
        while len(got) < n:
            try:
                got.append(self.results.get(timeout=5))
            except queue.Empty:  # a process that died never answers: say so instead of waiting forever
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    self.close(kill=True)
                    raise SystemExit(f"proc{self.world}: a process exited with code {dead[0]} "
                                     "(its traceback is above)") from None
        return got

    def call(self, k: int) -> dict[str, float]:
        for q in self.commands:
            q.put(k)
        got = self._gather(self.world)
        return {"seconds": max(g[2] for g in got), "samples": sum(g[3] for g in got),
                "tokens": sum(g[4] for g in got)}

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.commands, strict=True):
            if kill:
                p.kill()
            else:
                q.put(None)
        for p in self.procs:
            p.join()


def main_rollout_only(run_dir: Path, layouts: list[str], prompts: int | None, calls: int, repeat: int) -> None:
    """Rollout samples/s of each layout. Every layout's workers stay up, and the calls are taken in
    turn, call by call (layout A, B, A, B, ...), so the ratio of each pair of neighbouring calls is
    measured under the same load; the table gives medians over calls and ``repeat`` rebuilds."""
    import math

    if calls < 2:
        raise SystemExit(f"--rollout-only {calls}: give at least 2 calls (the first is a warm-up, dropped)")
    per: dict[str, list[dict[str, float]]] = {lay: [] for lay in layouts}
    ratios: dict[str, list[float]] = {lay: [] for lay in layouts}
    ray_layouts = [lay for lay in layouts if not lay.startswith("proc") and lay != "local"]
    with tempfile.TemporaryDirectory(prefix="nla-bench-rollout-") as tmp:
        for r in range(repeat):
            if ray_layouts:  # one Ray session big enough for every layout's actors at once
                import ray

                from nla.rl.ray_backend import CPU_ACTOR_CPUS

                n_actors = sum(sum(int(x) for x in lay.rstrip("r").split("x")) for lay in ray_layouts)
                ray.init(num_cpus=max(1, math.ceil(CPU_ACTOR_CPUS * n_actors)), include_dashboard=False)
            live = {}
            try:
                for lay in layouts:
                    if lay.startswith("proc"):
                        cfg = run_config(run_dir, Path(tmp) / f"{lay}-{r}", "local", 1, prompts)
                        live[lay] = _ProcRollout(cfg, int(lay[4:]))
                    else:
                        live[lay] = _GroupsRollout(run_config(run_dir, Path(tmp) / f"{lay}-{r}", lay, 1, prompts))
                for k in range(calls):
                    got = {lay: w.call(k) for lay, w in live.items()}
                    if not k:
                        continue  # the warm-up
                    sps = {lay: g["samples"] / g["seconds"] for lay, g in got.items()}
                    for lay, g in got.items():
                        per[lay].append(g)
                        ratios[lay].append(sps[lay] / sps[layouts[0]])
                    print(f"  round {r + 1} call {k}: samples/s "
                          + " ".join(f"{lay} {v:.1f}" for lay, v in sps.items()), flush=True)
            finally:
                for w in live.values():
                    w.close()
                if ray_layouts:
                    ray.shutdown()
    n = int(per[layouts[0]][0]["samples"])
    print(f"\nrollout alone ({n} samples per call), {repeat} round(s) x {calls - 1} timed call(s) taken in turn, "
          f"one torch thread per process; 'vs': median over calls of the ratio to {layouts[0]}'s neighbouring call")
    lines = []
    for lay, cs in per.items():
        sps = [c["samples"] / c["seconds"] for c in cs]
        tokens = statistics.mean(c["tokens"] / c["samples"] for c in cs)
        rs = ratios[lay]
        lines.append(f"{lay:<8} {statistics.median(sps):10.1f} {statistics.median(rs):6.2f}x {min(rs):6.2f}x "
                     f"{max(rs):6.2f}x {tokens:9.2f}")
    _table(f"{'layout':<8} {'samples/s':>10} {'vs':>7} {'min vs':>7} {'max vs':>7} {'resp len':>9}", lines)
    print("resp len: mean response tokens per sample (equal across layouts: the same tokens are sampled)")


TIMES_HEAD = f"{'gen s':>7} {'reward s':>9} {'policy s':>9} {'ar s':>7} {'build s':>8}"


def _times(m: dict[str, float]) -> str:
    return (f"{m['time_generate']:7.3f} {m['time_reward']:9.3f} {m['time_policy']:9.3f} {m['time_ar']:7.3f} "
            f"{m['build']:8.2f}")


def _table(head: str, lines: list[str]) -> None:
    print(head)
    print("-" * len(head))
    for line in lines:
        print(line)


def main_from_run(run_dirs: list[Path], layouts: list[str], steps: int, prompts: int | None,
                  repeat: int = 1) -> None:
    """Every (run, layout) pair, ``repeat`` rounds in turn (A, B, A, B: drift hits both alike);
    each row is the median over its rounds, ratios against the first row."""
    with tempfile.TemporaryDirectory(prefix="nla-bench-rl-") as tmp:
        rounds: dict[tuple[Path, str], list[dict[str, float]]] = {}
        for r in range(repeat):
            for run_dir in run_dirs:
                for lay in layouts:
                    out = Path(tmp) / f"run-{len(rounds)}-{r}-{lay}"
                    m = measure(run_config(run_dir, out, lay, steps, prompts), out, lay, steps, (0, 0))
                    rounds.setdefault((run_dir, lay), []).append(m)
                    print(f"  {run_dir.name} {lay} (round {r + 1}): step {m['time_step']:.3f} s, generate "
                          f"{m['time_generate']:.3f} s", flush=True)
    rows = {key: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for key, ms in rounds.items()}
    first = next(iter(rows))
    base = rows[first]
    print(f"\nRL step ({int(base['samples'])} samples/step), median of steps 2..{steps} and of {repeat} round(s), "
          f"one torch thread per process; ratios against {first[0].name} {first[1]}")
    lines = []
    for (run_dir, lay), m in rows.items():
        sps = m["samples"] / m["time_generate"]
        label = f"{run_dir.name} {lay}" if len(run_dirs) > 1 else lay
        lines.append(f"{label:<48} {sps:10.1f} {sps / (base['samples'] / base['time_generate']):6.2f}x "
                     f"{m['time_step']:8.3f} {base['time_step'] / m['time_step']:6.2f}x " + _times(m)
                     + f" {m['response_len']:8.1f}")
    _table(f"{'run / layout':<48} {'samples/s':>10} {'vs':>7} {'step s':>8} {'vs':>7} " + TIMES_HEAD
           + f" {'resp len':>8}", lines)
    print("samples/s: rollout samples per second of generation; step 'vs': speed-up of the whole step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layouts", default="local,1x1,1x2,2x2")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 4; --from-run: the run's)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the driver (actors use 1)")
    ap.add_argument("--from-run", type=Path, nargs="+", default=None,
                    help="quickstart run dir(s): measure their RL stage (module docstring); several: side by side")
    ap.add_argument("--repeat", type=int, default=1, help="--from-run: rounds in turn over runs and layouts")
    ap.add_argument("--rollout-only", type=int, default=None, metavar="CALLS",
                    help="--from-run: time CALLS rollouts of one batch per layout and round, no RL step")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    layouts = args.layouts.split(",")
    if args.rollout_only is None and any(lay.startswith("proc") for lay in layouts):
        raise SystemExit(f"--layouts {args.layouts}: a procK layout times a rollout alone; add --rollout-only CALLS")
    if args.rollout_only is not None:
        if args.from_run is None or len(args.from_run) != 1:
            raise SystemExit("--rollout-only needs --from-run with one run directory")
        main_rollout_only(args.from_run[0].resolve(), layouts, args.prompts, args.rollout_only, args.repeat)
        return
    if args.from_run is not None:
        main_from_run([p.resolve() for p in args.from_run], layouts, args.steps, args.prompts, args.repeat)
        return
    args.prompts = args.prompts or 4
    with tempfile.TemporaryDirectory(prefix="nla-bench-rl-") as tmp:
        root = Path(tmp)
        pair = build_pair(root)
        rows = {lay: measure(pair, root / f"run-{lay}", lay, args.steps, (args.prompts, args.samples))
                for lay in layouts}
    base = rows.get("local", next(iter(rows.values())))["time_step"]
    print(f"\nRL step time, median of steps 2..{args.steps}, {args.prompts}x{args.samples} samples/step, "
          f"{torch.get_num_threads()} driver thread(s), world tiny model (d={D})")
    _table(f"{'layout':<8} {'step s':>8} {'vs local':>9} " + TIMES_HEAD,
           [f"{lay:<8} {m['time_step']:8.3f} {m['time_step'] / base:8.2f}x " + _times(m) for lay, m in rows.items()])
    print("layout PxA = ray backend with P policy ranks and A reconstructor ranks (FSDP2; PxAr: replicated); "
          "build = actor start + model load + sharding (local: model load)")


if __name__ == "__main__":
    main()
