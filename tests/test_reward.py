"""Tests for nla.core.reward (extraction rules, MSE -> reward) and nla.rl.reward (scoring N samples, the async batcher)."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from nla.core.reward import (
    FAILED_EXTRACTION_REWARD,
    FAILED_EXTRACTION_REWARD_LOG,
    LOG_MSE_FLOOR,
    extract_explanation,
    failed_extraction_reward,
    mse_to_reward,
)
from nla.rl.reward import RewardBatcher, score_all

# ------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<explanation>\nA cat sat.\n</explanation>", "A cat sat."),
        ("<explanation>x</explanation>", "x"),
        # text before the opening tag and after the closing tag is allowed
        ("Sure! <explanation> two  words </explanation> bye", "two  words"),
        ("<explanation>a\nb</explanation><|eot|>", "a\nb"),
        # first complete pair wins; a later pair is ignored
        ("<explanation>first</explanation><explanation>second</explanation>", "first"),
        # missing tags (truncated response, no opening tag)
        ("<explanation>cut off mid sen", None),
        ("no tags at all", None),
        ("just text</explanation>", None),
        ("", None),
        # empty or whitespace-only content
        ("<explanation></explanation>", None),
        ("<explanation> \n\t </explanation>", None),
        # nested / doubled opening tag before the close: ambiguous span
        ("<explanation>a <explanation>b</explanation>", None),
        # stray closing tag before the opening tag: malformed
        ("</explanation><explanation>x</explanation>", None),
        # tags are case-sensitive and exact
        ("<Explanation>x</Explanation>", None),
        ("<explanation >x</explanation>", None),
        # inner text may contain other markup
        ("<explanation>uses <b>bold</b> & 2 < 3</explanation>", "uses <b>bold</b> & 2 < 3"),
    ],
)
def test_extract_explanation(text, expected):
    assert extract_explanation(text) == expected


# ------------------------------------------------------------------ reward


def test_failed_extraction_constants():
    assert FAILED_EXTRACTION_REWARD == -2.0
    assert FAILED_EXTRACTION_REWARD_LOG == pytest.approx(-0.6931471805599453)
    assert failed_extraction_reward(False) == -2.0
    assert failed_extraction_reward(True) == FAILED_EXTRACTION_REWARD_LOG


def test_mse_to_reward_hand_values():
    # d = 4, scale = sqrt(4) = 2.
    # row 0: identical -> mse 0 -> reward 0; log variant: -log(floor 1e-6) = 6 log 10
    # row 1: orthogonal e0 vs e1 -> normalised 2e0, 2e1 -> diff^2 = [4, 4, 0, 0], mean 2 -> -2; log: -log 2
    # row 2: opposite -> diff [4, 0, 0, 0]^2 = 16, mean 4 -> -4; log: -log 4
    # row 3: scale-invariant: pred = 5 * gold -> 0
    # row 4: 60 degrees: gold e0, pred (1, sqrt3, 0, 0): cos 0.5 -> mse = 2(1 - 0.5) = 1 -> -1; log: 0
    s3 = math.sqrt(3.0)
    gold = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [1.0, 0, 0, 0], [1.0, 0, 0, 0], [0.5, -1.0, 0, 2.0], [1.0, 0, 0, 0]]
    )
    pred = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [0, 1.0, 0, 0], [-1.0, 0, 0, 0], [2.5, -5.0, 0, 10.0], [1.0, s3, 0, 0]]
    )
    r = mse_to_reward(pred, gold, 2.0)
    torch.testing.assert_close(r, torch.tensor([0.0, -2.0, -4.0, 0.0, -1.0]), atol=1e-6, rtol=1e-6)
    rl = mse_to_reward(pred, gold, 2.0, log_mse=True)
    expected_log = torch.tensor([-math.log(LOG_MSE_FLOOR), -math.log(2.0), -math.log(4.0), -math.log(LOG_MSE_FLOOR), 0.0])
    torch.testing.assert_close(rl, expected_log, atol=1e-5, rtol=1e-5)
    # the failure value equals the orthogonal row's reward under each variant
    assert r[1].item() == pytest.approx(failed_extraction_reward(False))
    # exact up to fp32 rounding: the floor must not shift the orthogonal value (-log(2 + eps) would)
    assert abs(rl[1].item() - failed_extraction_reward(True)) < 1e-7


def test_mse_to_reward_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"\(2, 4\) vs \(2, 3\)"):
        mse_to_reward(torch.zeros(2, 4), torch.zeros(2, 3), 2.0)


# ------------------------------------------------------------------ batcher


class _Recorder:
    """score_batch that records batch sizes; reward = float(item)."""

    def __init__(self, fail: bool = False):
        self.sizes: list[int] = []
        self.threads: set[str] = set()
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, items):
        with self.lock:
            self.sizes.append(len(items))
            self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("AR forward exploded")
        return torch.tensor([float(x) for x in items]) * 2.0


def test_concurrent_callers_make_ceil_n_over_batch_forwards():
    # 10 callers, batch 4 -> 4 + 4 full batches, the tail of 2 flushes on the timer: 3 forwards.
    rec = _Recorder()

    async def main():
        async with RewardBatcher(rec, batch_size=4, flush_seconds=0.05) as b:
            out = await asyncio.gather(*(b.score(i) for i in range(10)))
            return out, b.stats

    out, stats = asyncio.run(main())
    assert out == [2.0 * i for i in range(10)]
    assert sorted(rec.sizes) == [2, 4, 4]
    assert stats.n_batches == 3 and stats.n_items == 10
    assert stats.mean_batch_size == pytest.approx(10 / 3)
    # the forwards ran off the event-loop thread
    assert threading.main_thread().name not in rec.threads


def test_exact_multiple_needs_no_tail_flush():
    # 8 callers, batch 4, a flush timer far in the future: exactly 2 size-triggered forwards
    rec = _Recorder()

    async def main():
        async with RewardBatcher(rec, batch_size=4, flush_seconds=3600.0) as b:
            return await asyncio.gather(*(b.score(i) for i in range(8)))

    assert asyncio.run(main()) == [2.0 * i for i in range(8)]
    assert rec.sizes == [4, 4]


def test_tail_flush_waits_for_the_timer_then_sends_partial_batch():
    rec = _Recorder()

    async def main():
        b = RewardBatcher(rec, batch_size=8, flush_seconds=1.0)
        tasks = [asyncio.ensure_future(b.score(i)) for i in range(3)]
        for _ in range(20):  # let the loop spin without time passing much
            await asyncio.sleep(0)
        assert rec.sizes == []  # below batch_size: nothing sent before the timer
        assert not any(t.done() for t in tasks)
        out = await asyncio.gather(*tasks)  # the timer fires and flushes the 3
        await b.aclose()
        return out

    assert asyncio.run(main()) == [0.0, 2.0, 4.0]
    assert rec.sizes == [3]


def test_raising_forward_reaches_every_caller():
    rec = _Recorder(fail=True)

    async def main():
        async with RewardBatcher(rec, batch_size=3, flush_seconds=0.01) as b:
            results = await asyncio.gather(*(b.score(i) for i in range(5)), return_exceptions=True)
            return results, b.stats

    results, stats = asyncio.run(main())
    assert len(results) == 5
    assert all(isinstance(r, RuntimeError) and "exploded" in str(r) for r in results)
    assert stats.n_failed_batches == 2 and stats.n_batches == 2


def test_wrong_reward_count_reaches_every_caller():
    async def main():
        async with RewardBatcher(lambda items: [0.0], batch_size=2, flush_seconds=0.01) as b:
            return await asyncio.gather(b.score("a"), b.score("b"), return_exceptions=True)

    results = asyncio.run(main())
    for r in results:
        assert isinstance(r, ValueError)
        assert "returned 1 rewards for a batch of 2 items" in str(r)


def test_score_group_returns_in_order_across_batches():
    rec = _Recorder()

    async def main():
        async with RewardBatcher(rec, batch_size=3, flush_seconds=0.01) as b:
            # two groups interleaved with single calls share batches
            g1 = asyncio.ensure_future(b.score_group([10, 11, 12, 13]))
            s = asyncio.ensure_future(b.score(99))
            g2 = asyncio.ensure_future(b.score_group([20, 21]))
            return await g1, await s, await g2

    g1, s, g2 = asyncio.run(main())
    assert g1 == [20.0, 22.0, 24.0, 26.0]
    assert s == 198.0
    assert g2 == [40.0, 42.0]
    assert sum(rec.sizes) == 7 and max(rec.sizes) <= 3


def test_score_group_raises_on_failure():
    async def main():
        async with RewardBatcher(_Recorder(fail=True), batch_size=2, flush_seconds=0.01) as b:
            await b.score_group([1, 2, 3])

    with pytest.raises(RuntimeError, match="exploded"):
        asyncio.run(main())


def test_event_loop_keeps_running_during_a_forward():
    # The forward blocks until a coroutine on the loop sets an event. Were the
    # forward run on the loop thread, the event could never be set (it would
    # time out and return -1).
    release = threading.Event()

    def blocking(items):
        ok = release.wait(timeout=10.0)
        return [1.0 if ok else -1.0] * len(items)

    async def main():
        async with RewardBatcher(blocking, batch_size=2, flush_seconds=0.01) as b:
            fut = asyncio.ensure_future(b.score_group(["x", "y"]))
            while not b.stats.n_batches:
                await asyncio.sleep(0.001)
            release.set()  # runs only if the loop is free while the forward blocks
            return await fut

    assert asyncio.run(main()) == [1.0, 1.0]


def test_score_all_sync_with_function_and_with_batcher():
    rec = _Recorder()
    assert score_all(rec, list(range(7)), batch_size=3, flush_seconds=0.01) == [2.0 * i for i in range(7)]
    assert sorted(rec.sizes) == [1, 3, 3]
    # a batcher can serve two successive event loops (score_all runs one per call)
    rec2 = _Recorder()
    b = RewardBatcher(rec2, batch_size=4, flush_seconds=0.01)
    assert score_all(b, [1, 2]) == [2.0, 4.0]
    assert score_all(b, [3, 4, 5, 6]) == [6.0, 8.0, 10.0, 12.0]
    assert b.stats.n_items == 6
    assert score_all(rec, []) == []
    asyncio.run(b.aclose())


def test_score_all_inside_running_loop_is_refused():
    async def main():
        score_all(_Recorder(), [1])

    with pytest.raises(RuntimeError, match="inside a running event loop"):
        asyncio.run(main())


def test_closed_batcher_refuses_and_aclose_flushes_queue():
    rec = _Recorder()

    async def main():
        b = RewardBatcher(rec, batch_size=100, flush_seconds=3600.0)
        t = asyncio.ensure_future(b.score(5))
        await asyncio.sleep(0)
        await b.aclose()  # flushes the queued item instead of waiting an hour
        assert t.done() and t.result() == 10.0
        with pytest.raises(RuntimeError, match="closed"):
            await b.score(1)

    asyncio.run(main())
    assert rec.sizes == [1]


def test_constructor_validation():
    with pytest.raises(ValueError, match="batch_size must be >= 1, found 0"):
        RewardBatcher(_Recorder(), 0, 0.1)
    with pytest.raises(ValueError, match="flush_seconds must be a finite number >= 0, found -1"):
        RewardBatcher(_Recorder(), 4, -1)
    with pytest.raises(TypeError, match="score_batch must be callable"):
        RewardBatcher(None, 4, 0.1)


def test_reward_service_batches_each_submission_alone_and_delivers_failures():
    from nla.rl.reward import RewardService

    calls = []

    def score(items):
        calls.append(list(items))
        return [float(x) * 10 for x in items]

    with RewardService(score, batch_size=2, flush_seconds=60.0) as service:
        f1 = service.submit([1, 2, 3])
        f2 = service.submit([4])  # within the flush window, but never merged with [3]: batches follow the items
        # nothing waits for the 60 s window: each submission's tail is sent at once
        assert f1.result(timeout=5) == [10.0, 20.0, 30.0] and f2.result(timeout=5) == [40.0]
        assert calls == [[1, 2], [3], [4]]
        assert service.score([]) == []

    def boom(items):
        raise RuntimeError("AR forward failed")

    with RewardService(boom, batch_size=2, flush_seconds=0.01) as service:
        futs = [service.submit([1]), service.submit([2])]
        for f in futs:
            with pytest.raises(RuntimeError, match="AR forward failed"):
                f.result(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        service.submit([1])


def test_inline_reward_service_scores_on_the_calling_thread_in_batches():
    """inline=True: the same values and checks as the thread, each submission cut into batches of
    batch_size and scored at once on the caller's thread; failures come back in the future."""
    import threading

    from nla.rl.reward import NonFiniteRewardError, RewardService

    calls, threads = [], []

    def score(items):
        calls.append(list(items))
        threads.append(threading.get_ident())
        return [float(x) * 10 for x in items]

    with RewardService(score, batch_size=2, flush_seconds=1.0, inline=True) as service:
        f1 = service.submit([1, 2, 3])
        assert f1.done() and f1.result() == [10.0, 20.0, 30.0]  # done before submit returned
        assert service.submit([4]).result() == [40.0]  # no merging across submissions inline
        assert service.score([]) == []
        assert calls == [[1, 2], [3], [4]]
        assert threads == [threading.get_ident()] * 3
        assert (service.stats.n_batches, service.stats.n_items, service.stats.n_failed_batches) == (3, 4, 0)
        assert not any(t.name == "nla-reward-loop" for t in threading.enumerate())

    def boom(items):
        if items == [3]:
            raise RuntimeError("AR forward failed")
        return [0.0] * len(items)

    with RewardService(boom, batch_size=2, flush_seconds=0.01, inline=True) as service:
        fut = service.submit([1, 2, 3])  # the second batch fails: the whole submission fails
        with pytest.raises(RuntimeError, match="AR forward failed"):
            fut.result()
        assert (service.stats.n_batches, service.stats.n_failed_batches) == (2, 1)
    with pytest.raises(RuntimeError, match="closed"):
        service.submit([1])

    with RewardService(lambda items: [0.5, float("nan")][: len(items)], batch_size=2, flush_seconds=0.01,
                       inline=True) as service:
        with pytest.raises(NonFiniteRewardError, match=r"non-finite values for items \[1\]"):
            service.score([0, 1])
        with pytest.raises(ValueError, match="returned 2 rewards for a batch of 1 items"):
            RewardService(lambda items: [0.0, 0.0], 4, 0.01, inline=True).score([0])


