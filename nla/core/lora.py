"""LoRA for the AV: adapters injected with peft, the reference as the base with adapters off.

``apply_lora(model, settings)`` injects LoRA layers into a plain HF causal LM *in place*
(``peft.inject_adapter_in_model``), so the module stays the transformers class every other
part of nla reads (``nla.core.arch``, the injection hook, the log-prob kernels, HF ``generate``);
only the adapter weights are trainable. What peft does not do for this use, and is written
here:

- ``adapters_off(model)``: a context in which every LoRA layer computes its base layer only
  (``BaseTunerLayer.enable_adapters(False)``): the frozen reference of the KL term, with no
  second copy of the weights;
- ``merged_state_dict(model)``: the plain HF state dict of base + adapters (``W + B A *
  scale`` per adapted layer, computed out of place, so saving never rounds the base weights),
  which a checkpoint writes as an ordinary HF dir that ``NLAClient`` and ``nla eval`` load
  unchanged; ``merged_items`` is the same merge on (name, tensor) pairs, for a sharded model
  whose weights are gathered one tensor at a time (the Ray backend's rollout copies and saves);
- ``save_adapter`` / ``load_adapter``: the adapter alone, in peft's own format
  (``adapter_config.json`` + ``adapter_model.safetensors``, keys ``base_model.model.*``), so
  ``peft.PeftModel.from_pretrained(base, dir)`` also reads it; RL resumes from it on top of
  the warm-started AV (the reference must stay that base). ``nla_lora.json`` records the
  settings, the base's path and, when the base is a local dir, ``base_weights_sha256`` (the
  SHA-256 of the base's checksum record, ``base_fingerprint``): ``load_merged`` refuses an
  adapter on any other base, even one of the same shape. Reading an adapter dir checks
  ``nla_lora.json`` by schema and refuses pickled weight files before peft sees the dir.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["DEFAULT_TARGETS", "LORA_SUBDIR", "LoRASettings", "adapter_dir_for", "adapter_state", "adapters_off",
           "apply_lora", "apply_sft_lora", "base_fingerprint", "check_adapter_files", "check_base_weights", "has_lora",
           "held_state_bytes", "is_adapter_dir", "load_adapter", "load_merged", "lora_scaling", "merged_items",
           "merged_state_dict", "read_lora_meta", "save_adapter"]

# The linear projections of a Llama / Qwen2 / Gemma block (attention and MLP).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_PREFIX = "base_model.model."  # peft's PeftModel key prefix in adapter_model.safetensors
LORA_SUBDIR = "lora_adapter"  # a warm-start checkpoint's adapter: checkpoints/step_N/lora_adapter/


@dataclass(frozen=True)
class LoRASettings:
    """LoRA rank ``r`` (0: off, full fine-tuning), ``alpha`` (scale = alpha / r), ``dropout``
    and the module names to adapt."""

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none")


def adapter_dir_for(model_dir: str | Path) -> Path:
    """Where a checkpoint keeps the adapter of the merged model in ``model_dir``: ``<dir>_adapter``
    beside it (``checkpoints/step_N/av`` -> ``checkpoints/step_N/av_adapter``)."""
    model_dir = Path(model_dir)
    return model_dir.with_name(model_dir.name + "_adapter")


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError("lora.r > 0 needs peft: install it with `pip install 'nla[lora]'`") from None
    return peft


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            yield name, m


def has_lora(model: nn.Module) -> bool:
    """Whether LoRA layers were injected into ``model``."""
    try:
        return any(True for _ in _lora_layers(model))
    except ImportError:
        return False


def apply_lora(model: nn.Module, settings: LoRASettings, *, train: list[nn.Module] = (),
               adapter_dir: str | Path | None = None) -> nn.Module:
    """Inject ``settings``' adapters into ``model`` in place; only they stay trainable, and the
    modules in ``train`` in full (parts that start new: the AR's head, a warm-start's injection
    adapter). ``adapter_dir``: load the adapter weights ``save_adapter`` wrote there (a resume;
    ``model`` must hold the run's base weights, not a checkpoint's merged ones). Returns ``model``."""
    peft = _peft()
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in settings.target_modules if t not in present]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} are not modules of {type(model).__name__} "
                         f"(it has e.g. {sorted(n for n in present if n.endswith('proj'))[:8]}); name its linear layers")
    peft.inject_adapter_in_model(settings.peft_config(), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    for module in train:
        module.requires_grad_(True)
    model.nla_lora = settings  # what a checkpoint of this model records
    if adapter_dir is not None:
        load_adapter(model, adapter_dir)
    return model


def apply_sft_lora(model: nn.Module, settings: LoRASettings, resume_from: str | Path | None = None,
                   train: list[nn.Module] = ()) -> nn.Module:
    """LoRA for a warm-start (``nla train av`` / ``nla train ar``): ``apply_lora``, on resume with
    the adapter of the checkpoint ``resume_from``'s ``LORA_SUBDIR``."""
    return apply_lora(model, settings, train=train,
                      adapter_dir=None if resume_from is None else Path(resume_from) / LORA_SUBDIR)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Every LoRA layer of ``model`` computes its base layer only inside the block (the reference)."""
    layers = [m for _, m in _lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)  # (also marks the adapters trainable again, as they were)


_LORA_PART = re.compile(r"^(?P<layer>.+)\.(?:(?P<w>base_layer)\.weight|lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight)$")


def lora_scaling(model: nn.Module) -> float:
    """The factor on ``B @ A`` of ``model``'s adapters: ``alpha / r`` (peft's ``LoraLayer.scaling``)."""
    settings: LoRASettings = model.nla_lora
    return settings.alpha / settings.r


def merged_items(items: Iterable[tuple[str, Tensor]], scaling: float) -> Iterator[tuple[str, Tensor]]:
    """A LoRA model's (name, full tensor) pairs as the plain model's, adapters merged in.

    Streams: a layer's ``base_layer.weight``, ``lora_A`` and ``lora_B`` are held until all three
    have passed, then ``W + (B @ A) * scaling`` is yielded under the plain name (peft's
    ``get_delta_weight`` for a Linear, out of place); every other tensor passes at once under its
    plain name (``.base_layer.`` dropped). So a sharded model's weights can be gathered one
    tensor at a time (``RankGroup.copy_full_weights``) with at most one layer's parts held.
    peft merges a module it holds; gathered tensors have no module, hence this.
    """
    pending: dict[str, dict[str, Tensor]] = {}
    for key, value in items:
        m = _LORA_PART.match(key)
        if m is None:
            if ".lora_" in key:
                raise ValueError(f"LoRA merge: {key!r} is not a Linear layer's lora_A / lora_B weight; "
                                 "adapt only linear layers (lora.target_modules)")
            yield key.replace(".base_layer.", "."), value
            continue
        parts = pending.setdefault(m["layer"], {})
        parts["W" if m["w"] else m["ab"]] = value
        if len(parts) == 3:
            del pending[m["layer"]]
            w, a, b = parts["W"], parts["A"], parts["B"]
            delta = (b.float() @ a.float()) * scaling if w.dtype in (torch.float16, torch.bfloat16) else (b @ a) * scaling
            yield f"{m['layer']}.weight", w + delta.to(w.dtype)
    if pending:
        raise ValueError(f"LoRA merge: layers {sorted(pending)[:4]} lack their base weight, lora_A or lora_B")


@torch.no_grad()
def merged_state_dict(model: nn.Module, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The plain HF state dict of ``model`` with every adapter merged in (out of place).
    ``state``: the model's full state dict when it is sharded (gathered on the writing rank)."""
    return dict(merged_items((model.state_dict() if state is None else state).items(), lora_scaling(model)))


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter weights of a LoRA model's (full) state dict under peft's file keys
    (``base_model.model.<layer>.lora_A.weight``: the adapter name dropped, as
    ``peft.get_peft_model_state_dict`` names them)."""
    out = {}
    for key, value in state.items():
        m = _LORA_PART.match(key)
        if m is not None and m["ab"]:
            out[f"{ADAPTER_PREFIX}{m['layer']}.lora_{m['ab']}.weight"] = value.detach().contiguous().cpu()
    return out


def save_adapter(model: nn.Module, directory: str | Path, base_model: str | Path,
                 nla_dir: str | Path | None = None, state: dict[str, Tensor] | None = None) -> Path:
    """The adapter weights and config in peft's format (``PeftModel.from_pretrained`` reads it).
    ``nla_dir``: the checkpoint whose sidecar, tokenizer and injection adapter go with this
    adapter (a warm-start's own dir); None: the base's (RL, whose base is the warm-started AV).
    ``state``: the model's full state dict when it is sharded (as for ``merged_state_dict``)."""
    from safetensors.torch import save_file

    settings: LoRASettings = model.nla_lora
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model.state_dict() if state is None else state), str(directory / "adapter_model.safetensors"))
    config = settings.peft_config()
    base = str(Path(base_model).resolve()) if str(base_model) else ""
    config.base_model_name_or_path = base
    config.save_pretrained(str(directory))
    meta = {**asdict(settings), "base_model": base}
    if base and Path(base).is_dir():  # the exact weights this adapter was trained on (a hub id: none)
        fingerprint = base_fingerprint(base)
        if fingerprint is not None:
            meta["base_weights_sha256"] = fingerprint
    if nla_dir is not None:  # ".." for a checkpoint's own adapter, so the run dir can move
        home = Path(nla_dir).resolve()
        meta["nla_dir"] = ".." if home == directory.resolve().parent else str(home)
    (directory / "nla_lora.json").write_text(json.dumps(meta, indent=1))
    return directory


