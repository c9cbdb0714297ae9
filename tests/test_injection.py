import pytest
import torch

from nla.core.arch import build_input_embeds
from nla.core.injection import InjectionHook, find_injection_sites, inject_at_marked_positions
from nla.core.sidecar import NLAConfig
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR

M, L, R = 9, 5, 6  # marker, left, right ids


def test_correct_rows_overwritten_and_bad_neighbours_ignored():
    ids = torch.tensor([
        [1, L, M, R, 2, 3],
        [1, 2, L, M, R, 3],
    ])
    emb = torch.arange(2 * 6 * 2, dtype=torch.float32).reshape(2, 6, 2)
    vec = torch.tensor([[100.0, 101.0], [200.0, 201.0]])
    out = inject_at_marked_positions(ids, emb, vec, M, L, R)
    expected = emb.clone()
    expected[0, 2] = vec[0]
    expected[1, 3] = vec[1]
    assert torch.equal(out, expected)
    assert torch.equal(emb, torch.arange(24, dtype=torch.float32).reshape(2, 6, 2))  # out of place

    # a marker in the response with other neighbours is not a site
    ids2 = torch.tensor([[L, M, R, 4, M, 4, L, M, 2]])
    assert find_injection_sites(ids2, M, L, R).nonzero().tolist() == [[0, 1]]


def test_count_mismatch_raises_with_counts_and_causes():
    ids = torch.tensor([[1, L, M, R], [1, 2, 3, 4]])
    emb = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match=r"found 1 valid marker sites .* for 2 vectors.*truncation"):
        inject_at_marked_positions(ids, emb, torch.ones(2, 3), M, L, R)
    with pytest.raises(ValueError, match=r"vectors: expected \[N, d\] with d = 3"):
        inject_at_marked_positions(ids, emb, torch.ones(1, 4), M, L, R)


def test_packed_layout_matches_padded():
    torch.manual_seed(0)
    padded = torch.tensor([[1, L, M, R, 2, 0], [L, M, R, 3, 4, 2]])
    packed = torch.tensor([[1, L, M, R, 2, L, M, R, 3, 4, 2]])
    vec = torch.randn(2, 4)
    table = torch.randn(16, 4)
    out_pad = inject_at_marked_positions(padded, table[padded], vec, M, L, R)
    out_pack = inject_at_marked_positions(packed, table[packed], vec, M, L, R)
    # first prompt = packed[0, :5], second = packed[0, 5:]
    assert torch.equal(out_pack[0, :5], out_pad[0, :5])
    assert torch.equal(out_pack[0, 5:], out_pad[1])


def test_gradients_flow_to_vectors_and_embeddings_and_dtype_cast():
    ids = torch.tensor([[L, M, R]])
    emb = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)
    vec = torch.randn(1, 2, requires_grad=True)
    out = inject_at_marked_positions(ids, emb, vec, M, L, R)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert torch.equal(emb.grad[0, 1], torch.zeros(2, dtype=torch.float64))  # overwritten position
    assert torch.equal(emb.grad[0, 0], torch.ones(2, dtype=torch.float64))
    assert torch.equal(vec.grad, torch.ones(1, 2))


def _setup(tiny_tokenizer, arch="llama"):
    from conftest import build_tiny_model

    model = build_tiny_model(arch, tiny_tokenizer)
    d = model.config.hidden_size
    cfg = NLAConfig.from_tokenizer(
        tiny_tokenizer, kind="nla_model", role="av", d_model=d, layer_index=1, av_template=DEFAULT_AV_TEMPLATE,
        ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR, injection_scale=3.0,
    )
    prompt = tiny_tokenizer.apply_chat_template(cfg.av_messages(), add_generation_prompt=True, tokenize=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
    return model, cfg, prompt


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hook_matches_manual_inputs_embeds(tiny_tokenizer, arch):
    model, cfg, prompt = _setup(tiny_tokenizer, arch)
    ids = prompt.repeat(2, 1)
    vec = torch.randn(2, cfg.d_model)
    hook = InjectionHook.from_config(model, cfg)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with hook.vectors(vec):
            hooked = model(input_ids=ids).logits
        # reference: build embeddings by hand (Gemma's sqrt(d) scale included), inject the rescaled vectors
        emb = build_input_embeds(model, ids)
        scaled = vec / vec.norm(dim=-1, keepdim=True) * 3.0
        ref = model(inputs_embeds=inject_at_marked_positions(ids, emb, scaled, cfg.injection_token_id,
                                                             cfg.injection_left_neighbor_id,
                                                             cfg.injection_right_neighbor_id)).logits
        after = model(input_ids=ids).logits
    assert torch.allclose(hooked, ref, atol=1e-5)
    assert not torch.allclose(hooked, plain, atol=1e-3)
    assert torch.equal(after, plain)  # outside the block the hook is a no-op
    hook.remove()


def test_hook_under_generate_injects_prefill_only(tiny_tokenizer):
    model, cfg, prompt = _setup(tiny_tokenizer)
    hook = InjectionHook.from_config(model, cfg)
    torch.manual_seed(0)
    vec = torch.randn(1, cfg.d_model)
    with torch.no_grad(), hook.vectors(vec):
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                             do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
    assert hook.applied_forwards == 1  # the prefill; decode steps had no marker and passed through
    assert out.shape[1] == prompt.shape[1] + 4
    # greedy continuation equals the one computed with an explicit injected prefill
    with torch.no_grad(), hook.vectors(vec):
        first = model(input_ids=prompt).logits[0, -1].argmax()
    assert out[0, prompt.shape[1]] == first
    hook.remove()


def test_hook_block_without_any_site_raises(tiny_tokenizer):
    model, cfg, prompt = _setup(tiny_tokenizer)
    hook = InjectionHook.from_config(model, cfg)
    truncated = prompt[:, :5]  # cut before the marker
    with pytest.raises(ValueError, match="none contained a marker site"), torch.no_grad():
        with hook.vectors(torch.randn(1, cfg.d_model)):
            model(input_ids=truncated)
    with pytest.raises(ValueError, match="found 2 valid marker sites .* for 1 vectors"), torch.no_grad():
        with hook.vectors(torch.randn(1, cfg.d_model)):
            model(input_ids=prompt.repeat(2, 1))
    hook.remove()
