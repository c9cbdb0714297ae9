"""The rollout's sampling loop against HF ``generate`` (the implementation it replaced).

Real tiny models of every supported architecture (random weights, the conftest tokenizer), vectors injected at the marker.
To get rows that end at different steps (and some that never end), the end-of-sequence id is
chosen from the greedy trajectories themselves: a token that some rows emit early.
"""

import pytest
import torch
from train_helpers import dataset_sidecar
from transformers import AutoModelForCausalLM

import nla.rl.sampling as S
from nla.core.injection import InjectionHook
from nla.core.reward import extract_explanation
from nla.core.token_ids import canonical_av_prompt_ids
from nla.rl.roles import RolloutWorker, parse_responses
from nla.rl.types import COMPLETED, FAILED_EXTRACTION, TRUNCATED

B, G, L = 6, 3, 20


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3", "gpt2"])
def av(request, tiny_model_dir, tiny_tokenizer):
    base = tiny_model_dir(request.param)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    d = model.config.hidden_size
    side = dataset_sidecar(tiny_tokenizer, base, d_model=d, layer_index=1, injection_scale=30.0)
    hook = InjectionHook.from_config(model, side)
    prompt = torch.tensor(canonical_av_prompt_ids(tiny_tokenizer, side.av_messages()), dtype=torch.long)
    vectors = torch.randn(B, d, generator=torch.Generator().manual_seed(0))
    return model, side, hook, prompt, vectors


def hf_generate(model, hook, prompt, vectors, n, max_new, eos, pad, suppress, greedy=True, **kw):
    """The rollout as it was: HF generate on the repeated prompt, the hook injecting at prefill."""
    vec = vectors.repeat_interleave(n, 0)
    ids = prompt.expand(vec.shape[0], prompt.shape[0])
    gen = {"do_sample": False} if greedy else {"do_sample": True, "top_k": 0, **kw}
    with torch.no_grad(), hook.vectors(vec):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=pad, suppress_tokens=suppress, **gen)
    return out[:, prompt.shape[0]:]


def varied_eos(av, tok):
    """A token that the greedy trajectories emit early in some rows but not in all."""
    model, side, hook, prompt, vectors = av
    first = hf_generate(model, hook, prompt, vectors, 1, L, tok.eos_token_id, tok.pad_token_id,
                        [side.injection_token_id])
    # Scan every step: rows with different injected vectors diverge somewhere, so some token is
    # emitted by some rows and not by others.
    for t in range(1, first.shape[1]):
        for cand in first[:, t].tolist():
            hits = (first == cand).any(1)
            if 0 < int(hits.sum()) < B:
                return cand
    if not S.supports_cache_reuse(model):
        # Not on the fast path (sample_responses hands it to HF generate), and its random tiny model
        # writes the same tokens whatever the vector: nothing to compare here.
        pytest.skip(f"{model.config.model_type}: takes the plain HF path; this random model ignores the vector")
    raise AssertionError(f"every row emits the same tokens {first[0].tolist()}: the injected vectors are ignored")


@pytest.mark.parametrize("divisor", [0, 1, S.COMPACT_DIVISOR, 10**6])  # 0: never drop rows; 10**6: at every end
def test_greedy_is_hf_generate(av, tiny_tokenizer, monkeypatch, divisor):
    model, side, hook, prompt, vectors = av
    eos, pad = varied_eos(av, tiny_tokenizer), tiny_tokenizer.pad_token_id
    monkeypatch.setattr(S, "COMPACT_DIVISOR", divisor)
    ref = hf_generate(model, hook, prompt, vectors, G, L, eos, pad, [side.injection_token_id])
    got = S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, suppress_ids=[side.injection_token_id],
                             greedy=True)
    assert got.shape == ref.shape
    assert torch.equal(got, ref)
    ended = (ref == eos).any(1)
    assert 0 < int(ended.sum()) < ref.shape[0]  # the case that matters: some rows end, others run on


