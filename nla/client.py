"""``NLAClient``: the one code path that verbalizes, reconstructs and scores (docs/design.md §6).

Notation: N vectors (or texts), d = ``d_model``.

The client wraps an AV checkpoint (vector -> text), an AR checkpoint (text -> vector), or
both, with the sidecar that tells how to use them. It reuses the RL loop's pieces rather
than copying them, so what the client measures is what training optimised:

1. Generation is ``nla.rl.roles.RolloutWorker.generate``: injection through the hook, the
   marker token suppressed, EOS handling, decoding with special tokens kept.
2. Reconstruction tokenises like AR training (``nla.core.reconstructor.tokenize_ar_texts``: right
   padding, left truncation so the AR template's tail survives) and reads the prediction at
   the last real token (``Reconstructor.predict``).
3. Scores use the AR sidecar's ``mse_scale`` (``nla.core.vectors.mse_nrm``), like the RL reward.

A sample without a usable explanation (missing tags, truncated response) has no
prediction: ``ScoreResult`` marks it ``failed`` with NaN scores, and callers that need a
number for it (``nla.eval.evaluate``) use :func:`failed_mse`, the MSE of an orthogonal
prediction, the same convention as ``FAILED_EXTRACTION_REWARD``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from nla.core import arch
from nla.core.injection import get_adapter
from nla.core.provenance import Provenance, check_provenance
from nla.core.reconstructor import VALUE_HEAD_FILE, Reconstructor, tokenize_ar_texts
from nla.core.reward import Status, charge_failures, failed_mse
from nla.core.sidecar import SIDECAR_NAME, NLAConfig, load_sidecar
from nla.core.sidecar_errors import SidecarError
from nla.core.token_ids import verify_tokenizer
from nla.core.vectors import cosine, mse_nrm
from nla.util.checkpoint_files import check_checkpoint
from nla.util.threads import adapt_threads
from nla.util.validation import check_sample_count, check_sampling, check_vectors

logger = logging.getLogger(__name__)

__all__ = [
    "STATUSES",
    "BlockView",
    "NLAClient",
    "NLAClientError",
    "ScoreResult",
    "Verbalization",
    "failed_mse",
    "load_vectors",
]

# The sample statuses (``nla.core.reward.Status``, a str enum: ``Status.COMPLETED == "completed"``).
COMPLETED, TRUNCATED, FAILED = Status.COMPLETED, Status.TRUNCATED, Status.FAILED
STATUSES = tuple(Status)


class NLAClientError(ValueError):
    """The client cannot do what was asked with what it was given; the message names the fix."""


@dataclass(frozen=True)
class Verbalization:
    """One AV sample.

    text: the decoded response (special tokens kept, cut at EOS).
    explanation: the text between the explanation tags, or None (missing tags or truncated).
    status: "completed" (explanation extracted), "truncated" (no EOS within ``max_new_tokens``)
        or "failed" (ended but the tags could not be parsed).
    row: index of the input vector this sample explains (samples of one vector are contiguous).
    mse_nrm: the AR's round-trip error of this sample when ``verbalize(best_of=N)`` chose it by that
        (its failed samples charged as in scoring), else None.
    """

    text: str
    explanation: str | None
    status: Status
    row: int
    mse_nrm: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"row": self.row, "status": str(self.status), "explanation": self.explanation, "text": self.text}
        if self.mse_nrm is not None:
            out["mse_nrm"] = self.mse_nrm
        return out


@dataclass(frozen=True)
class ScoreResult:
    """Per-sample reconstruction scores.

    mse_nrm: [N] ``mse_nrm`` at the AR's ``mse_scale``; NaN where ``failed``.
    cosine: [N] cosine(prediction, gold); NaN where ``failed``.
    failed: [N] bool, True where there was no explanation to reconstruct.
    predictions: [N, d] AR predictions (fp32, CPU); NaN rows where ``failed``.
    """

    mse_nrm: Tensor
    cosine: Tensor
    failed: Tensor
    predictions: Tensor

    @property
    def n(self) -> int:
        return int(self.mse_nrm.shape[0])

    @property
    def failure_rate(self) -> float:
        return float(self.failed.float().mean()) if self.n else 0.0


def load_vectors(path: str | os.PathLike, rows: int | None = None, *, check: bool = True) -> np.ndarray:
    """RAW vectors [N, d] float32 from a parquet ``activation_vector`` column or a ``.npy`` [N, d] file.

    With ``check`` (the default) unusable rows are an error naming them
    (``nla.util.validation.check_vectors``); without, the array comes back as stored (first ``rows``
    rows), for callers that drop bad rows themselves (``nla.util.validation.drop_bad_rows``).
    """
    from nla.datagen.io import read_vectors

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"vectors: no file at {p}; pass a parquet with an activation_vector column or a .npy")
    if rows is not None and rows < 1:
        raise NLAClientError(f"rows: expected a positive number of rows, found {rows}")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)  # never unpickle (docs/design.md §3.3)
        except (ValueError, OSError, EOFError) as err:
            raise NLAClientError(f"vectors: {p} is not a readable .npy array ({err}); save it with np.save") from None
    elif p.suffix == ".parquet":
        arr = read_vectors(p, check=False)
    else:
        raise NLAClientError(f"vectors: expected a .parquet or .npy file, found {p.name!r}")
    if arr.ndim != 2:
        raise NLAClientError(f"vectors: {p} holds an array of shape {arr.shape}, expected [N, d]")
    if arr.shape[0] == 0:
        raise NLAClientError(f"vectors: {p} has no rows; there is nothing to explain or score")
    if rows is not None:
        arr = arr[:rows]
    return check_vectors(arr, f"vectors {p}") if check else arr


def blocks_of(layer: Any, n: int, side: NLAConfig, what: str) -> list[int | None]:
    """The block of each of ``n`` vectors: ``layer`` an int (all of them), a sequence of ``n`` ints, or None;
    each checked against the blocks the pair reads (``NLAConfig.check_layer``: a pair of several blocks needs
    one, a pair of one takes its own or none)."""
    if layer is None or (isinstance(layer, int) and not isinstance(layer, bool)):
        blocks = [layer] * n
    else:
        blocks = layer.tolist() if hasattr(layer, "tolist") else list(layer)
        if len(blocks) != n:
            raise NLAClientError(f"{what}: layer holds {len(blocks)} blocks for {n} vectors; give one block (an int) "
                                 "or one a vector")
        def bad_block(k: Any) -> bool:
            return k is not None and (isinstance(k, bool) or not isinstance(k, int))

        if any(bad_block(k) for k in blocks):
            bad = next(k for k in blocks if bad_block(k))
            raise NLAClientError(f"{what}: layer: expected block numbers (ints), found {bad!r}")
    try:
        for k in dict.fromkeys(blocks):
            side.check_layer(k, what)
    except SidecarError as err:
        raise NLAClientError(str(err)) from None
    return blocks


def _as_tensor(vectors: Any, d_model: int, what: str) -> Tensor:
    """[N, d] fp32 CPU tensor from numpy/torch; raise naming both widths on a mismatch, or the bad rows."""
    if isinstance(vectors, Tensor):
        t = vectors.detach().cpu()
        arr = (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # numpy has no bfloat16
    else:
        arr = np.asarray(vectors)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise NLAClientError(f"vectors: expected [N, d], found shape {tuple(arr.shape)}")
    if arr.shape[1] != d_model:
        raise NLAClientError(
            f"vectors: have d={arr.shape[1]} but the {what} sidecar's d_model is {d_model}; use vectors extracted "
            "from the subject model this checkpoint was trained on (same layer, same model)"
        )
    # np.array copies: arrow-backed arrays are read-only, which torch warns about.
    return torch.from_numpy(np.array(check_vectors(arr, "vectors"), dtype=np.float32))


def decode_memory_lower_bound(model: nn.Module, sequences: int, tokens: int) -> int:
    """Bytes that decoding ``sequences`` rows of ``tokens`` tokens together cannot do without: the
    KV cache (keys and values of every layer, in the model's dtype) and one step's fp32 logits and
    their softmax. Activations and the weights come on top, so this only ever under-counts."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_head", 0) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(text, "head_dim", 0) or hidden // max(heads, 1))
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    try:
        elt = next(model.parameters()).element_size()
    except (StopIteration, AttributeError):
        elt = 4
    kv = sequences * tokens * 2 * layers * kv_heads * head_dim * elt
    return kv + sequences * vocab * 4 * 2