LORA_META = "nla_lora.json"
# nla_lora.json: key -> (accepted types, required). ``nla_dir`` and ``base_weights_sha256`` came later.
_META_SCHEMA: dict[str, tuple[tuple[type, ...], bool]] = {
    "r": ((int,), True), "alpha": ((int, float), True), "dropout": ((int, float), True),
    "target_modules": ((list,), True), "base_model": ((str,), True), "nla_dir": ((str,), False),
    "base_weights_sha256": ((str,), False),
}
# Weight files torch or peft would unpickle (adapter_model.bin is peft's fallback when no safetensors).
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def read_lora_meta(directory: str | Path) -> dict[str, Any]:
    """``directory``'s ``nla_lora.json``, checked by schema (an object with ``r`` > 0, ``alpha``,
    ``dropout``, ``target_modules`` (names), ``base_model``; ``nla_dir`` and
    ``base_weights_sha256`` optional), or an :class:`~nla.util.validation.InputError` naming the
    file, the key, what was expected and what was found."""
    from nla.util.validation import InputError

    path = Path(directory) / LORA_META
    fix = "re-save the adapter with nla (nla.core.lora.save_adapter), or load the merged AV dir beside it"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; this is not a LoRA adapter dir nla wrote") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not valid JSON ({err}); {fix}") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: expected a JSON object {{r, alpha, dropout, target_modules, base_model, ...}}, "
                         f"found a {type(meta).__name__}; {fix}")
    for key, (types, required) in _META_SCHEMA.items():
        if key not in meta:
            if required:
                raise InputError(f"{path}: missing key {key!r} (expected {' or '.join(t.__name__ for t in types)}); {fix}")
            continue
        value = meta[key]
        ok = isinstance(value, types) and not isinstance(value, bool)
        if ok and key == "r":
            ok = value > 0
        if ok and key == "target_modules":
            ok = bool(value) and all(isinstance(t, str) and t for t in value)
        if ok and key == "base_weights_sha256":
            ok = bool(re.fullmatch(r"[0-9a-f]{64}", value))
        if not ok:
            want = {"r": "a positive int", "target_modules": "a non-empty list of module names",
                    "base_weights_sha256": "64 hex digits"}.get(key, " or ".join(t.__name__ for t in types))
            raise InputError(f"{path}: {key}: expected {want}, found {value!r}; {fix}")
    return meta


