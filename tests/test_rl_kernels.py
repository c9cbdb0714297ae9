"""The policy/reference forward: the shared-prefix, trimmed path against the plain per-row path.

``response_logprobs(..., share_prefix=False)`` is the plain reference (every row runs
prompt + whole padded response); the fast path runs the prompt once per run of rows with the
same vector and skips the all-padding columns. Log-probs, entropies, losses and gradients
must agree to float tolerance, on a real tiny Llama in training mode.
"""

import pytest
import torch
from train_helpers import dataset_sidecar
from transformers import AutoModelForCausalLM

import nla.rl.kernels as W
from nla.core.injection import InjectionHook
from nla.core.token_ids import canonical_av_prompt_ids
from nla.rl import algorithms as A
from nla.rl.distributed import DataParallel
from nla.rl.kernels import by_group_length, response_logprobs, rollout_logprobs
from nla.rl.roles import OptimSettings, PolicyLossSettings, PolicyWorker
from nla.rl.types import COMPLETED, Rollout

D, B, G, L = 32, 3, 4, 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


@pytest.fixture(params=["llama", "qwen2", "gemma3", "gpt2"])
def setup(request, tiny_model_dir, tiny_tokenizer):
    base = tiny_model_dir(request.param)
    model = AutoModelForCausalLM.from_pretrained(base).train()
    for mod in model.modules():  # GPT-2 has dropout by default: two forwards would draw different masks
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    d = model.config.hidden_size
    side = dataset_sidecar(tiny_tokenizer, base, d_model=d, layer_index=1, injection_scale=30.0)
    prompt = torch.tensor(canonical_av_prompt_ids(tiny_tokenizer, side.av_messages()), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    vectors = torch.randn(B, d, generator=gen).repeat_interleave(G, 0)  # groups of G rows share a vector
    # response lengths 1..L-2, none reaching the last columns (those are all padding: trimmed);
    # tokens from the ordinary vocabulary (never the marker)
    lengths = torch.tensor([1, 5, 9, 10, 2, 3, 7, 10, 4, 8, 6, 1])
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids = torch.randint(3, model.config.vocab_size, (B * G, L), generator=gen)
    ids[ids == side.injection_token_id] = 3
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, tiny_tokenizer.pad_token_id))
    return model, side, InjectionHook.from_config(model, side), prompt, vectors, ids, mask


def _rollout(prompt, vectors, ids, mask):
    n = ids.shape[0]
    return Rollout(prompt_rows=torch.arange(n) // G, group=torch.arange(n) // G, vectors=vectors, prompt_ids=prompt,
                   response_ids=ids, response_mask=mask, texts=[""] * n, explanations=[None] * n,
                   status=torch.full((n,), COMPLETED))


def test_by_group_length_by_hand():
    # rows 0-3 one vector (lengths 1,5,9,10: longest 10), rows 4-7 another (2,3,7,10: 10), rows 8-11 a
    # third (4,8,6,1: 8). Groups by longest first, ties in order: [0-3], [4-7], [8-11] -> identity.
    vec = torch.arange(3.0).repeat_interleave(4)[:, None].expand(12, 2)
    lengths = torch.tensor([1, 5, 9, 10, 2, 3, 7, 10, 4, 8, 6, 1])
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    r = _rollout(torch.zeros(3, dtype=torch.long), vec, torch.zeros(12, 12, dtype=torch.long), mask)
    assert by_group_length(r, torch.arange(12)).tolist() == list(range(12))
    # rows 6..11: the tail of group 1 (7, 10) and group 2 (4, 8, 6, 1): group 1 first (10 > 8)
    assert by_group_length(r, torch.arange(6, 12)).tolist() == [0, 1, 2, 3, 4, 5]
    # rows 8..11 then 0..1: group 2 (longest 8) before group 0's head (1, 5: longest 5)
    rows = torch.tensor([0, 1, 8, 9, 10, 11])
    assert by_group_length(r, rows).tolist() == [2, 3, 4, 5, 0, 1]
    assert by_group_length(r, torch.arange(0)).tolist() == []


