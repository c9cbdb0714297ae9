"""The token ids a sidecar records: derived from a live tokenizer, and checked against one at load
(docs/design.md §3.1).

A sidecar pins the marker's id, its two neighbours in the canonical AV prompt and the AR
template's constant tail (``critic_suffix_ids``). :func:`derive_token_ids` computes them from a
tokenizer (``NLAConfig.from_tokenizer`` records them); :func:`verify_tokenizer` checks a loaded
sidecar against the tokenizer it is used with and raises a ``SidecarMismatchError`` subclass
naming the field, never a silent fix, because a drifted id makes injection write into the wrong
position and training quietly learns nothing.

1. The canonical AV prompt is the chat template applied to the AV message with the generation
   prompt on and ``date_string`` pinned (``TEMPLATE_DATE``); the marker appears in it exactly once.
2. The AR tail recorded is the part every explanation shares (``stable_ar_suffix``): a byte-level
   BPE may glue the explanation's last character to the tail's first; the token the prediction is
   read at (the last) must not depend on the explanation. A longer recorded tail (the published
   writer's) is checked where its ids can hold (``checked_ar_suffix``).

``cfg`` below is an ``nla.core.sidecar.NLAConfig`` (this module sits below it: the config's
``from_tokenizer`` calls :func:`derive_token_ids` and :func:`verify_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nla.core.sidecar_errors import (
    ARSuffixMismatchError,
    MarkerCountError,
    MarkerIdMismatchError,
    MarkerIsUnknownError,
    MarkerNotSingleTokenError,
    NeighborMismatchError,
    SidecarError,
    SidecarMismatchError,
)

__all__ = ["MARKER_BLOCKS", "TEMPLATE_DATE", "canonical_av_prompt_ids", "checked_ar_suffix", "derive_token_ids",
           "single_token_markers", "stable_ar_suffix", "verify_tokenizer"]

# Explanations whose last characters end them in different ways, used to find which ids of the AR
# template's tail every explanation shares. A byte-level BPE glues punctuation to what follows
# (Qwen2.5: ".\n" and '"\n' are single tokens, so are ".</" and '"</'): the first ids of the tail
# can depend on the explanation, the token the prediction is read at must not.
_PROBE_EXPLANATIONS = ("the", "A short explanation.", "x 42 )", 'He said "hi"', "Why?", "Done!", "a: b",
                       "it's", "3.14", "(see below)", "naïve café")


# The date every AV prompt is rendered with. Llama 3.1 to 3.3's chat templates print "Today Date: " and
# today's date (``strftime_now``) in a system header unless the caller passes ``date_string``: an AV
# trained on one day would be run on another prompt the next. This is the date those templates fall
# back to without ``strftime_now``; a template that does not read ``date_string`` ignores it.
TEMPLATE_DATE = "26 Jul 2024"


def canonical_av_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of the AV prompt as training and generation build it: chat template, generation prompt on,
    ``date_string`` pinned to ``TEMPLATE_DATE`` (the same prompt on every day)."""
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            date_string=TEMPLATE_DATE)
    except ValueError as err:
        raise SidecarMismatchError(
            f"the tokenizer cannot build the canonical AV prompt ({err}); give it a chat template "
            "(tokenizer.chat_template) before using it with an NLA verbalizer"
        ) from None
    if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], (list, tuple)):
        ids = list(ids[0])
    return [int(i) for i in ids]


def _ar_ids(tokenizer: Any, text: str) -> list[int]:
    # No special tokens: the tail must be the last ids of the text itself, whatever BOS/EOS policy.
    return list(tokenizer.encode(text, add_special_tokens=False))


# Where single_token_markers looks for a marker: the published marker's own Unicode block (Enclosed
# CJK Letters and Months, U+3200-U+32FF, where '㈎' is), then Enclosed Alphanumerics and Geometric Shapes.
MARKER_BLOCKS = ((0x3200, 0x3300), (0x2460, 0x2500), (0x25A0, 0x2600))


