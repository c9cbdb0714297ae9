"""Architecture adapters: the few places where Llama, Qwen2, Gemma-3 (text) and GPT-2 differ.

Everything else in nla talks to models through these functions, so supporting a new
family means adding a case here. Families are recognised by module attributes rather
than class names so that close relatives (Mistral, Qwen3, ...) work without changes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn


def _transformers_renamed_cache() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 24)


# transformers 5.24 renamed the KV cache of a forward: the ``cache=`` argument and the output's
# ``.cache`` (``past_key_values`` warns there, removed in 5.40). Before 5.24 a ``cache=`` argument
# is swallowed by ``**kwargs`` and silently ignored: the next token is then computed without its
# prefix. So every cached forward goes through ``cache_kwargs`` and ``output_cache``.
_CACHE_KW = "cache" if _transformers_renamed_cache() else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The forward keyword that passes a KV cache, for the installed transformers."""
    return {_CACHE_KW: cache}


def output_cache(out: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned."""
    return getattr(out, _CACHE_KW)


# Config attributes that hold one entry per decoder layer and must shrink with the layer count.
_PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers", "mlp_layer_types")


def text_config(config: Any) -> Any:
    """The text sub-config of multimodal configs (Gemma-3 ``text_config``); the config itself otherwise."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        return getter()
    return getattr(config, "text_config", config)


def max_positions(config: Any) -> int | None:
    """The positions the model was built for (``max_position_embeddings``, GPT-2's ``n_positions``), or
    None when its config names none: a longer input is extrapolated, not read (issue 58)."""
    tc = text_config(config)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(tc, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def hidden_size(config: Any) -> int:
    """Model width d."""
    tc = text_config(config)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(tc, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"cannot find the hidden size in {type(tc).__name__}: expected one of hidden_size / n_embd / d_model"
    )


def num_layers(config: Any) -> int:
    """Number of decoder blocks."""
    tc = text_config(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(tc, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"cannot find the layer count in {type(tc).__name__}: expected one of num_hidden_layers / n_layer / num_layers"
    )


def truncate_config(config: Any, n_layers: int) -> Any:
    """A copy of ``config`` with ``n_layers`` decoder blocks; per-layer lists (``layer_types``) cut to match."""
    total = num_layers(config)
    if not 1 <= n_layers <= total:
        raise ValueError(f"truncate_config: n_layers must be in 1..{total} (the model's layer count), found {n_layers}")
    new = copy.deepcopy(config)
    tc = text_config(new)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(tc, name, None), int):
            setattr(tc, name, n_layers)
    for name in _PER_LAYER_CONFIG_LISTS:
        value = getattr(tc, name, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(tc, name, list(value)[:n_layers])
    return new


def base_model(model: nn.Module) -> nn.Module:
    """The inner transformer (``model.model`` for Llama/Qwen2/Gemma-3, ``model.transformer`` for GPT-2).

    A model that already is the inner transformer is returned as is.
    """
    if _own_layers(model) is not None:
        return model
    for name in ("model", "transformer", "language_model"):
        inner = getattr(model, name, None)
        if isinstance(inner, nn.Module):
            if _own_layers(inner) is not None:
                return inner
            nested = getattr(inner, "language_model", None)  # multimodal wrappers
            if isinstance(nested, nn.Module) and _own_layers(nested) is not None:
                return nested
    raise ValueError(
        f"cannot find the decoder stack of {type(model).__name__}: expected .model.layers (Llama/Qwen2/Gemma) "
        "or .transformer.h (GPT-2); add the family to nla/core/arch.py"
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks."""
    layers = _own_layers(base_model(model))
    assert layers is not None  # base_model only returns modules that have them
    return layers


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block's activations in backward instead of keeping them
    (transformers' gradient checkpointing, non-reentrant, on the model's decoder stack).

    Memory for activations falls from one per block to one per model; a backward costs one more
    forward. The checkpointed blocks drop any KV cache they are given while gradients are on
    (transformers' rule: a recompute would write it twice), so a caller that continues from a
    cache (``nla.rl.kernels.response_logprobs``' shared prefix) must run without it. Under
    ``no_grad`` (generation, reference log-probs) the blocks run as they are, cache included.
    """
    base = base_model(model)
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # its name since transformers 5.2x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(base, "gradient_checkpointing_enable"):
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"gradient_checkpointing: {type(base).__name__} is no transformers model; it cannot "
                         "recompute its blocks")


def final_norm_name(base: nn.Module) -> str:
    """Attribute name of the final norm on the inner transformer (``norm`` or ``ln_f``)."""
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        if isinstance(getattr(base, name, None), nn.Module):
            return name
    raise ValueError(f"cannot find the final norm of {type(base).__name__}: expected .norm or .ln_f")


def embedding_scale(model: nn.Module) -> float:
    """Factor the embedding module multiplies its lookup by (Gemma: sqrt(d)); 1.0 for most families."""
    emb = model.get_input_embeddings()
    scale = getattr(emb, "scalar_embed_scale", None)
    if scale is None:
        scale = getattr(emb, "embed_scale", None)
    if scale is None:
        return 1.0
    if isinstance(scale, Tensor):
        return float(scale.item())
    return float(scale)


def build_input_embeds(model: nn.Module, input_ids: Tensor) -> Tensor:
    """Input embeddings built by hand from the embedding matrix, including the family's scale.

    Equals ``model.get_input_embeddings()(input_ids)`` for every supported family; use it when
    you need ``inputs_embeds`` without going through the module (and its forward hooks).
    GPT-2's learned position embeddings are added inside the model, not here.
    """
    weight = model.get_input_embeddings().weight
    embeds = torch.nn.functional.embedding(input_ids, weight)
    scale = embedding_scale(model)
    if scale != 1.0:
        # Gemma multiplies in the weight dtype; match it so the two paths agree bit for bit.
        embeds = embeds * torch.tensor(scale, dtype=weight.dtype, device=weight.device)
    return embeds


def _own_layers(module: nn.Module) -> nn.ModuleList | None:
    for name in ("layers", "h"):
        value = getattr(module, name, None)
        if isinstance(value, nn.ModuleList):
            return value
    return None


def load_tokenizer(path: str | Any, **kwargs: Any) -> Any:
    """Load a tokenizer, taking ``tokenizer.json`` verbatim when the directory has one.

    transformers 5's ``AutoTokenizer`` rebuilds the tokenizer of some model types (Qwen2
    among them) from the vocabulary with that family's own pre-tokenizer, ignoring a custom
    ``tokenizer.json``; the injection marker and the AR tail would then tokenise differently
    from training. The generic fast backend reads the file as saved.
    """
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    try:
        if p.is_dir() and (p / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(p, **kwargs)
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as err:  # noqa: BLE001 - tokenizers, json and HF raise a mix; all mean "cannot load"
        files = sorted(f.name for f in p.iterdir() if "token" in f.name or f.suffix in (".model", ".txt")) \
            if p.is_dir() else []
        raise ValueError(
            f"{path}: the tokenizer cannot be loaded ({' '.join(str(err).split())[:200]}); tokenizer files there: "
            f"{files or 'none'}. A damaged or missing tokenizer.json: copy it again from where the checkpoint "
            "came from") from None


# The tokenizer class every transformers (4.x and 5.x) and SGLang resolve to "read tokenizer.json as
# saved". transformers 5 writes ``TokenizersBackend``, a class 4.x does not have.
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def save_tokenizer(tokenizer: Any, directory: Any) -> None:
    """``tokenizer.save_pretrained(directory)``, then ``tokenizer_config.json`` made readable by
    transformers 4.57 (what the published NLA stack pins) as well as 5.x.

    transformers 5 writes what 4.57 cannot load: ``"tokenizer_class": "TokenizersBackend"`` (4.57:
    "does not exist") and ``extra_special_tokens`` as a list (4.57 takes a mapping there: "'list'
    object has no attribute 'keys'"; a list belongs in ``additional_special_tokens``, which 5.x
    reads too). With a ``tokenizer.json`` beside it the class becomes ``PreTrainedTokenizerFast``:
    every version then reads the file verbatim, as ``load_tokenizer`` does. Last, a declared BOS
    that tokenization never adds (``tok(text)`` does not start with it) is not declared in the
    saved config: nla's AR was trained on ``tok(text)``, and the published reconstructor reader
    refuses a tokenizer whose ``bos_token_id`` is set but not produced (its ARs were trained with
    the BOS that Gemma's and Llama's tokenizers add). Where the chat template uses ``bos_token``
    the declaration stays (the AV's prompt depends on it), with a warning.
    """
    import json
    import logging
    from pathlib import Path

    tokenizer.save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if (Path(directory) / "tokenizer.json").is_file():
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        del config["extra_special_tokens"]
        named = list(config.get("additional_special_tokens") or [])
        config["additional_special_tokens"] = named + [t for t in extra if t not in named]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and config.get("bos_token") is not None:
        probe = tokenizer("x", add_special_tokens=True)["input_ids"]
        if not probe or probe[0] != bos:
            template = getattr(tokenizer, "chat_template", None) or ""
            if "bos_token" in (template if isinstance(template, str) else str(template)):
                logging.getLogger(__name__).warning(
                    "%s: the tokenizer declares BOS %r but does not add it, and its chat template uses it; the "
                    "declaration stays, so the published reconstructor reader will refuse this tokenizer",
                    directory, config["bos_token"])
            else:
                config["bos_token"] = None
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) sharded ``module`` itself (``FSDPModule``; a torch build
    without ``torch.distributed`` shards nothing)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)
