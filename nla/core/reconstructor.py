"""The activation reconstructor (AR): text -> vector.

The subject model truncated to blocks 0..K, its final norm replaced by the identity (the
target is the raw residual stream after block K, which is not normalised), no LM head, and
a ``Linear(d, d, bias=False)`` value head initialised to the identity so that training starts
from "the residual stream at the last token is the prediction".

Notation: B rows, T positions, d width.

Departures from a plain ``AutoModel`` forward:
1. Position ids are derived from the attention mask (``cumsum - 1``), so a left-padded row
   gives the same values as the same row unpadded; HF's default positions would shift it.
2. K = the subject's last layer is allowed; note that HF's ``hidden_states[-1]`` of the
   subject is *after* its final norm, while the AR (and the extraction target, block K's
   output) is before it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from nla.core import arch
from nla.core.sidecar import SIDECAR_NAME, NLAConfig, load_sidecar, write_sidecar
from nla.core.vectors import mse_nrm, normalize_activation, ridge_solve
from nla.util.checkpoint_files import check_checkpoint

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"
# A pair of several blocks whose AR reads each row at its own block (``Reconstructor.exits``): a head a block,
# keys the blocks, the file's metadata the block each is read after (nla's file; without it the AR reads every
# row after its deepest block through ``value_head``).
EXIT_HEADS_FILE = "exit_heads.safetensors"
# Rows of a shallower block are read after this block: read after block 0, the last token has gathered the
# explanation through one attention layer only. Measured on the world's layers preset (seeds 0-2, AR warm-start,
# dev/experiments/ar_exits.py): block 0 read after block 1 beats it read after block 0 and after block 3.
EXIT_MIN_BLOCK = 1


def exit_map(blocks: Any, deepest: int, min_block: int = EXIT_MIN_BLOCK) -> dict[int, int]:
    """Block -> the block its rows are read after: block k after ``max(k, min_block)``, at most ``deepest``."""
    return {int(k): min(max(int(k), int(min_block)), int(deepest)) for k in blocks}


def last_token_index(attention_mask: Tensor) -> Tensor:
    """Index of each row's last real token [B], for left or right padding (argmax takes the first max)."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask: expected [B, T], found shape {tuple(attention_mask.shape)}")
    return attention_mask.long().cumsum(1).argmax(1)


def check_ar_max_length(max_length: int, suffix: tuple[int, ...] | None, what: str) -> None:
    """``max_length`` must hold the AR template's constant tail (``critic_suffix_ids``, which the AR
    reads its answer after) and at least one explanation token: texts are cut on the left, so a
    shorter cap cuts the tail itself and every prediction reads the wrong position."""
    if suffix is None:
        return
    need = len(suffix) + 1
    if max_length < need:
        raise ValueError(
            f"{what}: {max_length} tokens cannot hold the AR template's constant tail ({len(suffix)} tokens, "
            f"critic_suffix_ids) and an explanation; at least {need} (the default is 256)")


