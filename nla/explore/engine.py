"""The explorer's model side: text -> tokens -> activations at layer K -> explanations -> scores.

Notation: T tokens of one text, P requested positions, S samples per position, d = ``d_model``.

Every number the page shows comes from the library's own code paths, so the explorer shows
what training and evaluation measure:

1. Tokens and activations are those of datagen (``nla.core.activations.tokenize_text`` and
   ``block_outputs``): the output of block K of the subject model, K from the AR sidecar.
2. Explanations and scores are ``NLAClient.verbalize`` / ``NLAClient.score``: the AR's
   reconstruction compared with the RAW activation, ``mse_nrm = 2(1 - cos)`` at the AR's
   ``mse_scale``.
3. On the subject's world, ground truth is ``nla.world.token_facts`` on the held-out
   documents (never seen by the subject or the pair) and claims are graded by
   ``nla.world.grade`` (quotations are not fact claims). On any text, world or typed, the
   quotation of the text's end is graded unit by unit against the text read up to the token
   (``nla.world.explain.grade_quote``): a false quotation is marked as a false fact is.
4. Each claim's deletion cost is ``attribute_claims`` (``nla.eval.suite``) with the world
   grader: ``delta_mse`` = the AR's ``mse_nrm`` with the claim deleted minus with it, and the
   claim's truth against the position's facts on a world document (null elsewhere; the quotation's
   truth against the text read, on any text).

All P positions of a request go through one ``verbalize`` call and one ``score`` call (one
more of each for samples) and one ``attribute_claims`` call for every explanation.
Every check of a request raises ``nla.util.http.RequestError`` with an HTTP status and a one-line
reason; the server turns it into a JSON error and keeps running.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nla.client import NLAClient, NLAClientError, ScoreResult, Verbalization
from nla.core.activations import block_outputs, tokenize_text
from nla.core.arch import hidden_size, num_layers
from nla.core.graders import DatasetGrader, get_grader
from nla.core.provenance import Provenance, ProvenanceError, check_provenance
from nla.datagen.extract import load_subject
from nla.eval.suite.claims import attribute_claims
from nla.util.http import RequestError
from nla.util.validation import InputError, check_sampling
from nla.world import generate_documents, load_world, token_facts

logger = logging.getLogger(__name__)

__all__ = ["ExploreLimits", "Explorer", "TextInput", "WorldDocs", "grade_claims", "resolve_subject"]


@dataclass(frozen=True)
class ExploreLimits:
    """Caps on what one request may ask for (each breach is a 4xx naming the cap).

    max_body_bytes: request body size (413 above it).
    max_text_chars / max_tokens: one text; ``max_tokens`` is also capped by the subject's context.
    max_positions: positions explained in one request (a whole text is one request).
    max_samples: sampled explanations per position, on top of the greedy one.
    max_new_tokens: explanation length cap (and the default length).
    max_score_texts / max_explanation_chars: ``/api/score`` inputs.
    max_world_docs: held-out world documents offered in the page.
    """

    max_body_bytes: int = 4_000_000
    max_text_chars: int = 2000
    max_tokens: int = 128
    max_positions: int = 128
    max_samples: int = 8
    max_new_tokens: int = 96
    max_score_texts: int = 256
    max_explanation_chars: int = 2000
    max_world_docs: int = 40

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ExploreLimits.{name}: expected a positive integer, found {value!r}")

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class WorldDocs:
    """The held-out documents of the subject's world build (ground truth for every token)."""

    root: Path
    docs: dict[int, Any]  # doc_id -> nla.world.Document, in id order

    @classmethod
    def for_subject(cls, subject_dir: Path, n: int) -> WorldDocs | None:
        """The world whose build holds ``subject_dir`` (``<world>/subject``), or None for any other model."""
        root = subject_dir.resolve().parent
        if not (root / "summary.json").is_file() or not (root / "world_config.yaml").is_file():
            return None
        world = load_world(root)
        cfg = world.config
        docs = generate_documents(cfg.seed, min(n, cfg.n_heldout_docs), start_id=cfg.heldout_start)
        return cls(root, {d.doc_id: d for d in docs})