def test_failed_mse_is_orthogonal_whatever_the_gold():
    import math

    from nla.client import failed_mse as client_failed_mse
    from nla.core.reward import FAILED_EXTRACTION_MSE, failed_mse

    d = 4
    gold = torch.tensor([[0.0, 0.0, 0.0, 0.0],  # zero gold: used to cost 0, a perfect score
                         [1e38, 1e38, 0.0, 0.0],  # overflows fp32 when squared: used to normalise to 0
                         [1.0, 2.0, 3.0, 4.0]])
    # scale sqrt(d): 2 * d / d = 2.0 for every row
    assert failed_mse(gold, math.sqrt(d)).tolist() == [FAILED_EXTRACTION_MSE] * 3 == [2.0] * 3
    # scale 3: 2 * 9 / 4 = 4.5
    assert failed_mse(gold, 3.0).tolist() == [4.5] * 3
    # raw (no scale): 2 |g|^2 / d -> row 2: 2 * 30 / 4 = 15; row 1: 2 * 2e76 / 4 = 1e76 -> inf in fp32
    raw = failed_mse(gold, None)
    assert raw[0] == 0.0 and raw[2] == 15.0 and raw[1] == float("inf")
    assert client_failed_mse is failed_mse  # one definition, used by score, eval and the reward docs