def test_reference_logprobs_come_back_in_row_order(setup, buckets):
    model, side, hook, prompt, vectors, ids, mask = setup
    # shuffle the groups' lengths so that the length order is not the row order
    ids, mask = ids.flip(0), mask.flip(0)
    r = _rollout(prompt, vectors, ids, mask)
    model.eval()
    plain, _ = response_logprobs(model, hook, prompt, ids, mask, vectors, share_prefix=False)
    for mbs in (12, 5, 1):
        got = rollout_logprobs(model, hook, r, torch.arange(12), 12, DataParallel(), mbs)
        torch.testing.assert_close(got * mask, plain * mask, rtol=1e-5, atol=1e-5)


def _loss_and_grads(model, hook, prompt, ids, mask, vectors, share):
    model.zero_grad(set_to_none=True)
    logp, ent = response_logprobs(model, hook, prompt, ids, mask, vectors, with_entropy=True, share_prefix=share)
    w = torch.linspace(-1, 1, logp.numel()).view_as(logp)  # a loss that weights every token differently
    (logp * w * mask).sum().backward()
    return logp.detach(), ent, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(params=[1, 3, 6], ids=["1-bucket", "3-buckets", "6-buckets"])
def buckets(request, monkeypatch):
    """Length buckets of the shared-prefix path (``length_buckets``), at any micro-batch size;
    6 buckets of the 12 rows leave a bucket of rows of length 1 (nothing after token 0)."""
    monkeypatch.setattr(W, "LENGTH_BUCKETS", request.param)
    monkeypatch.setattr(W, "MIN_BUCKET_ROWS", 1)
    return request.param


def test_length_buckets_by_hand(monkeypatch):
    lengths = torch.tensor([3, 9, 1, 9, 5, 2])
    assert [b.tolist() for b in W.length_buckets(lengths, 3)] == [[1, 3, 4, 0, 5, 2]]  # < 2 x MIN_BUCKET_ROWS
    monkeypatch.setattr(W, "MIN_BUCKET_ROWS", 2)
    assert [b.tolist() for b in W.length_buckets(lengths, 3)] == [[1, 3], [4, 0], [5, 2]]
    assert [b.tolist() for b in W.length_buckets(lengths, 10)] == [[1, 3], [4, 0], [5, 2]]  # 2 rows each at least
    monkeypatch.setattr(W, "MIN_BUCKET_ROWS", 1)
    assert [b.tolist() for b in W.length_buckets(lengths, 10)] == [[1], [3], [4], [0], [5], [2]]
    assert W.length_buckets(torch.zeros(0, dtype=torch.long), 3) == []