@dataclass(frozen=True)
class TextInput:
    """One tokenized text: ids, character spans, and the world document when it is one.

    ids: [T] subject token ids; offsets: [T] ``(start, end)`` character spans in ``text``.
    """

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    doc: Any = None  # nla.world.Document for a held-out world document

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def resolve_subject(subject: str | os.PathLike | None, client: NLAClient) -> Path:
    """The subject model dir: the explicit path, else the ``base_model`` the pair's sidecars record."""
    if subject is not None:
        return Path(subject)
    for side in (client.av_sidecar, client.ar_sidecar):
        if side is not None and side.base_model:
            return Path(side.base_model)
    raise RequestError(
        "subject: neither the AV nor the AR sidecar records extraction.base_model; pass --subject DIR (the model "
        "the pair's vectors were extracted from)", status=409)


class Explorer:
    """Verbalize and score the activations of the subject model at the pair's layer, per token.

    A pair for several blocks (issue 59: ``layers`` in its sidecars) reads any of them: each request
    names its block (``layer``; the deepest when omitted), the activations are that block's output and
    the AV and AR are told the block as in training."""

    def __init__(self, client: NLAClient, subject_model: Any, subject_tokenizer: Any, *, subject_dir: Path,
                 layer_index: int, world: WorldDocs | None = None, limits: ExploreLimits | None = None) -> None:
        self.client = client
        self.model, self.tokenizer = subject_model, subject_tokenizer
        self.subject_dir = Path(subject_dir)
        self.layer_index = layer_index
        side = client.av_sidecar or client.ar_sidecar
        self.layers: tuple[int, ...] | None = side.layers if side is not None else None
        self.world = world
        self.limits = limits or ExploreLimits()
        if client.av_model is None or client.ar is None:
            raise RequestError("the explorer needs both an AV and an AR checkpoint (--av DIR --ar DIR)", status=409)
        n = num_layers(subject_model.config)
        if not 0 <= max(self.layers or (layer_index,)) < n:
            raise RequestError(
                f"layer: the pair reads block {layer_index} but the subject model {self.subject_dir} has {n} blocks "
                f"(0..{n - 1}); pass the --subject the pair was trained on", status=409)
        width = hidden_size(subject_model.config)
        if width != client.d_model:
            raise RequestError(
                f"d_model: the pair expects vectors of width {client.d_model} but the subject model "
                f"{self.subject_dir} has width {width}; pass the --subject the pair was trained on", status=409)
        if not getattr(subject_tokenizer, "is_fast", False):
            raise RequestError("subject: the explorer needs a fast tokenizer (character spans per token)", status=409)
        context = getattr(subject_model.config, "max_position_embeddings", None) or self.limits.max_tokens
        self.max_tokens = min(self.limits.max_tokens, int(context))
        self.max_new_tokens = self.limits.max_new_tokens
        self.world_docs_considered = len(world.docs) if world is not None else 0
        if world is not None:  # offer only the documents that fit the token cap
            fits = {i: d for i, d in world.docs.items()
                    if len(tokenize_text(subject_tokenizer, d.text, self.max_tokens + 1)[0]) <= self.max_tokens}
            self.world = WorldDocs(world.root, fits)
        # splits explanations into claims (a sentence each) and judges them: the language the pair was
        # trained on (its AV sidecar's training.explainer, e.g. wiki for the smollm2 preset), else the world's
        self.grader = pair_grader(client)
        self._lock = threading.Lock()  # one model call at a time: hooks and generation are not thread-safe

    @classmethod
    def load(cls, av: str | os.PathLike, ar: str | os.PathLike, subject: str | os.PathLike | None = None, *,
             device: str = "auto", dtype: str = "float32", limits: ExploreLimits | None = None,
             allow_mixed_provenance: bool = False) -> Explorer:
        """Load the pair and its subject model from directories given on the command line."""
        limits = limits or ExploreLimits()
        for role, path in (("av", av), ("ar", ar)):
            if not Path(path).is_dir():
                raise FileNotFoundError(f"--{role}: no checkpoint directory at {path}")
        try:
            client = NLAClient(av, ar, device=device, dtype=dtype, allow_mixed_provenance=allow_mixed_provenance)
        except (NLAClientError, ProvenanceError) as err:
            raise RequestError(str(err), status=409) from None
        subject_dir = resolve_subject(subject, client)
        if subject is not None:  # the explicit subject must be the one the pair records
            try:
                check_provenance([Provenance("--subject", subject=str(subject_dir)), *client.provenance()],
                                 allow=allow_mixed_provenance, context="explore")
            except ProvenanceError as err:
                raise RequestError(str(err), status=409) from None
        if not (subject_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"subject: no Hugging Face model at {subject_dir} (no config.json); pass --subject DIR, the model the "
                "pair's vectors were extracted from")
        model, tok = load_subject(subject_dir, device=str(next(client.av_model.parameters()).device))
        world = WorldDocs.for_subject(subject_dir, limits.max_world_docs)
        layer = client.ar_sidecar.need_layer("explore (extracting activations of block K)")
        logger.info("explore: subject %s, layer %d, d_model %d, world %s", subject_dir, layer, client.d_model,
                    world.root if world else "none")
        return cls(client, model, tok, subject_dir=subject_dir, layer_index=layer, world=world, limits=limits)

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        """What the page shows in its header, and the held-out documents it offers."""
        docs = []
        if self.world is not None:
            for doc_id, doc in self.world.docs.items():
                docs.append({"doc_id": doc_id, "title": doc.text[:60], "text": doc.text, "n_facts": len(doc.facts)})
        return {"d_model": self.client.d_model, "layer_index": self.layer_index,
                "layers": list(self.layers) if self.layers else None, "subject": str(self.subject_dir),
                "mse_scale": self.client.mse_scale, "world": str(self.world.root) if self.world else None,
                "world_docs": docs, "world_docs_considered": self.world_docs_considered,
                "max_tokens": self.max_tokens, "max_new_tokens": self.max_new_tokens}

    # ------------------------------------------------------------------ inputs
    def text_input(self, text: str | None = None, doc_id: int | None = None) -> TextInput:
        """Tokenize a typed text or a held-out world document (exactly one of the two)."""
        doc = None
        if (text is None) == (doc_id is None):
            raise RequestError("give either 'text' (a string) or 'doc_id' (a held-out world document)"
                               + (", not both" if text is not None else ""))
        if doc_id is not None:
            if self.world is None:
                raise RequestError(f"doc_id {doc_id}: the subject {self.subject_dir} is not a world build, so there "
                                   "are no world documents; send 'text' instead")
            if doc_id not in self.world.docs:
                ids = list(self.world.docs)
                offered = (f"expected one of {ids[0]}..{ids[-1]} (see /api/info)" if ids
                           else f"none fits the {self.max_tokens}-token cap")
                raise RequestError(f"doc_id {doc_id}: not a held-out document offered here; {offered}")
            doc = self.world.docs[doc_id]
            text = doc.text
        assert text is not None
        if not text.strip():
            raise RequestError("text is empty; type or paste a text to explore")
        if len(text) > self.limits.max_text_chars:
            raise RequestError(f"text is {len(text)} characters; the cap is {self.limits.max_text_chars}, "
                               "send a shorter text", status=413)
        ids, offsets = tokenize_text(self.tokenizer, text, max_len=self.max_tokens + 1)
        if len(ids) > self.max_tokens:
            raise RequestError(f"text is more than {self.max_tokens} tokens (the cap: the subject's context or "
                               "--max-tokens); send a shorter text", status=413)
        if not ids:
            raise RequestError("text has no tokens; type or paste a text to explore")
        assert offsets is not None  # fast tokenizer, checked at startup
        return TextInput(text, ids, [(int(s), int(e)) for s, e in offsets], doc)

    def tokens(self, inp: TextInput) -> list[dict[str, Any]]:
        """One entry per token: its text (the character span, or the decoded id for a special token)."""
        truth = self.facts(inp)
        out = []
        for i, (tid, (s, e)) in enumerate(zip(inp.ids, inp.offsets, strict=True)):
            piece = inp.text[s:e] if e > s else self.tokenizer.decode([tid])
            entry: dict[str, Any] = {"position": i, "text": piece, "start": s, "end": e}
            if truth is not None:
                entry["facts"] = truth[i]
            out.append(entry)
        return out

    def check_positions(self, inp: TextInput, positions: Sequence[int] | None) -> list[int]:
        if positions is None:
            positions = list(range(inp.n_tokens))
        if not positions:
            raise RequestError("positions is empty; give token positions to explain (or omit it for every token)")
        if len(positions) > self.limits.max_positions:
            raise RequestError(f"{len(positions)} positions; the cap is {self.limits.max_positions} per request",
                               status=413)
        for p in positions:
            if not 0 <= p < inp.n_tokens:
                raise RequestError(f"position {p} is out of range: the text has {inp.n_tokens} tokens "
                                   f"(positions 0..{inp.n_tokens - 1})")
        return list(positions)

    # ------------------------------------------------------------------ model work
    def block(self, layer: int | None) -> int:
        """The block a request reads: ``layer``, checked against the pair's blocks (None: the deepest, the
        one a one-block pair reads)."""
        if layer is None:
            return self.layer_index
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise RequestError(f"layer: expected a block number, found {layer!r}")
        offered = self.layers or (self.layer_index,)
        if layer not in offered:
            raise RequestError(f"layer: block {layer} is not one this pair was trained on; it reads "
                               f"{'blocks ' + ', '.join(map(str, offered)) if self.layers else f'block {self.layer_index} only'}"
                               "; pick one of those (or omit layer for the deepest)")
        return layer

    def _pair_layer(self, block: int) -> int | None:
        """What the client is told: the block for a pair of several, nothing for a one-block pair."""
        return block if self.layers else None

    def activations(self, inp: TextInput, layer: int | None = None) -> torch.Tensor:
        """Activations [T, d] (fp32, CPU) as the pair reads them: the output of block K (``layer``, checked
        by ``block``) at every token, as datagen extracts them, minus the sidecars' offset (the block's, for a pair
        of several blocks centred a block at a time) when the pair was trained on centred vectors
        (``NLAClient.to_pair_space``)."""
        block = self.block(layer)
        device = next(self.model.parameters()).device
        ids = torch.tensor([inp.ids], device=device)
        with self._lock:
            hidden = block_outputs(self.model, ids, torch.ones_like(ids), block)
        return self.client.to_pair_space(hidden[0].float().cpu(), self._pair_layer(block))

    def explain(self, inp: TextInput, positions: Sequence[int] | None = None, *, n_samples: int = 0,
                max_new_tokens: int | None = None, temperature: float = 1.0, seed: int = 0,
                return_vectors: bool = False, layer: int | None = None) -> list[dict[str, Any]]:
        """Greedy explanation (+ ``n_samples`` sampled ones) and round-trip scores for each position, at
        block ``layer`` (``block``)."""
        positions = self.check_positions(inp, positions)
        block = self.block(layer)
        at = self._pair_layer(block)
        if not 0 <= n_samples <= self.limits.max_samples:
            raise RequestError(f"n_samples must be 0..{self.limits.max_samples}, found {n_samples}")
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not 1 <= max_new <= self.max_new_tokens:
            raise RequestError(f"max_new_tokens must be 1..{self.max_new_tokens}, found {max_new}")
        try:  # the one check of sampling settings (nla.util.validation.check_sampling)
            check_sampling(temperature, what="temperature")
        except InputError as err:
            raise RequestError(str(err)) from None
        acts = self.activations(inp, block)
        vectors = acts[positions]  # [P, d]
        P = len(positions)
        truth = self.facts(inp)
        with self._lock:
            greedy = self.client.verbalize(vectors, max_new_tokens=max_new, greedy=True, batch_size=P, layer=at)
            greedy_scores = self.client.score([v.explanation for v in greedy], vectors, batch_size=P, layer=at)
            sampled: list[Verbalization] = []
            sampled_scores = None
            gold = vectors[:0]
            if n_samples:
                sampled = self.client.verbalize(vectors, max_new_tokens=max_new, greedy=False,
                                                temperature=temperature, n_samples=n_samples, seed=seed,
                                                batch_size=P, layer=at)
                gold = vectors[[v.row for v in sampled]]  # [P*S, d], samples of one vector contiguous
                sampled_scores = self.client.score([v.explanation for v in sampled], gold, batch_size=P * n_samples,
                                                   layer=at)
            # every explanation of the request (greedy ones, then samples) in one attribution call
            every = greedy + sampled
            row_facts = None if truth is None else [truth[positions[v.row]] for v in every]
            reads = [self.read_to(inp, positions[v.row]) for v in every]
            attributed = self._attribute([v.explanation for v in every], torch.cat([vectors, gold]), row_facts,
                                         reads, at)
        tokens = self.tokens(inp)
        out = []
        for k, p in enumerate(positions):
            facts = truth[p] if truth is not None else None
            read = self.read_to(inp, p)
            entry: dict[str, Any] = {
                "position": p, "token": tokens[p]["text"], "layer": block,
                "greedy": _explanation(greedy[k], greedy_scores, k, facts, attributed[k], read, self.grader),
                "samples": [_explanation(sampled[j], sampled_scores, j, facts, attributed[P + j], read, self.grader)
                            for j in range(k * n_samples, (k + 1) * n_samples)],
            }
            if facts is not None:
                entry["facts"] = facts
            if return_vectors:
                entry["vector"] = vectors[k].tolist()
            out.append(entry)
        return out

    def claim_attribution(self, texts: Sequence[str | None], vectors: torch.Tensor,
                          facts: Sequence[Sequence[str]] | None = None,
                          reads: Sequence[str] | None = None, layer: int | None = None) -> list[list[dict[str, Any]]]:
        """Per explanation, each claim's ``{"text", "delta_mse", "truth", "quotation"}``: what deleting
        it costs the AR's reconstruction of RAW ``vectors[i]`` [N, d] (``nla.eval.suite.attribute_claims``
        with the world grader); ``facts[i]``: row i's ground truth (None: every fact claim's truth is
        null); ``reads[i]``: the text read up to and including row i's token (the quotation's truth;
        None: not graded). A failed sample (None) has no claims; ``layer``: the block the vectors were
        read at (``block``). What ``explain`` returns as ``claim_attribution``."""
        at = self._pair_layer(self.block(layer))
        with self._lock:
            return self._attribute(texts, vectors, facts, reads, at)

    def _attribute(self, texts: Sequence[str | None], vectors: torch.Tensor,
                   facts: Sequence[Sequence[str]] | None,
                   reads: Sequence[str] | None = None, layer: int | None = None) -> list[list[dict[str, Any]]]:
        """``claim_attribution`` under the caller's lock (``layer``: what the client is told)."""
        if not texts:
            return []
        attr = attribute_claims(self.client, list(texts), vectors, grader=self.grader,
                                truths=None if facts is None else [list(f) for f in facts],
                                quotes=None if reads is None else [self.grader.quote_truth_of(r) for r in reads],
                                layer=layer)
        return [[c.to_dict() | {"delta_mse": _finite(c.delta_mse)} for c in cs] for cs in attr]

    def score(self, texts: Sequence[str | None], vectors: torch.Tensor,
              facts: list[str] | None = None, read: str | None = None, layer: int | None = None) -> list[dict[str, Any]]:
        """Reconstruct ``texts`` with the AR and compare with RAW ``vectors`` [N, d]; ``facts`` / ``read``:
        the token's ground truth and the text read up to it, to grade the claims and the quotation;
        ``layer``: the block the vectors were read at (``block``)."""
        at = self._pair_layer(self.block(layer))
        if not texts:
            raise RequestError("texts is empty; give one explanation per vector")
        if len(texts) > self.limits.max_score_texts:
            raise RequestError(f"{len(texts)} texts; the cap is {self.limits.max_score_texts} per request",
                               status=413)
        for i, t in enumerate(texts):
            if t is not None and len(t) > self.limits.max_explanation_chars:
                raise RequestError(f"texts[{i}] is {len(t)} characters; the cap is "
                                   f"{self.limits.max_explanation_chars}", status=413)
        if vectors.ndim != 2 or vectors.shape[1] != self.client.d_model:
            raise RequestError(f"vectors: expected [N, {self.client.d_model}] (the pair's d_model), found shape "
                               f"{list(vectors.shape)}")
        if vectors.shape[0] != len(texts):
            raise RequestError(f"{len(texts)} texts for {vectors.shape[0]} vectors; give one text per vector")
        if not torch.isfinite(vectors).all() or (vectors.norm(dim=-1) == 0).any():
            raise RequestError("vectors: every vector must be finite and non-zero")
        with self._lock:
            res = self.client.score(list(texts), vectors, batch_size=len(texts), layer=at)
        return [_scores(res, i) | grade_claims(t, facts, read, self.grader) for i, t in enumerate(texts)]

    @staticmethod
    def read_to(inp: TextInput, position: int) -> str:
        """The text read up to and including token ``position`` (what its quotation should end with)."""
        return inp.text[: inp.offsets[position][1]]

    def facts(self, inp: TextInput) -> list[list[str]] | None:
        """Ground truth per token (``"kind=value"`` strings) for a world document; None for typed text."""
        if inp.doc is None:
            return None
        return [sorted(str(f) for f in fs) for fs in token_facts(inp.doc, inp.offsets)]


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if np.isnan(v) else v


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None  # JSON has no NaN / inf


