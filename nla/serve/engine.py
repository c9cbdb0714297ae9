"""The model side of ``nla serve``: one worker thread owns the AV (and AR) and batches decodes.

Notation: B prompts in a batch, T_i tokens of prompt i, H the AV's hidden size (its embedding
width), L decode steps.

- :class:`SamplingParams`: SGLang's ``sampling_params`` as far as they are supported (temperature 0
  is greedy, ``top_k`` -1 is off), checked with one-line errors.
- :class:`Batcher`: a queue and one thread. A ``/generate`` prompt is a :class:`GenerateJob`; the
  thread takes the oldest item and, when it is a prompt, every queued prompt with the same decoding
  settings (``SamplingParams.batch_key``: greedy, temperature, top_p, top_k) up to ``max_batch``,
  and decodes them in one ``model.generate`` call (left padding). Each prompt's ``max_new_tokens``
  is honoured by truncation: the batch runs to the largest, and a prompt's tokens are cut at its
  own (a row's first n tokens do not depend on how long the batch runs). ``/verbalize`` and
  ``/score`` are tasks run alone on the same thread (the hooks and the models are not
  thread-safe). A batch that raises answers each of its prompts with the error; the thread goes on.
- :func:`decode_batch`: the decode, matching ``NLAClient.verbalize``: the marker token suppressed
  (``nla.rl.sampling.logits_processors`` through HF's ``suppress_tokens``), the tokenizer's EOS
  ends a row, and a neutral generation config (no ``generation_config.json`` default such as a
  repetition penalty or a top-k applies). On embeddings built as the published client builds
  them, greedy decoding gives ``NLAClient.verbalize(greedy=True)``'s text.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from nla.util.http import RequestError
from nla.util.validation import MAX_TEMPERATURE, InputError, check_sampling

logger = logging.getLogger(__name__)

__all__ = ["MAX_BYTES_PER_TOKEN", "MAX_TEMPERATURE", "SAMPLING_KEYS", "Batcher", "GenerateJob", "SamplingParams", "ServeLimits",
           "decode_batch", "generation_output"]

# sampling_params keys this server honours (SGLang's names and defaults)
# A token of any tokenizer nla serves is far shorter than this many UTF-8 bytes: a text longer than
# max_prompt_tokens * MAX_BYTES_PER_TOKEN bytes cannot fit the token cap and is refused untokenised.
MAX_BYTES_PER_TOKEN = 32
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "skip_special_tokens")


@dataclass(frozen=True)
class ServeLimits:
    """Caps on what one request may ask for (each breach is a 4xx naming the cap).

    max_body_bytes: request body (the default holds 2 prompts of 120 tokens x 3584 floats as JSON,
        a Qwen2.5-7B AV prompt, with room); max_prompt_tokens: tokens per prompt; max_prompts:
        prompts per ``/generate`` request (a list); max_new_tokens: decode steps; max_batch: prompts
        per decode; batch_wait_ms: how long the batcher waits for more prompts after the first;
        max_vectors / max_samples / max_texts / max_text_chars: ``/verbalize`` and ``/score``;
        max_request_tokens: the decode work one request may ask for, vectors x n_samples x
        max_new_tokens (``/verbalize``) or prompts x max_new_tokens (``/generate``), checked before
        any work (the other caps together admitted a ~20-minute ``/verbalize`` that held every
        other client, issue 58); header_timeout_s: seconds a request's line and headers may take to
        arrive (``nla.util.http.header_timeout_protocol``; a 408, then the connection closed);
        body_timeout_s: seconds the whole request body may take to arrive; verbalize_seconds: the wall
        time one ``/verbalize`` may decode for, checked between pieces of ``verbalize_piece`` vectors
        (a 503 naming how far it got once past it; the token cap bounds the work, this the time on a
        slow or busy machine);
        keep_alive_s: how long an idle connection stays open; max_connections: connections served at
        once (uvicorn's ``limit_concurrency``; more get a 503).
    A ``/generate`` text is refused on its length in bytes (more than ``MAX_BYTES_PER_TOKEN`` per
    allowed token) before it is tokenised: a 28 MB text was tokenised whole (37 s) before its
    token count was checked.
    """

    max_body_bytes: int = 32 * 2**20
    max_prompt_tokens: int = 2048
    max_prompts: int = 64
    max_new_tokens: int = 1024
    max_batch: int = 64
    batch_wait_ms: float = 2.0
    max_vectors: int = 256
    max_samples: int = 16
    max_texts: int = 256
    max_text_chars: int = 8000
    max_request_tokens: int = 65536
    header_timeout_s: float = 10.0
    verbalize_seconds: float = 120.0
    verbalize_piece: int = 8
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 256

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            seconds = name.endswith("_s") or name.endswith("_seconds")  # any positive time; counts are >= 1
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    value < 0 if name == "batch_wait_ms" else value <= 0 if seconds else value < 1):
                raise ValueError(f"ServeLimits.{name}: expected a positive number, found {value!r}")
            if not seconds and name != "batch_wait_ms" and not isinstance(value, int):
                raise ValueError(f"ServeLimits.{name}: expected a whole number, found {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters, as far as supported: ``temperature`` 0 is greedy, ``top_k`` -1 is off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def batch_key(self) -> tuple:
        """Prompts with the same key share a decode (max_new_tokens by truncation; skip_special_tokens at decoding)."""
        return ("greedy",) if self.greedy else ("sample", self.temperature, self.top_p, self.top_k)

    @classmethod
    def parse(cls, raw: Any, limits: ServeLimits) -> SamplingParams:
        """From a request's ``sampling_params`` object (None: the defaults); a 400 names the key."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RequestError(f"field 'sampling_params': expected an object, found {type(raw).__name__}")
        unknown = sorted(set(raw) - set(SAMPLING_KEYS))
        if unknown:
            raise RequestError(f"field 'sampling_params': unsupported key(s) {unknown}; this server supports "
                             f"{list(SAMPLING_KEYS)}")
        kw: dict[str, Any] = {}
        for key, value in raw.items():
            if value is None:
                continue
            what = f"field 'sampling_params.{key}'"
            if key == "skip_special_tokens":
                if not isinstance(value, bool):
                    raise RequestError(f"{what}: expected true or false, found {type(value).__name__}")
                kw[key] = value
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{what}: expected a number, found {type(value).__name__}")
            if key in ("top_k", "max_new_tokens") and not isinstance(value, int):
                if not float(value).is_integer():
                    raise RequestError(f"{what}: expected an integer, found {value}")
                value = int(value)
            kw[key] = value
        kw.setdefault("max_new_tokens", min(cls.max_new_tokens, limits.max_new_tokens))  # SGLang's 128, or the cap
        p = cls(**{k: (float(v) if k in ("temperature", "top_p") else v) for k, v in kw.items()})
        try:  # the one check of sampling settings (a 1e-40 temperature was a 500 here, garbage in /verbalize)
            check_sampling(p.temperature, p.top_p, what="field 'sampling_params.temperature'",
                           top_p_what="field 'sampling_params.top_p'", zero_is_greedy=True)
        except InputError as err:
            raise RequestError(str(err)) from None
        if not (p.top_k == -1 or 1 <= p.top_k < 2**31):
            raise RequestError(f"field 'sampling_params.top_k': expected -1 (off) or a positive integer, found {p.top_k}")
        if not 1 <= p.max_new_tokens <= limits.max_new_tokens:
            raise RequestError(f"field 'sampling_params.max_new_tokens': expected 1..{limits.max_new_tokens} (the "
                             f"server's cap, --max-new-tokens), found {p.max_new_tokens}")
        return p


@dataclass
class GenerateJob:
    """One prompt of a ``/generate`` request: its embeddings [T, H] (fp32, CPU) and where its answer goes."""

    embeds: Tensor
    params: SamplingParams
    future: Future = field(default_factory=Future)


@dataclass
class _Task:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


def _neutral_generation_config(eos_id: int, pad_id: int, params: SamplingParams, max_new_tokens: int,
                               suppress_ids: list[int]) -> Any:
    """A GenerationConfig that names every logits-processor setting, so that the checkpoint's own
    ``generation_config.json`` (a Qwen's repetition penalty or top-k) adds nothing: what runs is what
    ``nla.rl.sampling.logits_processors`` runs (suppress the marker; then temperature, top-k, top-p)."""
    from transformers import GenerationConfig

    sample = not params.greedy
    kw: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, min_length=0, do_sample=sample, num_beams=1, eos_token_id=eos_id,
        pad_token_id=pad_id, suppress_tokens=list(suppress_ids) or None, repetition_penalty=1.0,
        no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, use_cache=True,
    )
    if sample:  # greedy reads none of these (HF warns when they are set)
        kw.update(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
    return GenerationConfig(**kw)


@torch.no_grad()
def decode_batch(model: nn.Module, jobs: list[GenerateJob], eos_id: int, pad_id: int, suppress_ids: list[int]
                 ) -> list[list[int]]:
    """Decode the jobs (one batch key) in one ``model.generate``: left padding, the marker suppressed,
    EOS ends a row. Returns each job's generated ids, cut after its first EOS or at its own
    ``max_new_tokens``. (HF ``generate`` does every part here: embeddings in, padding, cache, EOS.)"""
    device = next(model.parameters()).device
    dtype = model.get_input_embeddings().weight.dtype
    lengths = [job.embeds.shape[0] for job in jobs]
    B, T, H = len(jobs), max(lengths), jobs[0].embeds.shape[1]
    embeds = torch.zeros(B, T, H, dtype=dtype, device=device)
    mask = torch.zeros(B, T, dtype=torch.long, device=device)
    for i, job in enumerate(jobs):  # left padding: every row's last prompt token at position T - 1
        embeds[i, T - lengths[i]:] = job.embeds.to(device=device, dtype=dtype)
        mask[i, T - lengths[i]:] = 1
    longest = max(job.params.max_new_tokens for job in jobs)
    config = _neutral_generation_config(eos_id, pad_id, jobs[0].params, longest, suppress_ids)
    saved = model.generation_config
    model.generation_config = config  # its values fill nothing in: every field that matters is set
    was_training = model.training
    model.eval()
    try:
        out = model.generate(inputs_embeds=embeds, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config = saved
        model.train(was_training)
    out = out.cpu()
    if out.shape[1] > longest:  # some versions return the prompt's (placeholder) ids in front
        out = out[:, -longest:] if out.shape[1] != T + longest else out[:, T:]
    results = []
    for i, job in enumerate(jobs):
        ids = out[i, : job.params.max_new_tokens].tolist()
        if eos_id in ids:
            ids = ids[: ids.index(eos_id) + 1]
        results.append(ids)
    return results


def generation_output(tokenizer: Any, ids: list[int], params: SamplingParams, prompt_tokens: int, eos_id: int
                      ) -> dict[str, Any]:
    """SGLang's response object for one prompt: the text (without EOS), finish reason and token counts."""
    ended = bool(ids) and ids[-1] == eos_id
    text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=params.skip_special_tokens)
    finish = {"type": "stop", "matched": eos_id} if ended else {"type": "length", "length": params.max_new_tokens}
    return {"text": text, "meta_info": {"id": uuid.uuid4().hex, "finish_reason": finish,
                                        "prompt_tokens": prompt_tokens, "completion_tokens": len(ids)}}


class Batcher:
    """One worker thread that owns the models: batched ``/generate`` decodes and single tasks.

    ``submit_generate(jobs)`` and ``submit_task(fn)`` return futures. Counters (``stats()``): requests,
    prompts, batches, largest batch, prompts per batch size, failed batches, tasks.
    """

    def __init__(self, decode: Callable[[list[GenerateJob]], list[Any]], limits: ServeLimits) -> None:
        self.decode, self.limits = decode, limits
        self._queue: collections.deque[GenerateJob | _Task] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._counts = {"requests": 0, "prompts": 0, "batches": 0, "largest_batch": 0, "failed_batches": 0,
                        "tasks": 0}
        self._sizes: collections.Counter[int] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="nla-serve-batcher", daemon=True)
        self._thread.start()

    def submit_generate(self, jobs: list[GenerateJob]) -> list[Future]:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._counts["requests"] += 1
            self._queue.extend(jobs)
            self._cond.notify()
        return [job.future for job in jobs]

    def submit_task(self, fn: Callable[[], Any], *, count: bool = True) -> Future:
        """Run ``fn`` alone on the thread; ``count=False``: a step of a request counted elsewhere."""
        task = _Task(fn)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._counts["requests"] += int(count)
            self._queue.append(task)
            self._cond.notify()
        return task.future

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self._counts, "queued": len(self._queue),
                    "batch_sizes": {str(k): v for k, v in sorted(self._sizes.items())}}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _take(self) -> GenerateJob | _Task | list[GenerateJob] | None:
        """The next task, or the next batch of prompts (the oldest and every queued one with its key)."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed and not self._queue:
                return None
            first = self._queue.popleft()
        if isinstance(first, _Task):
            return first
        if self.limits.batch_wait_ms > 0:  # let prompts sent at the same moment join this batch
            time.sleep(self.limits.batch_wait_ms / 1000)
        key = first.params.batch_key()
        batch = [first]
        with self._cond:
            rest: collections.deque = collections.deque()
            while self._queue:
                item = self._queue.popleft()
                if len(batch) < self.limits.max_batch and isinstance(item, GenerateJob) and \
                        item.params.batch_key() == key:
                    batch.append(item)
                else:
                    rest.append(item)
            self._queue.extendleft(reversed(rest))  # the others keep their order
        return batch

    def _run(self) -> None:
        while True:
            item = self._take()
            if item is None:
                return
            if isinstance(item, _Task):
                self._counts["tasks"] += 1
                try:
                    item.future.set_result(item.fn())
                except BaseException as err:  # noqa: BLE001 - the request gets it; the thread goes on
                    item.future.set_exception(err)
                continue
            with self._cond:
                self._counts["batches"] += 1
                self._counts["prompts"] += len(item)
                self._counts["largest_batch"] = max(self._counts["largest_batch"], len(item))
                self._sizes[len(item)] += 1
            try:
                results = self.decode(item)
                if len(results) != len(item):
                    raise RuntimeError(f"the decode returned {len(results)} results for {len(item)} prompts")
            except BaseException as err:  # noqa: BLE001 - every prompt of the batch gets the error
                logger.exception("serve: a batch of %d prompts failed", len(item))
                with self._cond:
                    self._counts["failed_batches"] += 1
                for job in item:
                    job.future.set_exception(err)
                continue
            for job, res in zip(item, results, strict=True):
                job.future.set_result(res)
