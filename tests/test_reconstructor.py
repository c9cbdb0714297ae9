import pytest
import torch
import yaml
from conftest import ARCHS
from transformers import AutoConfig

from nla.core.arch import num_layers
from nla.core.reconstructor import VALUE_HEAD_FILE, Reconstructor, last_token_index
from nla.core.sidecar import NLAConfig, load_sidecar
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR


def test_last_token_index_left_right_unpadded():
    mask = torch.tensor([
        [1, 1, 1, 0, 0],  # right padded -> 2
        [0, 0, 1, 1, 1],  # left padded -> 4
        [1, 1, 1, 1, 1],  # unpadded -> 4
        [1, 0, 0, 0, 0],  # single token -> 0
    ])
    assert last_token_index(mask).tolist() == [2, 4, 4, 0]


@pytest.mark.parametrize("name", ARCHS)
def test_block_k_output_matches_hidden_states(tiny_model_dir, name):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(name)
    full = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(0)
    ids = torch.randint(8, 100, (2, 6))
    mask = torch.ones_like(ids)
    k = 1  # K < last layer: HF's hidden_states[-1] is after the final norm, block K's output is not
    with torch.no_grad():
        hs = full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        ar = Reconstructor.from_base(path, k).eval()
        values = ar(ids, mask)
        from_instance = Reconstructor.from_base(full, k).eval()(ids, mask)
    assert num_layers(ar.config) == k + 1
    assert torch.allclose(values, hs[k + 1], atol=1e-5)
    assert torch.allclose(from_instance, hs[k + 1], atol=1e-5)
    assert len(list(full.parameters())) > len(list(ar.parameters()))  # the instance was copied, not cut


