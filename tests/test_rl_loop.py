"""The RL loop end to end on a task where the vector decides the right answer.

Four classes, each a prototype vector; the warm-started AV names a class word in its
explanation and the AR maps "the <word> is happy" back to that class's prototype. RL with
the live AR as reward must raise the mean reward; the mechanics (live AR, step-0 guard,
checkpoints, resume, PPO and DAPO paths) are checked on the same fixture.
"""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import assert_close_up_to_adam_eps
from train_helpers import dataset_sidecar, write_av_dataset

from nla.core.reward import FAILED_EXTRACTION_REWARD, FAILED_EXTRACTION_REWARD_LOG
from nla.core.sidecar import load_sidecar, write_sidecar
from nla.datagen.io import vectors_to_arrow
from nla.rl.algorithms import LOSS_AGG_MODES
from nla.rl.backend import build_groups
from nla.rl.config import RLConfig, load_rl_config
from nla.rl.loop import RLGuardError, run_rl, step0_guard
from nla.rl.reward import RewardBatcher, RewardService, score_all
from nla.train.ar import train_ar
from nla.train.av import train_av
from nla.train.config import ARTrainConfig, AVTrainConfig
from nla.util.metrics import read_metrics

WORDS = ["cat", "dog", "bird", "fish"]
D = 64  # the world tiny subject model's width


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def _class_vectors(n: int, seed: int):
    rng = np.random.default_rng(0)  # the same prototypes for every split
    protos = rng.normal(size=(len(WORDS), D))
    noise = np.random.default_rng(seed)
    cls = np.arange(n) % len(WORDS)
    return (protos[cls] + 0.1 * noise.normal(size=(n, D))).astype(np.float32), cls


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Warm-started AV + AR checkpoints and an RL parquet (built once per module).

    The base is the world tiny subject model (cached build): its byte-level BPE decodes
    text exactly, so explanations round-trip through generation and tag extraction.
    """
    from nla.core.arch import load_tokenizer
    from nla.world import build_world

    root = tmp_path_factory.mktemp("rl")
    base = build_world("tiny", progress=False).subject_dir
    side = dataset_sidecar(load_tokenizer(base), base, D, 1, injection_scale=8.0)
    vec, cls = _class_vectors(64, seed=1)
    texts = [f"the {WORDS[c]} is happy" for c in cls]
    av_ds = write_av_dataset(root / "av_sft.parquet", side, vec, texts)
    # The AV is only partly warm-started (few steps) so RL has room to improve it.
    av = train_av(AVTrainConfig(dataset=str(av_ds), out_dir=str(root / "av"), max_steps=40, batch_size=8, lr=3e-3,
                                warmup_steps=5, log_every=10, eval_every=40, save_every=1000, eval_fraction=0.25,
                                tensorboard=False, progress=False, smoke_num=1, smoke_max_new_tokens=8))
    ar_ds = root / "ar_sft.parquet"
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec), "doc_id": pa.array(range(64), pa.int64()),
                             "prompt": pa.array([side.ar_text(t) for t in texts]), "explanation": pa.array(texts)}),
                   ar_ds)
    write_sidecar(ar_ds, side)
    ar = train_ar(ARTrainConfig(dataset=str(ar_ds), out_dir=str(root / "ar"), max_steps=150, batch_size=16, lr=3e-3,
                                warmup_steps=5, log_every=50, eval_every=150, save_every=1000, eval_fraction=0.25,
                                tensorboard=False, progress=False))
    rl_vec, _ = _class_vectors(32, seed=2)
    rl_ds = root / "rl.parquet"
    pq.write_table(pa.table({"activation_vector": vectors_to_arrow(rl_vec),
                             "doc_id": pa.array(range(32), pa.int64())}), rl_ds)
    write_sidecar(rl_ds, side)
    return {"av": str(av.checkpoint_dir), "ar": str(ar.checkpoint_dir), "dataset": str(rl_ds), "root": root,
            "ar_fve": ar.metrics.get("eval_fve")}


def _cfg(pair, out, **kw) -> RLConfig:
    """The fixture's config; ``kw``: top-level fields, or sections as mappings of the keys to change."""
    base = RLConfig.from_dict(dict(
        av=pair["av"], ar=pair["ar"], dataset=pair["dataset"], out_dir=str(out), steps=4, eval_every=1000,
        tensorboard=False, progress=False, seed=0,
        rollout=dict(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=24),
        optimiser=dict(micro_batch_size=16, lr=3e-4), reconstructor=dict(lr=1e-3), checkpointing=dict(save_every=2)))
    return base.replace(**kw)


def test_config_guards_name_the_field(pair, tmp_path):
    with pytest.raises(ValueError, match="optimiser.global_batch_size"):
        _cfg(pair, tmp_path, optimiser=dict(global_batch_size=8))  # two steps per rollout without opting in
    assert _cfg(pair, tmp_path, optimiser=dict(global_batch_size=8, allow_multiple_updates=True)
                ).updates_per_rollout == 2
    with pytest.raises(ValueError, match="loss.advantage: expected one of"):
        _cfg(pair, tmp_path, loss=dict(advantage="ppo2"))
    with pytest.raises(ValueError, match="rollout.n_samples_per_prompt: expected >= 2 for the group baseline"):
        _cfg(pair, tmp_path, rollout=dict(n_samples_per_prompt=1))
    with pytest.raises(ValueError, match="unknown config key"):
        load_rl_config(None, {"av": "a", "ar": "b", "dataset": "c", "lerning_rate": 1})