def test_non_finite_rewards_fail_their_batch():
    from nla.rl.reward import NonFiniteRewardError, RewardService

    with RewardService(lambda items: [0.5, float("nan"), float("inf")][: len(items)], batch_size=3,
                       flush_seconds=0.01) as service:
        with pytest.raises(NonFiniteRewardError, match=r"non-finite values for items \[1, 2\] \(2 of 3, e.g. nan\)"):
            service.score([0, 1, 2])


def test_reward_timeout_fails_every_waiting_sample():
    import threading
    import time

    from nla.rl.reward import RewardService, RewardTimeoutError

    release = threading.Event()

    def stuck(items):
        release.wait(30)  # a forward that never returns on its own
        return [0.0] * len(items)

    t0 = time.perf_counter()
    with RewardService(stuck, batch_size=2, flush_seconds=0.01, timeout_seconds=0.2) as service:
        futs = [service.submit([1, 2]), service.submit([3])]
        for f in futs:
            with pytest.raises(RewardTimeoutError, match=r"took longer than timeout_seconds=0.2"):
                f.result(timeout=10)
        release.set()  # let the stuck thread end so the service closes
    assert time.perf_counter() - t0 < 10  # nothing waited for the 30 s forward
    with pytest.raises(ValueError, match="timeout_seconds must be a finite number > 0 or None, found 0"):
        RewardService(stuck, 2, 0.01, timeout_seconds=0)


