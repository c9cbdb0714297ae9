"""The ``nla_meta.yaml`` sidecar: what a checkpoint or dataset needs to be used correctly (docs/design.md §3.1).

A sidecar pins the extraction layer, the scales, the injection marker and its token ids,
and the two prompt templates. This module holds its schema (:class:`NLAConfig`) and its file:
reading, writing, where it lives and which one applies. Token ids are computed from a live
tokenizer (:meth:`NLAConfig.from_tokenizer`) and re-checked at load time
(``nla.core.token_ids.verify_tokenizer``); both live in ``nla.core.token_ids``.

Readers accept the published layouts and ignore unknown keys:

1. Templates under ``prompt_templates.av/ar`` or the older ``actor/critic``.
2. The layer K under ``extraction.layer_index``, ``critic.extraction_layer_index``, or, as the
   published AR sidecars record it, ``ar.num_hidden_layers`` (= K; the AR's config.json holds
   K+1 blocks) or the older ``critic.num_hidden_layers``. Sidecars written by nla before this
   rule recorded K+1 under ``ar.num_hidden_layers`` beside ``extraction.layer_index``; that pair
   is accepted too.
3. Each role carries only what it uses: an AV sidecar may have no layer and no AR fields (the
   published AV checkpoints have neither), an AR sidecar no injection fields and no scale.
   The layer, the AV fields and the AR fields are demanded where they are used
   (:meth:`NLAConfig.need_layer`, :meth:`~NLAConfig.need_av`, :meth:`~NLAConfig.need_ar`), with an
   error that names the purpose and the missing keys.
4. ``d_model`` top level or under ``extraction``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nla.core.sidecar_errors import SidecarError
from nla.core.token_ids import checked_ar_suffix, derive_token_ids, verify_tokenizer
from nla.core.vectors import SQRT_D_MODEL, resolve_scale
from nla.util.fsutil import write_text_atomic
from nla.util.validation import InputError, load_yaml

logger = logging.getLogger(__name__)

SIDECAR_NAME = "nla_meta.yaml"
KINDS = ("nla_model", "nla_dataset")
ROLES = ("av", "ar", None)

AV_FIELDS = ("injection_char", "injection_token_id", "injection_left_neighbor_id", "injection_right_neighbor_id",
             "av_template")
AR_FIELDS = ("critic_suffix_ids", "ar_template")
# Where each field sits in the written layout, for error messages.
_KEY_OF = {
    "injection_char": "tokens.injection_char", "injection_token_id": "tokens.injection_token_id",
    "injection_left_neighbor_id": "tokens.injection_left_neighbor_id",
    "injection_right_neighbor_id": "tokens.injection_right_neighbor_id", "av_template": "prompt_templates.av",
    "critic_suffix_ids": "tokens.critic_suffix_ids", "ar_template": "prompt_templates.ar",
}


@dataclass(frozen=True, kw_only=True)
class NLAConfig:
    """Resolved contents of a sidecar.

    kind: "nla_model" (checkpoint) or "nla_dataset" (parquet).
    role: "av", "ar" or None (datasets, and the published AV sidecars, which record no role).
    d_model: width of the subject model's residual stream.
    layer_index: K; vectors are the output of block K (HF ``hidden_states[K+1]``); None when the
        sidecar records no layer (published AV checkpoints). The AR keeps blocks 0..K.
    injection_char / injection_token_id / injection_{left,right}_neighbor_id: the marker and the
        token ids that must surround it in the canonical AV prompt (the AV fields; None in AR sidecars).
    critic_suffix_ids: ids of the AR template's constant tail after ``{explanation}`` (None in AV-only sidecars).
    av_template: user message of the AV prompt, with ``{injection_char}`` (None in AR sidecars).
    ar_template: AR input text, with ``{explanation}`` followed by a constant tail (None in AV-only sidecars).
    injection_scale: norm the vector is rescaled to before injection; "sqrt_d_model"; None = raw.
    mse_scale: norm both vectors are rescaled to before MSE; default "sqrt_d_model"; None = raw.
    base_model: name or path of the subject model (provenance).
    training: free-form provenance (lr, batch, step, parents).
    model_base / model_width: the AV's or AR's own base model and hidden size when it is not the
        subject (a cross-model pair; ``model.base_model`` / ``model.hidden_size``, nla's keys, not in
        the published layout); None: the model is (a copy of) the subject, of width ``d_model``.
    injection_adapter: the AV's learned affine map from the subject's ``d_model`` to its own
        embedding width (``nla.core.injection.InjectionAdapter``): ``{kind: affine, d_in, d_out, file}``
        and, when true, ``mean_invariant`` and ``conformal`` (absent: false); None: the vector is
        injected as it is (after ``injection_scale``).
    vector_offset: the vector subtracted from the subject's raw block outputs to get the vectors the
        pair reads and writes (``extraction.vector_offset``, nla's key: the training splits' mean for a
        ``center: true`` dataset, whose ``activation_vector`` column already holds the differences);
        None: the pair reads raw block outputs. ``to_pair_space`` applies it.
    layers: the blocks a pair for several layers reads (``extraction.layers``, nla's key), in increasing
        order, ``layer_index`` then the deepest (the AR keeps blocks 0..K); its templates name the block
        as ``{layer}`` and :meth:`av_messages` / :meth:`ar_text` fill it in per row. None: one block,
        ``layer_index`` (the published layout).
    layer_norms: per block of ``layers``, the median norm of the training rows' raw vectors
        (``extraction.layer_norms``; the scales differ by block, and the injection and the metric
        rescale every vector, so this is a record, not a setting).
    layer_offsets: per block of ``layers``, the vector subtracted from that block's raw outputs
        (``extraction.layer_offsets``, nla's key: the mean of the block's training rows for a ``center:
        true`` dataset of several blocks, whose blocks' means differ); ``to_pair_space`` applies each
        row's block's. Never with ``vector_offset``.

    The AV fields come all together or not at all, the AR fields likewise. Role "av" needs the AV
    fields, role "ar" the AR fields, a dataset both; a model sidecar without a role needs one set.
    """

    kind: str
    role: str | None
    d_model: int
    layer_index: int | None = None
    injection_char: str | None = None
    injection_token_id: int | None = None
    injection_left_neighbor_id: int | None = None
    injection_right_neighbor_id: int | None = None
    critic_suffix_ids: tuple[int, ...] | None = None
    av_template: str | None = None
    ar_template: str | None = None
    injection_scale: float | str | None = None
    mse_scale: float | str | None = SQRT_D_MODEL
    base_model: str | None = None
    training: dict = field(default_factory=dict, hash=False)
    model_base: str | None = None
    model_width: int | None = None
    injection_adapter: dict | None = field(default=None, hash=False)
    vector_offset: tuple[float, ...] | None = field(default=None, hash=False)
    layers: tuple[int, ...] | None = None
    layer_norms: dict | None = field(default=None, hash=False)
    layer_offsets: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"NLAConfig.kind: expected one of {KINDS}, found {self.kind!r}")
        if self.role not in ROLES:
            raise ValueError(f"NLAConfig.role: expected 'av', 'ar' or None, found {self.role!r}")
        if isinstance(self.d_model, bool) or not isinstance(self.d_model, int) or self.d_model < 1:
            raise ValueError(f"NLAConfig.d_model: expected a positive int, found {self.d_model!r}")
        for name in ("layer_index", "injection_token_id", "injection_left_neighbor_id",
                     "injection_right_neighbor_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"NLAConfig.{name}: expected a non-negative int, found {value!r}")
        self._check_groups()
        self._check_layers()
        if self.has_av_fields:
            if not isinstance(self.injection_char, str) or not self.injection_char:
                raise ValueError(
                    f"NLAConfig.injection_char: expected a non-empty string, found {self.injection_char!r}")
            _check_template("av_template", self.av_template, "injection_char", self.layers)
        if self.has_ar_fields:
            suffix = self.critic_suffix_ids
            if isinstance(suffix, (str, bytes)) or not isinstance(suffix, Sequence):
                raise ValueError(f"NLAConfig.critic_suffix_ids: expected a list of token ids, found {suffix!r}")
            suffix = tuple(suffix)
            if not suffix or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in suffix):
                raise ValueError(
                    f"NLAConfig.critic_suffix_ids: expected a non-empty list of non-negative ints, found "
                    f"{list(suffix)!r}"
                )
            object.__setattr__(self, "critic_suffix_ids", suffix)
            _check_template("ar_template", self.ar_template, "explanation", self.layers)
            if not self.ar_template.split("{explanation}")[-1].strip():
                raise ValueError(
                    f"NLAConfig.ar_template: needs a constant tail after {{explanation}} (the AR reads its prediction "
                    f"at the tail's last token), found {self.ar_template!r}"
                )
        for name in ("injection_scale", "mse_scale"):
            try:
                resolve_scale(getattr(self, name), self.d_model)
            except ValueError as err:
                raise ValueError(f"NLAConfig.{name}: {err}") from None
        if not isinstance(self.training, Mapping):
            raise ValueError(f"NLAConfig.training: expected a mapping, found {type(self.training).__name__}")
        object.__setattr__(self, "training", dict(self.training))
        self._check_own_model()
        self._check_offset()

    def _check_layers(self) -> None:
        layers = self.layers
        if layers is None:
            for name in ("layer_norms", "layer_offsets"):
                if getattr(self, name) is not None:
                    raise ValueError(f"NLAConfig.{name} (extraction.{name}): recorded only with "
                                     "extraction.layers; found it without")
            return
        if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
            raise ValueError(f"NLAConfig.layers (extraction.layers): expected a list of blocks, found {layers!r}")
        layers = tuple(layers)
        if (len(layers) < 2 or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in layers)
                or list(layers) != sorted(set(layers))):
            raise ValueError(f"NLAConfig.layers (extraction.layers): expected two or more distinct blocks >= 0 in "
                             f"increasing order, found {list(layers)!r}")
        if self.layer_index is not None and self.layer_index != layers[-1]:
            raise ValueError(f"NLAConfig.layer_index: expected the deepest of extraction.layers ({layers[-1]}: the "
                             f"AR keeps blocks 0..{layers[-1]}), found {self.layer_index}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "layer_index", layers[-1])
        norms = self.layer_norms
        if norms is not None:
            if not isinstance(norms, Mapping) or sorted(int(k) for k in norms) != list(layers) or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                    for v in norms.values()):
                raise ValueError(f"NLAConfig.layer_norms (extraction.layer_norms): expected a positive number for "
                                 f"each block of {list(layers)}, found {norms!r}")
            object.__setattr__(self, "layer_norms", {int(k): float(v) for k, v in norms.items()})

    def check_layer(self, layer: int | None, purpose: str) -> int | None:
        """The block a vector comes from, checked against what the pair reads: one of ``layers`` for a pair
        of several (required: the prompts name it), ``layer_index`` or None for a pair of one. A
        :class:`SidecarError` naming the blocks otherwise (a vector of a block the pair was not trained
        on is never verbalized silently)."""
        if self.layers is None:
            if layer is not None and self.layer_index is not None and layer != self.layer_index:
                raise SidecarError(
                    f"{purpose}: block {layer} was asked for, but this pair reads block {self.layer_index} only "
                    f"(extraction.layer_index); give vectors of block {self.layer_index}, or use a pair trained on "
                    f"block {layer}")
            return layer
        if layer is None:
            raise SidecarError(
                f"{purpose}: this pair reads several blocks ({list(self.layers)}, extraction.layers) and its prompts "
                "name the block; say which block each vector comes from (layer=...)")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.layers:
            raise SidecarError(
                f"{purpose}: block {layer!r} is not one this pair was trained on (extraction.layers: "
                f"{list(self.layers)}); give vectors of one of those blocks")
        return layer

    def _fill_layer(self, template: str, layer: int | None, purpose: str) -> str:
        """``template`` with ``{layer}`` filled in: the block zero-padded to the deepest one's digits (03 and 10),
        so that where a tokenizer reads digits one at a time every block's prompt has one length."""
        layer = self.check_layer(layer, purpose)
        if self.layers is None:
            return template
        return template.replace("{layer}", str(layer).zfill(len(str(self.layers[-1]))))

    def _check_offset(self) -> None:
        if self.vector_offset is not None:
            object.__setattr__(self, "vector_offset", self._offset_numbers(self.vector_offset, "vector_offset"))
        offsets = self.layer_offsets
        if offsets is None:
            return
        if self.vector_offset is not None:
            raise ValueError("NLAConfig.layer_offsets (extraction.layer_offsets): one offset a block, or "
                             "vector_offset, one for every row; found both")
        if not isinstance(offsets, Mapping) or sorted(int(k) for k in offsets) != list(self.layers):
            keys = sorted(offsets) if isinstance(offsets, Mapping) else type(offsets).__name__
            raise ValueError(f"NLAConfig.layer_offsets (extraction.layer_offsets): expected an offset for each block "
                             f"of {list(self.layers)}, found {keys}")
        object.__setattr__(self, "layer_offsets", {
            int(k): self._offset_numbers(v, f"layer_offsets[{k}]") for k, v in sorted(offsets.items(), key=lambda kv: int(kv[0]))})

    def _offset_numbers(self, off: Any, name: str) -> tuple[float, ...]:
        key = name.replace("[", ".").rstrip("]")
        if isinstance(off, (str, bytes, Mapping)) or not isinstance(off, Sequence):
            raise ValueError(f"NLAConfig.{name} (extraction.{key}): expected a list of {self.d_model} numbers, found "
                             f"{type(off).__name__}")
        off = tuple(off)
        if len(off) != self.d_model:
            raise ValueError(f"NLAConfig.{name} (extraction.{key}): expected {self.d_model} numbers (d_model), found "
                             f"{len(off)}")
        bad = [i for i, v in enumerate(off) if isinstance(v, bool) or not isinstance(v, (int, float))
               or not math.isfinite(v)]
        if bad:
            raise ValueError(f"NLAConfig.{name} (extraction.{key}): entry {bad[0]} is {off[bad[0]]!r}; expected finite "
                             "numbers")
        return tuple(float(v) for v in off)

    @property
    def centred(self) -> bool:
        """True when the pair reads its vectors minus an offset (``vector_offset`` or ``layer_offsets``)."""
        return self.vector_offset is not None or self.layer_offsets is not None

    def _offsets_for(self, like: Any, layer: Any, purpose: str) -> Any:
        """The offsets to subtract from ``like`` ([..., d_model], a tensor or an array) in its type, dtype and
        device: ``vector_offset``, or per row the ``layer_offsets`` entry of its block (``layer``: one block
        for every row, or a sequence of blocks, one per row of ``like``'s first dimension). None: no offset."""
        import numpy as np

        if hasattr(layer, "tolist"):  # a NumPy or torch integer, or an array of them: plain ints
            layer = layer.tolist()
        if self.layer_offsets is None:
            if self.vector_offset is None:
                return None
            off = np.asarray(self.vector_offset, dtype=np.float64)
        elif layer is None or isinstance(layer, int):
            off = np.asarray(self.layer_offsets[self.check_layer(layer, purpose)])
        else:
            blocks = list(layer)
            rows = like.shape[0] if like.ndim > 1 else None
            if rows != len(blocks):
                raise SidecarError(f"{purpose}: layer gives {len(blocks)} blocks for {rows if rows is not None else 'one'} "
                                   f"vector(s); give one block for every vector, or one block for all")
            table = {k: np.asarray(v) for k, v in self.layer_offsets.items()}
            off = np.stack([table[self.check_layer(k, purpose)] for k in blocks]) if blocks else np.zeros(
                (0, self.d_model))
            off = off.reshape(off.shape[:1] + (1,) * (like.ndim - 2) + off.shape[1:])
        if isinstance(like, np.ndarray):
            return off.astype(like.dtype)
        import torch

        return torch.as_tensor(off, dtype=like.dtype, device=like.device)

    def to_pair_space(self, raw: Any, layer: Any = None) -> Any:
        """The subject's raw block outputs ([..., d_model], a tensor or an array) as the pair reads
        them: minus ``vector_offset`` when the sidecar records one, minus each row's block's
        ``layer_offsets`` entry for a pair of several blocks centred a block at a time (``layer``: the
        block of every row, or one block a row), unchanged otherwise."""
        off = self._offsets_for(raw, layer, "to_pair_space")
        return raw if off is None else raw - off

    def from_pair_space(self, vectors: Any, layer: Any = None) -> Any:
        """The inverse of ``to_pair_space``: vectors as the pair reads them back in the subject's raw
        space (plus the offset; unchanged when the sidecar records none)."""
        off = self._offsets_for(vectors, layer, "from_pair_space")
        return vectors if off is None else vectors + off

    def _check_own_model(self) -> None:
        w = self.model_width
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"NLAConfig.model_width (model.hidden_size): expected a positive int, found {w!r}")
        if self.model_base is not None and not isinstance(self.model_base, str):
            raise ValueError(f"NLAConfig.model_base (model.base_model): expected a path or name, found {self.model_base!r}")
        a = self.injection_adapter
        if a is None:
            return
        if not isinstance(a, Mapping):
            raise ValueError(f"NLAConfig.injection_adapter: expected a mapping {{kind, d_in, d_out, file}}, found {a!r}")
        if a.get("kind") != "affine":
            raise ValueError(f"NLAConfig.injection_adapter.kind: expected 'affine', found {a.get('kind')!r}")
        expect = {"d_in": self.d_model, "d_out": self.own_width}
        for key, want in expect.items():
            if a.get(key) != want:
                raise ValueError(
                    f"NLAConfig.injection_adapter.{key}: expected {want} (d_in: the subject's d_model, d_out: the AV's "
                    f"own width, model.hidden_size or d_model), found {a.get(key)!r}; the sidecar does not describe "
                    "one checkpoint")
        if not isinstance(a.get("file"), str) or not a["file"]:
            raise ValueError(f"NLAConfig.injection_adapter.file: expected a file name, found {a.get('file')!r}")
        for flag in ("mean_invariant", "conformal"):
            if not isinstance(a.get(flag, False), bool):
                raise ValueError(f"NLAConfig.injection_adapter.{flag}: expected true or false (absent: false), "
                                 f"found {a.get(flag)!r}")
        if a.get("conformal", False) and a.get("d_in") != a.get("d_out"):
            raise ValueError(f"NLAConfig.injection_adapter.conformal: true needs d_in == d_out (a gain times a "
                             f"rotation), found d_in {a.get('d_in')} and d_out {a.get('d_out')}")
        object.__setattr__(self, "injection_adapter", dict(a))

    def _check_groups(self) -> None:
        for label, names in (("AV", AV_FIELDS), ("AR", AR_FIELDS)):
            given = [n for n in names if getattr(self, n) is not None]
            if given and len(given) != len(names):
                missing = [_KEY_OF[n] for n in names if getattr(self, n) is None]
                raise ValueError(
                    f"NLAConfig: the {label} fields come together; found {', '.join(_KEY_OF[n] for n in given)} "
                    f"but not {', '.join(missing)}. Complete the sidecar or drop the {label} fields"
                )
        needed = {"av": ("AV",), "ar": ("AR",)}.get(self.role, ("AV", "AR") if self.kind == "nla_dataset" else ())
        for label in needed:
            if not (self.has_av_fields if label == "AV" else self.has_ar_fields):
                names = AV_FIELDS if label == "AV" else AR_FIELDS
                what = f"role {self.role!r}" if self.role else f"kind {self.kind!r}"
                raise ValueError(
                    f"NLAConfig: a sidecar of {what} needs the {label} fields ({', '.join(_KEY_OF[n] for n in names)}); "
                    "found none. Use the sidecar written with the checkpoint or dataset"
                )
        if self.kind == "nla_model" and self.role is None and not (self.has_av_fields or self.has_ar_fields):
            raise ValueError(
                "NLAConfig: a model sidecar needs the AV fields (tokens.injection_*, prompt_templates.av) or the AR "
                "fields (tokens.critic_suffix_ids, prompt_templates.ar); found neither"
            )

    # -- what each use needs ------------------------------------------------------------------------
    @property
    def has_av_fields(self) -> bool:
        return any(getattr(self, n) is not None for n in AV_FIELDS)

    @property
    def has_ar_fields(self) -> bool:
        return any(getattr(self, n) is not None for n in AR_FIELDS)

    def need_av(self, purpose: str) -> NLAConfig:
        """``self`` if it carries the AV fields (injection marker, AV template); else a :class:`SidecarError`."""
        return self._need_fields(purpose, "AV", AV_FIELDS, "verbalizer")

    def need_ar(self, purpose: str) -> NLAConfig:
        """``self`` if it carries the AR fields (AR template and its tail ids); else a :class:`SidecarError`."""
        return self._need_fields(purpose, "AR", AR_FIELDS, "reconstructor")

    def _need_fields(self, purpose: str, group: str, fields: tuple[str, ...], owner: str) -> NLAConfig:
        if not any(getattr(self, n) is not None for n in fields):
            raise SidecarError(
                f"{purpose} needs the {group} fields of a sidecar ({', '.join(_KEY_OF[n] for n in fields)}), but this "
                f"sidecar (kind {self.kind!r}, role {self.role!r}) has none; use the {owner}'s own sidecar"
            )
        return self

    def need_layer(self, purpose: str) -> int:
        """K, for the uses that need it (extraction, building an AR from a base model)."""
        if self.layer_index is None:
            raise SidecarError(
                f"{purpose} needs the extraction layer K, but this sidecar (kind {self.kind!r}, role {self.role!r}) "
                "records none (extraction.layer_index, or ar.num_hidden_layers in an AR sidecar); set it "
                "explicitly (e.g. --set layer_index=K) or use the dataset's sidecar"
            )
        return self.layer_index

    # -- derived values ---------------------------------------------------------------------------
    @property
    def own_width(self) -> int:
        """The checkpoint's own hidden size: ``model_width`` for a cross-model pair, else ``d_model``."""
        return self.model_width if self.model_width is not None else self.d_model

    def injection_scale_value(self) -> float | None:
        return resolve_scale(self.injection_scale, self.d_model)

    def mse_scale_value(self) -> float | None:
        return resolve_scale(self.mse_scale, self.d_model)

    def av_messages(self, placeholder: str | None = None, layer: int | None = None) -> list[dict]:
        """The canonical AV chat messages; ``placeholder`` (e.g. ``"<INJECT>"``) replaces the marker;
        ``layer``: the block the vector comes from (a pair of several blocks names it in the prompt)."""
        self.need_av("the AV prompt")
        marker = placeholder or self.injection_char
        template = self._fill_layer(self.av_template, layer, "the AV prompt")
        return [{"role": "user", "content": template.format(injection_char=marker)}]

    def ar_text(self, explanation: str, layer: int | None = None) -> str:
        """The AR's input for ``explanation``; ``layer`` as in :meth:`av_messages`."""
        self.need_ar("the AR text")
        return self._fill_layer(self.ar_template, layer, "the AR text").format(explanation=explanation)

    def ar_text_layer(self, text: str) -> int:
        """The block an AR text of this pair of several blocks names: the one ``k`` of ``layers`` whose
        ``ar_text(..., layer=k)`` begins and ends as ``text`` does (the inverse of :meth:`ar_text`; an AR
        reading each row at its own block takes it from the texts it is given)."""
        if self.layers is None:
            raise ValueError("ar_text_layer: this pair reads one block (no extraction.layers); its AR texts name none")
        self.need_ar("the AR text's block")
        found = []
        for k in self.layers:
            head, _, tail = self.ar_text("\x00", layer=k).partition("\x00")
            if len(text) >= len(head) + len(tail) and text.startswith(head) and text.endswith(tail):
                found.append(k)
        if len(found) != 1:
            raise ValueError(f"ar_text_layer: {text[:80]!r} is {'no' if not found else 'more than one'} block's AR text "
                             f"of this pair (template {self.ar_template!r}, blocks {list(self.layers)}); give texts "
                             "made by NLAConfig.ar_text(explanation, layer=k)")
        return found[0]

    def replace(self, **kw: Any) -> NLAConfig:
        return dataclasses.replace(self, **kw)

    # -- construction from a live tokenizer -----------------------------------------------------
    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        kind: str,
        role: str | None,
        d_model: int,
        layer_index: int | None,
        av_template: str,
        ar_template: str,
        injection_char: str,
        injection_scale: float | str | None,
        mse_scale: float | str | None = SQRT_D_MODEL,
        base_model: str | None = None,
        training: dict | None = None,
        layers: Sequence[int] | None = None,
        layer_norms: Mapping[int, float] | None = None,
    ) -> NLAConfig:
        """Build a config whose token ids are computed from ``tokenizer``, then verify it."""
        draft = dict(
            kind=kind, role=role, d_model=d_model, layer_index=layer_index, injection_char=injection_char,
            av_template=av_template, ar_template=ar_template, injection_scale=injection_scale,
            mse_scale=mse_scale, base_model=base_model, training=dict(training or {}),
            layers=None if layers is None else tuple(layers), layer_norms=None if layer_norms is None else dict(layer_norms),
        )
        cfg = cls(**derive_token_ids(tokenizer, injection_char, av_template, ar_template), **draft)
        verify_tokenizer(cfg, tokenizer)
        return cfg


