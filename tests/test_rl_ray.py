"""The Ray backend against the local one on the ``pair`` fixture of test_rl_loop.

Real Ray (local cluster started by nla), gloo + FSDP2 on CPU. Ray starts once per test
that needs it; the module stays near two minutes on 2 cores.
"""

import os
import time

import numpy as np
import pytest
import torch
from conftest import assert_close_up_to_adam_eps
from test_rl_loop import _cfg, _class_vectors, _one_thread, pair  # noqa: F401  (fixtures used by name)

from nla.rl.distributed import micro_chunks, rank_rows
from nla.rl.loop import run_rl
from nla.rl.reward import RewardBatcher, score_all
from nla.util.metrics import read_metrics

ray = pytest.importorskip("ray")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _alive(p)]
    return left


_STEP_KEYS = ("reward_mean", "policy_loss", "pg_loss", "kl", "ar_loss", "response_len")


def _same_steps(local, remote, steps: int, keys=_STEP_KEYS, grad_key: str = "grad_norm"):
    """The local and the Ray run's step records, asserted equal: ``keys`` to 1e-4 absolute (float
    summation order: FSDP reduce-scatters gradients over 2 ranks where the local backend sums in
    one pass, ~1e-7 relative per step, amplified by Adam's normalisation of tiny gradients; a
    mis-normalised gradient changes policy_loss at the 1e-2 level) and ``grad_key`` to 1e-3 relative."""
    a = [r for r in read_metrics(local / "rl.jsonl") if "reward_mean" in r]
    b = [r for r in read_metrics(remote / "rl.jsonl") if "reward_mean" in r]
    assert len(a) == len(b) == steps
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], abs=1e-4), (ra["step"], key)
        assert ra[grad_key] == pytest.approx(rb[grad_key], rel=1e-3)
    return a, b


def _same_tensors(wa: dict, wb: dict) -> None:
    """Two saved state dicts: the same keys, the same values to the tolerance of ``_same_steps``."""
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=1e-3)


def _same_tensors_up_to_adam_eps(wa: dict, wb: dict) -> None:
    """``_same_tensors`` for the LoRA test's lr 3e-2 and 2 steps, where a weight whose gradient is near
    Adam's eps may move by a share of lr (conftest.assert_close_up_to_adam_eps)."""
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        assert_close_up_to_adam_eps(wb[k], wa[k], lr=3e-2, steps=2, atol=1e-4, rtol=1e-3)


# ----------------------------------------------------------------------------- pure partition helpers
@pytest.mark.parametrize("n,world,mbs", [(16, 2, 16), (9, 2, 4), (3, 2, 1), (1, 3, 2), (24, 3, 5)])
def test_partition_uses_every_row_once_with_equal_micro_counts(n, world, mbs):
    # e.g. n=9, W=2, mbs=4: slices 5 and 4 rows; K = ceil(ceil(9/2)/4) = ceil(5/4) = 2 on both ranks
    # (chunks 3+2 and 2+2). n=1, W=3: ranks 1 and 2 own nothing and run K=1 (empty) dummy chunk.
    seen = []
    counts = set()
    for r in range(world):
        chunks = micro_chunks(rank_rows(n, world, r), n, world, mbs)
        counts.add(len(chunks))
        assert all(len(c) <= mbs for c in chunks)
        seen += [int(i) for c in chunks for i in c]
    assert sorted(seen) == list(range(n))
    assert len(counts) == 1  # every rank runs the same number of (collective) forwards
    with pytest.raises(ValueError, match="rank=2, world=2"):
        rank_rows(4, 2, 2)


