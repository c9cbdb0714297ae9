import math

import pytest
import torch
from conftest import ARCHS, build_tiny_config, build_tiny_model

from nla.core import arch


@pytest.mark.parametrize("name", ARCHS)
def test_adapters_find_layers_norm_width(tiny_tokenizer, name):
    model = build_tiny_model(name, tiny_tokenizer)
    expected_d = 64 if name == "gemma3" else 32
    assert arch.hidden_size(model.config) == expected_d
    assert arch.num_layers(model.config) == 4
    assert len(arch.decoder_layers(model)) == 4
    base = arch.base_model(model)
    assert base is (model.transformer if name == "gpt2" else model.model)
    assert arch.base_model(base) is base
    assert arch.final_norm_name(base) == ("ln_f" if name == "gpt2" else "norm")


@pytest.mark.parametrize("name", ARCHS)
def test_build_input_embeds_matches_embedding_module(tiny_tokenizer, name):
    model = build_tiny_model(name, tiny_tokenizer)
    ids = torch.tensor([[1, 5, 9, 30]])
    expected_scale = math.sqrt(64) if name == "gemma3" else 1.0  # Gemma multiplies by sqrt(d)
    assert arch.embedding_scale(model) == pytest.approx(expected_scale)
    with torch.no_grad():
        assert torch.equal(arch.build_input_embeds(model, ids), model.get_input_embeddings()(ids))


def test_truncate_config_cuts_layer_types(tiny_tokenizer):
    cfg = build_tiny_config("gemma3", len(tiny_tokenizer), 0)
    short = arch.truncate_config(cfg, 3)
    assert short.num_hidden_layers == 3
    assert short.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.num_hidden_layers == 4 and len(cfg.layer_types) == 4  # original untouched
    gpt = arch.truncate_config(build_tiny_config("gpt2", 100, 0), 2)
    assert gpt.n_layer == 2 and arch.num_layers(gpt) == 2
    with pytest.raises(ValueError, match=r"n_layers must be in 1..4.*found 5"):
        arch.truncate_config(cfg, 5)


def test_unknown_model_errors():
    with pytest.raises(ValueError, match="cannot find the decoder stack of Linear"):
        arch.base_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ARCHS)
def test_load_tokenizer_keeps_saved_pipeline(tiny_model_dir, tiny_tokenizer, name):
    # AutoTokenizer would rebuild the qwen2 one from its vocab with Qwen's own pre-tokenizer.
    tok = arch.load_tokenizer(tiny_model_dir(name))
    text = "Explanation: the cat walks.\nSummary vector:"
    assert tok(text).input_ids == tiny_tokenizer(text).input_ids
    assert tok.convert_tokens_to_ids("㈎") == tiny_tokenizer.convert_tokens_to_ids("㈎")
    assert tok.chat_template == tiny_tokenizer.chat_template