def _check_template(name: str, template: Any, key: str, layers: Sequence[int] | None = None) -> None:
    if not isinstance(template, str) or "{" + key + "}" not in template:
        raise ValueError(f"NLAConfig.{name}: expected a string containing {{{key}}}, found {template!r}")
    if template.count("{" + key + "}") != 1:
        raise ValueError(f"NLAConfig.{name}: {{{key}}} must appear exactly once, found {template!r}")
    if layers is not None and template.count("{layer}") != 1:
        raise ValueError(f"NLAConfig.{name}: a pair of several blocks (extraction.layers {list(layers)}) names the "
                         f"block in its prompts: {{layer}} must appear exactly once, found {template!r}")
    if layers is None and "{layer}" in template:
        raise ValueError(f"NLAConfig.{name}: {{layer}} names the block of a pair of several blocks, but the sidecar "
                         f"records no extraction.layers; found {template!r}")
    try:
        template.replace("{layer}", "0").format(**{key: "x"})
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"NLAConfig.{name}: the template has braces other than {{{key}}} ({err!r}); double literal braces "
            f"as {{{{ and }}}}. Found {template!r}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Re-deriving a sidecar's token ids (nla sidecar fix-tokens)
# ---------------------------------------------------------------------------------------------
def token_id_changes(path: str | os.PathLike, tokenizer: Any) -> dict[str, tuple[Any, Any]]:
    """``{written key: (recorded, derived)}`` for every token id the sidecar of ``path`` records that
    ``tokenizer`` now gives another value (``{}``: the sidecar matches the tokenizer)."""
    cfg = load_sidecar(path)
    derived = derive_token_ids(tokenizer, cfg.injection_char if cfg.has_av_fields else None,
                               cfg.av_template if cfg.has_av_fields else None,
                               cfg.ar_template if cfg.has_ar_fields else None)
    changes = {}
    if "critic_suffix_ids" in derived:
        checked = checked_ar_suffix(cfg, tokenizer)
        if tuple(derived["critic_suffix_ids"])[-len(checked):] == checked:
            del derived["critic_suffix_ids"]  # the recorded tail holds where it can (a published longer one)
    for name, new in derived.items():
        old = getattr(cfg, name)
        if (list(old) if isinstance(old, tuple) else old) != (list(new) if isinstance(new, tuple) else new):
            changes[_KEY_OF[name]] = (list(old) if isinstance(old, tuple) else old,
                                      list(new) if isinstance(new, tuple) else new)
    return changes