def _scores(res: ScoreResult, i: int) -> dict[str, Any]:
    return {"cosine": _num(res.cosine[i]), "mse_nrm": _num(res.mse_nrm[i]), "failed": bool(res.failed[i])}


def pair_grader(client: NLAClient) -> DatasetGrader:
    """The grader of the language a pair was trained on: its AV sidecar's ``training.explainer`` when
    a grader of that name is registered (``wiki``), else the world's."""
    side = client.av_sidecar or client.ar_sidecar
    name = (side.training or {}).get("explainer") if side is not None else None
    if isinstance(name, str) and name != "world":
        try:
            return get_grader(name)
        except (KeyError, ValueError):
            pass  # an explainer with no grader of its name (context, an API model): the world's sentences
    return get_grader("world")


def grade_claims(explanation: str | None, facts: list[str] | None, read: str | None = None,
                 grader: DatasetGrader | None = None) -> dict[str, Any]:
    """Each fact the explanation claims, marked true/false against the token's ground truth (the
    ``"kind=value"`` strings of ``grader``'s language, default the world's), and with ``read`` (the text
    read up to and including the token, any text) its quotation of the text's end, graded unit by unit
    (``quote_grade``)."""
    grader = grader or get_grader("world")
    out: dict[str, Any] = {}
    if read is not None:
        out["quotation"] = quote_grade(explanation, read, grader)
    if facts is None:
        return out
    text = explanation or ""
    truth = set(facts)
    claims = sorted(grader.named_facts(text))
    unsure = list(dict.fromkeys(grader.hedged_facts(text)))  # said with "may": no claim, shown apart
    g = grader.grade(text, list(facts))
    return {"claims": [{"fact": f, "correct": f in truth} for f in claims],
            "unsure": [{"fact": f, "correct": f in truth} for f in unsure],
            "missed": sorted(truth - set(claims) - set(unsure)),
            "recall": g.recall, "precision": g.precision, **out}


