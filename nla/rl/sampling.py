"""The rollout's sampling loop: a KV-cache decode in which finished rows leave the batch.

Notation as in ``nla.rl.types``: B prompts, G samples per prompt, N = B*G, P prompt tokens,
L generated steps, V vocabulary.

Where it departs from HF ``model.generate`` (which the rollout used before, and which the
tests hold it to under greedy decoding):

1. Every row has the same prompt (the canonical AV prompt, P tokens, no padding), so the
   batch is never padded: all live rows sit at the same position, no attention mask is
   needed, and a row that emits EOS can simply be dropped from the KV cache
   (``DynamicCache.batch_select_indices``). HF keeps finished rows in the batch to the end;
   on the default world ~27% of its row-steps were spent on rows that had already ended.
2. Dropping rows copies the cache, so it happens when at least ``1/COMPACT_DIVISOR`` of the
   batch has finished (at most that share of a step is wasted on dead rows).
3. The prefill runs once per prompt (B rows), with the vector injected by the embedding hook;
   its cache and last logits are then repeated G times (the G samples of a group share the
   prompt and the vector, so their prefills are identical).
4. Logits go through HF's own processors in HF's order (suppress the marker token, then
   temperature, then top-p), in fp32. Greedy decoding gives HF's tokens; sampling draws
   from the same distribution, but not the same tokens for a seed: each draw inverts the CDF
   at a uniform of item 5 (``sample_categorical``) rather than calling ``torch.multinomial``
   (18% of the rollout's time on the default world).
5. The uniforms of the draws come from a generator of the call's own, seeded by one draw from
   torch's global stream: at decode step t every output row i of the whole batch has its own
   uniform (the i-th of that step's ``rand(N)``), whether or not it is still alive and
   wherever it sits in the (compacted) batch. So a batch split over ranks (``share``: each
   rank its contiguous rows, no communication) samples exactly the tokens of the whole batch
   in one process, a CPU and a GPU draw the same uniforms, and the global stream advances by
   one draw per call however many steps run (the rollout of 2, 3 or more generating ranks
   equals the local one for a seed, float rounding of the logits aside, which moves a draw
   only when it lands on a CDF step).
6. ``decode="captured"``: the decode runs on a static KV cache of P + ``max_new_tokens`` positions
   (HF ``StaticCache``, the prefill's cache repeated into it), finished rows stay in the batch
   (no compaction: every step has the same shapes), and on a CUDA device the decode step is one
   captured CUDA graph, replayed at every step (one launch instead of one per op per token,
   where small batches spend their time). The draws are item 5's. Attention over the static
   cache's full length (masked) rounds differently from the eager loop's exact length, in the last
   bits of the logits (at most 3e-7 measured on a Qwen2.5-shaped model at test width): greedy
   decoding writes the eager loop's tokens, and a sampled draw the same token except where that
   rounding moves it across a step of the CDF (item 5's caveat; frequent only for near-uniform
   distributions, such as a random model's over 151k tokens). The eager loop stays the reference
   and the default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from nla.core.arch import cache_kwargs, output_cache
from nla.core.injection import InjectionHook
from nla.core.prefix import CACHE_REUSE_MODEL_TYPES, supports_cache_reuse
from nla.rl.config import DECODES
from nla.rl.types import prompt_batch

COMPACT_DIVISOR = 8

def hf_generate(model: nn.Module, hook: InjectionHook, prompt_ids: Tensor, vectors: Tensor, n_samples: int,
                max_new_tokens: int, eos_id: int, pad_id: int, *, suppress_ids: list[int] = (),
                temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False) -> Tensor:
    """The plain path: HF ``generate`` on the repeated prompt, the hook injecting at prefill. [N, L]"""
    device = next(model.parameters()).device
    vec = vectors.repeat_interleave(n_samples, 0).to(device)
    ids = (prompt_ids.to(device).expand(vec.shape[0], prompt_ids.shape[0]) if prompt_ids.dim() == 1
           else prompt_ids.to(device).repeat_interleave(n_samples, 0))
    kw: dict = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p,
                                                    "top_k": 0}
    with hook.vectors(vec):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             eos_token_id=eos_id, pad_token_id=pad_id, suppress_tokens=list(suppress_ids), **kw)
    return out[:, prompt_ids.shape[-1]:]


def logits_processors(suppress_ids: list[int], temperature: float, top_p: float, greedy: bool,
                      device: torch.device) -> LogitsProcessorList:
    """HF's processors, in the order ``generate`` applies them (warpers only when sampling)."""
    procs = LogitsProcessorList()
    if suppress_ids:
        procs.append(SuppressTokensLogitsProcessor(suppress_ids, device=device))
    if not greedy:
        if temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
    return procs


