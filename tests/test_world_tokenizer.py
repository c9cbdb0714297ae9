"""World tokenizer: single-token marker, stable neighbours, round trip, chat template."""

import pytest
from transformers import AutoTokenizer

from nla.core.templates import DEFAULT_AV_TEMPLATE
from nla.world.explain import TextExplainer
from nla.world.facts import facts_at
from nla.world.generator import generate_documents
from nla.world.tokenizer import (
    EOS_TOKEN,
    INJECTION_CHAR,
    PAD_TOKEN,
    canonical_av_messages,
    marker_ids,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    docs = generate_documents(0, 400)
    ex = TextExplainer()
    expl = [f"<explanation>\n{ex.explain(facts_at(d, len(d.text)), d.doc_id)}\n</explanation>" for d in docs]
    tok = train_tokenizer([d.text for d in docs] + expl, vocab_size=400)
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


def test_marker_is_one_token_in_any_context(tok):
    inj, left, right = marker_ids(tok)
    assert tok.encode(INJECTION_CHAR, add_special_tokens=False) == [inj]
    assert inj != tok.unk_token_id
    for text in (f"a{INJECTION_CHAR}b", f" {INJECTION_CHAR} ", f"{INJECTION_CHAR}{INJECTION_CHAR}", f"x<<{INJECTION_CHAR}>>y"):
        assert tok.encode(text, add_special_tokens=False).count(inj) == text.count(INJECTION_CHAR)


def test_marker_never_in_corpus():
    assert not any(INJECTION_CHAR in d.text for d in generate_documents(0, 2000))


def test_canonical_av_prompt_marker_once_with_fixed_neighbours(tok):
    inj, left, right = marker_ids(tok)
    assert tok.convert_ids_to_tokens([left, right]) == ["<<", ">>"]
    enc = tok.apply_chat_template(canonical_av_messages(), add_generation_prompt=True, tokenize=True)
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    assert ids.count(inj) == 1
    i = ids.index(inj)
    assert (ids[i - 1], ids[i + 1]) == (left, right)
    # the neighbours do not depend on what surrounds the delimiters
    other = tok.encode(f"zzz<<{INJECTION_CHAR}>>qq", add_special_tokens=False)
    j = other.index(inj)
    assert (other[j - 1], other[j + 1]) == (left, right)


def test_round_trip_decode(tok):
    texts = [d.text for d in generate_documents(9, 30)]
    texts += [DEFAULT_AV_TEMPLATE.format(injection_char=INJECTION_CHAR), "<explanation>\nThe mood is calm.\n</explanation>"]
    texts += ["Unseen wörds ünd émojis 🙂 <<>> 12345"]
    for t in texts:
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t


def test_chat_template_exact_string(tok):
    messages = canonical_av_messages() + [{"role": "assistant", "content": "<explanation>\nhi\n</explanation>"}]
    s = tok.apply_chat_template(messages, tokenize=False)
    assert s == (
        "<|user|>\nExplain the hidden state <<㈎>> in a few short sentences.<|end|>\n"
        "<|assistant|>\n<explanation>\nhi\n</explanation><|end|>\n"
    )
    gen = tok.apply_chat_template(canonical_av_messages(), tokenize=False, add_generation_prompt=True)
    assert gen == "<|user|>\nExplain the hidden state <<㈎>> in a few short sentences.<|end|>\n<|assistant|>\n"


def test_special_tokens(tok):
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    assert len(tok.encode(EOS_TOKEN, add_special_tokens=False)) == 1


def test_explanation_tags_are_learned(tok):
    # The training text includes the tags, so BPE should compress them well below one token per byte.
    n = len(tok.encode("<explanation>", add_special_tokens=False))
    assert n <= 4


def test_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size must be >= 300"):
        train_tokenizer(["a b c"], vocab_size=100)