# ----------------------------------------------------------------------------- against the local backend
@pytest.mark.ray
@pytest.mark.slow
def test_ray_matches_local_rewards_and_losses(pair, tmp_path):  # noqa: F811
    from nla.rl.backend import build_groups

    local = tmp_path / "local"
    cfg_local = _cfg(pair, local, steps=3, checkpointing=dict(save_every=3))
    # Built before run_rl seeds: building local models draws from the driver's RNG (weight
    # init of modules later overwritten), building Ray actors does not; this way both runs
    # sample from the same seeded stream.
    local_groups = build_groups(cfg_local)
    run_rl(cfg_local, groups=local_groups)
    remote = tmp_path / "ray"
    res = run_rl(_cfg(pair, remote, steps=3, checkpointing=dict(save_every=3),
                      backend=dict(name="ray", num_policy_workers=2, num_reconstructor_workers=2)))
    assert not ray.is_initialized()  # nla started Ray, so closing the groups shut it down
    # Same seed -> same sampled tokens (the driver RNG travels with generate): same rewards and losses
    a, b = _same_steps(local, remote, 3)
    # step 1: same weights, same AR math; the local AR runs its last block at the read token
    # only (Reconstructor._predict_last_block), the sharded one the whole block: float rounding
    assert a[0]["reward_mean"] == pytest.approx(b[0]["reward_mean"], rel=1e-6)
    from safetensors.torch import load_file

    _same_tensors(load_file(str(local / "checkpoints" / res.checkpoint_dir.name / "av" / "model.safetensors")),
                  load_file(str(res.checkpoint_dir / "av" / "model.safetensors")))

    # backend.sharding: replicate: every rank the whole model, one gradient all-reduce per step,
    # generation from the policy itself: the same run again
    replicated = tmp_path / "ray-replicate"
    res_r = run_rl(_cfg(pair, replicated, steps=3, checkpointing=dict(save_every=3),
                        backend=dict(name="ray", num_policy_workers=2, num_reconstructor_workers=2,
                                     sharding="replicate")))
    assert not ray.is_initialized()
    _same_steps(local, replicated, 3)
    for role in ("av", "ar"):
        _same_tensors(load_file(str(local / "checkpoints" / res.checkpoint_dir.name / role / "model.safetensors")),
                      load_file(str(res_r.checkpoint_dir / role / "model.safetensors")))
    # the optimizer state is FSDP's name-keyed full format, so a run resumes under either sharding
    states = [torch.load(r.checkpoint_dir / "rl_state.pt", weights_only=False) for r in (res, res_r)]
    for role in ("policy", "reconstructor"):
        sharded, whole = (st[role] for st in states)
        assert sharded["format"] == whole["format"] == "full_fqn"
        assert sharded["optimizer"]["state"].keys() == whole["optimizer"]["state"].keys()
        for k, st in sharded["optimizer"]["state"].items():
            _same_tensors(st, whole["optimizer"]["state"][k])