def sample_categorical(scores: Tensor, u: Tensor | None = None) -> Tensor:
    """One draw per row from ``softmax(scores)`` [n, V] -> [n], by inverting the CDF.

    The same distribution as ``torch.multinomial(softmax(scores), 1)``, about 5x cheaper on CPU
    (a cumulative sum and a binary search instead of multinomial's setup per row). A token of
    probability 0 (suppressed, or cut by top-p) is never drawn: ``right=True`` returns the
    first index whose cumulative mass exceeds ``u``, so it moves past flat steps of the CDF.
    ``u`` [n, 1]: the uniforms to use (default: ``torch.rand`` drawn here).
    """
    cdf = torch.softmax(scores, -1).cumsum(-1)  # [n, V]
    if u is None:
        u = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype)
    u = u * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)


def draw_seed() -> int:
    """The seed of one sampling call, drawn from torch's global (CPU) stream: one draw per call."""
    return int(torch.randint(0, 2**62, (1,)))


def _static_cache(model: nn.Module, prefill: Any, repeats: int, length: int) -> Any:
    """A ``StaticCache`` of ``length`` positions holding the prefill's keys and values, each prompt's
    repeated ``repeats`` times (the rows of its group)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    for i, layer in enumerate(prefill.layers):
        keys, values = layer.keys.repeat_interleave(repeats, 0), layer.values.repeat_interleave(repeats, 0)
        cache.update(keys, values, i, {"cache_position": torch.arange(keys.shape[-2], device=keys.device)})
    return cache


class _StaticStep:
    """One decode step on a static cache: ``step(nxt [N], position) -> logits [N, V]`` (fp32). On
    a CUDA device the forward is captured once as a CUDA graph and replayed; where capture fails
    (a model whose forward synchronises with the host), the step runs as it is, with a warning:
    the same tokens either way."""

    def __init__(self, model: nn.Module, cache: Any, n: int, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: Any = None
        self.capture = device.type == "cuda"
        self.out: Tensor | None = None

    def _forward(self) -> Tensor:
        return self.model(input_ids=self.ids, cache_position=self.pos, use_cache=True,
                          **cache_kwargs(self.cache)).logits[:, -1].float()

    def __call__(self, nxt: Tensor, position: int) -> Tensor:
        self.ids.copy_(nxt[:, None])
        self.pos.fill_(position)
        if not self.capture:
            return self._forward()
        if self.graph is not None:
            self.graph.replay()
            return self.out.clone()
        # The first step runs for real on a side stream (capture needs a warm-up there), then is
        # captured; capturing records the kernels without running them, so the cache holds this
        # step's keys and values once. HF's StaticCache writes at a position of its own, a device
        # counter that each update advances (``cumulative_length``, transformers 5.17 to 5.25), so
        # every replay advances it too; ``self.pos`` sets the rotary positions and the mask, and the
        # two agree because each step (warm-up, then one replay a step) runs exactly once. Whether
        # the step is capturable is checked on the CPU: tests/test_rl_sampling.py,
        # test_the_captured_step_is_one_graph_at_every_position.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            logits = self._forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self._forward()
            self.graph = graph
        except RuntimeError as err:
            import logging

            logging.getLogger(__name__).warning("decode: the step could not be captured as a CUDA graph (%s); "
                                                "it runs on the static cache without one", err)
            self.capture = False
        return logits


@torch.no_grad()
def sample_responses(model: nn.Module, hook: InjectionHook, prompt_ids: Tensor, vectors: Tensor, n_samples: int,
                     max_new_tokens: int, eos_id: int, pad_id: int, *, suppress_ids: list[int] = (),
                     temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                     share: tuple[int, int] | None = None, decode: str = "eager") -> Tensor:
    """``n_samples`` responses per vector: token ids [N, L] (groups contiguous), ``pad_id`` after EOS.

    prompt_ids: [P] the prompt holding one injection site, or [B, P] one a vector (a pair of several
    blocks: each names its vector's block); vectors: [B, d] RAW (the hook
    rescales them). L is the number of decode steps run: ``max_new_tokens``, or fewer when
    every row has emitted EOS (as HF ``generate`` does). The caller sets eval mode.
    ``share``: (index of the first of these prompts, prompts of the whole batch) when the batch
    is split over ranks, each called with the same RNG state (module docstring, item 5); the
    whole batch is one share. Sampling draws one seed from the global stream; greedy none. A
    model outside ``CACHE_REUSE_MODEL_TYPES`` is sampled by ``hf_generate`` from that seed
    (plus the share's first prompt: split over ranks the shares' samples are independent, but
    not those of the whole batch in one call). ``decode``: ``eager`` (this loop, compacting finished
    rows) or ``captured`` (a static cache, and a CUDA graph of the step on a GPU; item 6).
    """
    if decode not in DECODES:
        raise ValueError(f"decode: expected one of {list(DECODES)}, found {decode!r}")
    B, P, G = vectors.shape[0], prompt_ids.shape[-1], n_samples
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] != B:
        raise ValueError(f"sample_responses: {prompt_ids.shape[0]} prompts for {B} vectors")
    first, total = share if share is not None else (0, B)
    if not 0 <= first <= first + B <= total:
        raise ValueError(f"sample_responses: share={share} does not hold {B} prompts")
    seed = None if greedy else draw_seed()
    if not supports_cache_reuse(model):
        cuda = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else []
        with torch.random.fork_rng(devices=cuda, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed + first)  # also seeds every CUDA device
            return hf_generate(model, hook, prompt_ids, vectors, n_samples, max_new_tokens, eos_id, pad_id,
                               suppress_ids=suppress_ids, temperature=temperature, top_p=top_p, greedy=greedy)
    device = next(model.parameters()).device
    N = B * G
    tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    if N == 0:
        return tokens[:, :0]
    uniforms = None if seed is None else torch.Generator().manual_seed(seed)
    ids = prompt_batch(prompt_ids.to(device), B)
    with hook.vectors(vectors.to(device)):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = output_cache(out)
    static = decode == "captured"
    if static:
        step = _StaticStep(model, _static_cache(model, cache, G, P + max_new_tokens), N, device)
    elif G > 1:
        cache.batch_repeat_interleave(G)
    logits = out.logits[:, -1].float().repeat_interleave(G, 0)  # [N, V]
    procs = logits_processors(list(suppress_ids), temperature, top_p, greedy, device)
    rows = torch.arange(N, device=device)  # [n] the output row of each batch row
    alive = torch.ones(N, dtype=torch.bool, device=device)  # [n] batch rows that have not emitted EOS
    steps = 0
    for t in range(max_new_tokens):
        # These processors read only the scores; HF's interface wants the ids too.
        scores = procs(tokens[:0, :0], logits)
        if uniforms is None:
            nxt = scores.argmax(-1)
        else:  # step t's uniforms of every row of the whole batch; this share's live batch rows
            u = torch.rand(total * G, 1, generator=uniforms)[first * G : (first + B) * G]
            nxt = sample_categorical(scores, u.to(device)[rows])
        tokens[rows[alive], t] = nxt[alive]
        alive = alive & (nxt != eos_id)
        steps = t + 1
        n_alive = int(alive.sum())
        if n_alive == 0 or steps == max_new_tokens:
            break
        if static:  # finished rows stay: the step's shapes never change
            logits = step(nxt, P + t)
            continue
        if (len(rows) - n_alive) * COMPACT_DIVISOR >= len(rows):
            keep = alive.nonzero(as_tuple=True)[0]
            cache.batch_select_indices(keep)
            rows, nxt, alive = rows[keep], nxt[keep], alive[keep]
        logits = model(input_ids=nxt[:, None], **cache_kwargs(cache), use_cache=True).logits[:, -1].float()
    return tokens[:, :steps]


__all__ = ["CACHE_REUSE_MODEL_TYPES", "COMPACT_DIVISOR", "DECODES", "draw_seed", "hf_generate", "supports_cache_reuse", "logits_processors", "sample_categorical", "sample_responses"]
