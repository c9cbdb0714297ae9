"""RL's reward machinery: the reward settings of an RL run, N samples scored into rewards, and
the batched scoring service over the live AR.

The reward itself (failure charge, MSE -> reward, format checks) is defined once in
``nla.core.reward``; this module applies it to rollouts.

``RewardBatcher`` gathers single-sample reward requests into batched AR
forwards. A forward that runs past ``timeout_seconds`` fails every sample
waiting on it (:class:`RewardTimeoutError`); a non-finite value from the score
function fails its batch (:class:`NonFiniteRewardError`) instead of reaching the
advantages as NaN. The score function it wraps is supplied by the caller and called as
is: the RL loop passes a closure over the *live* reconstructor, so every
reward uses the AR's current weights. The batcher never copies, reloads or
caches the model or its outputs.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from nla.core.reward import charge_failures, failed_mse, format_flags, make_rewards

__all__ = [
    "NonFiniteRewardError",
    "RewardTimeoutError",
    "RewardSettings",
    "ScoredSamples",
    "score_samples",
    "scorable_items",
    "BatcherStats",
    "RewardBatcher",
    "RewardService",
    "score_all",
]

logger = logging.getLogger(__name__)


class RewardTimeoutError(TimeoutError):
    """A reward forward ran past the batcher's timeout; every sample waiting on it gets this error."""


class NonFiniteRewardError(ValueError):
    """The score function returned NaN or Inf for some items."""


@dataclass(frozen=True)
class RewardSettings:
    """How MSEs become rewards: the -log variant, DAPO's soft overlong punishment (0 = off; the
    ramp ends at ``max_response_len``) and the format penalty of grader ``format_checks``
    (``nla.core.graders``). RL's ``reward`` section maps onto it (``nla.rl.loop.reward_settings``)."""

    log_mse: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    max_response_len: int = 0
    format_checks: str = "generic"
    format_penalty: float = 0.0

    def rewards(self, mse: Tensor, failed: Tensor, failed_cost: Tensor | float, lengths: Tensor,
                degenerate: Tensor | None = None) -> Tensor:
        """``make_rewards`` with these settings; lengths [N]: response tokens (the overlong ramp)."""
        shaping = None
        if self.overlong_buffer_len > 0:
            from nla.rl.algorithms import overlong_penalty  # the DAPO math stays with the other RL math

            shaping = overlong_penalty(lengths, self.max_response_len, self.overlong_buffer_len,
                                       self.overlong_penalty_factor)
        return make_rewards(mse, failed, failed_cost, log_mse=self.log_mse, shaping=shaping, degenerate=degenerate,
                            format_penalty=self.format_penalty)


@dataclass(frozen=True)
class ScoredSamples:
    """What scoring makes of N samples: ``mse`` [N] (a failed sample holds the MSE it is charged),
    ``degenerate`` [N] bool, ``rewards`` [N]."""

    mse: Tensor
    degenerate: Tensor
    rewards: Tensor


def scorable_items(explanations: Sequence[str | None], golds: Tensor, ok: Tensor) -> list[tuple[str, Tensor]]:
    """(explanation, RAW gold [d]) of the samples the AR scores (``ok`` [N]: extraction succeeded)."""
    return [(explanations[i], golds[i]) for i in ok.nonzero(as_tuple=True)[0].tolist()]


def score_samples(scored_mse: Sequence[float] | Tensor, ok: Tensor, golds: Tensor,
                  explanations: Sequence[str | None], lengths: Tensor, scale: float | None,
                  settings: RewardSettings) -> ScoredSamples:
    """The rewards of N samples from the AR's ``mse_nrm`` of the ``ok`` ones (``scored_mse``, in the
    order of ``scorable_items``): failed samples charged ``failed_mse(gold, scale)`` at the AR's
    scale, the format checks read from the explanations, then ``settings.rewards``."""
    n = len(explanations)
    mse = torch.full((n,), math.nan)
    scored = torch.as_tensor(scored_mse, dtype=torch.float32) if len(scored_mse) else torch.zeros(0)
    mse[ok] = scored
    cost = failed_mse(golds, scale)
    degenerate = format_flags(explanations, settings.format_checks)
    return ScoredSamples(mse=charge_failures(mse, ~ok, cost), degenerate=degenerate,
                         rewards=settings.rewards(mse, ~ok, cost, lengths, degenerate))