# ----------------------------------------------------------------------------- live AR, failures, cleanup
@pytest.mark.ray
@pytest.mark.slow
def test_live_ar_dead_worker_and_resume(pair, tmp_path):  # noqa: F811
    from nla.rl.backend import build_groups
    from nla.rl.ray_backend import RayWorkerError

    cfg = _cfg(pair, tmp_path / "run", steps=4, backend=dict(name="ray", num_policy_workers=1,
                                                           num_reconstructor_workers=2))
    groups = build_groups(cfg)
    pids = [p for ps in groups.pids.values() for p in ps]
    assert len(pids) == 3
    try:
        # 1. rewards come from the live AR: one update, no checkpoint, different MSEs
        ar = groups.reconstructor
        gold = torch.randn(4, 64)
        items = [(f"the {w} is happy", gold[i]) for i, w in enumerate(["cat", "dog", "fish", "bird"])]
        batcher = RewardBatcher(ar.mse_batch, batch_size=2, flush_seconds=0.01)
        before = score_all(batcher, items)
        # One row over two AR ranks: rank 1 owns nothing and runs a zero-weight dummy micro-batch
        # (its forward/backward keep FSDP's collectives paired). The reported loss is that row's
        # MSE at the pre-update weights, i.e. its score above (one row: no padding).
        one = ar.update([items[0][0]], gold[:1])
        assert one["ar_rows"] == 1.0
        assert one["ar_loss"] == pytest.approx(before[0], rel=1e-5)
        ar.update([t for t, _ in items], gold)
        after = score_all(batcher, items)
        assert all(x != y for x, y in zip(before, after, strict=True))
        assert np.mean(after) < np.mean(before)

        # 2. an AR rank dies mid-run (after step 3's AR update): the next reward call fails loudly
        calls = {"n": 0}
        real_update = ar.update

        def update_then_kill(explanations, golds):
            out = real_update(explanations, golds)
            calls["n"] += 1
            if calls["n"] == 3:
                ray.kill(ar.actors[1], no_restart=True)
            return out

        ar.update = update_then_kill
        with pytest.raises(RayWorkerError, match=r"reconstructor worker rank 1 .*nla rl --resume"):
            run_rl(cfg, groups=groups)
    finally:
        groups.close()
    assert not ray.is_initialized()
    assert _wait_gone(pids) == []  # no actor process outlives close()

    # 3. resume from the step-2 checkpoint on fresh actors finishes the run, here with replicated
    # AR ranks: the FSDP run's name-keyed optimizer state loads into whole models
    res = run_rl(cfg.replace(backend=dict(name="ray", num_policy_workers=1, num_reconstructor_workers=2,
                                          sharding="replicate")), resume=True)
    recs = [r for r in read_metrics(tmp_path / "run" / "rl.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in recs][-2:] == [3, 4]
    assert res.metrics["step"] == 4
    assert not ray.is_initialized()


@pytest.mark.ray
@pytest.mark.slow
def test_two_rank_ppo_on_ray_matches_local_ppo(pair, tmp_path):  # noqa: F811
    """PPO (GAE with the value model) on 2 policy ranks and 2 AR ranks, under ``adamw: fused`` (each
    FSDP2 rank steps its shard with the fused kernel): the value role sharded beside the policy,
    each rank its rows; same seed -> the local fused run's rewards, losses, value losses, saved value
    model and AV and AR weights, to float summation order (as the GRPO test above, which runs the
    default optimiser). One test for both, as each needs a local run and a cluster of its own."""
    from safetensors.torch import load_file

    from nla.rl.backend import build_groups

    ppo = dict(loss=dict(advantage="gae", gamma=1.0, lam=0.95), steps=2, checkpointing=dict(save_every=2),
               adamw="fused")
    local = tmp_path / "local"
    cfg_local = _cfg(pair, local, **ppo)
    local_groups = build_groups(cfg_local)
    assert local_groups.value is not None
    run_rl(cfg_local, groups=local_groups)
    remote = tmp_path / "ray"
    res = run_rl(_cfg(pair, remote, **ppo, backend=dict(name="ray", num_policy_workers=2,
                                                        num_reconstructor_workers=2)))
    assert not ray.is_initialized()
    a, _ = _same_steps(local, remote, 2, keys=("reward_mean", "policy_loss", "pg_loss", "kl", "ar_loss", "value_loss",
                                               "explained_variance"), grad_key="value_grad_norm")
    assert a[0]["value_loss"] > 0  # the zero-initialised head predicts 0: a real loss, not a vacuous match
    _same_tensors(torch.load(local / "checkpoints" / res.checkpoint_dir.name / "value_model.pt"),
                  torch.load(res.checkpoint_dir / "value_model.pt"))
    for role in ("av", "ar"):
        _same_tensors(load_file(str(local / "checkpoints" / res.checkpoint_dir.name / role / "model.safetensors")),
                      load_file(str(res.checkpoint_dir / role / "model.safetensors")))


@pytest.mark.ray
@pytest.mark.slow
def test_two_rank_lora_on_ray_matches_local_lora(pair, tmp_path):  # noqa: F811
    """LoRA on 2 policy ranks and 2 AR ranks: the adapters FSDP-sharded with the frozen base, the
    reference the same shards with adapters off, every rank's rollout copy the merged AV
    (nla.core.lora.merged_items on the gathered tensors), the AR's adapters and head trained on its
    shards. Same seed -> the local LoRA run's rewards, losses and KL; the same merged checkpoints
    and adapters; after a last sync, each rank's copy writes the local policy's
    greedy explanations, which the adapters changed from the warm start's (2 of these 8)."""
    from safetensors.torch import load_file

    from nla.core.lora import adapter_dir_for
    from nla.rl.backend import build_groups

    # a high lr, so two steps move the adapters enough to change greedy explanations
    lora = dict(lora=dict(r=4, alpha=8.0), optimiser=dict(lr=3e-2), steps=2, checkpointing=dict(save_every=2),
                reconstructor=dict(lora_r=4))
    local = tmp_path / "local"
    cfg_local = _cfg(pair, local, **lora)
    local_groups = build_groups(cfg_local)
    vectors, rows = torch.tensor(_class_vectors(8, seed=3)[0]), torch.arange(8)
    start = local_groups.rollout.generate(vectors, rows, 1, 24, greedy=True).texts
    run_rl(cfg_local, groups=local_groups)
    want = local_groups.rollout.generate(vectors, rows, 1, 24, greedy=True).texts
    local_groups.close()
    assert want != start  # the adapters changed what the AV writes: a stale or unmerged copy would fail below
    remote = tmp_path / "ray"
    cfg_remote = _cfg(pair, remote, **lora, backend=dict(name="ray", num_policy_workers=2,
                                                        num_reconstructor_workers=2))
    groups = build_groups(cfg_remote)
    try:
        res = run_rl(cfg_remote, groups=groups)
        groups.rollout.sync_weights(groups.policy)
        got = groups.rollout.generate(vectors, rows, 1, 24, greedy=True).texts
    finally:
        groups.close()
    assert got == want
    _, b = _same_steps(local, remote, 2)
    assert b[0]["kl"] == pytest.approx(0.0, abs=1e-7) and b[1]["kl"] > 1e-6  # the reference is the base
    for role, files in (("av", ("model.safetensors",)), ("ar", ("model.safetensors", "value_head.safetensors"))):
        ckpt_local = local / "checkpoints" / res.checkpoint_dir.name / role
        for name in files:  # merged: plain HF weights, as the local run's
            wb = load_file(str(res.checkpoint_dir / role / name))
            assert not any(".lora_" in k or "base_layer" in k for k in wb)
            # lr 3e-2, 2 steps (conftest.assert_close_up_to_adam_eps: measured on an Intel Xeon under
            # MKL's AVX2 branch, 6 of 4,096 merged weights 1.3e-4 apart, 1 of 256 adapter weights 1.0e-3)
            _same_tensors_up_to_adam_eps(load_file(str(ckpt_local / name)), wb)
        _same_tensors_up_to_adam_eps(load_file(str(adapter_dir_for(ckpt_local) / "adapter_model.safetensors")),
                                     load_file(str(adapter_dir_for(res.checkpoint_dir / role) /
                                                   "adapter_model.safetensors")))


# ----------------------------------------------------------------------------- an existing cluster
@pytest.mark.ray
@pytest.mark.slow
def test_runs_on_an_existing_cluster_and_leaves_it_running(pair, tmp_path):  # noqa: F811
    """`ray start --head` by hand, then `nla rl --ray-address`: the run connects, finishes,
    disconnects, and the cluster it did not start is still up afterwards. Two runs' groups fit
    on it side by side."""
    import subprocess
    import sys
    from pathlib import Path

    from nla.rl.distributed import free_port

    ray_cli = str(Path(sys.executable).parent / "ray")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, env=env, timeout=120)
    try:
        address = next(n["NodeManagerAddress"] for n in _cluster_nodes(ray_cli, env)) + f":{port}"
        cfg = _cfg(pair, tmp_path / "run", steps=2, backend=dict(name="ray", ray_address=address,
                                                                  num_policy_workers=1, num_reconstructor_workers=1))
        # Two runs' worker groups on one cluster at once: each gets its own placement groups (Ray
        # refuses a second group of the same name).
        from nla.rl.backend import build_groups

        first = build_groups(cfg)
        try:
            second = build_groups(cfg)
            second.close()
        finally:
            first.close()
        res = run_rl(cfg)
        assert res.metrics["step"] == 2 and not ray.is_initialized()  # disconnected, not shut down
        assert any(n["Alive"] for n in _cluster_nodes(ray_cli, env))  # the cluster outlives the run
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, env=env, timeout=120)


