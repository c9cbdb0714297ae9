"""The reward forward doubles as the AR update's forward (``ReconstructorWorker.begin_rollout``).

Against the plain path on a copy of the same AR (rewards from a no-grad eval forward, then an
update that runs every row again): the rewards must be identical, and the update's loss and
gradients the same to float tolerance, with replay rows after the rollout rows, for several
micro-batch sizes and reward batch splits. Failure paths: a window whose items are not the
update's first rows is dropped (and the update equals the plain one), calls outside a
window never leave gradients, and an AR with dropout never fuses.
"""

import copy
import logging

import pytest
import torch
from train_helpers import dataset_sidecar, explanations

from nla.core import arch
from nla.core.arch import load_tokenizer
from nla.core.reconstructor import Reconstructor
from nla.rl.roles import OptimSettings, ReconstructorWorker, has_dropout

D_LAYER = 1


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def _worker(tiny_model_dir, arch: str, micro: int) -> ReconstructorWorker:
    base = tiny_model_dir(arch)
    tok = load_tokenizer(base)
    ar = Reconstructor.from_base(base, D_LAYER, tokenizer=tok)
    if arch == "gpt2":  # GPT-2 has dropout by default
        for m in ar.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            setattr(ar.config, k, 0.0)
    side = dataset_sidecar(tok, base, d_model=ar.config.hidden_size, layer_index=D_LAYER)
    optim = OptimSettings(lr=1e-3, weight_decay=0.0, warmup_steps=0, total_steps=10, max_grad_norm=1e9)
    return ReconstructorWorker(ar, tok, side, optim, max_length=64, micro_batch_size=micro, device=torch.device("cpu"))


def _data(d: int, n_rollout: int, n_replay: int):
    gen = torch.Generator().manual_seed(0)
    texts = explanations(n_rollout + n_replay)
    # varied lengths: the reward layout pads on the left, the training layout on the right
    texts = [t if i % 3 else t + " and the dog sings about the river" for i, t in enumerate(texts)]
    texts[1] = "cat"
    golds = torch.randn(n_rollout + n_replay, d, generator=gen) * 3
    return texts, golds


def _grads_at_step(worker: ReconstructorWorker) -> dict[str, torch.Tensor]:
    """Record the gradients the optimiser step sees (then let it step)."""
    seen: dict[str, torch.Tensor] = {}
    real = worker._step

    def step():
        seen.update({n: p.grad.clone() for n, p in worker.ar.named_parameters() if p.grad is not None})
        return real()

    worker._step = step
    return seen