def check_adapter_files(directory: str | Path) -> None:
    """Refuse an adapter dir holding a pickled weight file (``adapter_model.bin``, ``*.pt``, ...)
    before peft reads it: nla never unpickles (peft would, or fail with an UnpicklingError)."""
    from nla.util.validation import InputError

    d = Path(directory)
    pickled = sorted(f.name for f in d.iterdir() if f.suffix.lower() in PICKLED_SUFFIXES) if d.is_dir() else []
    if pickled:
        raise InputError(
            f"{d}: holds pickled weight file(s) {pickled}; nla never unpickles (loading a pickle can run any code): "
            "convert the adapter to safetensors (adapter_model.safetensors, e.g. peft's save_pretrained(..., "
            "safe_serialization=True)) and remove the pickled file(s)")


def base_fingerprint(directory: str | Path) -> str | None:
    """SHA-256 of a checkpoint's weights: of the ``nla_checksums.sha256`` lines (``<sha256>  <name>``,
    sorted by name) of its ``*.safetensors`` files, read from its checksum record when it has one
    (nla's saves; cheap), else computed (once per file and machine). None without safetensors files."""
    import hashlib

    from nla.util.checkpoint_files import file_sha256, read_checksums

    d = Path(directory)
    digests = read_checksums(d)
    if digests is None:
        digests = {f.name: file_sha256(f, use_record=True) for f in sorted(d.glob("*.safetensors")) if f.is_file()}
    if not digests:
        return None
    return hashlib.sha256("".join(f"{digests[n]}  {n}\n" for n in sorted(digests)).encode()).hexdigest()


