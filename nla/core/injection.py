"""Activation injection: overwrite the marker token's input embedding with the vector (docs/design.md §3.4).

Notation: B rows, S positions, d width, N vectors.

A site is a position p with ``ids[p] == inj_id``, ``ids[p-1] == left_id`` and
``ids[p+1] == right_id``. Requiring both neighbours means a marker character the model
writes in its own response (or one that appears in a document) is not mistaken for the
prompt's marker. Sites are filled in row-major order, so a packed ``[1, T]`` sequence
holding several prompts takes its vectors in prompt order, exactly like a padded ``[B, S]``
batch with one prompt per row.

An AV may carry a learned :class:`InjectionAdapter` (an affine map from the subject's width to
its own embedding width; the published system's future work "a learned injection adapter", and what lets a
model of another width explain the subject). It is a submodule of the AV (attribute
``nla_injection_adapter``), so optimisers, sharding, weight syncs and copies carry it with the
rest of the weights; it is saved beside the HF files (``nla_injection_adapter.safetensors``,
recorded in the sidecar's ``injection_adapter`` block), never inside them, so the HF dir stays
a plain causal LM.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nla.core.sidecar import INJECTION_ADAPTER_FILE
from nla.core.vectors import normalize_activation, ridge_solve

logger = logging.getLogger(__name__)

ADAPTER_ATTR = "nla_injection_adapter"  # the adapter's submodule name on the AV
ADAPTER_FILE = INJECTION_ADAPTER_FILE  # "nla_injection_adapter.safetensors", what nla's saves name


class ScaledRotation(nn.Module):
    """A conformal adapter's weight, as a ``torch.nn.utils.parametrize`` parametrization:
    ``exp(log_gain) * matrix_exp(U - U^T)``, ``U`` the strict upper triangle of the stored
    matrix. So ``W^T W = exp(2 log_gain) I`` always: every direction of the vector is scaled
    alike and none can be amplified over another; what is learned is one gain, a rotation and
    the bias. Stored as the identity (``U = 0``) and ``log_gain = 0``, it starts as ``W = I``.
    (torch's own ``parametrizations.orthogonal`` has no gain and keeps a trivialization base
    that changes what is saved; this is the plain map, three lines.)"""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # [1], not a scalar: FSDP2's fully_shard refuses 0-d parameters
        self.log_gain = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        u = x.triu(1)
        return self.log_gain.exp() * torch.linalg.matrix_exp(u - u.T)


class InjectionAdapter(nn.Module):
    """``v -> W v + b``: a vector of the subject's width ``d_in`` (already rescaled to
    ``injection_scale``) to the AV's embedding width ``d_out``.

    Initialised so that training starts from today's fixed-scale injection: the identity
    when the widths are equal; otherwise a seeded random map with orthonormal rows (or
    columns), times ``sqrt(d_in / d_out)`` when it narrows, so a typical vector keeps its norm.

    ``conformal`` (equal widths only): ``W`` is a gain times a rotation (:class:`ScaledRotation`),
    so training cannot give one direction of the vector more weight than another, the way a
    free ``W`` does when it amplifies the directions the AV already reads (BENCHMARKS "Explain
    one model with another"). Its file holds the parametrization's stored matrix and gain
    (``proj.parametrizations.weight.original``, ``proj.parametrizations.weight.0.log_gain``);
    ``proj.weight`` is computed from them.
    """

    def __init__(self, d_in: int, d_out: int, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 mean_invariant: bool = False, conformal: bool = False) -> None:
        super().__init__()
        self.d_in, self.d_out = int(d_in), int(d_out)
        self.conformal = bool(conformal)
        if self.conformal and self.d_in != self.d_out:
            raise ValueError(f"InjectionAdapter: conformal needs equal widths (a gain times a rotation), found d_in "
                             f"{self.d_in} and d_out {self.d_out}; use the plain affine adapter for a cross-model pair")
        self.proj = nn.Linear(self.d_in, self.d_out, bias=True, dtype=dtype)
        with torch.no_grad():
            self.proj.weight.copy_(adapter_init(self.d_in, self.d_out, seed).to(dtype))
            self.proj.bias.zero_()
        if self.conformal:
            from torch.nn.utils import parametrize

            # unsafe: the stored matrix is the identity as it is (U = 0), no right inverse needed
            parametrize.register_parametrization(self.proj, "weight", ScaledRotation(dtype), unsafe=True)
        self.mean_invariant = bool(mean_invariant)
        if self.mean_invariant:
            # fitted on the training vectors (set_mean), never trained: saved with the weights
            self.register_buffer("mean_dir", torch.zeros(self.d_in, dtype=dtype))
            self.register_buffer("mean_tan", torch.zeros((), dtype=dtype))

    @torch.no_grad()
    def set_mean(self, vectors: Tensor) -> float:
        """Fit the mean-invariant view on raw training vectors [N, d_in]: the unit direction of their
        mean and the mean over rows of ``(v . m) / |v - (v . m) m|`` (the tangent of a typical
        vector's angle to it). Returns that tangent."""
        if not self.mean_invariant:
            raise ValueError("InjectionAdapter.set_mean: this adapter was built without mean_invariant")
        v = vectors.double().cpu()
        mu = v.mean(0)
        if float(mu.norm()) == 0.0:
            raise ValueError("InjectionAdapter.set_mean: the training vectors' mean is zero; there is no offset "
                             "to be invariant to (train without injection_adapter_mean_invariant)")
        m = mu / mu.norm()
        along = v @ m
        perp = (v - along[:, None] * m).norm(dim=1).clamp_min(1e-30)
        tan = float((along / perp).mean())
        self.mean_dir.copy_(m.to(self.mean_dir.dtype))
        self.mean_tan.fill_(tan)
        return tan

    def canonical(self, v: Tensor) -> Tensor:
        """``v`` [N, d_in] as the adapter reads it. Mean-invariant: the component along the training
        mean's direction ``m`` is dropped and replaced by the training data's typical one, at the
        same norm: ``|v| * u / |u|`` with ``u = p / |p| + tan * m``, ``p = v - (v . m) m``. So any
        shift of a vector along the training mean (a difference of means, which has none of it,
        an offset added again) and any rescaling read the same; what is lost is the one
        coordinate along ``m`` (~3 % of the default world's variance). Otherwise ``v`` as is."""
        if not self.mean_invariant:
            return v
        m = self.mean_dir.to(v.dtype)
        p = v - (v @ m)[..., None] * m
        u = p / p.norm(dim=-1, keepdim=True).clamp_min(1e-30) + self.mean_tan.to(v.dtype) * m
        return u * (v.norm(dim=-1, keepdim=True) / u.norm(dim=-1, keepdim=True))

    def forward(self, v: Tensor) -> Tensor:
        if v.shape[-1] != self.d_in:
            raise ValueError(f"injection adapter: vectors of width {v.shape[-1]}, expected {self.d_in} (the subject's "
                             "d_model this AV was trained for); extract them from that subject and layer")
        v = v.to(dtype=self.proj.weight.dtype, device=self.proj.weight.device)
        return self.proj(self.canonical(v))

    @torch.no_grad()
    def fit(self, source: Tensor, target: Tensor, ridge: float = 1e-3) -> float:
        """Set ``W, b`` to the ridge regression of ``target`` [N, d_out] on ``source`` [N, d_in]
        (both centred, ``lam = ridge * trace(S^T S) / d_in``; float64), the source as the adapter
        reads it (``canonical``; fit a mean-invariant adapter's mean first). Returns the fit's R^2."""
        if self.conformal:
            raise ValueError("InjectionAdapter.fit: a conformal adapter is a gain times a rotation, not a free map; "
                             "fit a plain affine adapter (conformal false)")
        s, t = self.canonical(source.to(self.proj.weight.dtype).cpu()).double(), target.double().cpu()
        sm, tm = s.mean(0), t.mean(0)
        sc, tc = s - sm, t - tm
        w = ridge_solve(sc, tc, ridge)  # [d_out, d_in]
        self.proj.weight.copy_(w.to(self.proj.weight.dtype))
        self.proj.bias.copy_((tm - w @ sm).to(self.proj.bias.dtype))
        resid = ((sc @ w.T - tc) ** 2).sum()
        return float(1.0 - resid / (tc**2).sum().clamp_min(1e-30))

    def describe(self) -> dict[str, Any]:
        """The sidecar's ``injection_adapter`` block."""
        block = {"kind": "affine", "d_in": self.d_in, "d_out": self.d_out, "file": ADAPTER_FILE}
        if self.mean_invariant:
            block["mean_invariant"] = True
        if self.conformal:
            block["conformal"] = True
        return block


def adapter_init(d_in: int, d_out: int, seed: int = 0) -> Tensor:
    """The starting weight [d_out, d_in] of :class:`InjectionAdapter` (see there)."""
    if d_in == d_out:
        return torch.eye(d_out)
    g = torch.Generator().manual_seed(int(seed))
    q, _ = torch.linalg.qr(torch.randn(max(d_in, d_out), min(d_in, d_out), generator=g))  # orthonormal columns
    w = q.T if d_out < d_in else q  # [d_out, d_in]: orthonormal rows when narrowing, columns when widening
    return w * (d_in / d_out) ** 0.5 if d_out < d_in else w


def get_adapter(model: nn.Module) -> InjectionAdapter | None:
    """The AV's injection adapter, or None (``model`` may be a causal LM or an FSDP-wrapped one)."""
    adapter = getattr(model, ADAPTER_ATTR, None)
    return adapter if isinstance(adapter, InjectionAdapter) else None


def attach_adapter(model: nn.Module, adapter: InjectionAdapter) -> InjectionAdapter:
    """Register ``adapter`` on ``model`` (moved to the model's device) before hooks and optimisers are built."""
    if get_adapter(model) is not None:
        raise ValueError("attach_adapter: the AV already carries an injection adapter")
    width = model.get_input_embeddings().weight.shape[-1]
    if adapter.d_out != width:
        raise ValueError(f"injection adapter: maps to width {adapter.d_out}, but the AV's embeddings have width {width}")
    param = next(model.parameters())
    model.add_module(ADAPTER_ATTR, adapter.to(device=param.device))
    return adapter


def split_adapter_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A full AV state dict -> (the plain HF part, the adapter's own keys ``proj.weight`` / ``proj.bias``
    and, mean-invariant, its fitted ``mean_dir`` / ``mean_tan``)."""
    prefix = ADAPTER_ATTR + "."
    plain = {k: v for k, v in state.items() if not k.startswith(prefix)}
    own = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    return plain, own


def save_adapter_file(adapter_state: dict[str, Tensor], directory: str | Path) -> Path:
    """Write the adapter's weights (``proj.weight`` [d_out, d_in], ``proj.bias`` [d_out]; mean-invariant
    also ``mean_dir`` [d_in] and ``mean_tan`` []) into ``directory``."""
    from safetensors.torch import save_file

    path = Path(directory) / ADAPTER_FILE
    save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state.items()}, str(path))
    return path


def adapter_file_path(directory: str | Path, sidecar: Any) -> Path:
    """The file the sidecar's ``injection_adapter.file`` names in the checkpoint ``directory``, checked:
    it resolves inside ``directory`` (no ``..``, absolute path or symlink out of it), and, when the
    checkpoint has ``nla_checksums.sha256``, the record lists it and its SHA-256 matches
    (``NLA_VERIFY_CHECKSUMS``); else an :class:`~nla.util.validation.InputError` naming the field."""
    from nla.util.checkpoint_files import CHECKSUM_FILE, file_sha256, read_checksums, verify_mode
    from nla.util.validation import InputError

    d = Path(directory)
    name = sidecar.injection_adapter["file"]
    where = f"{d}: the sidecar's injection_adapter.file {name!r}"
    root, path = d.resolve(), (d / name)
    resolved = path.resolve()
    if Path(name).is_absolute() or not resolved.is_relative_to(root):
        raise InputError(f"{where} resolves to {resolved}, outside the checkpoint dir {root}; an AV's adapter is a "
                         f"file of its own checkpoint (nla writes {ADAPTER_FILE}): fix the sidecar or restore the "
                         "checkpoint dir as it was written")
    if not resolved.is_file():
        raise FileNotFoundError(f"{path}: the sidecar's injection_adapter names this file but it is missing; the AV "
                                "cannot read vectors without it. Restore the checkpoint dir as it was written")
    record, listed = d / CHECKSUM_FILE, read_checksums(d)
    if listed is not None:
        rel = resolved.relative_to(root).as_posix()
        if rel not in listed:
            raise InputError(f"{where} is not listed in {record} (it lists {sorted(listed)}); the checksum record does "
                             "not cover the adapter it names, so it is not the file this checkpoint was saved with: "
                             f"name {ADAPTER_FILE}, or restore the checkpoint dir as it was written")
        mode = verify_mode()
        if mode != "off" and file_sha256(resolved, use_record=mode == "once") != listed[rel]:
            raise InputError(f"{resolved}: its SHA-256 differs from the one recorded when it was saved ({record.name}); "
                             "the file is corrupted or replaced: re-download or re-save the checkpoint")
    return resolved


def check_adapter_named(directory: str | Path, sidecar: Any) -> None:
    """An AV checkpoint holding ``nla_injection_adapter.safetensors`` whose sidecar has no
    ``injection_adapter`` block is refused: loading it without the adapter feeds the AV vectors
    it was not trained to read (or of the wrong width), silently."""
    from nla.util.checkpoint_files import CHECKSUM_FILE, read_checksums
    from nla.util.validation import InputError

    d = Path(directory)
    if (sidecar is not None and sidecar.injection_adapter is not None) or not (d / ADAPTER_FILE).exists():
        return
    listed = ADAPTER_FILE in (read_checksums(d) or {})
    raise InputError(
        f"{d / ADAPTER_FILE}: present{f' and listed in {CHECKSUM_FILE}' if listed else ''}, but the sidecar has no "
        "injection_adapter block naming it; the AV would load without the adapter it was trained with. Use the "
        "sidecar saved with this checkpoint, or restore its injection_adapter block (kind: affine, d_in, d_out, "
        f"file: {ADAPTER_FILE})")


def load_adapter_file(directory: str | Path, sidecar: Any, *, dtype: torch.dtype = torch.float32) -> InjectionAdapter:
    """The adapter the sidecar's ``injection_adapter`` block names, from ``directory`` (checked by
    :func:`adapter_file_path`: inside the checkpoint and covered by its checksum record)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from nla.util.validation import InputError

    spec = sidecar.injection_adapter
    path = adapter_file_path(directory, sidecar)
    try:
        state = load_file(str(path))
    except SafetensorError as err:
        raise InputError(f"{path}: not a safetensors file ({path.stat().st_size} bytes; safetensors: {err}); the "
                         f"sidecar's injection_adapter.file must name the adapter's safetensors weights "
                         f"({ADAPTER_FILE}): restore the checkpoint dir as it was written") from None
    adapter = InjectionAdapter(spec["d_in"], spec["d_out"], dtype=dtype, mean_invariant=spec.get("mean_invariant", False),
                               conformal=spec.get("conformal", False))
    want = {k: tuple(v.shape) for k, v in adapter.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if want != found:
        raise ValueError(f"{path}: adapter weights {found}, expected {want} (injection_adapter d_in "
                         f"{spec['d_in']}, d_out {spec['d_out']}, mean_invariant "
                         f"{adapter.mean_invariant}, conformal {adapter.conformal}); the file does not belong "
                         "to this sidecar")
    adapter.load_state_dict(state)
    return adapter


def save_av_weights(model: nn.Module, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
    """``model.save_pretrained`` (safetensors) of the plain HF part, and the injection adapter's file
    beside it when the AV has one. ``state_dict``: the full weights to write (gathered or merged)."""
    adapter = get_adapter(model)
    if adapter is None:
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        return
    plain, own = split_adapter_state(model.state_dict() if state_dict is None else state_dict)
    model.save_pretrained(directory, state_dict=plain, safe_serialization=True)
    save_adapter_file(own, directory)


def save_av_checkpoint(model: nn.Module, tokenizer: Any, sidecar: Any, directory: str | Path,
                       state_dict: dict[str, Tensor] | None = None, **provenance: Any) -> Path:
    """An AV checkpoint directory: the weights (``save_av_weights``), the tokenizer in the form every
    transformers version reads (``arch.save_tokenizer``) and ``nla_meta.yaml`` (role ``av``,
    ``provenance`` merged into ``training``). What the warm-start and RL both write."""
    from nla.core.arch import save_tokenizer
    from nla.core.sidecar import write_sidecar

    directory = Path(directory)
    save_av_weights(model, directory, state_dict)
    save_tokenizer(tokenizer, directory)
    write_sidecar(directory, sidecar.replace(kind="nla_model", role="av"), **provenance)
    return directory


def load_av_model(path: str | Path, sidecar: Any, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An AV checkpoint dir as a causal LM, with its injection adapter attached when the sidecar has one."""
    from transformers import AutoModelForCausalLM

    check_adapter_named(path, sidecar)
    adapter = load_adapter_file(path, sidecar, dtype=dtype) if sidecar is not None and sidecar.injection_adapter else None
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True)
    if adapter is not None:
        attach_adapter(model, adapter)
    return model


def find_injection_sites(input_ids: Tensor, inj_id: int, left_id: int, right_id: int) -> Tensor:
    """Boolean mask [B, S] of valid sites (marker with the expected left and right neighbours)."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids: expected [B, S] (or [1, T] packed), found shape {tuple(input_ids.shape)}")
    sites = torch.zeros_like(input_ids, dtype=torch.bool)
    if input_ids.shape[1] < 3:
        return sites  # decode steps and very short inputs cannot hold a marker with two neighbours
    mid = input_ids[:, 1:-1] == inj_id
    mid &= input_ids[:, :-2] == left_id
    mid &= input_ids[:, 2:] == right_id
    sites[:, 1:-1] = mid
    return sites


def inject_at_marked_positions(
    input_ids: Tensor,
    embeddings: Tensor,
    vectors: Tensor,
    inj_id: int,
    left_id: int,
    right_id: int,
) -> Tensor:
    """Return a copy of ``embeddings`` [B, S, d] with ``vectors`` [N, d] written at the N sites.

    Out of place, so gradients flow to both the untouched embeddings and the vectors.
    ``vectors`` are written as given (cast to the embedding dtype): rescale them first.
    """
    if embeddings.shape[:2] != input_ids.shape:
        raise ValueError(
            f"embeddings {tuple(embeddings.shape)} do not match input_ids {tuple(input_ids.shape)} in [B, S]"
        )
    if vectors.ndim != 2 or vectors.shape[1] != embeddings.shape[-1]:
        raise ValueError(
            f"vectors: expected [N, d] with d = {embeddings.shape[-1]} (the embedding width), found "
            f"{tuple(vectors.shape)}; check that the vectors come from the same model family/layer as the sidecar"
        )
    sites = find_injection_sites(input_ids, inj_id, left_id, right_id)
    n_sites = int(sites.sum())
    if n_sites != vectors.shape[0]:
        markers = int((input_ids == inj_id).sum())
        raise ValueError(
            f"injection: found {n_sites} valid marker sites (token {inj_id} between {left_id} and {right_id}; "
            f"{markers} marker tokens in all) for {vectors.shape[0]} vectors in a batch of shape "
            f"{tuple(input_ids.shape)}. Likely causes: the prompt was not built from the sidecar's AV template "
            "with the chat template; the tokenizer is not the one the sidecar was written for; truncation cut "
            "the marker; or the number of vectors does not match the batch (repeat each vector once per sample "
            "when generating several samples per prompt)"
        )
    if n_sites == 0:
        return embeddings
    # index_put on a fresh tensor (not an in-place write into the embedding output) keeps autograd intact.
    rows, cols = sites.nonzero(as_tuple=True)  # row-major order
    return embeddings.index_put((rows, cols), vectors.to(dtype=embeddings.dtype, device=embeddings.device))


class InjectionHook:
    """Forward hook on a model's input-embedding module that injects vectors at marker sites.

    Rule for which forwards are injected: while ``with hook.vectors(v):`` is active, every
    forward whose ``input_ids`` contain at least one valid site gets the vectors (and the site
    count must equal ``len(v)``); forwards without any site pass unchanged. Under
    ``model.generate`` with a KV cache only the prefill holds the marker, so the decode steps
    pass through; without a cache every step re-reads the prompt and is injected again, which
    is also correct. If the block ends without any forward having held a site although some
    forward ran, that is an error (the marker was truncated away or the prompt is wrong).
    Outside a ``vectors`` block the hook does nothing.
    """

    def __init__(self, model: nn.Module, inj_id: int, left_id: int, right_id: int, scale: float | None,
                 adapter: InjectionAdapter | None = None) -> None:
        self.inj_id, self.left_id, self.right_id, self.scale = inj_id, left_id, right_id, scale
        # the learned map to the AV's width (None: inject the rescaled vector as it is)
        self.adapter = adapter if adapter is not None else get_adapter(model)
        self._vectors: Tensor | None = None
        self._forwards = 0
        self._applied = 0
        self._handle = model.get_input_embeddings().register_forward_hook(self._hook)

    @classmethod
    def from_config(cls, model: nn.Module, cfg: Any) -> InjectionHook:
        """Hook configured from an :class:`nla.core.sidecar.NLAConfig`."""
        cfg.need_av("injection")
        return cls(
            model,
            cfg.injection_token_id,
            cfg.injection_left_neighbor_id,
            cfg.injection_right_neighbor_id,
            cfg.injection_scale_value(),
        )

    @contextlib.contextmanager
    def vectors(self, v: Tensor) -> Iterator[InjectionHook]:
        """Inject ``v`` [N, d] (rescaled to ``scale``; raw if None) in the forwards inside the block."""
        if self._vectors is not None:
            raise RuntimeError("InjectionHook.vectors: blocks cannot be nested; leave the current block first")
        if v.ndim == 1:
            v = v.unsqueeze(0)
        if self.adapter is not None and v.shape[-1] != self.adapter.d_in:
            raise ValueError(f"injection: vectors of width {v.shape[-1]}, but this AV reads {self.adapter.d_in}-d vectors "
                             "(its injection adapter's d_in, the subject's d_model); extract them from that subject")
        self._vectors = normalize_activation(v, self.scale)
        self._forwards = self._applied = 0
        ok = False
        try:
            yield self
            ok = True
        finally:
            forwards, applied = self._forwards, self._applied
            self._vectors = None
        if ok and forwards > 0 and applied == 0:
            raise ValueError(
                f"InjectionHook: {forwards} forward(s) ran inside the vectors block but none contained a marker "
                f"site (token {self.inj_id} between {self.left_id} and {self.right_id}); the prompt was not built "
                "from the sidecar template, the tokenizer differs, or truncation cut the marker"
            )

    def _hook(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if self._vectors is None:
            return None
        self._forwards += 1
        input_ids = args[0] if args else None
        if not isinstance(input_ids, Tensor):
            return None
        ids = input_ids if input_ids.ndim == 2 else input_ids.unsqueeze(0)
        if not bool(find_injection_sites(ids, self.inj_id, self.left_id, self.right_id).any()):
            return None
        self._applied += 1
        out = output if output.ndim == 3 else output.unsqueeze(0)
        vectors = self._vectors if self.adapter is None else self.adapter(self._vectors)
        injected = inject_at_marked_positions(ids, out, vectors, self.inj_id, self.left_id, self.right_id)
        return injected if output.ndim == 3 else injected.squeeze(0)

    @property
    def applied_forwards(self) -> int:
        """How many forwards in the current (or last) block were injected."""
        return self._applied

    def remove(self) -> None:
        self._handle.remove()