def test_a_row_ending_at_the_first_step_is_dropped_exactly(av, tiny_tokenizer):
    model, side, hook, prompt, vectors = av
    first = hf_generate(model, hook, prompt, vectors, 1, L, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id,
                        [side.injection_token_id])
    eos = int(first[0, 0])  # row 0's first token: row 0 ends at step 1, the rest whenever they emit it
    ref = hf_generate(model, hook, prompt, vectors, 1, L, eos, tiny_tokenizer.pad_token_id, [side.injection_token_id])
    got = S.sample_responses(model, hook, prompt, vectors, 1, L, eos, tiny_tokenizer.pad_token_id,
                             suppress_ids=[side.injection_token_id], greedy=True)
    assert torch.equal(got, ref)


def test_marker_is_never_written_and_suppression_is_exact(av, tiny_tokenizer):
    model, side, hook, prompt, vectors = av
    # Suppressing the greedy first token of row 0 must give HF's second choice, as HF does.
    first = hf_generate(model, hook, prompt, vectors, 1, L, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id,
                        [side.injection_token_id])
    banned = [side.injection_token_id, int(first[0, 0])]
    ref = hf_generate(model, hook, prompt, vectors, 1, L, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id,
                      banned)
    got = S.sample_responses(model, hook, prompt, vectors, 1, L, tiny_tokenizer.eos_token_id,
                             tiny_tokenizer.pad_token_id, suppress_ids=banned, greedy=True)
    assert torch.equal(got, ref)
    torch.manual_seed(0)
    sampled = S.sample_responses(model, hook, prompt, vectors, 4, L, tiny_tokenizer.eos_token_id,
                                 tiny_tokenizer.pad_token_id, suppress_ids=banned, temperature=2.0)
    assert not torch.isin(sampled, torch.tensor(banned)).any()


def test_sampling_with_a_vanishing_top_p_is_greedy(av, tiny_tokenizer):
    # top-p keeps the smallest set of tokens whose mass reaches p (at least one): p -> 0 keeps
    # the argmax alone, at any temperature, so the sample is the greedy token.
    model, side, hook, prompt, vectors = av
    eos, pad = varied_eos(av, tiny_tokenizer), tiny_tokenizer.pad_token_id
    greedy = S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad,
                                suppress_ids=[side.injection_token_id], greedy=True)
    torch.manual_seed(1)
    sampled = S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, suppress_ids=[side.injection_token_id],
                                 temperature=1.7, top_p=1e-9)
    assert torch.equal(sampled, greedy)


def test_sampling_is_seeded_and_groups_share_the_prompt(av, tiny_tokenizer):
    model, side, hook, prompt, vectors = av
    eos, pad = varied_eos(av, tiny_tokenizer), tiny_tokenizer.pad_token_id
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad,
                                       suppress_ids=[side.injection_token_id]))
    assert torch.equal(runs[0], runs[1])
    # the per-group prefill is the per-row prefill: G copies of row b's first-token distribution
    with torch.no_grad(), hook.vectors(vectors.repeat_interleave(G, 0)):
        full = model(input_ids=prompt.expand(B * G, -1)).logits[:, -1]
    with torch.no_grad(), hook.vectors(vectors):
        once = model(input_ids=prompt.expand(B, -1)).logits[:, -1]
    torch.testing.assert_close(once.repeat_interleave(G, 0), full, rtol=1e-5, atol=1e-5)


def test_rollout_worker_matches_the_hf_rollout(av, tiny_tokenizer):
    """Responses, masks, texts, statuses and truncation of ``RolloutWorker.generate`` (greedy) equal
    those made from HF generate's tokens by the same parsing (the implementation it replaced)."""
    model, side, hook, prompt, vectors = av
    eos = varied_eos(av, tiny_tokenizer)
    worker = RolloutWorker(model, tiny_tokenizer, side, torch.device("cpu"))
    worker.eos_id = eos
    r = worker.generate(vectors, torch.arange(B), G, L, greedy=True)
    ref = hf_generate(model, worker.hook, prompt, vectors, G, L, eos, worker.pad_id, [side.injection_token_id])
    mask, texts, truncated = parse_responses(tiny_tokenizer, ref, eos)
    assert torch.equal(r.response_mask, mask)
    assert torch.equal(r.response_ids, torch.where(mask.bool(), ref, torch.full_like(ref, worker.pad_id)))
    assert r.texts == texts
    status = [TRUNCATED if truncated[i] else (COMPLETED if extract_explanation(texts[i]) is not None
                                              else FAILED_EXTRACTION) for i in range(B * G)]
    assert r.status.tolist() == status
    assert 0 < int(truncated.sum()) < B * G