def check_base_weights(directory: str | Path, meta: dict[str, Any], base: Path) -> None:
    """The base dir holds the weights the adapter was saved on (``base_weights_sha256``; an adapter
    saved before that field existed is checked by its base path only, as before)."""
    from nla.util.checkpoint_files import verify_checksums
    from nla.util.validation import InputError

    want = meta.get("base_weights_sha256")
    if want is None:
        return
    verify_checksums(base)  # its files match their record (NLA_VERIFY_CHECKSUMS), so the record's digest is theirs
    found = base_fingerprint(base)
    if found != want:
        raise InputError(
            f"{Path(directory) / LORA_META}: base_weights_sha256 {want[:12]}… but the base AV {base} (base_model) now "
            f"holds weights {(found or 'none')[:12]}…; the adapter was trained on other weights (another AV of the "
            "same shape, or a base re-saved since): load it with the base it was saved on, or load the merged AV "
            "dir beside the adapter")


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether ``directory`` is an adapter written by ``save_adapter`` (``nla_lora.json`` + peft files)."""
    d = Path(directory)
    return (d / "nla_lora.json").is_file() and (d / "adapter_config.json").is_file()


def load_merged(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Path]:
    """The plain AV of an adapter dir: its recorded base with the adapter merged in (peft's
    ``merge_and_unload``), and the dir whose sidecar, tokenizer and injection adapter the AV
    uses (``nla_dir`` when recorded, a warm-start's checkpoint; else the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nla.util.checkpoint_files import check_safetensors_file

    meta = read_lora_meta(directory)
    check_adapter_files(directory)
    weights = Path(directory) / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing; the adapter dir is incomplete: re-save the adapter, or load the "
                                "merged AV dir beside it")
    check_safetensors_file(weights)
    base = Path(meta.get("base_model") or "")
    if not str(base) or not (base / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: the adapter's base AV {str(base)!r} (nla_lora.json base_model) is "
                                "not a checkpoint dir here; load the merged AV dir beside the adapter instead")
    check_base_weights(directory, meta, base)
    from nla.core.injection import attach_adapter, check_adapter_named, load_adapter_file
    from nla.core.sidecar import SIDECAR_NAME, load_sidecar

    home = (Path(directory) / meta["nla_dir"]).resolve() if meta.get("nla_dir") else base
    if not (home / SIDECAR_NAME).is_file():
        raise FileNotFoundError(f"{directory}: the checkpoint this adapter belongs to, {str(home)!r} (nla_lora.json), "
                                f"has no {SIDECAR_NAME}; load the merged AV dir beside the adapter instead")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, use_safetensors=True)
    merged = PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    side = load_sidecar(home)
    check_adapter_named(home, side)
    if side.injection_adapter is not None:  # RL: frozen, the base AV's own; a warm-start: the one it trained
        attach_adapter(merged, load_adapter_file(home, side, dtype=dtype))
    return merged, home


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Load adapter weights written by ``save_adapter`` into ``model`` (already ``apply_lora``'d)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / "adapter_model.safetensors"
    check_adapter_files(directory)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no LoRA adapter here; resume a LoRA run from a checkpoint it wrote")
    state = {k.removeprefix(ADAPTER_PREFIX): v for k, v in load_file(str(path)).items()}
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ValueError(f"{path}: adapter weights {unexpected[:4]} do not match this model's LoRA layers "
                         "(another lora.r / target_modules?)")


def held_state_bytes(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes held for training: distinct parameter storages of ``modules`` (a module shared by two
    roles counts once), buffers, gradients held now, the optimizers' state tensors and the
    trainable part. ``total`` counts a gradient per trainable value (what the step holds at
    its peak; a finished step has set them to None)."""
    seen: set[int] = set()
    sizes = {"params": 0, "buffers": 0, "grads": 0}

    def count(t: Tensor, kind: str) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            sizes[kind] += t.numel() * t.element_size()

    for mod in modules:
        for p in mod.parameters():
            count(p, "params")
            if p.grad is not None:
                count(p.grad, "grads")
        for b in mod.buffers():
            count(b, "buffers")
    opt = sum(v.numel() * v.element_size() for o in optimizers for s in o.state.values() for v in s.values()
              if isinstance(v, Tensor) and v.numel() > 1)
    distinct = {id(p): p for mod in modules for p in mod.parameters() if p.requires_grad}
    trainable = sum(p.numel() * p.element_size() for p in distinct.values())
    return {**sizes, "optimizer": opt, "trainable": trainable,
            "total": sizes["params"] + sizes["buffers"] + max(sizes["grads"], trainable) + opt}