def test_last_layer_edge_case_is_pre_norm(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from nla.core.arch import base_model

    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    ids = torch.randint(8, 100, (1, 5))
    with torch.no_grad():
        hs = full(input_ids=ids, output_hidden_states=True).hidden_states
        values = Reconstructor.from_base(full, 3)(ids)
        # hidden_states[4] is norm(block 3 output); undo by comparing after applying the norm
        normed = base_model(full).norm(values)
    assert torch.allclose(normed, hs[4], atol=1e-5)
    assert not torch.allclose(values, hs[4], atol=1e-3)


def test_left_padding_matches_unpadded(tiny_model_dir):
    ar = Reconstructor.from_base(tiny_model_dir("qwen2"), 2).eval()
    a = torch.tensor([[10, 11, 12, 13]])
    b = torch.tensor([[20, 21]])
    batch = torch.tensor([[10, 11, 12, 13], [0, 0, 20, 21]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        together = ar.predict(batch, mask)
        one_by_one = torch.cat([ar.predict(a), ar.predict(b)])
    assert torch.allclose(together, one_by_one, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_save_load_roundtrip(tiny_model_dir, tiny_tokenizer, tmp_path, name):
    ar = Reconstructor.from_base(tiny_model_dir(name), 1)
    d = ar.value_head.weight.shape[0]
    assert torch.equal(ar.value_head.weight, torch.eye(d))
    with torch.no_grad():
        ar.value_head.weight.add_(0.01 * torch.randn(d, d))  # a trained head must survive the trip
    cfg = NLAConfig.from_tokenizer(
        tiny_tokenizer, kind="nla_model", role="av", d_model=d, layer_index=1, av_template=DEFAULT_AV_TEMPLATE,
        ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR, injection_scale=None,
    )
    out = tmp_path / "ar"
    ar.save_pretrained(out, cfg, step=7)
    assert (out / VALUE_HEAD_FILE).is_file() and (out / "tokenizer.json").is_file()
    assert num_layers(AutoConfig.from_pretrained(out)) == 2  # K + 1 blocks, under each family's key
    meta = load_sidecar(out)
    assert (meta.role, meta.layer_index, meta.training["step"]) == ("ar", 1, 7)
    assert yaml.safe_load((out / "nla_meta.yaml").read_text())["ar"] == {"num_hidden_layers": 1}  # K, as published
    ar.save_pretrained(out, cfg)  # overwrite an existing checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar"]  # no temp / old dirs left behind
    back = Reconstructor.from_pretrained(out).eval()
    ids = torch.randint(8, 100, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        assert torch.equal(back(ids, mask), ar.eval()(ids, mask))
    assert back.layer_index == 1 and back.sidecar == meta.replace(training={})
    assert back.tokenizer is not None


def test_bad_layer_index_and_missing_head(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"layer_index: expected 0..3 .* found 4"):
        Reconstructor.from_base(tiny_model_dir("llama"), 4)
    with pytest.raises(FileNotFoundError, match="value_head.safetensors is missing"):
        Reconstructor.from_pretrained(tiny_model_dir("llama"))


def test_tokenize_ar_texts_pads_either_side_and_keeps_the_suffix(tiny_tokenizer):
    from nla.core.reconstructor import tokenize_ar_texts

    texts = ["the cat walks to the river . Summary", "Bob sings . Summary"]
    right = tokenize_ar_texts(tiny_tokenizer, texts, 64)
    left = tokenize_ar_texts(tiny_tokenizer, texts, 64, padding_side="left")
    for r in range(2):  # the same real tokens, padding on the named side
        assert torch.equal(right["input_ids"][r][right["attention_mask"][r].bool()],
                           left["input_ids"][r][left["attention_mask"][r].bool()])
    assert right["attention_mask"][1, -1] == 0 and left["attention_mask"][1, 0] == 0
    # truncation drops the head, never the suffix the prediction is read at
    short = tokenize_ar_texts(tiny_tokenizer, texts[:1], 3)
    assert tiny_tokenizer.convert_ids_to_tokens(short["input_ids"][0].tolist()) == ["river", ".", "Summary"]
    # the tokenizer's own sides are restored afterwards
    before = tiny_tokenizer.padding_side, tiny_tokenizer.truncation_side
    tiny_tokenizer.padding_side, tiny_tokenizer.truncation_side = "left", "right"
    try:
        tokenize_ar_texts(tiny_tokenizer, texts, 64)
        assert (tiny_tokenizer.padding_side, tiny_tokenizer.truncation_side) == ("left", "right")
    finally:
        tiny_tokenizer.padding_side, tiny_tokenizer.truncation_side = before
    with pytest.raises(ValueError, match="padding_side: expected 'left' or 'right', found 'middle'"):
        tokenize_ar_texts(tiny_tokenizer, texts, 64, padding_side="middle")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gpt2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_predict_runs_the_last_block_at_the_read_token_only(tiny_model_dir, tiny_tokenizer, arch, side):
    """``predict``'s last-block path (Llama/Qwen2) equals reading ``forward`` at the last real token:
    values and gradients, left or right padding, GQA (the tiny models have 2 kv heads for 4)."""
    from nla.core.arch import decoder_layers
    from nla.core.reconstructor import LAST_BLOCK_MODEL_TYPES, tokenize_ar_texts

    torch.manual_seed(0)
    ar = Reconstructor.from_base(tiny_model_dir(arch), 2).train()
    for mod in ar.modules():  # GPT-2's dropout would draw different masks in the two passes
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    assert ar.last_block_fast == (arch in LAST_BLOCK_MODEL_TYPES)
    texts = ["Explanation : cat walks", "Explanation : the dog runs to the river in the morning with Bob", "x"]
    enc = tokenize_ar_texts(tiny_tokenizer, texts, 64, side)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    gold = torch.randn(3, ar.config.hidden_size)
    last = decoder_layers(ar.base)[-1]
    results = []
    for read in ("predict", "forward"):
        ar.zero_grad(set_to_none=True)
        if read == "predict":
            pred = ar.predict(ids, mask)
        else:
            pred = ar(ids, mask)[torch.arange(3), last_token_index(mask)]
        ((pred - gold) ** 2).sum().backward()
        results.append((pred.detach(), {k: p.grad.clone() for k, p in ar.named_parameters() if p.grad is not None}))
    (p_fast, g_fast), (p_plain, g_plain) = results
    torch.testing.assert_close(p_fast, p_plain, rtol=1e-5, atol=1e-5)
    assert g_fast.keys() == g_plain.keys()
    for k in g_plain:
        torch.testing.assert_close(g_fast[k], g_plain[k], rtol=1e-4, atol=1e-5, msg=k)
    assert decoder_layers(ar.base)[-1] is last  # the block is never swapped out


def test_a_forward_on_another_thread_is_unaffected_by_predict(tiny_model_dir, tiny_tokenizer):
    """Issue 20, defect 4: ``predict`` used to swap the last block for a stand-in while the base
    ran, so a forward on a shared AR from another thread (the explorer) in that window ran
    without its last block. Here thread B's whole ``forward`` runs inside thread A's window."""
    import threading

    from nla.core.arch import decoder_layers
    from nla.core.reconstructor import tokenize_ar_texts

    torch.manual_seed(0)
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 2).eval()
    assert ar.last_block_fast
    enc = tokenize_ar_texts(tiny_tokenizer, ["Explanation : cat walks", "Explanation : the dog runs"], 64, "left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        ref_values = ar(ids, mask)
        ref_pred = ar.predict(ids, mask)
    seen: dict[str, torch.Tensor] = {}

    def other_thread_forward():
        with torch.no_grad():
            seen["values"] = ar(ids, mask)
            seen["pred"] = ar.predict(ids, mask)

    def in_window(module, args):  # block 0 of thread A's predict: A is inside its base forward
        if threading.current_thread() is threading.main_thread() and "values" not in seen:
            t = threading.Thread(target=other_thread_forward)
            t.start()
            t.join()

    handle = decoder_layers(ar.base)[0].register_forward_pre_hook(in_window)
    try:
        with torch.no_grad():
            pred = ar.predict(ids, mask)
    finally:
        handle.remove()
    torch.testing.assert_close(seen["values"], ref_values, rtol=0, atol=0)
    torch.testing.assert_close(seen["pred"], ref_pred, rtol=0, atol=0)
    torch.testing.assert_close(pred, ref_pred, rtol=0, atol=0)


def test_last_block_path_is_off_under_attention_dropout_in_training(tiny_model_dir):
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 1).train()
    ar.config.attention_dropout = 0.1
    assert not ar.last_block_fast
    assert ar.eval().last_block_fast  # eval mode drops nothing


@pytest.mark.parametrize("name", ARCHS)
def test_cutting_the_subject_prints_no_load_report_but_names_a_missing_weight(tiny_model_dir, name, tmp_path,
                                                                              capfd, caplog):
    # The blocks past K and the LM head are left out on purpose: transformers' UNEXPECTED table
    # would read as an error in the quickstart's console. A weight of a kept block that the
    # checkpoint lacks is still reported, by name.
    import logging

    from safetensors.torch import load_file, save_file

    path = tiny_model_dir(name)
    with caplog.at_level(logging.WARNING):
        Reconstructor.from_base(path, 0)
    out = capfd.readouterr()
    assert "LOAD REPORT" not in out.out + out.err + caplog.text and "UNEXPECTED" not in out.err + caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("nla")]

    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = load_file(broken / "model.safetensors")
    dropped = sorted(k for k in weights if ".0." in k and k.endswith("weight"))[0]
    save_file({k: v for k, v in weights.items() if k != dropped}, broken / "model.safetensors",
              metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Reconstructor.from_base(broken, 0)
    msgs = [r.getMessage() for r in caplog.records if r.name == "nla.core.reconstructor"]
    assert len(msgs) == 1 and "missing from the checkpoint" in msgs[0]
    assert dropped.split(".", 1)[1] in msgs[0]  # the key without its model./transformer. prefix