def _cluster_nodes(ray_cli, env):
    # The head binds this machine's own interface address (Ray never advertises loopback).
    ray.init(address="auto")
    try:
        return ray.nodes()
    finally:
        ray.shutdown()


def test_dispatch_table_names_real_role_methods():
    """Every method the Ray proxies dispatch exists on the local role it stands for (one table, no
    typos), splits name batch-aligned arguments, and a method the table lacks is refused by name."""
    import inspect

    from nla.rl.distributed import DISPATCH
    from nla.rl.ray_backend import RayRole
    from nla.rl.roles import PolicyWorker, ReconstructorWorker, ReferenceWorker, RolloutWorker, ValueWorker

    classes = {"rollout": RolloutWorker, "policy": PolicyWorker, "reference": ReferenceWorker,
               "reconstructor": ReconstructorWorker, "value": ValueWorker}
    assert set(DISPATCH) == set(classes)
    for role, methods in DISPATCH.items():
        for name, d in methods.items():
            assert callable(getattr(classes[role], name, None)), f"{role}.{name}"
            assert d.rows in ("split", "all") and d.answer in ("cat", "first", "none")
            if d.share:
                assert "share" in inspect.signature(getattr(classes[role], name)).parameters
    role = RayRole(group=None, role="reference")
    with pytest.raises(AttributeError, match=r"reference.update is not dispatched.*\['logprobs'\]"):
        getattr(role, "update")  # noqa: B009
