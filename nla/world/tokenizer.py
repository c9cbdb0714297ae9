"""The world's BPE tokenizer: byte-level BPE, chat template, EOS/PAD and the injection marker.

1. Byte-level BPE (``tokenizers``) trained on stories, explanations and chat samples,
   wrapped in ``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(dir)`` loads it.
2. The injection marker is an *added* token (non-special, ``normalized=False``): it always
   encodes to exactly one id whatever surrounds it, and never occurs in story text.
3. ``<<`` and ``>>`` (the delimiters around the marker in the AV prompt) are added tokens
   as well, so the marker's neighbours are the same ids in every context, independent of
   which merges BPE happened to learn.
4. ``<|bos|>`` is in the vocabulary (a special token) but is not the tokenizer's BOS: no text is
   tokenised with it, so declaring it would tell readers that the AR's inputs start with it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nla.core.templates import DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR

INJECTION_CHAR = DEFAULT_INJECTION_CHAR
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)
DELIMITER_TOKENS = ("<<", ">>")

# "<|role|>\ncontent<|end|>\n" per message; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def canonical_av_messages(injection_char: str = INJECTION_CHAR) -> list[dict[str, str]]:
    """The AV's user turn with the marker in place (docs/design.md §3.1 'canonical AV prompt')."""
    return [{"role": "user", "content": DEFAULT_AV_TEMPLATE.format(injection_char=injection_char)}]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts`` and wrap it with the chat template and markers."""
    if vocab_size < 300:
        # 256 byte symbols + specials must fit, with room for merges.
        raise ValueError(f"train_tokenizer: vocab_size must be >= 300, found {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in (INJECTION_CHAR, *DELIMITER_TOKENS)])
    # BOS_TOKEN keeps its id and stays special, but is not declared the BOS: no sequence starts with
    # it (pretraining, extraction and the AR read the text as it is), and a declared BOS that
    # tokenization never adds is one the published reconstructor reader refuses (item 4, above).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[BOS_TOKEN, *ROLE_TOKENS],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    check_tokenizer(fast)
    return fast


def check_tokenizer(tok: PreTrainedTokenizerFast) -> None:
    """Raise if the marker is not one stable token inside the canonical AV prompt."""
    ids = tok.encode(INJECTION_CHAR, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tok.unk_token_id:
        raise ValueError(f"injection char {INJECTION_CHAR!r} must encode to one non-UNK token, found ids {ids}")
    marker = ids[0]
    prompt_ids = tok.apply_chat_template(canonical_av_messages(), add_generation_prompt=True, tokenize=True)
    if hasattr(prompt_ids, "keys"):  # transformers 5 may return a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    if prompt_ids.count(marker) != 1:
        raise ValueError(f"canonical AV prompt must contain the marker once, found {prompt_ids.count(marker)} times")
    i = prompt_ids.index(marker)
    left, right = tok.convert_ids_to_tokens([prompt_ids[i - 1], prompt_ids[i + 1]])
    if (left, right) != DELIMITER_TOKENS:
        raise ValueError(f"marker neighbours must be {DELIMITER_TOKENS}, found {(left, right)}")


def marker_ids(tok: PreTrainedTokenizerFast) -> tuple[int, int, int]:
    """``(injection_token_id, left_neighbor_id, right_neighbor_id)`` for the sidecar."""
    inj = tok.convert_tokens_to_ids(INJECTION_CHAR)
    left, right = tok.convert_tokens_to_ids(list(DELIMITER_TOKENS))
    return inj, left, right