def tokenize_ar_texts(tokenizer: Any, texts: list[str], max_length: int, padding_side: str = "right"
                      ) -> dict[str, Tensor]:
    """Tokenise full AR texts [B] -> ``input_ids`` / ``attention_mask`` [B, T], truncated on the left.

    Left truncation keeps the constant AR suffix the prediction is read at. Training pads on
    the right; the RL reward path pads on the left like a batched inference server (the RL
    step-0 guard checks both give the same MSE). Every caller tokenises here, with default
    special tokens and no EOS after the suffix, or its predictions would not match the
    trained layout.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: expected 'left' or 'right', found {padding_side!r}")
    old_side, old_pad = tokenizer.truncation_side, tokenizer.padding_side
    tokenizer.truncation_side, tokenizer.padding_side = "left", padding_side
    try:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    finally:
        tokenizer.truncation_side, tokenizer.padding_side = old_side, old_pad
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def reconstruction_loss(ar: nn.Module, input_ids: Tensor, attention_mask: Tensor, gold: Tensor,
                        scale: float | None, blocks: Any = None) -> tuple[Tensor, Tensor]:
    """The AR's training loss: mean ``mse_nrm`` of its prediction [B, d] against RAW ``gold`` [B, d].

    Returns ``(loss, pred)``. The one definition used by the warm-start (``nla.train.ar``)
    and the online RL update on both backends. ``blocks``: each row's block, for an AR with ``exits``.
    """
    pred = ar.predict(input_ids, attention_mask) if blocks is None else ar.predict(input_ids, attention_mask,
                                                                                     blocks=blocks)
    return mse_nrm(pred, gold.to(pred.device), scale).mean(), pred


# Decoder blocks ``Reconstructor._predict_last_block`` knows (pre-norm, RoPE, q/k/v/o projections).
LAST_BLOCK_MODEL_TYPES = frozenset({"llama", "qwen2"})


# ``_predict_last_block`` stops the base forward at the last block's input with a forward
# pre-hook that raises. The hook stays on the block and acts only for the thread that asked
# (``_CAPTURE.block``): swapping the block out of the live module, as before, broke a concurrent
# forward on a shared AR (the explorer's threads; issue 20, defect 4).
_CAPTURE = threading.local()
_HOOK_LOCK = threading.Lock()


class _BlockInput(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """Raised by the capture hook: the last block's input and the keyword arguments the model gave it."""

    def __init__(self, hidden_states: Tensor, kwargs: dict[str, Any]) -> None:
        super().__init__("captured the last block's input")
        self.hidden_states, self.kwargs = hidden_states, kwargs