def test_reward_uses_the_live_reconstructor(pair, tmp_path):
    groups = build_groups(_cfg(pair, tmp_path))
    ar = groups.reconstructor
    gold = torch.randn(4, D)
    items = [("the cat is happy", gold[0]), ("the dog is happy", gold[1]), ("the fish is happy", gold[2]),
             ("the bird is happy", gold[3])]
    batcher = RewardBatcher(ar.mse_batch, batch_size=2, flush_seconds=0.01)
    before = score_all(batcher, items)
    ar.update([t for t, _ in items], gold)  # one AR step, no checkpoint written in between
    after = score_all(batcher, items)
    assert batcher.stats.n_batches == 4  # 2 calls x ceil(4 / 2)
    assert all(b != a for b, a in zip(before, after, strict=True))
    # after a step towards the golds, the MSEs fall on average
    assert np.mean(after) < np.mean(before)


def test_step0_guard_passes_and_refuses(pair, tmp_path):
    cfg = _cfg(pair, tmp_path)
    groups = build_groups(cfg)
    vec = torch.from_numpy(_class_vectors(4, 3)[0])
    r = groups.rollout.generate(vec, torch.arange(4), 2, cfg.rollout.max_response_len)
    diff = step0_guard(groups, r, tol=1e-4)  # left- vs right-padded AR layouts agree in fp32
    assert diff < 1e-4
    # Break the layout the way a real bug would: reading the last *position* instead of
    # the last real token is right for left padding and wrong for right padding.
    ar = groups.reconstructor.ar

    def predict_last_position(input_ids, attention_mask):
        return ar(input_ids, attention_mask)[:, -1]

    ar.predict = predict_last_position
    with pytest.raises(RLGuardError, match="step0_guard_tol"):
        step0_guard(groups, r, tol=1e-4)


def test_rollout_statuses_and_failed_reward(pair, tmp_path):
    cfg = _cfg(pair, tmp_path, rollout=dict(max_response_len=4))  # too short for any complete explanation
    groups = build_groups(cfg)
    vec = torch.from_numpy(_class_vectors(2, 3)[0])
    r = groups.rollout.generate(vec, torch.arange(2), 3, cfg.rollout.max_response_len)
    assert r.n == 6 and r.group.tolist() == [0, 0, 0, 1, 1, 1]
    from nla.rl.loop import score_rollout
    from nla.rl.types import COMPLETED

    with RewardService(groups.reconstructor.mse_batch, 8, 0.01) as service:
        score_rollout(r, service, cfg, groups.ar_sidecar.mse_scale_value())
    failed = r.status != COMPLETED
    assert failed.all()  # 3 tokens cannot hold "<explanation> x </explanation>" + EOS
    assert torch.all(r.rewards[failed] == FAILED_EXTRACTION_REWARD)
    # a failed sample holds the MSE it is charged (2.0 at sqrt(d)), as nla eval counts it
    assert torch.all(r.mse[failed] == 2.0)
    from nla.rl.loop import rollout_metrics

    m = rollout_metrics(r, baseline=0.8)
    assert m["mse_nrm"] == 2.0 and m["fve_nrm"] == pytest.approx(1.0 - 2.0 / 0.8)


def config_rewards(status, mse, lengths, cfg, degenerate=None, *, failed_cost):
    """The rewards [N] the config's reward section makes: what fill_rewards (score_samples) applies to
    every rollout; a sample whose explanation was not extracted costs ``failed_cost``."""
    from nla.rl.loop import reward_settings
    from nla.rl.types import COMPLETED

    return reward_settings(cfg).rewards(mse, status != COMPLETED, failed_cost, lengths, degenerate)


def test_the_reward_section_makes_rewards_by_hand():
    from nla.rl.types import COMPLETED, FAILED_EXTRACTION, TRUNCATED

    status = torch.tensor([COMPLETED, TRUNCATED, FAILED_EXTRACTION, COMPLETED])
    # row 2 failed although an MSE of 0.0 sits in its slot (say, scored against a zero gold):
    # a failure always counts as the orthogonal MSE 2.0, whatever its gold or its slot holds.
    mse = torch.tensor([0.5, float("nan"), 0.0, 1.0])
    lengths = torch.tensor([10, 3, 8, 6])
    cfg = RLConfig.from_dict(dict(av="a", ar="b", dataset="c", rollout=dict(max_response_len=10)))
    kw = dict(failed_cost=2.0)
    torch.testing.assert_close(config_rewards(status, mse, lengths, cfg, **kw), torch.tensor([-0.5, -2.0, -2.0, -1.0]))
    # -log variant: [-log 0.5, -log 2, -log 2, -log 1] = [log 2, -log 2, -log 2, 0]
    log2 = float(np.log(2.0))
    log_cfg = cfg.replace(reward=dict(log_mse=True))
    torch.testing.assert_close(config_rewards(status, mse, lengths, log_cfg, **kw),
                               torch.tensor([log2, -log2, -log2, 0.0]))
    assert config_rewards(status, mse, lengths, log_cfg, **kw)[1].item() == pytest.approx(
        FAILED_EXTRACTION_REWARD_LOG, abs=1e-7)
    # overlong: cap 10, buffer 4 -> expected 6; lengths 10, 3, 8, 6 -> penalties -1, 0, -0.5, 0
    over = cfg.replace(reward=dict(overlong_buffer_len=4, overlong_penalty_factor=1.0))
    torch.testing.assert_close(config_rewards(status, mse, lengths, over, **kw), torch.tensor([-1.5, -2.0, -2.5, -1.0]))


