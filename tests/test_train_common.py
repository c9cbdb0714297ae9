import math
import random

import numpy as np
import pytest
import torch

from nla.train.checkpoint import (
    apply_training_state,
    latest_checkpoint,
    load_training_state,
    save_training_state,
)
from nla.train.data import DataCursor
from nla.train.optim import (
    build_optimizer,
    micro_batches,
    optimizer_step_guarded,
    sqrt_lr,
    warmup_cosine,
    warn_if_lr_far,
)
from nla.util.checkpoint_files import atomic_dir


def test_warmup_cosine_values_by_hand():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], lr=1.0)
    sched = warmup_cosine(opt, warmup=2, total=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(11):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup: 0/2, 1/2, then 1.0 at step 2.
    assert lrs[0] == pytest.approx(0.0)
    assert lrs[1] == pytest.approx(0.5)
    assert lrs[2] == pytest.approx(1.0)
    # step 6: progress (6-2)/8 = 0.5 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lrs[6] == pytest.approx(0.55)
    # end: the floor, 0.1
    assert lrs[10] == pytest.approx(0.1)


def test_warmup_cosine_rejects_bad_values():
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="warmup"):
        warmup_cosine(opt, warmup=11, total=10)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        warmup_cosine(opt, warmup=1, total=10, min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="lr"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=-1.0)


def test_micro_batches_weights():
    # 10 rows in micros of 4: 4, 4, 2 rows -> weights 0.4, 0.4, 0.2
    mb = micro_batches(10, 4)
    assert [(s.start, s.stop) for s, _ in mb] == [(0, 4), (4, 8), (8, 10)]
    assert [w for _, w in mb] == pytest.approx([0.4, 0.4, 0.2])
    with pytest.raises(ValueError, match="micro"):
        micro_batches(10, 0)


def test_accumulated_4x2_equals_batch_of_8():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    x, y = torch.randn(8, 5), torch.randn(8, 3)

    def loss_fn(xb, yb):
        return ((lin(xb) - yb) ** 2).mean()

    loss_fn(x, y).backward()
    full = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    for sl, w in micro_batches(8, 2):
        (loss_fn(x[sl], y[sl]) * w).backward()
    for g_full, p in zip(full, lin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g_full, rtol=1e-6, atol=1e-7)


def test_guard_skips_nonfinite_and_counts():
    lin = torch.nn.Linear(2, 1)
    opt = build_optimizer(lin, lr=0.1)
    sched = warmup_cosine(opt, warmup=0, total=4)
    before = [p.detach().clone() for p in lin.parameters()]
    lin(torch.ones(1, 2)).sum().backward()
    lin.weight.grad[0, 0] = float("nan")
    stepped, gn = optimizer_step_guarded(lin, opt, sched, max_grad_norm=1.0)
    assert not stepped and not math.isfinite(gn)
    for b, p in zip(before, lin.parameters(), strict=True):
        assert torch.equal(b, p.detach())
        assert p.grad is None  # bad gradients are dropped
    assert sched.last_epoch == 1  # schedule still follows the global step
    # a clean step updates and clips: grad of sum(w.x+b) at x=1 is (1,1,1), norm sqrt(3) -> clipped to 1
    lin(torch.ones(1, 2)).sum().backward()
    stepped, gn = optimizer_step_guarded(lin, opt, sched, max_grad_norm=1.0)
    assert stepped and gn == pytest.approx(math.sqrt(3))
    assert not torch.equal(before[0], lin.weight.detach())


def test_sqrt_lr_and_warning(caplog):
    assert sqrt_lr(256) == pytest.approx(2e-5)
    assert sqrt_lr(1024) == pytest.approx(4e-5)  # 2e-5 * sqrt(4)
    assert sqrt_lr(64) == pytest.approx(1e-5)
    assert not warn_if_lr_far(3e-5, 1024)
    with caplog.at_level("WARNING"):
        assert warn_if_lr_far(1e-3, 1024)
    assert "sqrt-scaled" in caplog.text