def single_token_markers(tokenizer: Any, n: int = 3) -> list[tuple[str, int]]:
    """Up to ``n`` characters of ``MARKER_BLOCKS`` that ``tokenizer`` encodes as one known token and
    decodes back, as (character, id), each block's highest ids first.

    The highest ids first because both BPE (merges in order of frequency) and SentencePiece (pieces in
    order of score) give rarer pieces later ids, and a marker should be rare: on Qwen2.5 the published
    '㈎' is 149,705 of 151,643 regular ids. Whether a candidate also keeps its neighbours in the AV
    template is checked when it is used (``NLAConfig.from_tokenizer``).
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    found: list[tuple[str, int]] = []
    for lo, hi in MARKER_BLOCKS:
        block = []
        for cp in range(lo, hi):
            ids = tokenizer.encode(chr(cp), add_special_tokens=False)
            if len(ids) == 1 and ids[0] != unk and tokenizer.decode(ids) == chr(cp):
                block.append((chr(cp), int(ids[0])))
        found += sorted(block, key=lambda c: -c[1])
        if len(found) >= n:
            break
    return found[:n]


def _single_marker_id(tokenizer: Any, injection_char: str) -> int:
    ids = tokenizer.encode(injection_char, add_special_tokens=False)
    if len(ids) != 1:
        have = single_token_markers(tokenizer)
        hint = (" (this tokenizer has, as single tokens: "
                + ", ".join(f"{c!r} id {i}" for c, i in have) + "; pick one your text never contains)") if have else ""
        raise MarkerNotSingleTokenError(
            f"injection_char: expected {injection_char!r} to encode to exactly 1 token, found {len(ids)} "
            f"tokens {ids}; set injection_char to a character the tokenizer already has as a single token{hint}, "
            f"or add it to the tokenizer (tokenizer.add_tokens([{injection_char!r}]), then resize the model's "
            "embeddings)"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and ids[0] == unk:
        raise MarkerIsUnknownError(
            f"injection_char: {injection_char!r} encodes to the UNK token (id {unk}); the model cannot tell "
            "it apart from other unknown text. Add it to the tokenizer or choose another marker"
        )
    return int(ids[0])


def _marker_position(prompt: list[int], marker_id: int, injection_char: str) -> int:
    count = prompt.count(marker_id)
    if count != 1:
        raise MarkerCountError(
            f"injection_token_id: the canonical AV prompt (chat template, generation prompt on) must contain "
            f"the marker {injection_char!r} (id {marker_id}) exactly once, found {count} times in {prompt}; "
            "remove the marker from the chat template / system prompt, and keep a single {injection_char} "
            "in av_template"
        )
    pos = prompt.index(marker_id)
    if pos == 0 or pos == len(prompt) - 1:
        raise NeighborMismatchError(
            f"injection_left_neighbor_id/injection_right_neighbor_id: the marker sits at the "
            f"{'start' if pos == 0 else 'end'} of the canonical AV prompt, so it has no neighbour there; "
            "put delimiters around {injection_char} in av_template"
        )
    return pos


def _common_tail(seqs: Sequence[Sequence[int]], cap: int) -> tuple[int, ...]:
    n = 0
    while n < cap and all(len(s) > n for s in seqs) and len({s[-1 - n] for s in seqs}) == 1:
        n += 1
    return tuple(seqs[0][len(seqs[0]) - n:])


def _any_block(template: str) -> str:
    """A template of a pair of several blocks with ``{layer}`` filled in: the ids derived here (the
    marker's neighbours, the AR's tail) are the same for every block, which sits elsewhere in the text."""
    return template.replace("{layer}", "0")


def _ar_tails(tokenizer: Any, ar_template: str) -> tuple[list[list[int]], int]:
    ar_template = _any_block(ar_template)
    n_tail = len(tokenizer.encode(ar_template.split("{explanation}")[-1], add_special_tokens=False))
    if n_tail == 0:
        raise SidecarError(f"ar_template: the tail after {{explanation}} tokenises to nothing: {ar_template!r}")
    return [_ar_ids(tokenizer, ar_template.format(explanation=e)) for e in _PROBE_EXPLANATIONS], n_tail


def stable_ar_suffix(tokenizer: Any, ar_template: str) -> tuple[int, ...]:
    """The ids the AR text ends in whatever the explanation: the last ids of the template's tail
    that every probe explanation shares (``critic_suffix_ids``). Its last id is the token the AR
    reads its prediction at; the ids before it may be fewer than the tail's own tokenisation where
    the tokenizer merges the explanation's last character with the tail's first (Qwen2.5's ".\n").
    Raises when not even that last token is the same for every explanation."""
    seqs, n_tail = _ar_tails(tokenizer, ar_template)
    tail = _common_tail(seqs, n_tail)
    if not tail:
        ends = sorted({tokenizer.convert_ids_to_tokens(s[-1:])[0] for s in seqs})
        raise SidecarError(
            f"ar_template: the AR reads its prediction at the last token of the AR text, and with this tokenizer "
            f"that token depends on the explanation (it is one of {ends[:6]}); end the template in constant text "
            f"the tokenizer keeps apart from the explanation, e.g. a newline and a word: {ar_template!r}")
    return tail


def checked_ar_suffix(cfg: Any, tokenizer: Any) -> tuple[int, ...]:
    """The part of the recorded ``critic_suffix_ids`` every AR text must end in with this tokenizer:
    its last ``min(len(recorded), len(stable))`` ids, where ``stable`` is what every explanation
    shares (:func:`stable_ar_suffix`). Always at least the token the prediction is read at; all of
    what nla records; a published sidecar's longer tail (ids a BPE merges with the explanation's
    last character) is checked where it can hold."""
    return _checked_tail(cfg, tokenizer)[0]


def _checked_tail(cfg: Any, tokenizer: Any) -> tuple[tuple[int, ...], list[list[int]]]:
    """``checked_ar_suffix`` and the probe explanations' AR-text ids it was read from."""
    recorded = tuple(cfg.critic_suffix_ids)
    seqs, n_tail = _ar_tails(tokenizer, cfg.ar_template)
    n = max(1, min(len(recorded), len(_common_tail(seqs, max(n_tail, len(recorded))))))
    return recorded[-n:], seqs