def test_a_failure_costs_the_orthogonal_mse_at_the_ars_own_scale():
    """Issue 20, defect 1: at mse_scale s the real MSEs lie in [0, 4 s^2 / d]; a constant 2.0 let a
    failure out-score real answers once s > sqrt(d) (here s = 2 sqrt(d): a real answer at
    cos 0.5 costs 2 s^2/d (1 - cos) = 4.0, twice the old constant)."""
    from nla.core.reward import failed_mse
    from nla.rl.loop import fill_rewards
    from nla.rl.types import COMPLETED, FAILED_EXTRACTION, Rollout

    d = 16
    s = 2.0 * d ** 0.5
    gold = torch.randn(3, d)
    cost = failed_mse(gold, s)
    assert torch.all(cost == 2.0 * s * s / d) and cost[0].item() == pytest.approx(8.0)
    cfg = RLConfig.from_dict(dict(av="a", ar="b", dataset="c", rollout=dict(max_response_len=8)))
    r = Rollout(explanations=["a cat", None, "a dog"], texts=["x", "y", "z"],
                status=torch.tensor([COMPLETED, FAILED_EXTRACTION, COMPLETED]),
                prompt_rows=torch.arange(3), group=torch.arange(3), vectors=gold,
                prompt_ids=torch.zeros(2, dtype=torch.long), response_ids=torch.zeros(3, 8, dtype=torch.long),
                response_mask=torch.ones(3, 8, dtype=torch.long))
    fill_rewards(r, [4.0, 0.5], cfg, s)  # the AR's mse of rows 0 and 2
    torch.testing.assert_close(r.rewards, torch.tensor([-4.0, -8.0, -0.5]))
    assert r.rewards[1] < r.rewards[0]  # failing is worse than a cos-0.5 answer at any scale
    # raw comparison (scale None): 2 |g|^2 / d per row, from the gold itself
    fill_rewards(r, [4.0, 0.5], cfg, None)
    assert r.rewards[1].item() == pytest.approx(-2.0 * float(gold[1].double().pow(2).mean()), rel=1e-6)


@pytest.mark.parametrize("loss_agg", sorted(LOSS_AGG_MODES))
def test_policy_update_is_the_same_on_any_micro_batch_split(pair, tmp_path, loss_agg):
    # One policy step on one rollout, with the whole batch in one micro-batch and split 3+3+2:
    # the loss and the (pre-clip) gradient norm agree, and so do the weights after the step.
    # The rollout has responses of varied length, so token and row weights differ.
    from nla.rl.algorithms import broadcast_to_tokens, grpo_advantages

    whole_cfg = _cfg(pair, tmp_path, loss=dict(loss_agg=loss_agg), optimiser=dict(micro_batch_size=8, max_grad_norm=1e9),
                     rollout=dict(n_samples_per_prompt=4, rollout_batch_size=2))
    results = []
    for cfg in (whole_cfg, whole_cfg.replace(optimiser=dict(micro_batch_size=3))):
        torch.manual_seed(0)
        groups = build_groups(cfg)
        vec = torch.from_numpy(_class_vectors(2, 5)[0])
        r = groups.rollout.generate(vec, torch.arange(2), 4, cfg.rollout.max_response_len)
        assert len(set(r.lengths.tolist())) > 1
        adv = broadcast_to_tokens(grpo_advantages(torch.linspace(-1, 1, r.n), 4), r.response_mask.float())
        ref = groups.reference.logprobs(r) - 0.05  # a KL term that is not zero
        m = groups.policy.update(r, adv, ref)
        weights = {k: v.detach().clone() for k, v in groups.policy.model.named_parameters()}
        results.append((r.response_ids, m, weights))
    (ids_a, m_a, w_a), (ids_b, m_b, w_b) = results
    assert torch.equal(ids_a, ids_b)  # the same seeded rollout
    for key in ("policy_loss", "pg_loss", "kl", "grad_norm"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-5, abs=1e-7), key
    # Adam's first step is ~lr x sign(g) (lr 3e-4): float-order noise in a gradient entry near
    # Adam's eps can move its weight by ~1e-5 (measured: 1.3e-5, one embedding row of the tiny
    # world's subject), a wrong weighting by ~lr; the tolerance is a tenth of lr.
    for k in w_a:
        torch.testing.assert_close(w_b[k], w_a[k], rtol=1e-5, atol=3e-5)


def test_optimizer_state_of_another_backend_is_refused(pair, tmp_path):
    groups = build_groups(_cfg(pair, tmp_path))
    state = groups.policy.optim_state()
    assert state["format"] == "local"
    groups.policy.load_optim_state({k: v for k, v in state.items() if k != "format"})  # older local checkpoints
    with pytest.raises(ValueError, match=r"expected the 'local' format of this backend, found 'full_fqn'"):
        groups.reconstructor.load_optim_state({**groups.reconstructor.optim_state(), "format": "full_fqn"})


def test_grpo_raises_mean_reward(pair, tmp_path):
    # Seeded run. A step's mean reward (16 samples) scatters by about 0.2 around its trend, so the
    # test compares means over 10 steps of a 60-step run. Measured on this fixture: 30 steps, first 5
    # vs last 5, -1.49 -> -1.07 (+0.42; AMD EPYC, 2026-11-30) but -1.536 -> -1.504 (+0.03) on an
    # Intel Xeon under MKL's AVX2 branch (another trajectory of the same chaotic process); 60 steps,
    # first 10 vs last 10, -1.428 -> -1.210 (+0.22) on that Xeon. Assert a margin of 0.1.
    out = tmp_path / "grpo"
    res = run_rl(_cfg(pair, out, steps=60, checkpointing=dict(save_every=30), eval_every=1000))
    recs = [r for r in read_metrics(out / "rl.jsonl") if "reward_mean" in r]
    assert len(recs) == 60
    first = np.mean([r["reward_mean"] for r in recs[:10]])
    last = np.mean([r["reward_mean"] for r in recs[-10:]])
    assert last > first + 0.1, (first, last)
    assert recs[0]["step0_guard_diff"] < 1e-4
    for key in ("kl", "clipfrac", "approx_kl", "entropy", "fve_nrm", "response_len", "truncation_rate",
                "extraction_fail_rate", "zero_spread_frac", "time_generate", "time_reward", "time_policy", "time_ar",
                "ar_loss"):
        assert key in recs[-1], key
    assert (out / "rl_curves.png").is_file()
    ck = res.checkpoint_dir
    assert load_sidecar(ck / "av").role == "av" and load_sidecar(ck / "ar").role == "ar"
    assert json.loads((out / "rl_summary.json").read_text())["step"] == 60
    # what --resume compares: the dataset this run trained on (issue 58)
    import hashlib
    from pathlib import Path

    rec = json.loads((ck / "inputs.json").read_text())
    assert set(rec) == {"dataset"}
    assert rec["dataset"]["sha256"] == hashlib.sha256(Path(pair["dataset"]).read_bytes()).hexdigest()