def test_atomic_dir_keeps_old_on_failure(tmp_path):
    final = tmp_path / "ckpt"
    with atomic_dir(final) as d:
        (d / "a.txt").write_text("one")
    assert (final / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError), atomic_dir(final) as d:
        (d / "a.txt").write_text("two")
        raise RuntimeError("crash mid-save")
    assert (final / "a.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dirs left behind
    with atomic_dir(final) as d:
        (d / "a.txt").write_text("three")
    assert (final / "a.txt").read_text() == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_training_state_roundtrip_restores_everything(tmp_path):
    torch.manual_seed(1)
    lin = torch.nn.Linear(3, 1)
    opt = build_optimizer(lin, lr=0.01)
    sched = warmup_cosine(opt, warmup=1, total=10, min_lr_ratio=0.1)
    for _ in range(3):
        lin(torch.randn(4, 3)).pow(2).mean().backward()
        optimizer_step_guarded(lin, opt, sched, 1.0)
    cursor = DataCursor(n=7, seed=3)
    cursor.next_indices(5)
    random.seed(5)
    np.random.seed(5)
    save_training_state(tmp_path, opt, sched, step=3, data_cursor=cursor)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    lr_before = opt.param_groups[0]["lr"]

    opt2 = build_optimizer(lin, lr=0.01)
    sched2 = warmup_cosine(opt2, warmup=1, total=10, min_lr_ratio=0.1)
    state = load_training_state(tmp_path)
    apply_training_state(state, opt2, sched2)
    assert state.step == 3
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_before)
    assert sched2.last_epoch == 3
    for k, v in opt.state_dict()["state"][0].items():
        torch.testing.assert_close(opt2.state_dict()["state"][0][k], v)
    c2 = DataCursor(n=7, seed=3)
    c2.load_state_dict(state.data_cursor)
    assert (c2.epoch, c2.position) == (0, 5)


def test_load_training_state_missing_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot be resumed"):
        load_training_state(tmp_path)
    assert latest_checkpoint(tmp_path) is None


def test_data_cursor_epochs_and_resume():
    c = DataCursor(n=5, seed=0)
    first = c.next_indices(3)
    second = c.next_indices(4)  # crosses into epoch 1
    allidx = np.concatenate([first, second])
    assert sorted(allidx[:5].tolist()) == [0, 1, 2, 3, 4]  # epoch 0 is a permutation
    assert (c.epoch, c.position) == (1, 2)
    straight = DataCursor(n=5, seed=0)
    a = straight.next_indices(7)
    b = straight.next_indices(6)
    resumed = DataCursor(n=5, seed=0)
    resumed.load_state_dict(c.state_dict())
    np.testing.assert_array_equal(a, allidx)
    np.testing.assert_array_equal(resumed.next_indices(6), b)
    with pytest.raises(ValueError, match="same dataset"):
        DataCursor(n=6, seed=0).load_state_dict(c.state_dict())