def derive_token_ids(tokenizer: Any, injection_char: str | None, av_template: str | None,
                     ar_template: str | None) -> dict[str, Any]:
    """The token-id fields a sidecar records, computed from ``tokenizer``: the marker's id and its
    neighbours in the canonical AV prompt (with ``av_template``), the AR template's constant tail
    (with ``ar_template``). Only the fields whose template is given."""
    out: dict[str, Any] = {}
    if av_template is not None and injection_char is not None:
        marker_id = _single_marker_id(tokenizer, injection_char)
        messages = [{"role": "user", "content": _any_block(av_template).format(injection_char=injection_char)}]
        prompt = canonical_av_prompt_ids(tokenizer, messages)
        pos = _marker_position(prompt, marker_id, injection_char)
        out.update(injection_token_id=marker_id, injection_left_neighbor_id=prompt[pos - 1],
                   injection_right_neighbor_id=prompt[pos + 1])
    if ar_template is not None:
        out["critic_suffix_ids"] = stable_ar_suffix(tokenizer, ar_template)
    return out


def verify_tokenizer(cfg: Any, tokenizer: Any) -> None:
    """Check the live tokenizer against the sidecar; raise a :class:`SidecarMismatchError` subclass.

    The AV fields are checked when the sidecar has them, the AR fields likewise.
    """
    if cfg.has_av_fields:
        _verify_av(cfg, tokenizer)
    if cfg.has_ar_fields:
        _verify_ar(cfg, tokenizer)


def _verify_av(cfg: Any, tokenizer: Any) -> None:
    marker_id = _single_marker_id(tokenizer, cfg.injection_char)
    if marker_id != cfg.injection_token_id:
        raise MarkerIdMismatchError(
            f"injection_token_id: the sidecar records {cfg.injection_token_id} but the tokenizer encodes "
            f"{cfg.injection_char!r} to {marker_id}; load the tokenizer saved with this checkpoint/dataset "
            "(or rebuild the sidecar with NLAConfig.from_tokenizer)"
        )
    prompt = canonical_av_prompt_ids(tokenizer, cfg.av_messages(layer=cfg.layers[0] if cfg.layers else None))
    pos = _marker_position(prompt, marker_id, cfg.injection_char)
    for side, name, found in (
        ("left", "injection_left_neighbor_id", prompt[pos - 1]),
        ("right", "injection_right_neighbor_id", prompt[pos + 1]),
    ):
        expected = getattr(cfg, name)
        if found != expected:
            raise NeighborMismatchError(
                f"{name}: the sidecar records {expected} but the token {side} of the marker in the canonical AV "
                f"prompt is {found} ({tokenizer.convert_ids_to_tokens([found])}); the chat template or "
                "av_template changed since the sidecar was written. Use the original tokenizer/template or "
                "rebuild the sidecar with NLAConfig.from_tokenizer"
            )


def _verify_ar(cfg: Any, tokenizer: Any) -> None:
    checked, seqs = _checked_tail(cfg, tokenizer)  # the probes' AR texts, tokenised once
    n = len(checked)
    for explanation, ids in zip(_PROBE_EXPLANATIONS, seqs, strict=True):
        tail = tuple(ids[-n:])
        if tail[-1:] != checked[-1:]:
            raise ARSuffixMismatchError(
                f"critic_suffix_ids: the AR reads its prediction at the last token of the AR text; the sidecar "
                f"records {checked[-1]} ({tokenizer.convert_ids_to_tokens(list(checked[-1:]))}) but the tokenised "
                f"AR text for explanation {explanation!r} ends in {tail[-1:]} "
                f"({tokenizer.convert_ids_to_tokens(list(tail[-1:]))}); the tokenizer must be the one the AR was "
                "trained with, and the AR template's tail must end in the same token whatever the explanation"
            )
        if tail != checked:
            raise ARSuffixMismatchError(
                f"critic_suffix_ids: the sidecar records {list(cfg.critic_suffix_ids)} but the tokenised AR text "
                f"for explanation {explanation!r} ends in {list(ids[-len(cfg.critic_suffix_ids):])}: the last "
                f"{n} ids, which every explanation shares with this tokenizer, must match; the tokenizer must be "
                "the one the AR was trained with (or rebuild the sidecar with NLAConfig.from_tokenizer)"
            )