def device_of(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


class NLAClient:
    """Verbalize vectors with the AV, reconstruct texts with the AR, score round trips.

    ``NLAClient(av_dir, ar_dir)`` loads checkpoint directories with their ``nla_meta.yaml``;
    an explicit ``sidecar`` path overrides both checkpoints' own. Either side may be None
    when only the other is needed. ``NLAClient.from_models(...)`` wraps live models (the RL
    loop, eval during training) without reloading them.
    """

    def __init__(
        self,
        av: str | os.PathLike | None,
        ar: str | os.PathLike | None = None,
        *,
        device: str = "auto",
        dtype: str = "float32",
        sidecar: str | os.PathLike | None = None,
        max_length: int = 256,
        allow_mixed_provenance: bool = False,
    ) -> None:
        from nla.train.device import resolve_device, resolve_dtype

        if av is None and ar is None:
            raise NLAClientError("NLAClient: give an AV checkpoint (av=DIR), an AR checkpoint (ar=DIR), or both")
        dev, dt = resolve_device(device), resolve_dtype(dtype)
        explicit = load_sidecar(sidecar) if sidecar is not None else None
        av_model = av_tok = av_side = None
        if av is not None:
            from nla.core.injection import load_av_model
            from nla.core.lora import is_adapter_dir, load_merged

            path = Path(av)
            if is_adapter_dir(path):  # a LoRA adapter (nla.core.lora): its base AV with the adapter merged in
                try:
                    av_model, path = load_merged(path, dt)
                except FileNotFoundError as err:
                    raise NLAClientError(str(err)) from None
                av_model = av_model.to(dev).eval()
                check_checkpoint(path, "av")
            av_side = explicit or load_checkpoint_sidecar(path, "av")
            if av_model is None:
                check_checkpoint(path, "av")
                try:
                    av_model = load_av_model(path, av_side, dtype=dt).to(dev).eval()  # + its injection adapter
                except (FileNotFoundError, ValueError) as err:
                    raise NLAClientError(str(err)) from None
            av_tok = _checkpoint_tokenizer(path, "av")
        ar_model = ar_tok = ar_side = None
        if ar is not None:
            path = Path(ar)
            ar_side = explicit or load_checkpoint_sidecar(path, "ar")
            check_checkpoint(path, "ar", extra=(VALUE_HEAD_FILE,))
            ar_model = Reconstructor.from_pretrained(path, dtype=dt).to(dev).eval()
            ar_tok = ar_model.tokenizer
            if ar_tok is None:
                raise NLAClientError(f"ar: no tokenizer files in {path}; save the tokenizer beside the AR checkpoint")
        self._setup(av_model, av_tok, av_side, ar_model, ar_tok, ar_side, max_length, allow_mixed_provenance)

    @classmethod
    def from_models(
        cls,
        av_model: nn.Module | None = None,
        av_tokenizer: Any = None,
        av_sidecar: NLAConfig | None = None,
        ar: Reconstructor | None = None,
        ar_tokenizer: Any = None,
        ar_sidecar: NLAConfig | None = None,
        *,
        max_length: int = 256,
        allow_mixed_provenance: bool = False,
    ) -> NLAClient:
        """Wrap already-loaded models (no copy: the client sees their current weights).

        ``ar_tokenizer`` / ``ar_sidecar`` default to the ones the Reconstructor carries.
        """
        if av_model is None and ar is None:
            raise NLAClientError("NLAClient.from_models: give av_model, ar, or both")
        if av_model is not None and (av_tokenizer is None or av_sidecar is None):
            raise NLAClientError("NLAClient.from_models: av_model needs av_tokenizer and av_sidecar as well")
        if ar is not None:
            ar_tokenizer = ar_tokenizer if ar_tokenizer is not None else ar.tokenizer
            ar_sidecar = ar_sidecar if ar_sidecar is not None else ar.sidecar
            if ar_tokenizer is None or ar_sidecar is None:
                raise NLAClientError(
                    "NLAClient.from_models: the reconstructor carries no tokenizer/sidecar; pass ar_tokenizer "
                    "and ar_sidecar"
                )
        self = cls.__new__(cls)
        self._setup(av_model, av_tokenizer, av_sidecar, ar, ar_tokenizer, ar_sidecar, max_length,
                    allow_mixed_provenance)
        return self

    def _setup(self, av_model: nn.Module | None, av_tok: Any, av_side: NLAConfig | None, ar: Reconstructor | None,
               ar_tok: Any, ar_side: NLAConfig | None, max_length: int, allow_mixed_provenance: bool = False) -> None:
        if max_length < 1:
            raise NLAClientError(f"max_length: expected a positive token count, found {max_length}")
        for role, model, tok, side in (("av", av_model, av_tok, av_side), ("ar", ar, ar_tok, ar_side)):
            if model is None:
                continue
            verify_tokenizer(side, tok)
            width = arch.hidden_size(model.config)
            if width != side.own_width:
                key = "model.hidden_size" if side.model_width is not None else "d_model"
                raise NLAClientError(
                    f"{key}: the {role.upper()} sidecar says {side.own_width} but the {role.upper()} model has width "
                    f"{width}; the sidecar does not belong to this checkpoint"
                )
            if role == "av" and side.own_width != side.d_model and get_adapter(model) is None:
                raise NLAClientError(
                    f"the AV has width {width} but reads {side.d_model}-d vectors: it needs its injection adapter "
                    "(injection_adapter in the sidecar, nla_injection_adapter.safetensors); load it with "
                    "nla.core.injection.load_av_model")
        if av_side is not None and ar_side is not None and av_side.d_model != ar_side.d_model:
            raise NLAClientError(
                f"d_model: the AV sidecar says {av_side.d_model} but the AR sidecar says {ar_side.d_model}; the two "
                "checkpoints were not trained on the same subject model and cannot form a pair"
            )
        if av_side is not None and ar_side is not None and av_side.layers != ar_side.layers:
            raise NLAClientError(f"layers: the AV reads blocks {av_side.layers} but the AR {ar_side.layers} "
                                 "(extraction.layers); the two checkpoints cannot form a pair")
        self.allow_mixed_provenance = allow_mixed_provenance
        if av_side is not None and ar_side is not None:  # subject, layer and tokenizer (nla.core.provenance)
            check_provenance([Provenance.of("the AV", av_side), Provenance.of("the AR", ar_side)],
                             allow=allow_mixed_provenance, context="AV/AR pair")
        self.av_model, self.av_tokenizer, self.av_sidecar = av_model, av_tok, av_side
        self.ar, self.ar_tokenizer, self.ar_sidecar = ar, ar_tok, ar_side
        self.max_length = max_length
        self._rollout = None  # built on first verbalize: it registers an injection hook on the AV

    def check_data(self, path: str | os.PathLike, width: int | None = None) -> None:
        """Refuse a dataset whose sidecar records another subject, layer or tokenizer than this
        client's checkpoints (``nla.core.provenance``; ``allow_mixed_provenance`` warns instead), or is no
        dataset sidecar, or contradicts the vectors' ``width``. A dataset without a sidecar has
        nothing to compare."""
        from nla.core.sidecar import sidecar_path_for

        where = sidecar_path_for(path)
        if not where.is_file():
            return
        side = load_sidecar(path)
        if side.kind != "nla_dataset":
            raise NLAClientError(f"{where}: kind {side.kind!r} (role {side.role}) is a checkpoint's sidecar, not a "
                                 "dataset's (kind nla_dataset); restore the one nla datagen wrote beside the parquet")
        if width is not None and side.d_model != width:
            raise NLAClientError(f"{where}: d_model {side.d_model}, but {path} holds {width}-d vectors; the sidecar "
                                 "does not belong to this data: restore the one nla datagen wrote")
        check_provenance([Provenance.of(f"the dataset {path}", side), *self.provenance()],
                         allow=self.allow_mixed_provenance, context="dataset")

    def to_pair_space(self, raw: Any, layer: Any = None) -> Any:
        """The subject's raw block outputs ([..., d], a tensor or an array) as this pair reads them:
        minus the ``vector_offset`` its sidecars record (a pair trained on centred vectors), or for a pair
        of several blocks centred a block at a time minus each vector's block's ``layer_offsets`` entry
        (``layer``: one block for all, or one a vector, as ``verbalize`` takes it); unchanged otherwise.
        ``verbalize`` and ``score`` take vectors in the pair's space, as its datasets hold them; call this
        first on vectors taken from the subject. The AV and the AR must agree."""
        side = self._offset_sidecar()
        return raw if side is None else side.to_pair_space(raw, layer)

    def from_pair_space(self, vectors: Any, layer: Any = None) -> Any:
        """The inverse of ``to_pair_space``: vectors in the pair's space (an AR's reading, a dataset's
        vector) as the subject's raw block outputs, e.g. to patch them into the subject."""
        side = self._offset_sidecar()
        return vectors if side is None else side.from_pair_space(vectors, layer)

    def _offset_sidecar(self) -> Any:
        """The sidecar whose offsets this pair applies; the AV's and the AR's must agree."""
        offsets = {(s.vector_offset, None if s.layer_offsets is None else tuple(sorted(s.layer_offsets.items())))
                   for s in (self.av_sidecar, self.ar_sidecar) if s is not None}
        if len(offsets) > 1:
            raise ValueError("the AV's and the AR's sidecars record different extraction.vector_offset or "
                             "extraction.layer_offsets values (one pair centred on two means); use a pair trained "
                             "on the same dataset")
        return self.av_sidecar or self.ar_sidecar

    def provenance(self) -> list[Provenance]:
        """What this client's checkpoints record of their subject (``nla.core.provenance``)."""
        return [Provenance.of(label, side) for label, side in (("the AV", self.av_sidecar),
                                                               ("the AR", self.ar_sidecar)) if side is not None]

    # ------------------------------------------------------------------ properties
    @property
    def d_model(self) -> int:
        side = self.av_sidecar or self.ar_sidecar
        assert side is not None  # _setup requires one side
        return side.d_model

    @property
    def mse_scale(self) -> float | None:
        """The AR's ``mse_scale`` (the scale scores are computed at)."""
        return self.require_ar("score").mse_scale_value()

    def require_ar(self, what: str) -> NLAConfig:
        """The AR's sidecar; a clear error naming ``what`` when this client has no AR."""
        if self.ar is None or self.ar_sidecar is None:
            raise NLAClientError(
                f"{what}: this client has no reconstructor; create it with an AR checkpoint "
                "(NLAClient(av, ar=DIR) or --ar DIR)"
            )
        return self.ar_sidecar

    def require_av(self, what: str) -> NLAConfig:
        """The AV's sidecar; a clear error naming ``what`` when this client has no AV."""
        if self.av_model is None or self.av_sidecar is None:
            raise NLAClientError(
                f"{what}: this client has no verbalizer; create it with an AV checkpoint (NLAClient(av=DIR) or --av DIR)"
            )
        return self.av_sidecar

    def at_block(self, layer: int) -> BlockView:
        """This pair seen at one of its blocks (:class:`BlockView`): every call that takes ``layer`` gets
        ``layer`` where it is given none. A block the pair was not trained on is refused here."""
        return BlockView(self, layer)

    # ------------------------------------------------------------------ verbalize
    def verbalize(
        self,
        vectors: np.ndarray | Tensor,
        *,
        max_new_tokens: int = 150,
        greedy: bool = True,
        temperature: float = 1.0,
        n_samples: int = 1,
        seed: int | None = None,
        batch_size: int = 64,
        best_of: int = 1,
        layer: int | Sequence[int] | None = None,
    ) -> list[Verbalization]:
        """Explanations for RAW vectors [N, d]: N * ``n_samples`` results, samples of one vector contiguous.

        ``layer``: the block the vectors come from (an int, or one a vector). A pair of several blocks
        (``extraction.layers``) needs it, its prompt names the block; a pair of one takes its own or
        none; a block the pair was not trained on is refused.

        ``best_of=N`` (needs the AR): draw N samples per vector (``greedy=False``, at ``temperature``)
        and keep the one the AR reconstructs best (lowest ``mse_nrm`` against the vector; a failed
        sample is charged the failure cost, so it is kept only when every sample failed): N results,
        each with its ``mse_nrm``.
        """
        from nla.rl.roles import RolloutWorker

        side = self.require_av("verbalize")
        vec = _as_tensor(vectors, side.d_model, "AV")
        blocks = blocks_of(layer, vec.shape[0], side, "verbalize")
        if n_samples < 1 or batch_size < 1 or max_new_tokens < 1 or best_of < 1:
            raise NLAClientError(
                f"verbalize: n_samples, batch_size, max_new_tokens and best_of must be >= 1, found {n_samples}, "
                f"{batch_size}, {max_new_tokens}, {best_of}"
            )
        try:
            check_sample_count(n_samples, "n_samples")
            check_sample_count(best_of, "best_of")
            if not greedy or best_of > 1:  # the one check of sampling settings (nla.util.validation)
                check_sampling(temperature, what="temperature")
        except ValueError as err:
            raise NLAClientError(str(err)) from None
        self._check_decode_memory(min(batch_size, vec.shape[0]), max(n_samples, best_of), max_new_tokens,
                                  "best_of" if best_of > 1 else "n_samples")
        if best_of > 1:
            return self._best_of(vec, best_of, n_samples=n_samples, greedy=greedy, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed, batch_size=batch_size, layer=blocks)
        if self._rollout is None:
            self._rollout = RolloutWorker(self.av_model, self.av_tokenizer, side, device_of(self.av_model))
        out: list[Verbalization] = []
        devices = [device_of(self.av_model)] if device_of(self.av_model).type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, vec.shape[0], batch_size):
                adapt_threads()
                chunk = vec[start : start + batch_size]
                rows = torch.arange(start, start + chunk.shape[0])
                kw = {} if side.layers is None else {"blocks": torch.tensor(blocks[start : start + chunk.shape[0]])}
                ro = self._rollout.generate(chunk, rows, n_samples, max_new_tokens, temperature=temperature,
                                            greedy=greedy, **kw)
                for i, status in enumerate(ro.statuses()):
                    out.append(Verbalization(ro.texts[i], ro.explanations[i], status, int(ro.prompt_rows[i])))
        return out

    def _check_decode_memory(self, vectors: int, samples: int, max_new_tokens: int, what: str) -> None:
        """Refuse, before decoding, a batch whose KV cache and logits alone exceed the memory free now
        (``vectors`` x ``samples`` sequences of the prompt + ``max_new_tokens`` tokens decode together)."""
        from nla.train.health import available_memory

        need = decode_memory_lower_bound(self.av_model, vectors * samples, max_new_tokens + 64)
        free = available_memory(device_of(self.av_model))
        if free is not None and need > free:
            raise NLAClientError(
                f"verbalize: {what}={samples} decodes {vectors} x {samples} = {vectors * samples} sequences at once, "
                f"which needs at least {need / 2**30:.1f} GiB (KV cache and logits) and {free / 2**30:.1f} GiB is "
                "free; ask for fewer samples, a smaller batch_size (--batch-size) or fewer max_new_tokens"
            )

    def _best_of(self, vec: Tensor, best_of: int, *, n_samples: int, greedy: bool, **kw: Any) -> list[Verbalization]:
        self.require_ar("verbalize(best_of=...)")
        if n_samples != 1:
            raise NLAClientError(f"verbalize: best_of={best_of} keeps one sample per vector; n_samples must be 1, "
                                 f"found {n_samples}")
        if greedy:
            raise NLAClientError(f"verbalize: best_of={best_of} chooses among sampled explanations; pass "
                                 "greedy=False (greedy decoding gives the same one every time)")
        verbs = self.verbalize(vec, n_samples=best_of, greedy=False, **kw)
        gold = vec[[v.row for v in verbs]]
        res = self.score([v.explanation for v in verbs], gold, batch_size=kw["batch_size"],
                         layer=[kw["layer"][v.row] for v in verbs])
        # failed samples at the failure cost; a non-finite prediction (NaN mse) is never chosen
        mse = charge_failures(res.mse_nrm.nan_to_num(nan=float("inf")), res.failed,
                              failed_mse(gold, self.ar_sidecar.mse_scale_value()))
        best = mse.view(-1, best_of).argmin(dim=1)  # the first of equal ones
        return [replace(verbs[i * best_of + int(j)], mse_nrm=float(mse[i * best_of + int(j)]))
                for i, j in enumerate(best)]

    # ------------------------------------------------------------------ reconstruct
    @torch.no_grad()
    def reconstruct(self, texts: Sequence[str], batch_size: int = 64,
                    layer: int | Sequence[int] | None = None) -> Tensor:
        """AR predictions [N, d] (fp32, CPU) for explanations (wrapped in the AR template here); ``layer``
        as in :meth:`verbalize` (a pair of several blocks reads each text with its block named)."""

        side = self.require_ar("reconstruct")
        blocks = blocks_of(layer, len(texts), side, "reconstruct")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise NLAClientError(
                    f"reconstruct: text {i} is {type(t).__name__}, expected a str; drop failed samples first "
                    "(score() handles None explanations)"
                )
        if batch_size < 1:
            raise NLAClientError(f"reconstruct: batch_size must be >= 1, found {batch_size}")
        if not texts:
            return torch.zeros(0, side.d_model)
        device = device_of(self.ar)
        was = self.ar.training
        self.ar.eval()
        preds = []
        try:
            for s in range(0, len(texts), batch_size):
                adapt_threads()
                enc = tokenize_ar_texts(self.ar_tokenizer, [side.ar_text(t, layer=k) for t, k in
                                                            zip(texts[s : s + batch_size], blocks[s : s + batch_size],
                                                                strict=True)], self.max_length)
                kw = {} if getattr(self.ar, "exits", None) is None else {"blocks": blocks[s : s + batch_size]}
                preds.append(self.ar.predict(enc["input_ids"].to(device), enc["attention_mask"].to(device), **kw)
                             .float().cpu())
        finally:
            self.ar.train(was)
        return torch.cat(preds)

    # ------------------------------------------------------------------ score
    def score(self, texts: Sequence[str | None], vectors: np.ndarray | Tensor, batch_size: int = 64,
              layer: int | Sequence[int] | None = None) -> ScoreResult:
        """Reconstruct ``texts`` and compare with RAW ``vectors`` [N, d]; None texts are failed samples;
        ``layer`` as in :meth:`verbalize`."""
        side = self.require_ar("score")
        gold = _as_tensor(vectors, side.d_model, "AR")
        if len(texts) != gold.shape[0]:
            raise NLAClientError(
                f"score: {len(texts)} texts for {gold.shape[0]} vectors; pass exactly one text (or None) per vector"
            )
        blocks = blocks_of(layer, len(texts), side, "score")
        n, d = gold.shape
        # No text, or an empty one (what extraction never returns: it says nothing), is a failed sample.
        failed = torch.tensor([t is None or (isinstance(t, str) and not t.strip()) for t in texts], dtype=torch.bool)
        ok = (~failed).nonzero(as_tuple=True)[0]
        preds = torch.full((n, d), float("nan"))
        mse = torch.full((n,), float("nan"))
        cos = torch.full((n,), float("nan"))
        if len(ok):
            p = self.reconstruct([texts[int(i)] for i in ok], batch_size=batch_size,
                                 layer=[blocks[int(i)] for i in ok])
            bad = ~torch.isfinite(p).all(dim=-1)
            if bad.any():
                logger.warning(
                    "score: the AR predicts non-finite vectors for %d of %d rows (its weights overflow, or its "
                    "training diverged); their mse_nrm and cosine are NaN (null in JSON output). Check the AR "
                    "checkpoint's training log", int(bad.sum()), len(ok))
            preds[ok] = p
            mse[ok] = mse_nrm(p, gold[ok], side.mse_scale_value())
            cos[ok] = cosine(p, gold[ok])
        return ScoreResult(mse_nrm=mse, cosine=cos, failed=failed, predictions=preds)

    def round_trip(self, vectors: np.ndarray | Tensor, **verbalize_kwargs: Any) -> tuple[list[Verbalization],
                                                                                         ScoreResult]:
        """Verbalize, then score each sample's explanation against its own vector."""
        self.require_ar("round_trip")
        verbs = self.verbalize(vectors, **verbalize_kwargs)
        vec = _as_tensor(vectors, self.d_model, "AV")
        blocks = blocks_of(verbalize_kwargs.get("layer"), vec.shape[0], self.require_av("round_trip"), "round_trip")
        gold = vec[[v.row for v in verbs]]
        return verbs, self.score([v.explanation for v in verbs], gold,
                                 batch_size=verbalize_kwargs.get("batch_size", 64), layer=[blocks[v.row] for v in verbs])