def _capture_block_input(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if getattr(_CAPTURE, "block", None) is module:
        raise _BlockInput(args[0] if args else kwargs["hidden_states"], kwargs)


def _keep_block_output(module: nn.Module, args: tuple, output: Any) -> None:
    kept = getattr(_CAPTURE, "outputs", None)
    if kept is not None and module in kept:
        kept[module] = output[0] if isinstance(output, tuple) else output


def _output_hooked(block: nn.Module) -> None:
    """Register the output-keeping hook on ``block`` once (acts only for the thread that set ``_CAPTURE.outputs``)."""
    if getattr(block, "_nla_output_hook", False):
        return
    with _HOOK_LOCK:
        if not getattr(block, "_nla_output_hook", False):
            block.register_forward_hook(_keep_block_output)
            block._nla_output_hook = True


def _rows_of(value: Any, rows: Tensor, batch: int) -> Any:
    """``value`` (a block's keyword argument) cut to ``rows`` of its ``batch``: tensors of two or more dims whose
    first is the batch (masks, position ids, rotary tables), tuples of them; anything else as it is."""
    if isinstance(value, Tensor):
        return value[rows] if value.ndim >= 2 and value.shape[0] == batch and batch > 1 else value
    if isinstance(value, tuple):
        return tuple(_rows_of(v, rows, batch) for v in value)
    return value


def _capture_hooked(block: nn.Module) -> None:
    """Register the capture hook on ``block`` once (never removed: hooks are shared by threads)."""
    if getattr(block, "_nla_capture_hook", False):
        return
    with _HOOK_LOCK:
        if not getattr(block, "_nla_capture_hook", False):
            block.register_forward_pre_hook(_capture_block_input, with_kwargs=True)
            block._nla_capture_hook = True


class _SkippedNorm(nn.Module):
    """Identity that keeps the replaced norm's parameters under the same names.

    Keeping them means the saved directory is a normal HF checkpoint that loads without
    missing-key warnings; they are frozen because they never touch the output.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        for name, param in norm.named_parameters(recurse=False):
            self.register_parameter(name, nn.Parameter(param.detach().clone(), requires_grad=False))

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


class Reconstructor(nn.Module):
    """Truncated subject model + identity-initialised value head. ``forward -> [B, T, d]``."""

    def __init__(self, base: nn.Module, value_head: nn.Linear | None = None, tokenizer: Any = None,
                 sidecar: NLAConfig | None = None, out_dim: int | None = None) -> None:
        super().__init__()
        self.base = base
        d = arch.hidden_size(base.config)
        if value_head is None:
            # out_dim: the subject's width when the AR is another model (a cross-model pair); the head
            # then starts as a norm-keeping random map (nla.core.injection.adapter_init), not the identity.
            from nla.core.injection import adapter_init

            out = d if out_dim is None else int(out_dim)
            value_head = nn.Linear(d, out, bias=False)
            with torch.no_grad():
                value_head.weight.copy_(adapter_init(d, out).to(value_head.weight.dtype))
        self.value_head = value_head
        # a pair of several blocks reading each row at its own block (set_exits): block -> the block it is read
        # after, and a head a block (ModuleDict keys: the blocks as strings)
        self.exits: dict[int, int] | None = None
        self.exit_heads: nn.ModuleDict | None = None
        self.tokenizer = tokenizer
        self.sidecar = sidecar
        norm_name = arch.final_norm_name(base)
        norm = getattr(base, norm_name)
        if not isinstance(norm, _SkippedNorm):
            setattr(base, norm_name, _SkippedNorm(norm))

    @property
    def config(self) -> Any:
        return self.base.config

    @property
    def layer_index(self) -> int:
        """K: the AR keeps blocks 0..K."""
        return arch.num_layers(self.base.config) - 1

    @classmethod
    def from_base(cls, base: str | os.PathLike | nn.Module, layer_index: int, tokenizer: Any = None,
                  sidecar: NLAConfig | None = None, out_dim: int | None = None, **load_kwargs: Any) -> Reconstructor:
        """Build an AR from a subject model (path, hub name or instance) keeping blocks 0..``layer_index``.

        ``out_dim``: the width of the vectors it predicts when ``base`` is another model than the
        subject (its head maps its own width to the subject's); None: the base's own width.

        A path/name loads only K+1 blocks (``AutoModel`` with a truncated config: the rest is
        never allocated). An instance is deep-copied first, so training the AR never changes it.
        """
        from transformers import AutoConfig

        n_keep = layer_index + 1
        if isinstance(base, nn.Module):
            inner = copy.deepcopy(arch.base_model(base))
            total = arch.num_layers(inner.config)
            _check_layer(layer_index, total)
            layers = arch.decoder_layers(inner)
            for name in ("layers", "h"):
                if getattr(inner, name, None) is layers:
                    setattr(inner, name, nn.ModuleList(list(layers)[:n_keep]))
            inner.config = arch.truncate_config(inner.config, n_keep)
        else:
            if Path(base).is_dir():
                check_checkpoint(base, "base model")
            config = AutoConfig.from_pretrained(base)
            _check_layer(layer_index, arch.num_layers(config))
            config = arch.truncate_config(arch.text_config(config), n_keep)
            inner = arch.base_model(_load_truncated(base, config, n_keep, load_kwargs))
            if tokenizer is None:
                tokenizer = _maybe_tokenizer(base)
        return cls(inner, tokenizer=tokenizer, sidecar=sidecar, out_dim=out_dim)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Values at every position [B, T, d] (fp32 head input is the model dtype)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False)
        hidden = out.last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype))

    def predict(self, input_ids: Tensor, attention_mask: Tensor | None = None, blocks: Any = None) -> Tensor:
        """Prediction [B, d] at each row's last real token.

        For ``LAST_BLOCK_MODEL_TYPES`` the last block runs its query, attention output and MLP
        at that token only (``_predict_last_block``); other models run ``forward`` and read it.
        ``blocks``: each row's block, for an AR with ``exits`` (each row read after its block's exit
        through its block's head: ``_predict_exits``); ignored by an AR without.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.exits is not None:
            return self._predict_exits(input_ids, attention_mask, self._exit_rows(blocks, input_ids.shape[0]))
        if self.last_block_fast:
            return self._predict_last_block(input_ids, attention_mask)
        values = self(input_ids, attention_mask)
        idx = last_token_index(attention_mask)
        return values[torch.arange(values.shape[0], device=values.device), idx]

    def set_exits(self, layers: Any, min_block: int = EXIT_MIN_BLOCK) -> dict[int, int]:
        """Read each row at its own block: a row of block k after block ``max(k, min_block)`` (at most K) through a
        head of block k's own, each a copy of ``value_head`` (the identity for a same-model AR: "the residual
        stream after the block is the prediction", what a one-block pair's AR starts from). ``layers``: the
        pair's blocks (``extraction.layers``), the deepest K. Returns the map block -> block read after.

        Rows read before block K need blocks 0..their exit only: ``_predict_exits`` runs each row that far.
        """
        blocks = [int(k) for k in layers]
        K = self.layer_index
        if len(blocks) < 2 or blocks != sorted(set(blocks)) or blocks[-1] != K or blocks[0] < 0:
            raise ValueError(f"exits: expected the pair's blocks in increasing order, the deepest this AR's K = {K}, "
                             f"found {blocks}; give extraction.layers of the dataset the AR reads")
        self.exits = exit_map(blocks, K, min_block)
        heads = {}
        for k in blocks:
            h = nn.Linear(self.value_head.in_features, self.value_head.out_features, bias=False,
                          dtype=self.value_head.weight.dtype, device=self.value_head.weight.device)
            with torch.no_grad():
                h.weight.copy_(self.value_head.weight)
            heads[str(k)] = h
        self.exit_heads = nn.ModuleDict(heads)
        return dict(self.exits)

    def _exit_rows(self, blocks: Any, n: int) -> Tensor:
        if blocks is None:
            raise ValueError(f"blocks: this AR reads each row at its own block (exits {self.exits}) and needs each "
                             "row's block; pass blocks=[...] (one of the pair's blocks a row)")
        b = torch.as_tensor(blocks).reshape(-1).long().cpu()
        if b.numel() != n:
            raise ValueError(f"blocks: expected one block a row ({n} rows), found {b.numel()}")
        bad = sorted({int(k) for k in b.tolist()} - set(self.exits))
        if bad:
            raise ValueError(f"blocks: block(s) {bad} are not ones this AR reads (its blocks: {sorted(self.exits)})")
        return b

    def _predict_exits(self, input_ids: Tensor, attention_mask: Tensor, blocks: Tensor) -> Tensor:
        """``predict`` of an AR with ``exits``: row i read after block ``exits[blocks[i]]`` at its last real token,
        through ``exit_heads[blocks[i]]``.

        Where ``last_block_fast`` holds for every block (Llama/Qwen2, no sliding window), blocks run one by one
        from block 0's input on the rows still going (a row stops at its exit, read there at its last token only,
        as ``_predict_last_block`` does); other models run the whole forward and read the blocks' outputs (forward
        hooks). Tests hold the two to each other and to a plain forward read at each block.
        """
        B = input_ids.shape[0]
        exit_of = torch.tensor([self.exits[int(k)] for k in blocks.tolist()])
        dec = arch.decoder_layers(self.base)
        idx = last_token_index(attention_mask)
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
        features: list[tuple[Tensor, Tensor]] = []  # (rows, their read features)
        if self._exits_stepwise:
            first = dec[0]
            _capture_hooked(first)
            _CAPTURE.block = first
            try:
                self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
                raise RuntimeError("Reconstructor: the base forward never reached its first block")
            except _BlockInput as got:
                x = got.hidden_states  # block 0's input
                kw = {k: v for k, v in got.kwargs.items() if k != "hidden_states"}
            finally:
                _CAPTURE.block = None
            going = torch.arange(B)
            for r, block in enumerate(dec):
                here = exit_of[going] == r
                if here.any():
                    rows = going[here].to(x.device)
                    sub = {k: _rows_of(v, rows, B) for k, v in kw.items()}
                    features.append((going[here], self._block_at_last(block, x[here.to(x.device)], sub,
                                                                      attention_mask[rows])))
                on = exit_of[going] > r
                if not on.any():
                    break
                rows = going[on].to(x.device)
                sub = {k: _rows_of(v, rows, B) for k, v in kw.items()}
                out = block(x[on.to(x.device)], **sub)
                x, going = (out[0] if isinstance(out, tuple) else out), going[on]
        else:
            wanted = sorted(set(exit_of.tolist()))
            for r in wanted:
                _output_hooked(dec[r])
            _CAPTURE.outputs = {dec[r]: None for r in wanted}
            try:
                self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
                kept = _CAPTURE.outputs
            finally:
                _CAPTURE.outputs = None
            for r in wanted:
                rows = (exit_of == r).nonzero().reshape(-1)
                h = kept[dec[r]]
                dev = rows.to(h.device)
                features.append((rows, h[dev, idx[dev]]))
        order = torch.cat([rows for rows, _ in features])
        feats = torch.cat([f for _, f in features])
        feats = feats[torch.argsort(order).to(feats.device)]  # back to the rows' order
        head_dtype = self.value_head.weight.dtype
        out = None
        for k in sorted(set(blocks.tolist())):
            sel = (blocks == k).nonzero().reshape(-1).to(feats.device)
            pred = self.exit_heads[str(k)](feats[sel].to(head_dtype))
            if out is None:
                out = pred.new_zeros(B, pred.shape[-1])
            out = out.index_put((sel,), pred)
        return out

    @property
    def _exits_stepwise(self) -> bool:
        """Whether ``_predict_exits`` may run the blocks one by one from block 0's input: what ``last_block_fast``
        asks of the last block, of every block (the kwargs the model gives block 0 are then every block's)."""
        return self.last_block_fast and all(
            getattr(b, "self_attn", None) is not None and getattr(b.self_attn, "sliding_window", None) is None
            and not arch.is_sharded(b) for b in arch.decoder_layers(self.base))

    @property
    def last_block_fast(self) -> bool:
        """Whether ``predict`` may run the last block at the read token only (see ``_predict_last_block``)."""
        if getattr(self.config, "model_type", None) not in LAST_BLOCK_MODEL_TYPES:
            return False
        last = arch.decoder_layers(self.base)[-1]
        attn = getattr(last, "self_attn", None)
        sharded = any(arch.is_sharded(m) for m in (self.base, last))
        dropout = self.training and float(getattr(self.config, "attention_dropout", 0.0) or 0.0) > 0
        return (attn is not None and getattr(attn, "sliding_window", None) is None and not sharded
                and not dropout and getattr(self.config, "_attn_implementation", "sdpa") in ("sdpa", "eager"))

    def _predict_last_block(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``predict`` with the last block computed at each row's last real token only.

        Only that token's output is read, and a block mixes positions only through attention,
        whose keys and values come from the block's *input*: so blocks 0..K-1 run as usual,
        the last block's keys and values are computed at every position, and its query,
        attention output, MLP and the value head at one position per row. The same math as
        ``forward`` (tests hold values and gradients to it), about a (1 - 1/n_blocks) share of
        the last block's matmuls fewer. Llama/Qwen2 blocks (pre-norm, RoPE, GQA). The base forward
        stops at the last block's input (a pre-hook that acts for this thread only), so other
        threads may run any forward on the same AR meanwhile.
        """
        last = arch.decoder_layers(self.base)[-1]
        _capture_hooked(last)
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
        _CAPTURE.block = last
        try:
            self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            raise RuntimeError("Reconstructor: the base forward never reached its last block")
        except _BlockInput as got:
            x, captured = got.hidden_states, got.kwargs  # block K's input
        finally:
            _CAPTURE.block = None
        r = self._block_at_last(last, x, captured, attention_mask)
        return self.value_head(r.to(self.value_head.weight.dtype))

    @staticmethod
    def _block_at_last(block: nn.Module, x: Tensor, captured: dict[str, Any], attention_mask: Tensor) -> Tensor:
        """``block``'s output [B, d] at each row's last real token, from its input ``x`` [B, T, d] and the keyword
        arguments the model gives it (``captured``: its rotary tables): keys and values at every position, the
        query, attention output and MLP at that token only (Llama/Qwen2 blocks)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = captured["position_embeddings"]  # [B or 1, T, head_dim]
        B, T, _ = x.shape
        rows = torch.arange(B, device=x.device)
        idx = last_token_index(attention_mask)
        attn = block.self_attn
        hd = attn.head_dim
        h = block.input_layernorm(x)
        q = attn.q_proj(h[rows, idx][:, None]).view(B, 1, -1, hd).transpose(1, 2)  # [B, heads, 1, hd]
        k = attn.k_proj(h).view(B, T, -1, hd).transpose(1, 2)  # [B, kv_heads, T, hd]
        v = attn.v_proj(h).view(B, T, -1, hd).transpose(1, 2)
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        q, _ = apply_rotary_pos_emb(q, q, cos[rows, idx][:, None], sin[rows, idx][:, None])
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        # the read token is each row's last real one: it sees every real position (left or right padding)
        keep = attention_mask.bool()[:, None, None, :]
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=attn.scaling)
        r = x[rows, idx][:, None] + attn.o_proj(a.transpose(1, 2).reshape(B, 1, -1))
        r = r + block.mlp(block.post_attention_layernorm(r))
        return r[:, 0]

    @torch.no_grad()
    def read_features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The value head's input [B, d] at each row's last real token (block K's output)."""
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp_min(0)
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        idx = last_token_index(attention_mask)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]

    @torch.no_grad()
    def fit_head(self, features: Tensor, gold: Tensor, scale: float | None, ridge: float = 1e-3) -> float:
        """Set the value head to the ridge regression of the normalised golds on ``features``.

        ``W = argmin ||F W^T - G||^2 + lam ||W||^2`` with ``G`` = ``gold`` [N, d_out] rescaled to
        ``scale`` (the loss compares normalised vectors) and ``lam = ridge * trace(F^T F) / d_in``:
        a linear probe of the base's own features, the start of a cross-model AR (the identity,
        a same-model AR's start, has no meaning between two widths; linear probing before
        fine-tuning, Kumar et al. 2022). In float64. Returns the mean ``mse_nrm`` of the fit.
        """
        f = features.double().cpu()
        w = ridge_solve(f, normalize_activation(gold.float(), scale), ridge)  # [d_out, d_in]
        self.value_head.weight.copy_(w.to(self.value_head.weight.dtype))
        return float(mse_nrm((f @ w.T).float(), gold.float(), scale).mean())

    def save_pretrained(self, directory: str | os.PathLike, sidecar: NLAConfig | None = None, *,
                        state_dict: dict[str, Tensor] | None = None, **provenance: Any) -> Path:
        """Write an HF dir + ``value_head.safetensors`` + tokenizer + ``nla_meta.yaml`` (role "ar"), atomically.

        Everything goes to a temp dir beside ``directory`` that is then renamed into place, so a
        crash leaves either the old checkpoint or the new one, never a mix. ``state_dict``: the
        full weights to write instead of the module's own (a sharded module gathers them first).
        """
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            exits = {} if self.exits is None else {str(k): f"exit_heads.{k}.weight" for k in self.exits}
            if state_dict is None:
                base_state, head = None, self.value_head.weight
                own = dict(self.named_parameters())
                heads = {k: own[name] for k, name in exits.items()}
            else:
                base_state = {k.removeprefix("base."): v for k, v in state_dict.items() if k.startswith("base.")}
                head = state_dict["value_head.weight"]
                heads = {k: state_dict[name] for k, name in exits.items()}
            self.base.save_pretrained(tmp, state_dict=base_state, safe_serialization=True)
            save_file({"weight": head.detach().cpu().contiguous()}, str(tmp / VALUE_HEAD_FILE))
            if heads:  # the metadata: the block each head's rows are read after
                save_file({k: w.detach().cpu().contiguous() for k, w in heads.items()}, str(tmp / EXIT_HEADS_FILE),
                          metadata={"read_after": json.dumps({str(k): int(r) for k, r in self.exits.items()})})
            if self.tokenizer is not None:
                arch.save_tokenizer(self.tokenizer, tmp)
            meta = sidecar if sidecar is not None else self.sidecar
            if meta is not None:
                meta = meta.replace(kind="nla_model", role="ar", layer_index=self.layer_index)
                write_sidecar(tmp / SIDECAR_NAME, meta, **provenance)
            _replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    @torch.no_grad()
    def load_head(self, directory: str | os.PathLike) -> None:
        """Set the head from a checkpoint's ``VALUE_HEAD_FILE`` (a LoRA run resumes as its base's
        body + the saved adapter + this head), and its exits' heads where it has ``EXIT_HEADS_FILE``."""
        self.value_head.weight.copy_(load_file(str(Path(directory) / VALUE_HEAD_FILE))["weight"])
        exits = Path(directory) / EXIT_HEADS_FILE
        if exits.is_file():
            self._install_exits(exits)

    def _install_exits(self, file: Path) -> None:
        """Set ``exits`` and ``exit_heads`` from ``file`` (``EXIT_HEADS_FILE``); an AR that has exits already
        must read its rows where the file's heads do."""
        read_after, weights = _load_exit_heads(file)
        if self.exits is not None and self.exits != read_after:
            raise ValueError(f"{file}: its heads are read after {read_after}, this AR's after {self.exits}")
        w0 = self.value_head.weight
        heads = {}
        for k, w in weights.items():
            if tuple(w.shape) != tuple(w0.shape):
                raise ValueError(f"{file}: block {k}'s head has shape {tuple(w.shape)}, expected {tuple(w0.shape)} "
                                 "(value_head's)")
            h = nn.Linear(w0.shape[1], w0.shape[0], bias=False, dtype=w.dtype, device=w0.device)
            with torch.no_grad():
                h.weight.copy_(w)
            heads[str(k)] = h
        self.exits, self.exit_heads = read_after, nn.ModuleDict(heads)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **load_kwargs: Any) -> Reconstructor:
        """Load a directory written by :meth:`save_pretrained` (safetensors only, nothing unpickled)."""
        from transformers import AutoModel

        path = Path(directory)
        head_file = path / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise FileNotFoundError(
                f"{path} is not a reconstructor checkpoint: {VALUE_HEAD_FILE} is missing; build one with "
                "Reconstructor.from_base(...) and save_pretrained"
            )
        check_checkpoint(path, "reconstructor", extra=(VALUE_HEAD_FILE,))
        inner = arch.base_model(AutoModel.from_pretrained(path, use_safetensors=True, **load_kwargs))
        weight = load_file(str(head_file))["weight"]
        d = arch.hidden_size(inner.config)
        sidecar = load_sidecar(path) if (path / SIDECAR_NAME).is_file() else None
        # [subject width, own width]: square unless the AR is another model than the subject
        out = sidecar.d_model if sidecar is not None else (d if weight.ndim != 2 else int(weight.shape[0]))
        if tuple(weight.shape) != (out, d):
            raise ValueError(f"{head_file}: value head weight has shape {tuple(weight.shape)}, expected ({out}, {d}) "
                             f"(the subject's d_model, the AR's own width); the head does not belong to this checkpoint")
        head = nn.Linear(d, out, bias=False, dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight)
        n_blocks = arch.num_layers(inner.config)
        if sidecar is not None and sidecar.layer_index is not None and sidecar.layer_index + 1 != n_blocks:
            # The sidecar records K (ar.num_hidden_layers or extraction.layer_index); the AR keeps K+1 blocks.
            raise ValueError(
                f"{path}: the sidecar records layer K = {sidecar.layer_index}, so the AR should keep K+1 = "
                f"{sidecar.layer_index + 1} blocks, but config.json has {n_blocks}; the checkpoint is inconsistent, "
                "re-save it (or fix ar.num_hidden_layers in nla_meta.yaml to K)"
            )
        ar = cls(inner, value_head=head, tokenizer=_maybe_tokenizer(path), sidecar=sidecar)
        exits = path / EXIT_HEADS_FILE
        if exits.is_file():
            ar._install_exits(exits)
            if sidecar is not None and sidecar.layers is not None and list(sidecar.layers) != sorted(ar.exits):
                raise ValueError(f"{exits}: heads for blocks {sorted(ar.exits)}, but the sidecar's extraction.layers "
                                 f"are {list(sidecar.layers)}; the checkpoint is inconsistent")
        return ar


def _load_exit_heads(file: Path) -> tuple[dict[int, int], dict[int, Tensor]]:
    """``EXIT_HEADS_FILE``'s map block -> block read after, and its heads' weights a block, checked."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
        weights = {int(k): f.get_tensor(k) for k in f.keys()}
    try:
        read_after = {int(k): int(v) for k, v in json.loads(meta["read_after"]).items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        raise ValueError(f"{file}: no readable 'read_after' metadata (expected a JSON map block -> block); "
                         "re-save the AR with Reconstructor.save_pretrained") from None
    if sorted(read_after) != sorted(weights) or any(r < k for k, r in read_after.items()):
        raise ValueError(f"{file}: heads for blocks {sorted(weights)}, read after {read_after}: expected one head a "
                         "block, each read after a block at or past its own")
    return dict(sorted(read_after.items())), weights


def _check_layer(layer_index: int, total: int) -> None:
    if not 0 <= layer_index < total:
        raise ValueError(
            f"layer_index: expected 0..{total - 1} (the subject model has {total} blocks), found {layer_index}"
        )


_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _load_truncated(base: str | os.PathLike, config: Any, n_keep: int, load_kwargs: dict[str, Any]) -> nn.Module:
    """Blocks 0..n_keep-1 of the model at ``base``. The blocks past the cut and the LM head are left
    out on purpose, so transformers' load report (a table of UNEXPECTED keys that reads as an error)
    is silenced; any other unexpected or missing key is still reported, here, by name."""
    from transformers import AutoModel

    report_logger = logging.getLogger("transformers.modeling_utils")
    level = report_logger.level
    report_logger.setLevel(logging.ERROR)
    try:
        model, info = AutoModel.from_pretrained(base, config=config, use_safetensors=True, output_loading_info=True,
                                                **load_kwargs)
    finally:
        report_logger.setLevel(level)

    def past_the_cut(key: str) -> bool:
        m = _BLOCK_INDEX.search(key)
        return (m is not None and int(m.group(1)) >= n_keep) or not key.startswith(("model.", "transformer."))

    odd = sorted(k for k in info.get("unexpected_keys", []) if not past_the_cut(k))
    if odd:
        logger.warning("%s: %d weights of the kept blocks were not used (e.g. %s)", base, len(odd), odd[:3])
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        logger.warning("%s: %d weights of the AR's %d blocks are missing from the checkpoint and start random "
                       "(e.g. %s)", base, len(missing), n_keep, missing[:3])
    return model


def _maybe_tokenizer(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_dir() or not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return arch.load_tokenizer(p)


def _replace_dir(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` onto ``target``; an existing target is moved aside first and removed after."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