def test_resume_matches_uninterrupted(pair, tmp_path):
    straight = tmp_path / "straight"
    run_rl(_cfg(pair, straight, steps=4))
    split = tmp_path / "split"
    run_rl(_cfg(pair, split, steps=4, stop_after_steps=2))
    run_rl(_cfg(pair, split, steps=4), resume=True)
    a = [r for r in read_metrics(straight / "rl.jsonl") if "reward_mean" in r]
    b = [r for r in read_metrics(split / "rl.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert ra["reward_mean"] == pytest.approx(rb["reward_mean"], abs=1e-5)
        assert ra["policy_loss"] == pytest.approx(rb["policy_loss"], abs=1e-5)
    wa = load_file_weights(straight)
    wb = load_file_weights(split)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)


def load_file_weights(out):
    from safetensors.torch import load_file

    ck = sorted((out / "checkpoints").iterdir())[-1]
    return load_file(str(ck / "av" / "model.safetensors"))


@pytest.mark.parametrize("variant", [
    {"loss": {"advantage": "gae", "gamma": 1.0, "lam": 0.95}},
    {"rollout": {"dynamic_sampling": True}, "loss": {"eps_high": 0.28, "loss_agg": "seq-mean-token-mean"},
     "reward": {"overlong_buffer_len": 4}},
    {"loss": {"advantage": "drgrpo", "kl_estimator": "k1", "loss_agg": "seq-mean-token-sum-norm"},
     "reward": {"log_mse": True}},
    {"optimiser": {"global_batch_size": 8, "allow_multiple_updates": True}, "loss": {"dual_clip_c": 3.0}},
])
def test_variants_run_and_log(pair, tmp_path, variant):
    out = tmp_path / "v"
    res = run_rl(_cfg(pair, out, steps=2, **variant))
    rec = [r for r in read_metrics(out / "rl.jsonl") if "reward_mean" in r][-1]
    assert np.isfinite(rec["reward_mean"]) and np.isfinite(rec["ar_loss"])
    if variant.get("loss", {}).get("advantage") == "gae":
        assert "value_loss" in rec and (res.checkpoint_dir / "value_model.pt").is_file()
    if variant.get("rollout", {}).get("dynamic_sampling"):
        assert {"zero_spread_frac", "refill_rounds", "train_groups"} <= rec.keys()  # refill: the next test
    if variant.get("optimiser", {}).get("global_batch_size"):
        # two off-policy steps per rollout: the second one's ratio moved off 1 (the first is exact)
        assert rec["ratio_mean"] != 1.0


def test_dynamic_sampling_drops_flat_groups_and_refills_the_batch(pair, tmp_path):
    """Issue 20, defect 6: the refill was only checked to run. A score function that gives every
    sample of the first generation the same MSE (every group flat, failures included: they cost
    2.0 too) and distinct MSEs afterwards: round 0 is dropped whole, the refill rounds fill the
    batch, and the kept groups are exactly the generated groups whose rewards spread."""
    from nla.rl.algorithms import dynamic_sampling_mask
    from nla.rl.loop import RLData, collect_rollout
    from nla.train.data import DataCursor

    cfg = _cfg(pair, tmp_path, rollout=dict(dynamic_sampling=True, max_refill_rounds=3))
    groups = build_groups(cfg)
    data = RLData.load(cfg.dataset)
    calls = []

    def score(items):
        calls.append(len(items))
        if len(calls) == 1:
            return torch.full((len(items),), 2.0)
        return torch.arange(len(items), dtype=torch.float32) / (4.0 * max(1, len(items)))

    G, B = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size
    with RewardService(score, 64, 0.01, inline=True) as service:
        train, everything, m = collect_rollout(groups, cfg, data, DataCursor(n=data.vectors.shape[0], seed=0), service)
    assert m["zero_spread_frac"] == 1.0  # the first generation: every group flat
    assert m["refill_rounds"] >= 1 and len(calls) == m["refill_rounds"] + 1
    spread = dynamic_sampling_mask(everything.rewards, G)
    assert not spread[:B].any()
    assert m["train_groups"] == min(B, int(spread.sum())) and train.n == G * m["train_groups"]
    assert torch.equal(train.rewards, everything.rewards[spread.repeat_interleave(G)][: train.n])
    assert dynamic_sampling_mask(train.rewards, G).all()  # no flat group reaches the update
    if m["refill_rounds"] < cfg.rollout.max_refill_rounds:
        assert m["train_groups"] == B  # it stopped because the batch was full


def test_chunked_generation_scores_every_chunk_with_the_live_ar(pair, tmp_path):
    from nla.rl.loop import RLData, generate_and_score

    cfg = _cfg(pair, tmp_path, rollout=dict(generation_chunk_prompts=2))
    groups = build_groups(cfg)
    data = RLData.load(cfg.dataset)
    rows = torch.arange(5)  # chunks of 2, 2, 1 prompts
    with RewardService(groups.reconstructor.mse_batch, 64, 0.01) as service:
        r, t_gen, t_wait = generate_and_score(groups, cfg, data, rows, service)
        n_batches = service.stats.n_batches
    G = cfg.rollout.n_samples_per_prompt
    assert r.n == 5 * G and r.group.tolist() == [g for g in range(5) for _ in range(G)]
    assert r.prompt_rows.tolist() == [p for p in range(5) for _ in range(G)]
    # one AR forward per chunk, each flushed (10 ms timer) while the next one generated; a
    # starved loop thread could merge two chunks into one forward, never split one
    assert 2 <= n_batches <= 3
    ok = r.ok
    direct = groups.reconstructor.mse_batch([(r.explanations[i], r.vectors[i]) for i in ok.nonzero()[:, 0].tolist()])
    torch.testing.assert_close(r.mse[ok], direct.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.rewards[ok], -direct.float(), atol=1e-5, rtol=0)
    assert torch.all(r.rewards[~ok] == FAILED_EXTRACTION_REWARD)


def test_format_penalty_charges_degenerate_explanations_only():
    from nla.rl.types import COMPLETED, FAILED_EXTRACTION

    status = torch.tensor([COMPLETED, COMPLETED, FAILED_EXTRACTION])
    mse = torch.tensor([0.5, 0.25, float("nan")])
    lengths = torch.tensor([5, 5, 5])
    degenerate = torch.tensor([False, True, True])
    cfg = RLConfig.from_dict(dict(av="a", ar="b", dataset="c", reward=dict(format_penalty=0.5)))
    # -0.5; -0.25 - 0.5 = -0.75; a failure is charged the orthogonal MSE only (no penalty on top)
    kw = dict(failed_cost=2.0)
    torch.testing.assert_close(config_rewards(status, mse, lengths, cfg, degenerate, **kw),
                               torch.tensor([-0.5, -0.75, -2.0]))
    off = cfg.replace(reward=dict(format_penalty=0.0))
    torch.testing.assert_close(config_rewards(status, mse, lengths, off, degenerate, **kw),
                               torch.tensor([-0.5, -0.25, -2.0]))
    with pytest.raises(ValueError, match="reward.format_penalty"):
        cfg.replace(reward=dict(format_penalty=-1.0))
    with pytest.raises(ValueError, match="reward.format_checks: expected one of"):
        cfg.replace(reward=dict(format_checks="strict"))


def test_format_flags_generic_and_world():
    from nla.core.reward import format_flags

    texts = [
        'The text ends with "park. He". The mood is sad.',  # clean in both
        "The mood is sad. The mood is sad.",  # repeated sentence
        'The text ends with "He. The mood is sad.',  # unbalanced quote
        "The tone is cooking. The mood is sad.",  # a mood template with an activity word: outside the language
        None,  # failed extraction: charged elsewhere
    ]
    assert format_flags(texts, "generic").tolist() == [False, True, True, False, False]
    assert format_flags(texts, "world").tolist() == [False, True, True, True, False]
    with pytest.raises(ValueError, match="format_checks: expected one of"):
        format_flags(texts, "nope")


def test_replay_rows_join_each_ar_update(pair, tmp_path):
    from nla.rl.loop import ReplayData

    ar_ds = pair["root"] / "ar_sft.parquet"
    replay = ReplayData.load(ar_ds)
    assert len(replay.texts) == 64 and replay.vectors.shape == (64, D)
    # fraction 0.25 of an update with 12 rollout rows: 12 * 0.25 / 0.75 = 4 replay rows; keyed on (seed, step)
    t1, v1 = replay.sample(12, 0.25, seed=0, step=3)
    t2, v2 = replay.sample(12, 0.25, seed=0, step=3)
    assert len(t1) == 4 and t1 == t2 and torch.equal(v1, v2)
    assert replay.sample(12, 0.25, seed=0, step=4)[0] != t1
    # shuffled: the same rows and vectors, each text's sentences in an order from the same RNG
    from nla.core.graders import shuffle_sentences, split_sentences

    t3, v3 = replay.sample(12, 0.25, seed=0, step=3, shuffle=True)
    assert torch.equal(v3, v1) and all(sorted(split_sentences(a)) == sorted(split_sentences(b))
                                       for a, b in zip(t3, t1, strict=True))
    rng = np.random.default_rng([0, 3])
    rng.choice(len(replay.texts), size=4, replace=False)
    assert t3 == [shuffle_sentences(t, rng) for t in t1]
    for t, v in zip(t1, v1, strict=True):  # each text comes with its own vector
        assert torch.equal(v, replay.vectors[replay.texts.index(t)]) or replay.texts.count(t) > 1
    cfg = _cfg(pair, tmp_path, steps=2, reconstructor=dict(replay_dataset=str(ar_ds), replay_fraction=0.5))
    res = run_rl(cfg)
    rows = read_metrics(tmp_path / "rl.jsonl")
    for r in rows:  # half of every AR update is replay: as many replay rows as rollout rows
        assert r["ar_replay_rows"] == r["ar_rows"] / 2
    assert res.metrics["step"] == 2
    with pytest.raises(ValueError, match="reconstructor.replay_dataset"):
        _cfg(pair, tmp_path, reconstructor=dict(replay_fraction=0.5))
    with pytest.raises(ValueError, match="has no 'explanation' column"):
        ReplayData.load(pair["dataset"])


def test_local_cpu_rewards_run_on_the_loop_thread(pair, tmp_path):
    """A local CPU AR scores on the loop's own thread (RewardService inline): a second thread of
    torch ops would make libgomp put every worker to sleep between ops. Chunked generation
    still scores every chunk; the reward time is the scoring, not zero."""
    import threading

    from nla.rl.loop import scores_inline

    cfg = _cfg(pair, tmp_path, steps=2, rollout=dict(generation_chunk_prompts=2))
    groups = build_groups(cfg)
    assert scores_inline(groups)
    seen, live = [], groups.reconstructor.mse_batch

    def recording(items):
        seen.append((threading.get_ident(), len(items)))
        return live(items)

    groups.reconstructor.mse_batch = recording
    run_rl(cfg, groups=groups)
    assert {t for t, _ in seen} == {threading.get_ident()}
    assert len(seen) >= 4  # two chunks per step, two steps (fewer only if a chunk had no explanation)
    recs = [r for r in read_metrics(tmp_path / "rl.jsonl") if "reward_mean" in r]
    assert len(recs) == 2 and all(r["time_reward"] > 0 for r in recs)


@pytest.mark.parametrize("variant", [
    {},
    {"rollout": {"dynamic_sampling": True, "generation_chunk_prompts": 2}},
])
def test_fused_ar_reward_runs_the_plain_loop(pair, tmp_path, variant, caplog):
    """The reward forwards doubling as the AR update's forward (ReconstructorWorker.begin_rollout)
    give the run of the plain path: the same rewards, AR losses and gradient norms every step,
    with replay rows in every AR update (and, in the variant, refill rounds and chunked scoring)."""
    ar_ds = pair["root"] / "ar_sft.parquet"
    recs = {}
    for fused in (True, False):
        out = tmp_path / f"fused_{fused}"
        cfg = _cfg(pair, out, steps=3, checkpointing=dict(save_every=100),
                   reconstructor=dict(replay_dataset=str(ar_ds), replay_fraction=0.25), **variant)
        groups = build_groups(cfg)
        assert groups.reconstructor.fuse_reward
        groups.reconstructor.fuse_reward = fused
        with caplog.at_level(logging.WARNING, logger="nla.rl.roles.reconstructor"):
            run_rl(cfg, groups=groups)
        assert "not the update's first rows" not in caplog.text  # every window was used
        recs[fused] = [r for r in read_metrics(out / "rl.jsonl") if "reward_mean" in r]
    assert len(recs[True]) == len(recs[False]) == 3
    for a, b in zip(recs[True], recs[False], strict=True):
        assert a["ar_replay_rows"] == b["ar_replay_rows"] > 0 and a["ar_rows"] == b["ar_rows"]
        for k in ("reward_mean", "mse_nrm", "ar_loss", "ar_grad_norm", "kl", "policy_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7), (a["step"], k)


def test_update_batches_cover_every_row_when_the_rollout_does_not_divide():
    """Issue 20, defect 3: ``n // updates`` rows per update dropped the remainder (a dynamic-sampling
    rollout short of a full batch) and gave empty updates when n < updates."""
    from nla.rl.roles import update_batches

    sizes = [b.numel() for b in update_batches(10, 4)]
    assert sizes == [3, 3, 2, 2]
    assert torch.cat(update_batches(10, 4)).tolist() == list(range(10))
    assert [b.tolist() for b in update_batches(3, 4)] == [[0], [1], [2]]
    assert [b.tolist() for b in update_batches(8, 1)] == [list(range(8))]
    assert update_batches(0, 2) == []


def test_rl_grades_a_failed_sample_as_nla_eval_does():
    """Issue 20, defect 2: a failed sample claims nothing: grade("") in both (precision 1 when the
    row has no true fact, else 0), so fact_precision means one number in the RL log and in eval."""
    from nla.eval.evaluate import faithfulness
    from nla.rl.loop import grade_facts
    from nla.rl.types import COMPLETED, FAILED_EXTRACTION, Rollout

    facts = [[], ["place=harbor"]]
    r = Rollout(explanations=[None, None], texts=["", ""], status=torch.tensor([FAILED_EXTRACTION] * 2),
                prompt_rows=torch.arange(2), group=torch.arange(2), vectors=torch.zeros(2, 4),
                prompt_ids=torch.zeros(2, dtype=torch.long), response_ids=torch.zeros(2, 3, dtype=torch.long),
                response_mask=torch.ones(2, 3, dtype=torch.long))
    g = grade_facts(r, facts)
    f = faithfulness([None, None], facts)
    # row 0 ([]: nothing holds) claims nothing: no recall, no precision (issue 58); row 1: (0, 0)
    assert g == {"fact_recall": 0.0, "fact_precision": 0.0}
    assert (g["fact_recall"], g["fact_precision"]) == (f.recall, f.precision)
    assert COMPLETED != FAILED_EXTRACTION


def test_ppo_value_clipping_and_advantage_whitening_are_options(pair, tmp_path):
    """Issue 20, defect 5: value clipping was unreachable (``clip_eps=None`` hard-coded) and GAE
    advantages could not be whitened (verl and cleanrl do both)."""
    from nla.rl.loop import advantages
    from nla.rl.types import COMPLETED, Rollout

    assert build_groups(_cfg(pair, tmp_path, loss=dict(advantage="gae"))).value.clip_eps is None
    assert build_groups(_cfg(pair, tmp_path, loss=dict(advantage="gae", value_clip=0.3))).value.clip_eps == 0.3
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    r = Rollout(explanations=["a", "b", "c"], texts=["a", "b", "c"], status=torch.tensor([COMPLETED] * 3),
                prompt_rows=torch.arange(3), group=torch.arange(3), vectors=torch.zeros(3, 4),
                prompt_ids=torch.zeros(2, dtype=torch.long), response_ids=torch.zeros(3, 4, dtype=torch.long),
                response_mask=mask, rewards=torch.tensor([1.0, 0.0, 3.0]))
    values = torch.zeros(3, 4)
    cfg = _cfg(pair, tmp_path, loss=dict(advantage="gae", gamma=1.0, lam=1.0))
    plain, _ = advantages(r, cfg, values)
    # V = 0, gamma = lam = 1: every response token's advantage is its row's outcome reward
    torch.testing.assert_close(plain, torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0], [3, 3, 3, 3]]))
    white, _ = advantages(r, cfg.replace(loss=dict(whiten_advantages=True)), values)
    tokens = torch.tensor([1.0, 1, 1, 0, 0, 3, 3, 3, 3])  # the 9 response tokens, by hand
    expected = (tokens - tokens.mean()) / tokens.var(unbiased=True).add(1e-8).sqrt()
    torch.testing.assert_close(white[mask.bool()], expected)
    assert torch.all(white[~mask.bool()] == 0)
    with pytest.raises(ValueError, match=r"loss.value_clip: expected a number > 0 or null, found 0"):
        cfg.replace(loss=dict(value_clip=0))
    with pytest.raises(ValueError, match="whiten_advantages: expected true or false, found 'yes'"):
        cfg.replace(loss=dict(whiten_advantages="yes"))