def rewrite_token_ids(path: str | os.PathLike, changes: Mapping[str, tuple[Any, Any]]) -> Path:
    """Write ``changes`` (from ``token_id_changes``) into the sidecar of ``path``: only those keys
    change, every other key and its order stay as written (comments are not kept: PyYAML drops
    them); the previous file is kept beside it as ``<name>.bak``. Returns the sidecar path."""
    import shutil

    side = sidecar_path_for(path)
    doc = load_yaml(side, "sidecar")  # a repeated key is refused here too
    for key, (_old, new) in changes.items():
        node = doc
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = new
    shutil.copy2(side, side.with_name(side.name + ".bak"))
    from nla.util.fsutil import write_text_atomic

    write_text_atomic(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, default_flow_style=None), side)
    return side


# ---------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------
INJECTION_ADAPTER_FILE = "nla_injection_adapter.safetensors"  # the AV's adapter file (nla.core.injection)


def _check_adapter_named(file: Path, doc: Mapping) -> None:
    """An AV checkpoint dir holding the injection adapter file needs the block that names it: without
    it every loader would read the AV without its adapter, silently (issue 48)."""
    if file.name != SIDECAR_NAME or doc.get("injection_adapter") is not None or doc.get("kind") != "nla_model":
        return
    if doc.get("role") in ("ar", "critic") or not (file.parent / INJECTION_ADAPTER_FILE).exists():
        return
    raise SidecarError(
        f"{file}: no injection_adapter block, but {file.parent / INJECTION_ADAPTER_FILE} is there; the AV would "
        "load without the adapter it was trained with. Use the sidecar saved with this checkpoint, or restore its "
        f"injection_adapter block (kind: affine, d_in, d_out, file: {INJECTION_ADAPTER_FILE})")