def test_atomic_dir_names_a_failed_save_and_keeps_the_old_checkpoint(tmp_path):
    from nla.util.checkpoint_files import CheckpointSaveError

    final = tmp_path / "step_00000002"
    with atomic_dir(final) as d:
        (d / "a.txt").write_text("old")
    # /dev/full answers every write with ENOSPC: a real full-disk save, whose torch message is
    # only "[enforce fail at inline_container.cc] ... unexpected pos".
    with pytest.raises(CheckpointSaveError, match=r"saving the checkpoint .*step_00000002 failed \(.*\); \d+ MB are "
                                                  r"free on that disk now. The previous checkpoint is intact"):
        with atomic_dir(final) as d:
            (d / "state.pt").symlink_to("/dev/full")
            torch.save({"w": torch.zeros(1000)}, d / "state.pt")
    assert (final / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002"]


def test_build_optimizer_lr_scales_put_a_submodule_in_its_own_group():
    """lr_scales={"head": 10}: the head's parameters train at 10x lr and the schedule scales both groups.

    Derived by hand: AdamW's first step (weight decay 0) moves each value by lr * g / (|g| + eps),
    i.e. by lr for any nonzero gradient, so the head moves ten times as far as the body."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(3, 3))
    model.add_module("head", torch.nn.Linear(3, 1))
    opt = build_optimizer(model, lr=0.01, lr_scales={"head": 10.0})
    assert [g["lr"] for g in opt.param_groups] == [0.01, pytest.approx(0.1)]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert all(p is q for p, q in zip(opt.param_groups[1]["params"], model.head.parameters(), strict=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    for n, p in model.named_parameters():
        moved = (p.detach() - before[n]).abs()
        want = 0.1 if n.startswith("head.") else 0.01
        torch.testing.assert_close(moved, torch.full_like(moved, want), rtol=1e-4, atol=0)
    sched = warmup_cosine(build_optimizer(model, lr=1.0, lr_scales={"head": 4.0}), warmup=2, total=10)
    sched.step()  # warmup step 1 of 2: half of each group's lr
    assert [g["lr"] for g in sched.optimizer.param_groups] == [pytest.approx(0.5), pytest.approx(2.0)]


def test_build_optimizer_lr_scales_of_one_and_bad_values():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    plain = build_optimizer(model, lr=0.1)
    same = build_optimizer(model, lr=0.1, lr_scales={"1": 1.0})  # factor 1: the one group, same order
    assert len(same.param_groups) == 1
    assert [id(p) for p in same.param_groups[0]["params"]] == [id(p) for p in plain.param_groups[0]["params"]]
    with pytest.raises(ValueError, match=r"lr_scales\['1'\] must be a positive finite number, found 0"):
        build_optimizer(model, lr=0.1, lr_scales={"1": 0.0})
    with pytest.raises(ValueError, match="lr_scales names 'adapter', which holds no trainable parameter"):
        build_optimizer(model, lr=0.1, lr_scales={"adapter": 2.0})
    with pytest.raises(ValueError, match="params must be a module"):
        build_optimizer(list(model.parameters()), lr=0.1, lr_scales={"1": 2.0})


def _adamw_reference(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float,
                     betas=(0.9, 0.999), eps=1e-8) -> torch.Tensor:
    """AdamW written out (Loshchilov & Hutter, torch's bias-corrected form) in float64."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return p


def _run_adamw(impl: str | None, steps: int = 5) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A two-group model (``lr_scales``) stepped on fixed gradients; ``impl`` None: torch's per-parameter loop."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(7, 5))
    model.add_module("head", torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    grads = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(steps)]
    if impl is None:
        opt = torch.optim.AdamW([{"params": list(model.body.parameters())},
                                 {"params": list(model.head.parameters()), "lr": 0.03}],
                                lr=0.01, weight_decay=0.1, foreach=False)
    else:
        opt = build_optimizer(model, lr=0.01, weight_decay=0.1, lr_scales={"head": 3.0}, impl=impl)
    for step in grads:
        for p, gr in zip(model.parameters(), step, strict=True):
            p.grad = gr.clone()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], grads


def test_adamw_impls_against_a_written_out_adamw():
    """``default`` (torch's choice: on a CPU the per-parameter loop, what nla ran before ``adamw`` existed)
    gives the very bits of ``foreach=False``; both impls agree with AdamW written out, to float rounding."""
    loop, grads = _run_adamw(None)
    default, _ = _run_adamw("default")
    fused, _ = _run_adamw("fused")
    assert all(torch.equal(a, b) for a, b in zip(loop, default, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(loop, fused, strict=True))  # another kernel, its own bits
    g = torch.Generator().manual_seed(0)
    starts = [torch.randn(p.shape, generator=g) for p in loop]  # the same draws as _run_adamw's
    for i, (p0, got_loop, got_fused) in enumerate(zip(starts, loop, fused, strict=True)):
        lr = 0.03 if i >= 2 else 0.01  # the head's group at 3x
        want = _adamw_reference(p0, [step[i] for step in grads], lr=lr, wd=0.1)
        torch.testing.assert_close(got_loop.double(), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_fused.double(), want, rtol=0, atol=1e-6)


def test_adamw_state_moves_between_impls_and_bad_impl():
    """A checkpoint's optimizer state written under one impl resumes under the other (same format)."""
    model = torch.nn.Linear(4, 2)
    a = build_optimizer(model, lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    a.step()
    b = build_optimizer(model, lr=0.1, impl="fused")
    b.load_state_dict(a.state_dict())
    b.step()
    assert b.defaults["fused"] is True and not a.defaults["fused"]
    assert int(b.state[model.weight]["step"]) == 2
    with pytest.raises(ValueError, match=r"impl must be one of \['default', 'fused'\], found 'sgd'"):
        build_optimizer(model, lr=0.1, impl="sgd")