def test_gradient_checkpointing_gives_the_same_updates_and_recomputes(pair, tmp_path):
    # The policy update (whole prompt + response per row instead of the shared-prefix cache, the
    # blocks recomputed in backward) and the AR update with gradient checkpointing on: the same
    # losses, gradient norms and weights after the step as with it off, and the first block's
    # attention runs twice per micro-batch (forward, then the recompute).
    from nla.core import arch
    from nla.rl.algorithms import broadcast_to_tokens, grpo_advantages

    plain = _cfg(pair, tmp_path, optimiser=dict(micro_batch_size=3, max_grad_norm=1e9),
                 rollout=dict(n_samples_per_prompt=4, rollout_batch_size=2))
    results = []
    for cfg in (plain, plain.replace(optimiser=dict(gradient_checkpointing=True),
                                     reconstructor=dict(gradient_checkpointing=True))):
        torch.manual_seed(0)
        groups = build_groups(cfg)
        vec = torch.from_numpy(_class_vectors(2, 5)[0])
        r = groups.rollout.generate(vec, torch.arange(2), 4, cfg.rollout.max_response_len)
        adv = broadcast_to_tokens(grpo_advantages(torch.linspace(-1, 1, r.n), 4), r.response_mask.float())
        ref = groups.reference.logprobs(r) - 0.05
        calls = []
        attn = arch.decoder_layers(groups.policy.model)[0].self_attn
        handle = attn.register_forward_hook(lambda *_, c=calls: c.append(1))
        m = groups.policy.update(r, adv, ref)
        handle.remove()
        ar_calls = []
        handle = arch.decoder_layers(groups.reconstructor.ar.base)[0].self_attn.register_forward_hook(
            lambda *_, c=ar_calls: c.append(1))
        texts = ["Alice is in the garden.", "It is morning.", "Bob walks to the river.", "She is happy."]
        m_ar = groups.reconstructor.update(texts, torch.from_numpy(_class_vectors(4, 7)[0]))
        handle.remove()
        results.append((r.response_ids, m, m_ar, len(calls), len(ar_calls),
                        {k: v.detach().clone() for k, v in groups.policy.model.named_parameters()},
                        {k: v.detach().clone() for k, v in groups.reconstructor.ar.named_parameters()}))
        groups.close()
    (ids_a, m_a, ar_a, n_a, nar_a, w_a, war_a), (ids_b, m_b, ar_b, n_b, nar_b, w_b, war_b) = results
    assert torch.equal(ids_a, ids_b)
    # 8 rows in micro-batches of 3: 3 whole-row forwards, each recomputed once in backward (off,
    # the shared-prefix path runs the prefix and its length buckets: another count); the AR twice as often
    assert n_b == 2 * 3 and nar_b == 2 * nar_a > 0
    for key in ("policy_loss", "pg_loss", "kl", "grad_norm"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-5, abs=1e-7), key
    assert ar_b["ar_loss"] == pytest.approx(ar_a["ar_loss"], rel=1e-6)
    # The weights after the step (conftest.assert_close_up_to_adam_eps: a weight whose gradient is near
    # Adam's eps may move by a share of lr; measured on an Intel Xeon under MKL's AVX2 branch, 1 policy
    # weight of 32,832 apart by 4.3e-5 and 1 of 11,008 by 6.9e-6, every other one within 5e-6)
    for k in w_a:
        assert_close_up_to_adam_eps(w_b[k], w_a[k], lr=3e-4, steps=1, atol=5e-6, rtol=1e-5)
    for k in war_a:
        assert_close_up_to_adam_eps(war_b[k], war_a[k], lr=1e-3, steps=1, atol=5e-6, rtol=1e-5)


