"""An AR reading each row at its own block (``Reconstructor.set_exits``, issue 59): the stepwise path and the
hooked path against a plain reference, what rows run, the checkpoint, and the errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from nla.core.arch import decoder_layers
from nla.core.reconstructor import EXIT_HEADS_FILE, Reconstructor, last_token_index, tokenize_ar_texts

TEXTS = ["Explanation : cat walks", "Explanation : the dog runs to the river in the morning with Bob", "x",
         "Explanation : Bob runs", "the cat"]
BLOCKS = [0, 3, 1, 2, 0]


def _reference(ar: Reconstructor, ids, mask, blocks) -> torch.Tensor:
    """A plain forward with HF's hidden states, row i read after block max(b_i, 1) at its last real token,
    through head b_i: the definition, written the slow way."""
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    hs = ar.base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                 output_hidden_states=True).hidden_states  # [emb, block 0, ..., block K] (K's: the skipped norm)
    last = last_token_index(mask)
    rows = []
    for i, b in enumerate(blocks):
        r = max(b, 1)
        rows.append(ar.exit_heads[str(b)](hs[r + 1][i, last[i]]))
    return torch.stack(rows)


def _heads_apart(ar: Reconstructor) -> None:
    torch.manual_seed(1)
    with torch.no_grad():  # heads that differ, so a row read through another block's head shows
        for h in ar.exit_heads.values():
            h.weight.add_(0.05 * torch.randn_like(h.weight))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_exits_read_each_row_after_its_block_through_its_head(tiny_model_dir, tiny_tokenizer, arch, side,
                                                               single_thread):
    torch.manual_seed(0)
    ar = Reconstructor.from_base(tiny_model_dir(arch), 3).train()
    assert ar.set_exits([0, 1, 2, 3]) == {0: 1, 1: 1, 2: 2, 3: 3}
    # the heads start as the value head (the identity): "the stream after the block is the prediction"
    assert all(torch.equal(h.weight, ar.value_head.weight) for h in ar.exit_heads.values())
    _heads_apart(ar)
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, side)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    gold = torch.randn(len(TEXTS), ar.config.hidden_size)
    results = []
    for read in ("predict", "reference"):
        ar.zero_grad(set_to_none=True)
        pred = ar.predict(ids, mask, blocks=BLOCKS) if read == "predict" else _reference(ar, ids, mask, BLOCKS)
        ((pred - gold) ** 2).sum().backward()
        results.append((pred.detach(), {k: p.grad.clone() for k, p in ar.named_parameters() if p.grad is not None}))
    (p_ex, g_ex), (p_ref, g_ref) = results
    torch.testing.assert_close(p_ex, p_ref, rtol=1e-5, atol=1e-5)
    assert g_ex.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g_ex[k], g_ref[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    # Llama/Qwen2 run the blocks one by one, Gemma-3 (a sliding window on some blocks) the whole forward
    assert ar._exits_stepwise == (arch in ("llama", "qwen2"))


def test_rows_read_early_do_not_run_the_later_blocks(tiny_model_dir, tiny_tokenizer, single_thread):
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    ar.set_exits([0, 1, 2, 3])
    seen = {}
    for r, block in enumerate(decoder_layers(ar.base)):
        block.register_forward_pre_hook(lambda m, a, kw, r=r: seen.setdefault(r, []).append(
            (a[0] if a else kw["hidden_states"]).shape[0]), with_kwargs=True)
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, "left")
    with torch.no_grad():
        ar.predict(enc["input_ids"], enc["attention_mask"], blocks=BLOCKS)
    # block 0 is called by the model (5 rows, stopped at its input), then by the loop on every row (none is read
    # after it); a row is read at its exit at its last token only, not through the block's call: the rows of
    # blocks 0 and 1 (3) are read at block 1, so it runs the 2 others; block 2 the one of block 3; block 3 none
    assert seen == {0: [5, 5], 1: [2], 2: [1]}


def test_one_exit_at_k_equals_the_deep_ar(tiny_model_dir, tiny_tokenizer, single_thread):
    """Every block read after K through copies of the value head: the AR without exits."""
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, "left")
    with torch.no_grad():
        deep = ar.predict(enc["input_ids"], enc["attention_mask"])
        ar.set_exits([0, 3], min_block=3)
        assert ar.exits == {0: 3, 3: 3}
        both = ar.predict(enc["input_ids"], enc["attention_mask"], blocks=[0, 3, 3, 0, 0])
    torch.testing.assert_close(both, deep, rtol=1e-5, atol=1e-6)


def test_exits_checkpoint_round_trip_and_errors(tiny_model_dir, tiny_tokenizer, tmp_path, single_thread):
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    ar.set_exits([0, 1, 2, 3])
    _heads_apart(ar)
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, "right")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        before = ar.predict(ids, mask, blocks=BLOCKS)
    ar.save_pretrained(tmp_path / "ar")
    with safe_open(str(tmp_path / "ar" / EXIT_HEADS_FILE), framework="pt") as f:
        assert sorted(f.keys()) == ["0", "1", "2", "3"]
        assert json.loads(f.metadata()["read_after"]) == {"0": 1, "1": 1, "2": 2, "3": 3}
    back = Reconstructor.from_pretrained(tmp_path / "ar").eval()
    assert back.exits == {0: 1, 1: 1, 2: 2, 3: 3}
    with torch.no_grad():
        torch.testing.assert_close(back.predict(ids, mask, blocks=BLOCKS), before, rtol=0, atol=0)
    # a fresh AR loading the heads (a LoRA run's resume)
    fresh = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    fresh.load_head(tmp_path / "ar")
    with torch.no_grad():
        torch.testing.assert_close(fresh.predict(ids, mask, blocks=BLOCKS), before, rtol=0, atol=0)

    with pytest.raises(ValueError, match=r"blocks: this AR reads each row at its own block .* pass blocks="):
        back.predict(ids, mask)
    with pytest.raises(ValueError, match=r"blocks: expected one block a row \(5 rows\), found 2"):
        back.predict(ids, mask, blocks=[0, 1])
    with pytest.raises(ValueError, match=r"block\(s\) \[7\] are not ones this AR reads \(its blocks: \[0, 1, 2, 3\]\)"):
        back.predict(ids, mask, blocks=[0, 1, 7, 2, 3])
    with pytest.raises(ValueError, match=r"exits: expected the pair's blocks in increasing order, the deepest this "
                                         r"AR's K = 3, found \[0, 2\]"):
        fresh.set_exits([0, 2])