def test_one_status_type_for_rollouts_clients_and_reports():
    import json

    from nla.client import STATUSES, Verbalization
    from nla.core.reward import Status
    from nla.rl.types import COMPLETED, FAILED_EXTRACTION, TRUNCATED

    assert (COMPLETED, TRUNCATED, FAILED_EXTRACTION) == (0, 1, 2)
    assert [Status.from_code(c) for c in (0, 1, 2)] == [Status.COMPLETED, Status.TRUNCATED, Status.FAILED]
    assert Status.COMPLETED == "completed" and str(Status.FAILED) == "failed" and STATUSES == tuple(Status)
    with pytest.raises(ValueError, match=r"status code: expected one of \[0, 1, 2\], found 7"):
        Status.from_code(7)
    # a truncated response is never parsed, even when its tags look whole
    assert Status.of("<explanation>x</explanation>", truncated=True) == (Status.TRUNCATED, None)
    assert Status.of("<explanation> x </explanation>", truncated=False) == (Status.COMPLETED, "x")
    assert Status.of("<explanation>x", truncated=False) == (Status.FAILED, None)
    v = Verbalization("t", None, Status.TRUNCATED, 3)
    assert json.loads(json.dumps(v.to_dict()))["status"] == "truncated"


def test_an_inline_reward_service_starts_no_thread_at_all():
    import threading

    from nla.rl.reward import RewardService

    before = {t.ident for t in threading.enumerate()}
    service = RewardService(lambda items: [0.0] * len(items), 2, 0.01, inline=True)
    assert service.score([1, 2, 3]) == [0.0, 0.0, 0.0]
    assert {t.ident for t in threading.enumerate()} == before  # no batcher executor, no loop thread
    service.close()
    assert service.batcher.closed