def test_a_run_whose_plan_exceeds_the_gpu_is_refused_before_loading(pair, tmp_path, monkeypatch, capsys):
    # A card of 1 MiB (the plan checks GPUs only; here its size is given): the run stops before any
    # model loads or anything is written, naming the plan's figure and what to change.
    import yaml

    from nla.cli import main
    from nla.rl import plan

    cfg = _cfg(pair, tmp_path / "run")
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    monkeypatch.setattr(plan, "device_memory", lambda device: 2**20)
    assert main(["rl", "--config", str(tmp_path / "rl.yaml")]) == 2
    err = capsys.readouterr().err
    assert "memory plan: this RL step needs about" in err and "the GPU has 0.0 GiB" in err
    assert "--no-plan-check" in err and not (tmp_path / "run").exists()
    expected = plan.plan_of_config(cfg).peak
    assert f"needs about {expected / 2**30:.1f} GiB" in err


def test_the_adam_eps_tolerance_passes_an_isolated_move_and_fails_a_wrong_update():
    w = torch.zeros(1000)
    one = w.clone()
    one[7] = 2e-4  # one weight moved by 2/3 of lr (a gradient near Adam's eps): passes
    assert_close_up_to_adam_eps(one, w, lr=3e-4, steps=1, atol=5e-6, rtol=1e-5)
    far = w.clone()
    far[7] = 1e-3  # beyond 3 * lr * steps: no Adam step moves a weight that far
    with pytest.raises(AssertionError, match="largest difference"):
        assert_close_up_to_adam_eps(far, w, lr=3e-4, steps=1, atol=5e-6, rtol=1e-5)
    many = w + 1e-5  # every weight moved (a mis-scaled gradient): 1000 outside the tight tolerance
    with pytest.raises(AssertionError, match="1000 of 1000 elements"):
        assert_close_up_to_adam_eps(many, w, lr=3e-4, steps=1, atol=5e-6, rtol=1e-5)