@pytest.mark.parametrize("rows", [slice(0, 12), slice(2, 9), slice(3, 4)], ids=["whole", "split-groups", "one-row"])
def test_shared_prefix_equals_plain_forward(setup, rows, buckets):
    model, side, hook, prompt, vectors, ids, mask = setup
    plain = _loss_and_grads(model, hook, prompt, ids[rows], mask[rows], vectors[rows], share=False)
    fast = _loss_and_grads(model, hook, prompt, ids[rows], mask[rows], vectors[rows], share=True)
    m = mask[rows].bool()
    torch.testing.assert_close(fast[0][m], plain[0][m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[1][m], plain[1][m], rtol=1e-5, atol=1e-5)
    Lc = int(m.sum(1).max())
    assert Lc < L and (fast[0][:, Lc:] == 0).all()  # trimmed columns: 0, and masked out by every loss
    if W.supports_cache_reuse(model):  # the head ran on real positions only: padding reads 0
        assert (fast[0][~m] == 0).all() and (fast[1][~m] == 0).all()
    assert plain[2].keys() == fast[2].keys()
    emb = next(k for k in fast[2] if k.endswith(("embed_tokens.weight", "wte.weight")))
    assert fast[2][emb].abs().sum() > 0  # the prefix (and the injection site) got its gradient
    for k in plain[2]:
        torch.testing.assert_close(fast[2][k], plain[2][k], rtol=1e-4, atol=1e-6, msg=k)


def test_policy_step_equals_plain_forward(setup, tiny_tokenizer, monkeypatch, buckets):
    """One policy update (clip + k3 KL, token-mean, two micro-batches that split a group): the same
    metrics and weights with the fast forward as with the plain one."""
    model, side, hook, prompt, vectors, ids, mask = setup
    n = B * G
    rollout = _rollout(prompt, vectors, ids, mask)
    adv = A.broadcast_to_tokens(A.grpo_advantages(torch.linspace(-1, 1, n), G), mask.float())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    settings = PolicyLossSettings(eps_low=0.2, eps_high=0.2, dual_clip_c=None, kl_coef=0.1, kl_estimator="k3",
                                  loss_agg="token-mean", micro_batch_size=7, updates_per_rollout=1, norm_len=L)
    results = []
    for share in (False, True):
        model.load_state_dict(state)

        def logprobs(*a, _share=share, **kw):
            return response_logprobs(*a, **{**kw, "share_prefix": _share})

        monkeypatch.setattr(W, "response_logprobs", logprobs)
        ref = logprobs(model, hook, prompt, ids, mask, vectors)[0].detach() - 0.05
        worker = PolicyWorker(model, tiny_tokenizer, side, settings, OptimSettings(1e-3, 0.0, 0, 1, 1e9))
        m = worker.update(rollout, adv, ref)
        results.append((m, {k: v.detach().clone() for k, v in model.named_parameters()}))
        worker.hook.remove()
    (m_a, w_a), (m_b, w_b) = results
    for key in ("policy_loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-5, abs=1e-7), key
    for k in w_a:
        torch.testing.assert_close(w_b[k], w_a[k], rtol=1e-5, atol=5e-6, msg=k)


def test_reconstructor_update_on_length_ordered_micro_batches_equals_one_batch(tiny_model_dir, tiny_tokenizer):
    """The AR update cuts micro-batches from rows ordered by text length: loss and weights after
    the step equal those of one micro-batch holding every row in the given order."""
    from nla.core.reconstructor import Reconstructor, reconstruction_loss, tokenize_ar_texts
    from nla.rl.roles import ReconstructorWorker

    base = tiny_model_dir("llama")
    side = dataset_sidecar(tiny_tokenizer, base, d_model=D, layer_index=1)
    texts = ["a cat", "the dog runs to the river in the morning with Bob", "Alice", "birds sing near the old market",
             "x", "Carol and Dave walk to the school"]
    golds = torch.randn(len(texts), D, generator=torch.Generator().manual_seed(2))
    results = []
    for mbs in (len(texts), 2):
        torch.manual_seed(0)
        ar = Reconstructor.from_base(base, 1)
        worker = ReconstructorWorker(ar, tiny_tokenizer, side, OptimSettings(1e-3, 0.0, 0, 1, 1e9), max_length=64,
                                     micro_batch_size=mbs, device=torch.device("cpu"))
        m = worker.update(texts, golds)
        results.append((m["ar_loss"], {k: v.detach().clone() for k, v in ar.named_parameters()}))
    (loss_a, w_a), (loss_b, w_b) = results
    # the plain reference: every row, in the given order, in one right-padded batch (texts paired with their golds)
    torch.manual_seed(0)
    ar = Reconstructor.from_base(base, 1)
    enc = tokenize_ar_texts(tiny_tokenizer, [side.ar_text(t) for t in texts], 64, "right")
    with torch.no_grad():
        plain, _ = reconstruction_loss(ar, enc["input_ids"], enc["attention_mask"], golds, side.mse_scale_value())
    assert loss_a == pytest.approx(float(plain), rel=1e-5)
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for k in w_a:
        torch.testing.assert_close(w_b[k], w_a[k], rtol=1e-5, atol=5e-6, msg=k)


def test_token_logprobs_by_hand_and_chunked_equals_plain():
    import math

    from nla.core.logprobs import token_logprobs

    # logits [0, ln 3]: p = [1/4, 3/4]; log p(1) = ln 3/4, log p(0) = ln 1/4; entropy = -(1/4 ln 1/4 + 3/4 ln 3/4)
    lp, ent = token_logprobs(torch.tensor([[0.0, math.log(3)], [0.0, math.log(3)]]), torch.tensor([1, 0]),
                             with_entropy=True)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75), math.log(0.25)]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([h, h]))
    # chunks of 8 rows (some short) against one block: values, entropies and gradients agree
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 50, generator=g, dtype=torch.float64)
    tgt = torch.randint(0, 50, (37,), generator=g)
    w = torch.randn(37, generator=g, dtype=torch.float64)
    out = {}
    for name, chunk in (("plain", 10**9), ("chunked", 8 * 50)):
        x = base.clone().requires_grad_(True)
        lp, ent = token_logprobs(x, tgt, with_entropy=True, chunk_elements=chunk)
        (lp * w).sum().backward()
        out[name] = (lp.detach(), ent, x.grad)
    for a, b in zip(out["plain"], out["chunked"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not out["chunked"][1].requires_grad


def test_response_logprobs_at_a_large_vocabulary_chunk_like_one_block(setup, monkeypatch):
    # A vocabulary larger than one chunk takes the per-row chunked path for the first response
    # token, the buckets and the plain path: log-probs, entropies and gradients equal one block's.
    model, side, hook, prompt, vectors, ids, mask = setup
    for share in (True, False):
        out = {}
        for name, chunk in (("block", W.LOGPROB_CHUNK_ELEMENTS), ("chunked", 3 * model.config.vocab_size)):
            monkeypatch.setattr(W, "LOGPROB_CHUNK_ELEMENTS", chunk)
            out[name] = _loss_and_grads(model, hook, prompt, ids, mask, vectors, share)
        torch.testing.assert_close(out["block"][0] * mask, out["chunked"][0] * mask, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["block"][1] * mask, out["chunked"][1] * mask, rtol=1e-5, atol=1e-6)
        assert out["block"][2].keys() == out["chunked"][2].keys()
        for k, g in out["block"][2].items():
            torch.testing.assert_close(out["chunked"][2][k], g, rtol=1e-4, atol=1e-6)


def test_a_prompt_per_row_is_each_rows_own_prompt(setup):
    """A pair of several blocks gives each row its own prompt (one length, [n, P]): the log-probs, by the
    shared-prefix path and the plain one, are each row's with its prompt alone ([P]); and [n, P] holding
    one prompt on every row is the [P] call bit for bit."""
    model, side, hook, prompt, vectors, ids, mask = setup
    model.eval()
    other = prompt.clone()
    other[1] = 3 if int(prompt[1]) != 3 else 4  # another token away from the marker and its neighbours
    per_group = [prompt, other, other]
    prompts = torch.stack([per_group[g] for g in range(B) for _ in range(G)])  # [n, P]
    want = torch.zeros(B * G, L)
    for g in range(B):
        rows = slice(g * G, (g + 1) * G)
        want[rows], _ = response_logprobs(model, hook, per_group[g], ids[rows], mask[rows], vectors[rows],
                                          share_prefix=False)
    for share in (False, True):
        got, _ = response_logprobs(model, hook, prompts, ids, mask, vectors, share_prefix=share)
        torch.testing.assert_close(got * mask, want * mask, rtol=1e-5, atol=1e-5)
    same = prompt.expand(B * G, -1).clone()
    for share in (False, True):
        a, _ = response_logprobs(model, hook, same, ids, mask, vectors, share_prefix=share)
        b, _ = response_logprobs(model, hook, prompt, ids, mask, vectors, share_prefix=share)
        assert torch.equal(a, b)
    # a rollout keeps each sample's prompt row when it is cut and joined
    r = _rollout(prompts, vectors, ids, mask)
    keep = torch.tensor([i % 2 == 0 for i in range(B * G)])
    assert torch.equal(r.select(keep).prompt_ids, prompts[keep])
    joined = Rollout.concat([r.select(keep), _rollout(prompt, vectors[:2], ids[:2], mask[:2])], pad_id=0)
    assert torch.equal(joined.prompt_ids, torch.cat([prompts[keep], prompt.expand(2, -1)]))