def quote_grade(explanation: str | None, read: str, grader: DatasetGrader | None = None) -> dict[str, Any] | None:
    """The explanation's quotation against the end of ``read``, by ``grader``'s rule (default the
    world's: its last three units; the wiki's: the token read's unit):
    ``{"quoted", "truth", "exact", "correct", "units": [{"unit", "position", "correct"}]}`` in reading
    order (position 0 = the token read; ``correct``: every unit true); None when it quotes nothing or
    the language grades no quotation."""
    grader = grader or get_grader("world")
    truth = grader.quote_truth_of(read)
    g = grader.grade_quote(explanation, truth) if truth is not None else None
    if g is None or g.quoted is None:
        return None
    end = truth[0]
    units = grader.quote_units(g.quoted)
    hedged = getattr(g, "hedged", None)  # said unsure (nla.world.explain.Hedged): each unit's truth all the same
    claims = g.claims if hedged is None else hedged
    return {"quoted": g.quoted, "truth": end, "exact": g.exact, "correct": g.all_true, "hedged": hedged is not None,
            "units": [{"unit": u, "position": len(units) - 1 - j, "correct": claims[len(units) - 1 - j]}
                      for j, u in enumerate(units)]}


def _explanation(v: Verbalization, res: ScoreResult | None, i: int, facts: list[str] | None,
                 attribution: list[dict[str, Any]], read: str | None = None,
                 grader: DatasetGrader | None = None) -> dict[str, Any]:
    assert res is not None
    return {"explanation": v.explanation, "status": v.status, "text": v.text, **_scores(res, i),
            **grade_claims(v.explanation, facts, read, grader), "claim_attribution": attribution}