def test_autocast_runs_the_step_in_bf16_with_the_heads_in_fp32(pair, tmp_path, monkeypatch):
    """``autocast: bfloat16`` (nla.util.precision): the policy's log-probs, the AR's predictions and the
    rewards stay fp32 while the step's matmuls run in bf16; a second run of the seed repeats the first. Measured against the fp32 run of the same
    seed: the step-0 guard differs by more than fp32's 1e-4 (bf16 matmuls ran) and passes bf16's 5e-2, and
    the first rollout's reward mean is within 0.05 of fp32's (bf16 rounding, not another computation)."""
    import os

    from nla.util import precision

    monkeypatch.setattr(precision, "bf16_native", lambda flags=None: True)  # emulated where absent: slow, not wrong
    # this process settled its bf16 kernels under the pin's cap at an earlier test's matmul: the reference
    # kernel, slow but not wrong (the refusal itself: tests/test_precision.py, in a fresh process)
    monkeypatch.setattr(precision, "bf16_kernels_ready", lambda: None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"))  # restored after
    monkeypatch.setattr(precision, "_BEFORE_LIFT", precision._BEFORE_LIFT)
    dtypes = []
    groups = build_groups(_cfg(pair, tmp_path / "bf16", steps=2, autocast="bfloat16"))
    groups.policy.model.get_output_embeddings().register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    run_rl(_cfg(pair, tmp_path / "bf16", steps=2, autocast="bfloat16"), groups=groups)
    run_rl(_cfg(pair, tmp_path / "bf16_again", steps=2, autocast="bfloat16"))
    run_rl(_cfg(pair, tmp_path / "fp32", steps=2))
    # the same seed under autocast: the same numbers, and the same weights, bit for bit (one thread here)
    again = [r for r in read_metrics(tmp_path / "bf16_again" / "rl.jsonl") if "reward_mean" in r]
    first = [r for r in read_metrics(tmp_path / "bf16" / "rl.jsonl") if "reward_mean" in r]
    for ra, rb in zip(first, again, strict=True):
        assert {k: v for k, v in ra.items() if not k.startswith("time")} == \
            {k: v for k, v in rb.items() if not k.startswith("time")}
    wa, wb = load_file_weights(tmp_path / "bf16"), load_file_weights(tmp_path / "bf16_again")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    bf, fp = ([r for r in read_metrics(tmp_path / d / "rl.jsonl") if "reward_mean" in r] for d in ("bf16", "fp32"))
    assert dtypes and set(dtypes) == {torch.float32}
    assert 1e-4 < bf[0]["step0_guard_diff"] < 5e-2 and fp[0]["step0_guard_diff"] < 1e-4
    assert abs(bf[0]["reward_mean"] - fp[0]["reward_mean"]) < 0.05
    assert all(np.isfinite(r["reward_mean"]) and np.isfinite(r["ar_loss"]) for r in bf)


def test_adamw_setting_reaches_every_trained_role(pair, tmp_path):
    """``adamw``: torch's default (a per-parameter loop on a CPU: tests/test_train_common) unless fused is
    asked for, for the policy and the AR alike. A fused run's first rollout is the default run's (the
    weights are the same until the first step), its second within float rounding of it."""
    plain = build_groups(_cfg(pair, tmp_path / "default", steps=2))
    fused = build_groups(_cfg(pair, tmp_path / "fused", steps=2, adamw="fused"))
    for g, on in ((plain, False), (fused, True)):
        assert bool(g.policy.opt.defaults["fused"]) is on and bool(g.reconstructor.opt.defaults["fused"]) is on
    run_rl(_cfg(pair, tmp_path / "default", steps=2), groups=plain)
    run_rl(_cfg(pair, tmp_path / "fused", steps=2, adamw="fused"), groups=fused)
    a, b = ([r for r in read_metrics(tmp_path / d / "rl.jsonl") if "reward_mean" in r] for d in ("default", "fused"))
    assert a[0]["reward_mean"] == b[0]["reward_mean"] and a[0]["policy_loss"] == b[0]["policy_loss"]
    assert b[1]["reward_mean"] == pytest.approx(a[1]["reward_mean"], abs=1e-3)
    with pytest.raises(ValueError, match=r"RLConfig.adamw: expected one of \['default', 'fused'\], found 'adam'"):
        _cfg(pair, tmp_path, adamw="adam")