def test_sample_categorical_frequencies_and_zero_mass():
    # probabilities [0.5, 0, 0.3, 0.2] (scores are their logs; -inf for the suppressed token):
    # 40,000 draws; the standard error of a frequency is <= sqrt(0.25 / 40000) = 0.0025, so 0.01 is 4 s.e.
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.0, 0.3, 0.2])
    draws = S.sample_categorical(p.log().expand(40_000, 4))
    freq = torch.bincount(draws, minlength=4).float() / 40_000
    assert freq[1] == 0
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)
    # a row with all mass on the last token, and one with all mass on the first
    one_hot = torch.full((2, 5), float("-inf"))
    one_hot[0, 4] = one_hot[1, 0] = 0.0
    assert S.sample_categorical(one_hot.repeat(500, 1)).view(500, 2).tolist() == [[4, 0]] * 500


# ----------------------------------------------------------------------------- split over ranks
@pytest.mark.parametrize("cuts", [[3], [2, 4], [0, 6], [1, 1, 5]])  # share boundaries in B=6 prompts
def test_sampling_split_into_shares_draws_the_tokens_of_one_batch(av, tiny_tokenizer, cuts):
    """Each share of the prompts sampled from the same RNG state (as every generating rank is) gives
    exactly the tokens of the whole batch in one call, with its rows leaving the batch at other
    steps; every call advances the global stream by one draw. [0, 6]: an empty first share;
    [1, 1, 5]: an empty middle one."""
    model, side, hook, prompt, vectors = av
    eos, pad = varied_eos(av, tiny_tokenizer), tiny_tokenizer.pad_token_id
    kw = dict(suppress_ids=[side.injection_token_id], temperature=1.3)
    torch.manual_seed(7)
    start = torch.get_rng_state()
    ref = S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, **kw)
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    torch.randint(0, 2**62, (1,))
    assert torch.equal(after, torch.get_rng_state())  # one draw per call, on either path
    if not S.supports_cache_reuse(model):
        pytest.skip(f"{model.config.model_type}: HF generate path, shares sample from their own seeds (documented)")
    ended = (ref == eos).any(1)
    assert 0 < int(ended.sum()) < ref.shape[0]  # rows leave at different steps: compaction runs
    bounds = [0, *cuts, B]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        torch.set_rng_state(start)
        parts.append(S.sample_responses(model, hook, prompt, vectors[a:b], G, L, eos, pad, share=(a, B), **kw))
        assert torch.equal(torch.get_rng_state(), after)
        assert parts[-1].shape[0] == (b - a) * G
    width = max(p.shape[1] for p in parts)
    got = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts])
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match=r"share=\(4, 6\) does not hold 6 prompts"):
        S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, share=(4, B), **kw)