# ------------------------------------------------------------------ batcher

Item = TypeVar("Item")
ScoreBatch = Callable[[list], "list[float] | Tensor"]


@dataclass(frozen=True)
class BatcherStats:
    """Counters of a RewardBatcher.

    n_batches: calls of ``score_batch`` (including failed ones).
    n_items: items sent to ``score_batch``.
    n_failed_batches: calls that raised (each failure reached all its callers).
    """

    n_batches: int = 0
    n_items: int = 0
    n_failed_batches: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.n_items / self.n_batches if self.n_batches else 0.0


class RewardBatcher(Generic[Item]):
    """Collects reward requests into batched ``score_batch`` calls.

    ``await score(item)`` queues one item; ``await score_group(items)`` queues
    several and returns their rewards in order. The queue is flushed as one
    ``score_batch(items) -> list[float] | Tensor [n]`` call when it reaches
    ``batch_size`` items, or ``flush_seconds`` after the first item of the
    current queue arrived (tail flush), whichever is first.

    ``score_batch`` runs in a single worker thread, so the event loop (and
    any generation callbacks on it) keeps running during a forward, and
    forwards never overlap each other (the AR is not shared across threads).
    If ``score_batch`` raises, or returns the wrong number of rewards, every
    caller waiting on that batch gets the exception; nothing hangs.

    ``score_batch`` is called as given: pass a closure over the *live*
    reconstructor so rewards follow its current weights. The batcher keeps no
    copy of the model or its outputs.

    Use as ``async with RewardBatcher(...) as b:`` or call ``await b.aclose()``,
    which flushes what is queued, waits for running batches and stops the
    worker thread. A batcher may serve several event loops one after the
    other (``score_all`` runs a fresh loop per call), but not at once.
    """

    def __init__(self, score_batch: ScoreBatch, batch_size: int, flush_seconds: float,
                 timeout_seconds: float | None = None) -> None:
        if not callable(score_batch):
            raise TypeError(f"score_batch must be callable, found {type(score_batch).__name__}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}.")
        if not (flush_seconds >= 0 and math.isfinite(flush_seconds)):
            raise ValueError(f"flush_seconds must be a finite number >= 0, found {flush_seconds}.")
        if timeout_seconds is not None and not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
            raise ValueError(f"timeout_seconds must be a finite number > 0 or None, found {timeout_seconds}.")
        self.timeout_seconds = timeout_seconds
        self.score_batch = score_batch
        self.batch_size = batch_size
        self.flush_seconds = flush_seconds
        self._pending: list[tuple[Item, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._inflight: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None  # started by the first threaded batch
        self._closed = False
        self._stats = BatcherStats()

    # -- public API

    @property
    def stats(self) -> BatcherStats:
        return self._stats

    @property
    def closed(self) -> bool:
        return self._closed

    async def score(self, item: Item) -> float:
        """Reward for one item (waits until its batch has been scored)."""
        (fut,) = self._enqueue([item])
        return await fut

    async def score_group(self, items: Sequence[Item], *, flush: bool = False) -> list[float]:
        """Rewards for ``items``, in order. Raises the first failure among its batches.

        ``flush``: send the tail at once instead of waiting ``flush_seconds`` for more items. When
        every caller flushes, each call's items are batched alone, in ``batch_size`` slices in
        order: the batches (and so the padded shapes the AR computes with) depend on the items,
        never on when they arrived.
        """
        if not items:
            return []
        futures = self._enqueue(list(items))
        if flush:
            self._flush_pending()
        # return_exceptions so every future is retrieved (no "never retrieved" warnings).
        results = await asyncio.gather(*futures, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def flush(self) -> None:
        """Send whatever is queued now and wait for all running batches."""
        self._flush_pending()
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)

    async def aclose(self) -> None:
        """Flush, wait for running batches, stop the worker thread. Idempotent."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            self.close()

    def close(self) -> None:
        """Stop taking items and stop the worker thread (if one was started), without waiting for
        queued items: for a batcher used through ``score_now`` only, or after ``aclose``. Idempotent."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def __aenter__(self) -> RewardBatcher[Item]:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def score_now(self, items: Sequence[Item]) -> list[float]:
        """Rewards for ``items`` scored on the calling thread, in batches of ``batch_size``, with the
        checks and counters of the threaded path; the first failure is raised (no loop, no timeout)."""
        items, out = list(items), []
        for start in range(0, len(items), self.batch_size):
            batch = items[start : start + self.batch_size]
            self._count(n_items=len(batch))
            try:
                out.extend(_to_float_list(self.score_batch(batch), len(batch)))
            except Exception:
                self._count(failed=True)
                raise
        return out

    # -- internals

    def _count(self, n_items: int = 0, failed: bool = False) -> None:
        """One batch sent (``n_items``) or, with ``failed``, the last one failed."""
        st = self._stats
        self._stats = (BatcherStats(st.n_batches, st.n_items, st.n_failed_batches + 1) if failed
                       else BatcherStats(st.n_batches + 1, st.n_items + n_items, st.n_failed_batches))

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._pending or self._inflight:
                raise RuntimeError(
                    "RewardBatcher is busy on another event loop; use one batcher per loop at a time."
                )
            self._loop = loop
        return loop

    def _enqueue(self, items: list[Item]) -> list[asyncio.Future]:
        if self._closed:
            raise RuntimeError("RewardBatcher is closed; create a new one to score more items.")
        loop = self._bind_loop()
        futures = [loop.create_future() for _ in items]
        was_empty = not self._pending
        self._pending.extend(zip(items, futures, strict=True))
        while len(self._pending) >= self.batch_size:
            self._launch(self._pending[: self.batch_size])
            del self._pending[: self.batch_size]
        if not self._pending:
            self._cancel_timer()
        elif was_empty or self._timer is None:
            # The tail clock starts with the first item of the current queue.
            self._cancel_timer()
            self._timer = loop.call_later(self.flush_seconds, self._flush_pending)
        return futures

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _flush_pending(self) -> None:
        self._cancel_timer()
        while self._pending:
            self._launch(self._pending[: self.batch_size])
            del self._pending[: self.batch_size]

    def _launch(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        task = asyncio.get_running_loop().create_task(self._run_batch(list(batch)))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _run_batch(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        items = [item for item, _ in batch]
        futures = [fut for _, fut in batch]
        loop = asyncio.get_running_loop()
        self._count(n_items=len(items))
        try:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nla-reward")
            call = loop.run_in_executor(self._executor, self.score_batch, items)
            try:
                raw = await asyncio.wait_for(call, self.timeout_seconds)
            except asyncio.TimeoutError:
                # The forward keeps its thread (Python cannot stop it); the waiters are told now.
                raise RewardTimeoutError(
                    f"a reward batch of {len(items)} items took longer than timeout_seconds="
                    f"{self.timeout_seconds}; the reconstructor forward is stuck or far too slow "
                    "(raise reward_timeout_seconds, or lower reward_batch_size)"
                ) from None
            rewards = _to_float_list(raw, len(items))
        except asyncio.CancelledError:
            # The loop is shutting down: cancel the waiters instead of leaving them pending.
            for fut in futures:
                fut.cancel()
            raise
        except BaseException as exc:  # delivered to every waiting caller
            self._count(failed=True)
            logger.warning("reward batch of %d items failed: %r", len(items), exc)
            for fut in futures:
                if not fut.done():
                    fut.set_exception(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        for fut, r in zip(futures, rewards, strict=True):
            if not fut.done():  # a caller may have been cancelled meanwhile
                fut.set_result(r)


def _to_float_list(raw: list[float] | Tensor, n: int) -> list[float]:
    if isinstance(raw, Tensor):
        raw = raw.detach().float().reshape(-1).cpu().tolist()
    else:
        raw = [float(x) for x in raw]
    if len(raw) != n:
        raise ValueError(
            f"score_batch returned {len(raw)} rewards for a batch of {n} items; "
            "it must return one reward per item, in order."
        )
    bad = [i for i, r in enumerate(raw) if not math.isfinite(r)]
    if bad:
        raise NonFiniteRewardError(
            f"score_batch returned non-finite values for items {bad[:10]}{' ...' if len(bad) > 10 else ''} "
            f"({len(bad)} of {n}, e.g. {raw[bad[0]]}); the reconstructor diverged or a gold vector is not "
            "finite. Check the AR's loss and the dataset"
        )
    return raw


def score_all(
    batcher_or_fn: RewardBatcher | ScoreBatch,
    items: Sequence[Item],
    *,
    batch_size: int = 64,
    flush_seconds: float = 0.05,
) -> list[float]:
    """Synchronously score ``items`` through a batcher; rewards in order.

    Given a ``RewardBatcher`` it is used (and left open); given a plain
    ``score_batch`` function a temporary batcher with ``batch_size`` and
    ``flush_seconds`` is built and closed. Runs its own event loop, so it must
    not be called from inside a running loop (await ``score_group`` there).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "score_all was called inside a running event loop; use `await batcher.score_group(items)` there."
        )

    async def _main() -> list[float]:
        if isinstance(batcher_or_fn, RewardBatcher):
            return await batcher_or_fn.score_group(items)
        async with RewardBatcher(batcher_or_fn, batch_size, flush_seconds) as b:
            return await b.score_group(items)

    return asyncio.run(_main())


class RewardService:
    """A ``RewardBatcher`` on its own event-loop thread, for a synchronous caller.

    ``submit(items)`` queues items and returns at once with a ``concurrent.futures.Future``
    of their rewards, so the caller can keep generating while the AR scores what is
    already done. Each submission is scored in ``batch_size`` slices of its own items, in
    order, never merged with another submission by arrival time: the AR sees the same
    batches, and gives the same bits, however fast the caller submits (docs/design.md §4,
    "Determinism").
    ``score(items)`` is the blocking form. A failing forward reaches every waiting future.
    ``close()`` flushes and stops the thread.

    ``inline=True`` runs no thread: ``submit`` scores its items on the calling thread, in
    batches of ``batch_size``, and returns a finished future (the same values, the same
    checks, a failure in the future). This is for a reconstructor in this process on the
    CPU: torch ops on a second thread start a second OpenMP team, and libgomp, once it
    manages more threads than there are cores, stops spinning idle workers, so every op
    of every thread pays a sleep/wake-up. On 2 cores at 2 torch threads an RL step of
    the default world took 1.11 s with the thread and 0.65 s inline
    (``bench/bench_rl_step.py``). There is no timeout inline: the caller is the one waiting.
    """

    def __init__(self, score_batch: ScoreBatch, batch_size: int, flush_seconds: float,
                 timeout_seconds: float | None = None, *, inline: bool = False) -> None:
        import threading

        # The batcher first: bad arguments raise before a loop thread exists.
        self.batcher: RewardBatcher = RewardBatcher(score_batch, batch_size, flush_seconds, timeout_seconds)
        self.inline = inline
        self._loop = self._thread = None
        if inline:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nla-reward-loop", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> BatcherStats:
        return self.batcher.stats

    def submit(self, items: Sequence[Item]):  # -> concurrent.futures.Future[list[float]]
        if self.batcher.closed:  # set by close() in both modes
            raise RuntimeError("RewardService is closed; create a new one to score more items.")
        if self.inline:
            fut: Future = Future()
            try:
                fut.set_result(self.batcher.score_now(items))
            except Exception as exc:  # delivered through the future, as from the thread
                logger.warning("reward batch failed: %r", exc)
                fut.set_exception(exc)
            return fut
        return asyncio.run_coroutine_threadsafe(self.batcher.score_group(list(items), flush=True), self._loop)

    def score(self, items: Sequence[Item]) -> list[float]:
        return self.submit(items).result() if items else []

    def close(self) -> None:
        """Flush what is queued, stop the loop thread. Idempotent."""
        if self._thread is None:  # inline: nothing queued, no thread
            self.batcher.close()
            return
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.batcher.aclose(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