def sidecar_path_for(path: str | os.PathLike) -> Path:
    """Where the sidecar of ``path`` lives: ``dir/nla_meta.yaml`` or ``x.parquet.nla_meta.yaml``."""
    p = Path(path)
    if p.is_dir():
        return p / SIDECAR_NAME
    if p.suffix == ".parquet":
        return p.with_name(p.name + "." + SIDECAR_NAME)
    if p.suffix in (".yaml", ".yml"):
        return p
    # Anything else names a checkpoint directory, possibly one not written yet.
    return p / SIDECAR_NAME


_MISSING = object()


def _lookup(doc: Mapping, *paths: tuple[str, ...]) -> Any:
    for path in paths:
        node: Any = doc
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                node = _MISSING
                break
            node = node[key]
        if node is not _MISSING:
            return node
    return _MISSING


def load_sidecar(path: str | os.PathLike) -> NLAConfig:
    """Read a sidecar file, a checkpoint dir's ``nla_meta.yaml`` or a parquet's ``{file}.nla_meta.yaml``."""
    file = sidecar_path_for(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"no NLA sidecar at {str(file)!r} (looked for it from {str(path)!r}); write one with "
            "nla.core.sidecar.write_sidecar or pass the sidecar path explicitly"
        )
    try:
        doc = load_yaml(file, "sidecar")
    except InputError as err:
        raise SidecarError(str(err)) from None
    if not isinstance(doc, Mapping):
        raise SidecarError(f"{file}: expected a YAML mapping at the top level, found {type(doc).__name__}")
    _check_template_digests(doc, file)
    _check_adapter_named(file, doc)

    def need(name: str, *paths: tuple[str, ...]) -> Any:
        value = _lookup(doc, *paths)
        if value is _MISSING:
            where = " or ".join(".".join(p) for p in paths)
            raise SidecarError(f"{file}: missing required key {where} ({name}); the sidecar is incomplete")
        return value

    role = _lookup(doc, ("role",))
    role = None if role is _MISSING else role
    if role == "critic":  # the published system's name for the AR (its inference client accepts both)
        role = "ar"
    scale = _lookup(doc, ("extraction", "injection_scale"), ("injection_scale",))
    has_av = _lookup(doc, ("tokens", "injection_char")) is not _MISSING
    if scale is _MISSING:
        if role != "ar" and has_av:  # the AR never injects, so its sidecar may leave the scale out
            need("injection_scale", ("extraction", "injection_scale"), ("injection_scale",))
        scale = None
    mse_scale = _lookup(doc, ("extraction", "mse_scale"), ("mse_scale",))
    base = _lookup(doc, ("extraction", "base_model"), ("base_model",))
    training = _lookup(doc, ("training",))

    def opt(*paths: tuple[str, ...]) -> Any:
        value = _lookup(doc, *paths)
        return None if value is _MISSING else value

    av_template = opt(("prompt_templates", "av"), ("prompt_templates", "actor"))
    # The published writer puts the shared tokens block (the injection marker and its
    # neighbours) in every sidecar, the critic's too, which has no AV template: an AR never
    # injects, so there the marker fields are read as absent (nla writes such an AR back in the
    # documented AR-only layout).
    marker = (lambda key: None) if role == "ar" and av_template is None else (lambda key: opt(("tokens", key)))

    try:
        return NLAConfig(
            kind=need("kind", ("kind",)),
            role=role,
            d_model=need("d_model", ("d_model",), ("extraction", "d_model")),
            layer_index=_layer_of(doc, file),
            injection_char=marker("injection_char"),
            injection_token_id=marker("injection_token_id"),
            injection_left_neighbor_id=marker("injection_left_neighbor_id"),
            injection_right_neighbor_id=marker("injection_right_neighbor_id"),
            critic_suffix_ids=opt(("tokens", "critic_suffix_ids")),
            av_template=av_template,
            ar_template=opt(("prompt_templates", "ar"), ("prompt_templates", "critic")),
            injection_scale=scale,
            mse_scale=SQRT_D_MODEL if mse_scale is _MISSING else mse_scale,
            base_model=None if base is _MISSING else base,
            training={} if training is _MISSING or training is None else training,
            model_base=opt(("model", "base_model")),
            model_width=opt(("model", "hidden_size")),
            injection_adapter=opt(("injection_adapter",)),
            vector_offset=opt(("extraction", "vector_offset")),
            layers=opt(("extraction", "layers")),
            layer_norms=opt(("extraction", "layer_norms")),
            layer_offsets=opt(("extraction", "layer_offsets")),
        )
    except SidecarError:
        raise
    except ValueError as err:
        raise SidecarError(f"{file}: {err}") from None