def test_the_captured_decode_writes_the_eager_tokens(av, tiny_tokenizer):
    # rollout.decode: captured runs the decode on a static KV cache without compaction (and, on a
    # GPU, as a CUDA graph). Greedy, it writes the eager loop's tokens while rows end at different
    # steps (the eager loop drops them, here they stay) and others never end; its logits are the
    # dynamic cache's up to float rounding (what is guaranteed; a sampled draw can move only there).
    from nla.core.arch import cache_kwargs, output_cache

    model, side, hook, prompt, vectors = av
    if not S.supports_cache_reuse(model):
        pytest.skip(f"{model.config.model_type}: sampled by HF generate whatever the decode")
    eos, pad = varied_eos(av, tiny_tokenizer), tiny_tokenizer.pad_token_id
    out = {decode: S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, greedy=True, decode=decode,
                                      suppress_ids=[side.injection_token_id]) for decode in ("eager", "captured")}
    assert torch.equal(out["captured"], out["eager"])
    ended = (out["eager"] == eos).any(1)
    assert 0 < int(ended.sum()) < out["eager"].shape[0]
    # the same step on the two caches, fed the eager loop's tokens: logits within float32 rounding
    P = prompt.shape[0]
    with torch.no_grad(), hook.vectors(vectors):
        pre = model(input_ids=prompt.expand(B, P), use_cache=True, logits_to_keep=1)
    dyn = output_cache(pre)
    static = S._static_cache(model, dyn, G, P + L)
    dyn.batch_repeat_interleave(G)
    for t in range(3):
        nxt = out["eager"][:, t]
        with torch.no_grad():
            a = model(input_ids=nxt[:, None], **cache_kwargs(dyn), use_cache=True).logits[:, -1]
            b = model(input_ids=nxt[:, None], cache_position=torch.tensor([P + t]), use_cache=True,
                      **cache_kwargs(static)).logits[:, -1]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"decode: expected one of \['eager', 'captured'\], found 'graph'"):
        S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, decode="graph")



# ATen ops that read a tensor's values back to the host (.item(), int(), bool() of a tensor, and
# the ops whose output shape depends on values): on a GPU each synchronises with the host, which
# CUDA-graph capture refuses.
HOST_READS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
                        "aten.unique_consecutive", "aten.unique_dim", "aten.repeat_interleave"})


def test_the_captured_step_is_one_graph_at_every_position(av, tiny_tokenizer, monkeypatch):
    # What a CUDA graph needs of the decode step, checked where no GPU is. (1) No op of the step
    # reads a tensor's value back to the host (HOST_READS: capture would fail). (2) The step's
    # Python-side decisions do not change with the position: a capture records them once and every
    # replay reuses them. TorchDynamo checks (2): traced with fullgraph=True, a decision that changed
    # would trip its guards into a second compile. HF takes the same branches under dynamo as under
    # stream capture (``is_tracing`` is true in both). The traced graph, run at every step, must
    # write the eager loop's tokens.
    import torch._dynamo.testing
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    model, side, hook, prompt, vectors = av
    if not S.supports_cache_reuse(model):
        pytest.skip(f"{model.config.model_type}: sampled by HF generate whatever the decode")
    eos, pad = varied_eos(av, tiny_tokenizer), tiny_tokenizer.pad_token_id
    kw = dict(greedy=True, suppress_ids=[side.injection_token_id])
    counter, ops = torch._dynamo.testing.CompileCounter(), Ops()
    plain_forward = S._StaticStep._forward
    traced: dict = {}

    def recorded(self):  # the step as it runs eagerly, its ops recorded
        with ops:
            return plain_forward(self)

    def compiled(self):  # the step traced once, the trace run at every position
        if self not in traced:
            traced[self] = torch.compile(lambda: plain_forward(self), backend=counter, fullgraph=True)
        return traced[self]()

    got = {}
    for name, forward in (("recorded", recorded), ("compiled", compiled)):
        monkeypatch.setattr(S._StaticStep, "_forward", forward)
        torch._dynamo.reset()
        try:
            got[name] = S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, decode="captured", **kw)
        finally:
            torch._dynamo.reset()
            monkeypatch.undo()
    want = S.sample_responses(model, hook, prompt, vectors, G, L, eos, pad, decode="eager", **kw)
    assert "aten.mm" in ops.seen or "aten.addmm" in ops.seen  # the recorder saw the step
    assert not ops.seen & HOST_READS, f"the step reads tensors back to the host: {sorted(ops.seen & HOST_READS)}"
    assert got["compiled"].shape[1] > 3  # several positions ran through the one graph
    assert counter.frame_count == 1, f"the step compiled {counter.frame_count} times: a decision changed"
    assert torch.equal(got["compiled"], want) and torch.equal(got["recorded"], want)