def test_score_samples_charges_failures_shapes_and_penalises_by_hand():
    from nla.rl.reward import RewardSettings, scorable_items, score_samples

    golds = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ok = torch.tensor([True, False, True])
    explanations = ["a.", None, "x. x."]
    assert [e for e, _ in scorable_items(explanations, golds, ok)] == ["a.", "x. x."]
    settings = RewardSettings(overlong_buffer_len=4, max_response_len=8, format_checks="generic", format_penalty=0.5)
    s = score_samples([0.5, 1.0], ok, golds, explanations, torch.tensor([3, 10, 5]), 2.0, settings)
    # the failed row costs 2 s^2 / d = 2 * 4 / 4 = 2.0; overlong ramp from 8 - 4 = 4: 0, -1 (past 8), -0.25
    assert s.mse.tolist() == [0.5, 2.0, 1.0]
    assert s.degenerate.tolist() == [False, False, True]  # "x. x." repeats a sentence
    assert s.rewards.tolist() == [-0.5, -3.0, -1.75]  # -1.0 - 0.25 - 0.5 on the last
    log = score_samples([0.5, 1.0], ok, golds, explanations, torch.tensor([3, 3, 3]), 2.0,
                        RewardSettings(log_mse=True))
    assert log.rewards.tolist() == pytest.approx([-math.log(0.5), -math.log(2.0), 0.0])