# Keys that record K directly, then the keys of the AR's depth (published: = K as well).
_LAYER_KEYS = (("extraction", "layer_index"), ("critic", "extraction_layer_index"), ("layer_index",))
_AR_DEPTH_KEYS = (("ar", "num_hidden_layers"), ("critic", "num_hidden_layers"))


def _layer_of(doc: Mapping, file: Path) -> int | None:
    """K from the first key that records it; None when the sidecar records no layer."""

    def as_int(path: tuple[str, ...], value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SidecarError(f"{file}: {'.'.join(path)}: expected a non-negative int (the layer K), found {value!r}")
        return value

    direct = [(p, as_int(p, v)) for p in _LAYER_KEYS if (v := _lookup(doc, p)) is not _MISSING]
    depth = [(p, as_int(p, v)) for p in _AR_DEPTH_KEYS if (v := _lookup(doc, p)) is not _MISSING]
    if len({v for _, v in direct}) > 1:
        found = ", ".join(f"{'.'.join(p)} = {v}" for p, v in direct)
        raise SidecarError(f"{file}: the sidecar records two different layers ({found}); keep the right one")
    if direct:
        k = direct[0][1]
        for p, v in depth:
            # K is what the published AR sidecars record; K+1 is what nla wrote before following them.
            if v not in (k, k + 1):
                raise SidecarError(
                    f"{file}: {'.'.join(p)} = {v} disagrees with {'.'.join(direct[0][0])} = {k} (expected {k}, "
                    "the extraction layer); the sidecar does not describe one checkpoint, fix it"
                )
        return k
    if len({v for _, v in depth}) > 1:
        found = ", ".join(f"{'.'.join(p)} = {v}" for p, v in depth)
        raise SidecarError(f"{file}: the sidecar records two different layers ({found}); keep the right one")
    return depth[0][1] if depth else None


def _plain(value: Any) -> Any:
    """Turn provenance values into YAML-safe builtins (paths, tuples, numpy scalars)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def sidecar_document(cfg: NLAConfig, **provenance: Any) -> dict:
    """The published-layout mapping for ``cfg`` (what :func:`write_sidecar` dumps)."""
    doc: dict[str, Any] = {"kind": cfg.kind}
    if cfg.role is not None:
        doc["role"] = cfg.role
    extraction: dict[str, Any] = {}
    if cfg.kind == "nla_model":
        doc["d_model"] = cfg.d_model
    else:
        extraction["d_model"] = cfg.d_model
    if cfg.base_model is not None:
        extraction["base_model"] = cfg.base_model
    if cfg.layer_index is not None:
        extraction["layer_index"] = cfg.layer_index
    # Numbers, never the symbol "sqrt_d_model" (which stays a valid input): the published readers
    # convert both scales with float(), and their released sidecars hold numbers (150, 59.87).
    extraction.update(injection_scale=cfg.injection_scale_value(), mse_scale=cfg.mse_scale_value())
    if cfg.vector_offset is not None:  # nla's key (the published readers ignore it): docs/serve.md
        extraction["vector_offset"] = list(cfg.vector_offset)
    if cfg.layers is not None:  # nla's keys: a pair of several blocks (one block: the published layout)
        extraction["layers"] = list(cfg.layers)
        if cfg.layer_norms is not None:
            extraction["layer_norms"] = {int(k): float(v) for k, v in sorted(cfg.layer_norms.items())}
        if cfg.layer_offsets is not None:
            extraction["layer_offsets"] = {int(k): list(v) for k, v in sorted(cfg.layer_offsets.items())}
    doc["extraction"] = extraction
    tokens: dict[str, Any] = {}
    templates: dict[str, Any] = {}
    if cfg.has_av_fields:
        tokens.update(
            injection_char=cfg.injection_char,
            injection_token_id=cfg.injection_token_id,
            injection_left_neighbor_id=cfg.injection_left_neighbor_id,
            injection_right_neighbor_id=cfg.injection_right_neighbor_id,
        )
        templates["av"] = cfg.av_template
    if cfg.has_ar_fields:
        tokens["critic_suffix_ids"] = list(cfg.critic_suffix_ids)
        templates["ar"] = cfg.ar_template
    doc["tokens"] = tokens
    doc["prompt_templates"] = templates
    # Not in the published layout (readers ignore unknown keys): catches a template edited after
    # training, which the token checks miss whenever the marker's neighbours stay the same.
    doc["prompt_template_sha256"] = {k: template_digest(v) for k, v in templates.items()}
    if cfg.role == "ar" and cfg.layer_index is not None:
        doc["ar"] = {"num_hidden_layers": cfg.layer_index}  # K, as the published AR sidecars record it
    # nla's keys for a cross-model pair (the published layout has none; its readers ignore them).
    own = {k: v for k, v in (("base_model", cfg.model_base), ("hidden_size", cfg.model_width)) if v is not None}
    if own:
        doc["model"] = own
    if cfg.injection_adapter is not None:
        doc["injection_adapter"] = dict(cfg.injection_adapter)
    doc["training"] = _plain({**cfg.training, **provenance})
    return doc


def template_digest(template: str) -> str:
    """First 16 hex digits of the template's SHA-256 (what ``prompt_template_sha256`` records)."""
    import hashlib

    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def _check_template_digests(doc: Mapping, file: Path) -> None:
    digests = _lookup(doc, ("prompt_template_sha256",))
    if not isinstance(digests, Mapping):
        return  # written by another tool, or before nla recorded digests
    for role in ("av", "ar"):
        template = _lookup(doc, ("prompt_templates", role))
        if role in digests and isinstance(template, str) and template_digest(template) != digests[role]:
            raise SidecarError(
                f"{file}: prompt_templates.{role} was edited after this sidecar was written (its SHA-256 starts "
                f"{template_digest(template)}, the sidecar recorded {digests[role]}); the model was trained on the "
                "recorded template. Restore it, or delete prompt_template_sha256 if the change is deliberate"
            )


def write_sidecar(path: str | os.PathLike, cfg: NLAConfig, **provenance: Any) -> Path:
    """Write ``cfg`` (provenance merged into ``training``) atomically; returns the file written.

    ``path`` may be the sidecar file itself, a checkpoint dir or a parquet path.
    """
    p = Path(path)
    file = sidecar_path_for(p)
    text = yaml.safe_dump(sidecar_document(cfg, **provenance), sort_keys=False, allow_unicode=True)
    return write_text_atomic(text, file)


def resolve_sidecar(
    explicit: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    dataset: str | os.PathLike | None = None,
) -> NLAConfig:
    """Pick the sidecar that applies: explicit path > the checkpoint's own > the dataset's.

    An explicit path that does not exist is an error (not a silent fall-through).
    """
    if explicit is not None:
        return load_sidecar(explicit)
    tried: list[str] = []
    for label, source in (("checkpoint", checkpoint), ("dataset", dataset)):
        if source is None:
            continue
        file = sidecar_path_for(source)
        if file.is_file():
            logger.info("using the %s sidecar %s", label, file)
            return load_sidecar(file)
        tried.append(f"{label}: {file}")
    raise FileNotFoundError(
        "no NLA sidecar found; tried "
        + ("; ".join(tried) if tried else "nothing (no explicit, checkpoint or dataset path given)")
        + ". Pass the sidecar path explicitly or write one with nla.core.sidecar.write_sidecar"
    )