class BlockView:
    """An :class:`NLAClient` at one block (``client.at_block(k)``): ``verbalize``, ``reconstruct``, ``score``,
    ``round_trip``, ``to_pair_space`` and ``from_pair_space`` read their vectors and texts as block ``layer``'s
    where the call names no block; everything else is the client's. Code written for a pair of one block (the
    explanation suite, a user's loop) runs on one block of a pair for several this way, unchanged; a call that
    names its blocks keeps them."""

    def __init__(self, client: NLAClient, layer: int):
        for side in (client.av_sidecar, client.ar_sidecar):
            if side is not None:
                try:
                    side.check_layer(layer, "at_block")
                except SidecarError as err:
                    raise NLAClientError(str(err)) from None
        self.client, self.layer = client, layer

    def __getattr__(self, name: str) -> Any:
        if name == "client":  # not set yet (copy, pickle): no recursion through this method
            raise AttributeError(name)
        return getattr(self.client, name)

    def _at(self, layer: Any) -> Any:
        return self.layer if layer is None else layer

    def verbalize(self, vectors: np.ndarray | Tensor, *, layer: Any = None, **kw: Any) -> list[Verbalization]:
        return self.client.verbalize(vectors, layer=self._at(layer), **kw)

    def reconstruct(self, texts: Sequence[str], batch_size: int = 64, layer: Any = None) -> Tensor:
        return self.client.reconstruct(texts, batch_size=batch_size, layer=self._at(layer))

    def score(self, texts: Sequence[str | None], vectors: np.ndarray | Tensor, batch_size: int = 64,
              layer: Any = None) -> ScoreResult:
        return self.client.score(texts, vectors, batch_size=batch_size, layer=self._at(layer))

    def round_trip(self, vectors: np.ndarray | Tensor, **verbalize_kwargs: Any) -> tuple[list[Verbalization],
                                                                                         ScoreResult]:
        return self.client.round_trip(vectors, **{**verbalize_kwargs, "layer": self._at(verbalize_kwargs.get("layer"))})

    def to_pair_space(self, raw: Any, layer: Any = None) -> Any:
        return self.client.to_pair_space(raw, self._at(layer))

    def from_pair_space(self, vectors: Any, layer: Any = None) -> Any:
        return self.client.from_pair_space(vectors, self._at(layer))