def _plain_and_fused(tiny_model_dir, arch, micro, n_rollout, n_replay, splits):
    plain = _worker(tiny_model_dir, arch, micro)
    fused = copy.deepcopy(plain)
    texts, golds = _data(plain.ar.config.hidden_size, n_rollout, n_replay)
    items = list(zip(texts[:n_rollout], golds[:n_rollout], strict=True))
    cuts = [0, *splits, n_rollout]
    g_plain, g_fused = _grads_at_step(plain), _grads_at_step(fused)
    r_plain = torch.cat([plain.mse_batch(items[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a])
    fused.begin_rollout()
    r_fused = torch.cat([fused.mse_batch(items[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a])
    m_plain, m_fused = plain.update(texts, golds), fused.update(texts, golds)
    return plain, fused, (r_plain, r_fused), (m_plain, m_fused), (g_plain, g_fused)


def _assert_same_grads(g_plain, g_fused):
    assert g_plain.keys() == g_fused.keys() and g_plain
    for name, g in g_plain.items():
        torch.testing.assert_close(g_fused[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize(("micro", "n_replay", "splits"), [(64, 4, [5]), (3, 4, [2, 7]), (1, 0, [10]), (4, 6, [])])
def test_fused_rewards_and_update_equal_the_plain_path(tiny_model_dir, arch, micro, n_replay, splits):
    plain, fused, (r_plain, r_fused), (m_plain, m_fused), (g_plain, g_fused) = _plain_and_fused(
        tiny_model_dir, arch, micro, 12, n_replay, splits)
    assert fused.fuse_reward
    assert torch.equal(r_fused, r_plain)  # the rewards are the plain path's values, bit for bit
    assert m_fused["ar_rows"] == m_plain["ar_rows"] == 12 + n_replay
    assert m_fused["ar_loss"] == pytest.approx(m_plain["ar_loss"], rel=1e-5)
    assert m_fused["ar_grad_norm"] == pytest.approx(m_plain["ar_grad_norm"], rel=1e-4)
    _assert_same_grads(g_plain, g_fused)
    for (name, a), b in zip(plain.ar.state_dict().items(), fused.ar.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    # the next step starts clean: calls outside a window leave no gradient behind
    fused.mse_batch([("cat", torch.zeros(fused.ar.config.hidden_size))])
    assert all(p.grad is None for p in fused.ar.parameters())


def _window_over(tiny_model_dir, n: int):
    """A llama AR worker whose open reward window has scored ``n`` rows: (worker, texts, golds)."""
    w = _worker(tiny_model_dir, "llama", 4)
    texts, golds = _data(w.ar.config.hidden_size, n, 0)
    w.begin_rollout()
    w.mse_batch(list(zip(texts, golds, strict=True)))
    return w, texts, golds


def test_a_window_covering_every_row_runs_no_forward_in_the_update(tiny_model_dir):
    w, texts, golds = _window_over(tiny_model_dir, 6)
    calls = {"n": 0}
    real = w.ar.predict

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    w.ar.predict = counting
    m = w.update(texts, golds)
    assert calls["n"] == 0 and m["ar_rows"] == 6.0 and m["ar_grad_norm"] > 0


def test_a_window_that_does_not_match_the_update_is_dropped(tiny_model_dir, caplog):
    plain = _worker(tiny_model_dir, "llama", 4)
    fused = copy.deepcopy(plain)
    texts, golds = _data(plain.ar.config.hidden_size, 8, 0)
    g_plain, g_fused = _grads_at_step(plain), _grads_at_step(fused)
    fused.begin_rollout()
    fused.mse_batch([(texts[0], golds[0]), ("the cat is happy", golds[1])])  # not the update's row 1
    with caplog.at_level(logging.WARNING, logger="nla.rl.roles.reconstructor"):
        m_fused = fused.update(texts, golds)
    assert "not the update's first rows" in caplog.text
    m_plain = plain.update(texts, golds)
    assert m_fused["ar_loss"] == pytest.approx(m_plain["ar_loss"], rel=1e-6)
    _assert_same_grads(g_plain, g_fused)
    # a gold that differs (same text) is a mismatch too
    fused.begin_rollout()
    fused.mse_batch([(texts[0], golds[0] + 1)])
    assert fused.window.close(fused, texts, golds) == (0, 0.0)
    assert all(p.grad is None for p in fused.ar.parameters())


def test_more_window_rows_than_update_rows_is_a_mismatch(tiny_model_dir):
    w, texts, golds = _window_over(tiny_model_dir, 4)
    assert w.window.close(w, texts[:2], golds[:2]) == (0, 0.0)


def test_dropout_turns_fusing_off(tiny_model_dir):
    base = tiny_model_dir("gpt2")  # dropout 0.1 by default
    tok = load_tokenizer(base)
    ar = Reconstructor.from_base(base, D_LAYER, tokenizer=tok)
    assert has_dropout(ar)
    side = dataset_sidecar(tok, base, d_model=ar.config.hidden_size, layer_index=D_LAYER)
    optim = OptimSettings(lr=1e-3, weight_decay=0.0, warmup_steps=0, total_steps=10, max_grad_norm=1.0)
    w = ReconstructorWorker(ar, tok, side, optim, 64, 4, torch.device("cpu"))
    assert not w.fuse_reward
    w.begin_rollout()
    w.mse_batch([("cat", torch.zeros(ar.config.hidden_size))])
    assert all(p.grad is None for p in ar.parameters())
    assert not has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))


def test_reward_sub_batches_equal_one_padded_batch(tiny_model_dir, monkeypatch):
    """mse_batch runs the rows longest first in sub-batches; each row's MSE is the one of a single
    left-padded batch in the given order (float tolerance), returned in the given order."""
    import nla.rl.roles.reconstructor as W
    from nla.core.vectors import mse_nrm

    w = _worker(tiny_model_dir, "llama", 4)
    texts, golds = _data(w.ar.config.hidden_size, 11, 0)
    whole = mse_nrm(w.predict(texts), golds, w.scale)
    for sub in (1, 3, 64):
        monkeypatch.setattr(W, "REWARD_SUB_BATCH", sub)
        got = w.mse_batch(list(zip(texts, golds, strict=True)))
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- replicated ranks
def _replica_rank(rank: int, world: int, port: int, base: str, out: str) -> None:
    """One rank of a real 2-process gloo group of ``Replicas``: fused AR workers (one of whose
    windows holds a text the update does not, on rank 1) and a plain one score their shares of
    each reward call (as ``DISPATCH`` splits them) and update on every row."""
    import torch.distributed as dist

    from nla.rl.distributed import Replicas, init_group, rank_rows

    torch.set_num_threads(1)
    init_group(rank, world, "127.0.0.1", port, use_cuda=False, timeout_s=120)
    try:
        tok = load_tokenizer(base)
        dp = Replicas(rank, world)
        workers = {}
        for name in ("fused", "mismatch", "plain"):
            torch.manual_seed(0)
            ar = Reconstructor.from_base(base, D_LAYER, tokenizer=tok)
            dp.shard(ar, arch.decoder_layers(ar.base))  # rank 0's weights on every rank
            side = dataset_sidecar(tok, base, d_model=ar.config.hidden_size, layer_index=D_LAYER)
            optim = OptimSettings(lr=1e-3, weight_decay=0.0, warmup_steps=0, total_steps=10, max_grad_norm=1e9)
            workers[name] = ReconstructorWorker(ar, tok, side, optim, max_length=64, micro_batch_size=3,
                                                device=torch.device("cpu"), dp=dp)
        fused, plain = workers["fused"], workers["plain"]
        assert fused.fuse_reward and workers["mismatch"].fuse_reward  # replicated ranks fuse
        plain.fuse_reward = False
        texts, golds = _data(fused.ar.config.hidden_size, 13, 4)
        calls = [(0, 5), (5, 13)]  # two reward calls over the 13 rollout rows; 4 replay rows follow
        res: dict = {}
        for name, w in workers.items():
            seen: dict[str, torch.Tensor] = {}  # the gradients the optimiser steps on: after the all-reduce
            real_step = w.opt.step

            def step(*a, _w=w, _seen=seen, _real=real_step, **kw):
                _seen.update({n: p.grad.clone() for n, p in _w.ar.named_parameters() if p.grad is not None})
                return _real(*a, **kw)

            w.opt.step = step
            w.begin_rollout()
            rewards = []
            for a, b in calls:
                mine = (torch.arange(a, b)[rank_rows(b - a, world, rank)]).tolist()
                items = [(texts[i], golds[i]) for i in mine]
                if name == "mismatch" and rank == 1 and a == 5:
                    items[0] = ("the cat is happy", items[0][1])  # not the update's row
                rewards.append(w.mse_batch(items))
            m = w.update(texts, golds)
            res[name] = {"rewards": torch.cat(rewards), "metrics": m, "grads": seen,
                         "state": {k: v.clone() for k, v in w.ar.state_dict().items()}}
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_replicated_ranks_fuse_and_equal_the_plain_step(tiny_model_dir, tmp_path):
    """2 replicated ranks (a real gloo group): each backpropagates its share of every reward call,
    the update skips those rows and the all-reduce sums the shares: rewards bit for bit the plain
    path's on that rank, the gradient and the stepped weights the one-process plain step's.
    A window that does not match the update (one text on rank 1) is dropped on every rank: had it
    been kept, rank 1's gradient would hold that text's and the step would not be the plain one."""
    import torch.multiprocessing as mp

    from nla.rl.distributed import free_port

    base = tiny_model_dir("llama")
    mp.spawn(_replica_rank, args=(2, free_port(), str(base), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # the reference: one process, plain path, every row
    torch.manual_seed(0)
    ref = _worker(tiny_model_dir, "llama", 3)
    texts, golds = _data(ref.ar.config.hidden_size, 13, 4)
    g_ref = _grads_at_step(ref)
    m_ref = ref.update(texts, golds)
    for rank, r in enumerate(ranks):
        assert torch.equal(r["fused"]["rewards"], r["plain"]["rewards"])
        if rank == 0:
            assert torch.equal(r["mismatch"]["rewards"], r["plain"]["rewards"])
        for name in ("fused", "mismatch", "plain"):
            m = r[name]["metrics"]
            assert m["ar_rows"] == 17.0
            assert m["ar_loss"] == pytest.approx(m_ref["ar_loss"], rel=1e-5)
            assert m["ar_grad_norm"] == pytest.approx(m_ref["ar_grad_norm"], rel=1e-4)
            _assert_same_grads(g_ref, r[name]["grads"])
            for (k, a), b in zip(ref.ar.state_dict().items(), r[name]["state"].values(), strict=True):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=k)
    # the replicas stay equal, bit for bit
    for k, v in ranks[0]["fused"]["state"].items():
        assert torch.equal(v, ranks[1]["fused"]["state"][k]), k