def load_checkpoint_sidecar(path: Path, role: str) -> NLAConfig:
    if path.is_file():
        raise NLAClientError(f"{role}: {path} is a file, expected the checkpoint directory (e.g. {path.parent})")
    if not path.is_dir():
        raise FileNotFoundError(f"{role}: checkpoint directory {path} does not exist")
    if not (path / SIDECAR_NAME).is_file():
        raise FileNotFoundError(
            f"{role}: {path} has no {SIDECAR_NAME}; an NLA checkpoint needs its sidecar (pass sidecar=PATH / "
            "--sidecar PATH explicitly, or re-save the checkpoint with nla)"
        )
    side = load_sidecar(path)
    other = "ar" if role == "av" else "av"
    is_ar_dir = (path / VALUE_HEAD_FILE).is_file()
    if side.role == other or (side.role is None and is_ar_dir == (role == "av")):
        # Loading the other role "works" (an AR dir as AV gets a random lm_head) and writes garbage: refuse.
        found = f"role {side.role!r}" if side.role else ("a value head" if is_ar_dir else "no value head")
        raise NLAClientError(
            f"{role}: {path} is an {other.upper()} checkpoint ({found}), not an {role.upper()}; pass a "
            f"{'verbalizer' if role == 'av' else 'reconstructor'} checkpoint there"
        )
    try:
        return side.need_av("verbalizing") if role == "av" else side.need_ar("reconstructing")
    except SidecarError as err:
        raise NLAClientError(f"{role}: {path}: {err}") from None


def _checkpoint_tokenizer(path: Path, role: str) -> Any:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise NLAClientError(f"{role}: no tokenizer files in {path}; save the tokenizer beside the checkpoint")
    return arch.load_tokenizer(path)
