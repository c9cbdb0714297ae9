"""AV warm-start: next-token loss on the explanation with the vector injected at the marker.

Notation: B rows, T tokens, V vocabulary. Each row is ``chat_template(AV messages,
generation prompt on) + response + EOS``; labels are -100 over the prompt and padding, so
only response tokens and the EOS are learned. The vector (rescaled to ``injection_scale``)
overwrites the marker's input embedding through :class:`nla.core.injection.InjectionHook`, the
same path generation and RL use.

Departures from a plain SFT recipe:
1. Position ids come from the attention mask (``cumsum - 1``), so left- and right-padded
   batches give the same loss.
2. The loss is a token mean per micro-batch, combined across micro-batches by row count
   (the shared loop's weighting); with equal-length responses it equals the batch token mean.
3. Held-out loss is also measured with the vectors rolled by one row across the eval batch
   (a permutation without fixed points); ``eval_vector_gap = shuffled - real`` > 0 shows
   the vector is used. A greedy smoke decode at every save flags empty output or output
   containing the marker / CJK characters (the injection-failure smell, docs/design.md §3.4).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nla.core import arch
from nla.core.injection import (
    ADAPTER_ATTR,
    InjectionAdapter,
    InjectionHook,
    attach_adapter,
    load_adapter_file,
    save_av_checkpoint,
)
from nla.core.logprobs import LOGPROB_CHUNK_ELEMENTS, token_logprobs
from nla.core.lora import LORA_SUBDIR, apply_sft_lora, merged_state_dict, save_adapter
from nla.core.prefix import cache_rows, lm_head_on, supports_cache_reuse
from nla.core.sidecar import NLAConfig
from nla.core.templates import AV_PLACEHOLDER
from nla.core.token_ids import canonical_av_prompt_ids, derive_token_ids, verify_tokenizer
from nla.core.vectors import resolve_scale
from nla.train.ar import load_split, own_model, resolve_sidecar_and_base
from nla.train.checkpoint import find_resume_checkpoint, seed_everything
from nla.train.config import AVTrainConfig
from nla.train.device import resolve_device, resolve_dtype
from nla.train.loop import LoopSpec, TrainResult, run_training_loop
from nla.util.checkpoint_files import check_checkpoint
from nla.util.precision import prepare_autocast
from nla.util.threads import apply_threads

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# CJK ideographs, symbols/punctuation, enclosed CJK (the default marker ㈎ lives there), compatibility.
_CJK = re.compile("[\u2e80-\u2fff\u3000-\u303f\u3200-\u32ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


class AVTrainError(ValueError):
    """A problem found before AV training starts; the message names the field and the fix."""


@dataclass
class AVExample:
    prompt_ids: list[int]
    response_ids: list[int]  # includes the trailing EOS


@dataclass
class AVBatch:
    """input_ids / attention_mask / labels / position_ids: [B, T]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor


def prompt_messages(raw: Any, injection_char: str) -> list[dict[str, str]]:
    """Parquet AV prompt (chat messages with ``<INJECT>``) -> messages with the real marker."""
    if not isinstance(raw, list) or not all(isinstance(m, dict) and "content" in m for m in raw):
        raise AVTrainError(f"prompt: expected a list of chat messages {{role, content}}, found {raw!r}")
    return [{"role": m["role"], "content": m["content"].replace(AV_PLACEHOLDER, injection_char)} for m in raw]


def build_examples(tokenizer: Any, prompts: list[Any], responses: list[str], injection_char: str,
                   max_length: int, what: str = "AV data") -> list[AVExample]:
    """Tokenise rows once. Long rows lose response tokens from the right (the marker must survive);
    how many did, and the max_length that keeps them whole, is logged as a warning: a cut response
    loses its closing tag and EOS, and the AV learns not to stop (it was silent, issue 58)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise AVTrainError("tokenizer: no eos_token_id; the AV must learn to stop, set tokenizer.eos_token")
    cache: dict[str, list[int]] = {}
    out = []
    cut: list[tuple[int, int]] = []  # (row, the tokens it needs)
    for i, (raw, resp) in enumerate(zip(prompts, responses, strict=True)):
        msgs = prompt_messages(raw, injection_char)
        key = repr(msgs)
        if key not in cache:
            cache[key] = canonical_av_prompt_ids(tokenizer, msgs)
        p = cache[key]
        r = list(tokenizer.encode(resp, add_special_tokens=False)) + [eos]
        room = max_length - len(p)
        if room < 2:
            raise AVTrainError(
                f"max_length: row {i}'s prompt alone is {len(p)} tokens, leaving no room for a response; "
                f"raise max_length above {len(p) + 2}"
            )
        if len(r) > room:
            cut.append((i, len(p) + len(r)))
        out.append(AVExample(p, r[:room]))
    if cut:
        longest = max(n for _, n in cut)
        logger.warning(
            "max_length: %d of %d rows of the %s are longer than max_length %d (prompt + response + EOS; row %d "
            "needs %d tokens): their responses are cut, losing the closing tag and the EOS, so the AV learns not to "
            "stop on them; raise max_length to %d to keep every row whole", len(cut), len(out), what, max_length,
            cut[0][0], cut[0][1], longest)
    return out


def collate(examples: list[AVExample], pad_id: int, padding_side: str) -> AVBatch:
    """Pad to the longest row on ``padding_side``; labels only over response tokens (+EOS)."""
    T = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    B = len(examples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for b, e in enumerate(examples):
        row = e.prompt_ids + e.response_ids
        start = 0 if padding_side == "right" else T - len(row)
        ids[b, start : start + len(row)] = torch.tensor(row)
        mask[b, start : start + len(row)] = 1
        labels[b, start + len(e.prompt_ids) : start + len(row)] = torch.tensor(e.response_ids)
    position_ids = (mask.cumsum(1) - 1).clamp_min(0)
    return AVBatch(ids, mask, labels, position_ids)


def token_losses(model: torch.nn.Module, batch: AVBatch, device: torch.device, shared: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token loss [B, T-1] and its mask [B, T-1] (true where the label is learned).

    ``shared`` > 0: the batch's first ``shared`` tokens are the same on every row and hold no
    injection site (``shared_prompt_head``): they run once, their KV cache is repeated to the rows
    (``take_rows``: gradients reach them as the sum over the rows, as in the per-row forward), the
    rest of each row runs on top of it, and the LM head reads the learned positions only. The same
    loss as ``shared=0`` to float rounding (tests/test_train_av.py); right-padded batches of a
    ``supports_cache_reuse`` model only (the caller checks).
    """
    labels = batch.labels[:, 1:].to(device)  # [B, T-1]
    learned = labels != IGNORE_INDEX
    if shared > 0:
        B = batch.input_ids.shape[0]
        ids = batch.input_ids.to(device)
        head = model(input_ids=ids[:1, :shared], position_ids=batch.position_ids[:1, :shared].to(device),
                     use_cache=True, logits_to_keep=1)
        cache = cache_rows(arch.output_cache(head), torch.zeros(B, dtype=torch.long, device=device))
        # position t's logits predict token t+1: the learned positions, all past the shared head
        at = torch.cat([learned, torch.zeros_like(learned[:, :1])], 1)[:, shared:]
        with lm_head_on(model, at):
            logits = model(input_ids=ids[:, shared:], attention_mask=batch.attention_mask.to(device),
                           position_ids=batch.position_ids[:, shared:].to(device), use_cache=True,
                           **arch.cache_kwargs(cache)).logits  # [learned tokens, V]
        lp, _ = token_logprobs(logits, labels[learned])
        return torch.zeros(labels.shape, dtype=lp.dtype, device=lp.device).index_put(
            learned.nonzero(as_tuple=True), -lp), learned
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                position_ids=batch.position_ids.to(device), use_cache=False)
    logits = out.logits[:, :-1]  # [B, T-1, V]
    if logits.numel() <= LOGPROB_CHUNK_ELEMENTS:  # a small vocabulary: the plain loss
        nll = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        return nll, learned
    # a large one: the learned positions only, a row chunk of the log-softmax at a time
    lp, _ = token_logprobs(logits[learned], labels[learned])
    return torch.zeros(labels.shape, dtype=lp.dtype, device=lp.device).index_put(learned.nonzero(as_tuple=True),
                                                                                  -lp), learned


def shared_prompt_head(examples: list[AVExample], inj_id: int, left_id: int) -> int:
    """How many leading tokens every row's prompt has in common, stopping before the injection
    site's left neighbour (the hook finds a site by its neighbours, so they run per row): the
    chat template's head and the prompt's words before the marker. 0 when under 2."""
    if not examples:
        return 0
    first = examples[0].prompt_ids
    n = len(first)
    for e in examples[1:]:
        p = e.prompt_ids
        n = min(n, len(p))
        while n and p[:n] != first[:n]:
            n -= 1
    for i in range(1, n):
        if first[i] == inj_id and first[i - 1] == left_id:
            n = i - 1
            break
    return n if n >= 2 else 0


def _resolve_injection(cfg: AVTrainConfig, side: NLAConfig) -> NLAConfig:
    spec = cfg.injection_scale if cfg.injection_scale is not None else side.injection_scale
    if spec is None:
        raise AVTrainError(
            "injection_scale: neither the train config nor the dataset sidecar gives one (the sidecar has null); "
            "set injection_scale in the config (a number, or 'sqrt_d_model') or --set injection_scale=..."
        )
    resolve_scale(spec, side.d_model)  # validates the value early
    return side.replace(injection_scale=spec)


def smoke_flags(text: str, injection_char: str) -> list[str]:
    """Reasons a decoded AV output looks like failed injection (empty list = looks fine)."""
    flags = []
    if not text.strip():
        flags.append("empty")
    if injection_char in text:
        flags.append("marker")
    if _CJK.search(text.replace(injection_char, "")):
        flags.append("cjk")
    return flags


def check_av_base(base: Path) -> None:
    """An AR checkpoint (a truncated body + value head) is no base for an AV: it has no LM head."""
    from nla.core.reconstructor import VALUE_HEAD_FILE
    from nla.core.sidecar import SIDECAR_NAME

    role = None
    if (base / SIDECAR_NAME).is_file():
        from nla.util.validation import load_yaml

        doc = load_yaml(base / SIDECAR_NAME, "sidecar")
        role = doc.get("role") if isinstance(doc, dict) else None
    if (base / VALUE_HEAD_FILE).is_file() or role in ("ar", "critic"):
        raise AVTrainError(
            f"base_model: {base} is a reconstructor (AR) checkpoint ({VALUE_HEAD_FILE}, role {role or 'ar'}): a "
            "truncated body with a value head and no LM head, so the AV would start from a random one; pass the "
            "subject model the dataset was extracted from (or an AV checkpoint)"
        )


def _refuse_random_head(model: Any, info: dict[str, Any], src: str) -> None:
    """Refuse a base whose LM head weights were missing from its files (the loader starts them at random)."""
    head = model.get_output_embeddings()
    if head is None:
        raise AVTrainError(f"base_model: {src} loads without an LM head; pass a causal language model")
    tied = getattr(model.config, "tie_word_embeddings", False) or getattr(
        getattr(model.config, "get_text_config", lambda: model.config)(), "tie_word_embeddings", False)
    names = {n for n, p in model.named_parameters() if p is head.weight}
    missing = [k for k in info.get("missing_keys", []) if k in names or k.endswith("lm_head.weight")]
    if missing and not tied:
        raise AVTrainError(
            f"base_model: {src} has no LM head weights ({', '.join(sorted(missing))} missing from its files; the "
            "loader would start them at random); pass a causal language model with its head"
        )


TRANSLATION_ROWS = 4096  # training rows whose contexts the cross-model adapter's start is fitted on


def _fit_translation(adapter: InjectionAdapter, model: Any, tok: Any, contexts: list[str], vectors: np.ndarray,
                     side: NLAConfig, cfg: AVTrainConfig) -> None:
    """Start a cross-model adapter as the ridge translation from the subject's layer-K vectors to the
    AV base's own vectors at the same depth on the same text (each row's ``context``, the text up to
    the vector's token): the AV then starts as a same-model NLA of its own base, whose fixed-scale
    injection of its own residual is what the published recipe trains. Both sides at the
    injection norm (the AV's at that norm times sqrt(d_av / d_subject), ``sqrt_d_model``'s ratio)."""
    from nla.core.activations import block_outputs, pad_right, tokenize_text
    from nla.core.reconstructor import last_token_index
    from nla.core.vectors import normalize_activation

    k = side.need_layer("fitting the cross-model injection adapter")
    own_layers = arch.num_layers(model.config)
    subject_layers = None
    if side.base_model and (Path(side.base_model) / "config.json").is_file():
        from transformers import AutoConfig

        subject_layers = arch.num_layers(AutoConfig.from_pretrained(side.base_model))
    # the same relative depth in the AV's base (the same K when both have as many blocks)
    k_own = min(own_layers - 1, round(k * own_layers / subject_layers)) if subject_layers else min(k, own_layers - 1)
    rng = np.random.default_rng([cfg.seed, 4111])
    idx = np.sort(rng.permutation(len(contexts))[:TRANSLATION_ROWS])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    feats = []
    model.eval()
    for s in range(0, len(idx), cfg.micro):
        seqs = [tokenize_text(tok, contexts[i], cfg.max_length * 4)[0] for i in idx[s : s + cfg.micro]]
        ids, mask = pad_right(seqs, pad)
        h = block_outputs(model, ids, mask, k_own).float()
        feats.append(h[torch.arange(h.shape[0]), last_token_index(mask)])
    model.train()
    scale = side.injection_scale_value()
    d_in, d_out = adapter.d_in, adapter.d_out
    src = normalize_activation(torch.from_numpy(np.ascontiguousarray(vectors[idx])).float(), scale)
    tgt = normalize_activation(torch.cat(feats), None if scale is None else scale * (d_out / d_in) ** 0.5)
    r2 = adapter.fit(src, tgt)
    logger.info("AV: cross-model injection adapter fitted as the translation from the subject's layer %d to the "
                "base's layer %d on %d contexts (R^2 %.3f)", k, k_own, len(idx), r2)


def _injection_adapter(cfg: AVTrainConfig, side: NLAConfig, model: Any, src: str, tok: Any = None,
                       contexts: list[str] | None = None, vectors: np.ndarray | None = None
                       ) -> InjectionAdapter | None:
    """Attach the AV's injection adapter: the one ``src`` was saved with (resume, or an AV checkpoint
    as the base), else a new one when ``injection_adapter: affine`` or the widths differ (fitted as
    the translation between the two models when the rows carry their ``context``; else the seeded
    norm-keeping map of ``nla.core.injection.adapter_init``)."""
    from nla.core.sidecar import SIDECAR_NAME, load_sidecar

    d = arch.hidden_size(model.config)
    saved = load_sidecar(src) if (Path(src) / SIDECAR_NAME).is_file() else None
    if saved is not None and saved.kind == "nla_model" and saved.injection_adapter is not None:
        adapter = load_adapter_file(src, saved)
    elif cfg.injection_adapter == "affine" or d != side.d_model:
        if cfg.injection_adapter != "affine":
            raise AVTrainError(
                f"injection_adapter: the base model {src} has width {d} but the dataset's vectors have d_model "
                f"{side.d_model}; a model of another width reads them through a learned map: set injection_adapter: "
                "affine (or --set injection_adapter=affine), or use the subject the dataset was extracted from")
        if cfg.injection_adapter_conformal and d != side.d_model:
            raise AVTrainError(f"injection_adapter_conformal: the base model {src} has width {d}, the subject "
                               f"d_model {side.d_model}; a gain times a rotation maps a width onto itself. Set "
                               "injection_adapter_conformal: false for a cross-model pair")
        adapter = InjectionAdapter(side.d_model, d, seed=cfg.seed, mean_invariant=cfg.injection_adapter_mean_invariant,
                                   conformal=cfg.injection_adapter_conformal)
        if adapter.mean_invariant:
            tan = adapter.set_mean(torch.from_numpy(np.ascontiguousarray(vectors)))
            logger.info("AV: mean-invariant injection adapter (the training mean's direction fitted on %d vectors; "
                        "typical tangent %.3f)", len(vectors), tan)
        if d != side.d_model and contexts is not None:
            _fit_translation(adapter, model, tok, contexts, vectors, side, cfg)
    else:
        return None
    if adapter.d_in != side.d_model:
        raise AVTrainError(f"injection_adapter: {src}'s adapter reads {adapter.d_in}-d vectors, the dataset holds "
                           f"{side.d_model}-d ones; start from a base trained on this subject")
    return attach_adapter(model, adapter)


def train_av(cfg: AVTrainConfig, *, resume: bool = False) -> TrainResult:
    """Warm-start the verbalizer on ``cfg.dataset`` (``av_sft.parquet``). See module docstring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # autocast: lift the CPU pin's oneDNN cap before this process's first matmul (nla.util.precision)
    prepare_autocast(cfg.autocast, resolve_device(cfg.device), "av.autocast")
    seed_everything(cfg.seed)
    side, base = resolve_sidecar_and_base(cfg)
    side = _resolve_injection(cfg, side)
    train_tab, train_vec, eval_tab, eval_vec = load_split(cfg, "prompt")
    for col in ("response",):
        if col not in train_tab.column_names:
            raise AVTrainError(f"dataset {cfg.dataset}: column {col!r} missing; found {train_tab.column_names}")
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    apply_threads(cfg.threads)
    resume_from = find_resume_checkpoint(cfg.out_dir) if resume else None
    src = str(resume_from) if resume_from is not None else base
    if resume_from is not None:
        check_checkpoint(resume_from, "--resume checkpoint")
    if resume_from is None:
        check_av_base(Path(base))
    tok = AutoTokenizer.from_pretrained(src)
    own = own_model(base, side)
    if own is not None:  # another model explains the subject: the marker's ids are its own tokenizer's
        try:
            side = side.replace(**derive_token_ids(tok, side.injection_char, side.av_template, side.ar_template))
        except ValueError as err:
            raise AVTrainError(f"base_model: {base}'s tokenizer cannot hold the AV prompt: {err}") from None
    verify_tokenizer(side, tok)
    lora = cfg.lora.settings()
    # A LoRA run resumes as base + its saved adapter (the checkpoint's weights are merged ones).
    weights = base if lora.enabled and resume_from is not None else src
    model, info = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype, use_safetensors=True,
                                                       output_loading_info=True)
    _refuse_random_head(model, info, weights)
    if train_vec.shape[1] != side.d_model:
        raise AVTrainError(f"activation_vector: vectors have {train_vec.shape[1]} dims, the sidecar's d_model is "
                           f"{side.d_model}; the sidecar does not belong to this dataset")
    contexts = train_tab.column("context").to_pylist() if "context" in train_tab.column_names else None
    adapter = _injection_adapter(cfg, side, model, src, tok, contexts, train_vec)
    d = arch.hidden_size(model.config)
    side = side.replace(model_base=own, model_width=d if d != side.d_model else None,
                        injection_adapter=None if adapter is None else adapter.describe())
    if lora.enabled:
        apply_sft_lora(model, lora, resume_from, train=[] if adapter is None else [adapter])
    model.to(device)
    if cfg.gradient_checkpointing:
        arch.enable_gradient_checkpointing(model)
    hook = InjectionHook.from_config(model, side)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def examples(tab, what: str) -> list[AVExample]:
        return build_examples(tok, tab.column("prompt").to_pylist(), tab.column("response").to_pylist(),
                              side.injection_char, cfg.max_length, what)

    train_ex, eval_ex = examples(train_tab, "training split"), examples(eval_tab, "eval split")
    shared = 0
    if cfg.share_prompt_head:
        why = ("the model's type is not one whose KV cache is reused (nla.core.prefix.CACHE_REUSE_MODEL_TYPES)"
               if not supports_cache_reuse(model) else "padding_side is left" if cfg.padding_side != "right"
               else "gradient_checkpointing is on" if cfg.gradient_checkpointing else None)
        if why is None:
            shared = shared_prompt_head(train_ex + eval_ex, side.injection_token_id, side.injection_left_neighbor_id)
            logger.info("AV: the prompt's first %d tokens run once per batch (share_prompt_head)", shared)
        else:
            logger.info("AV: share_prompt_head is on but %s: every row runs its whole prompt", why)
    train_v = torch.from_numpy(np.ascontiguousarray(train_vec))
    eval_v = torch.from_numpy(np.ascontiguousarray(eval_vec))
    logger.info("AV: %d train / %d eval rows, injection_scale=%s", len(train_ex), len(eval_ex), side.injection_scale)

    mean = train_v.double().mean(0).float() if cfg.mean_shift_augment > 0 else None  # the offset it varies

    def micro_loss(idx: np.ndarray) -> tuple[torch.Tensor, dict[str, float]]:
        batch = collate([train_ex[i] for i in idx], pad_id, cfg.padding_side)
        vecs = train_v[torch.from_numpy(idx)]
        if cfg.mean_shift_augment > 0:  # torch's RNG: a resumed run restores it and draws the same a
            a = (torch.rand(len(idx), 1) * 2 - 1) * cfg.mean_shift_augment
            vecs = vecs + a * mean
        with hook.vectors(vecs.to(device)):
            nll, m = token_losses(model, batch, device, shared)
        loss = (nll * m).sum() / m.sum().clamp_min(1)
        return loss, {"response_tokens": float(m.sum())}

    def eval_loss(rows: list[AVExample], vecs: torch.Tensor) -> float:
        tot, cnt = 0.0, 0.0
        for s in range(0, len(rows), cfg.micro):
            batch = collate(rows[s : s + cfg.micro], pad_id, cfg.padding_side)
            with hook.vectors(vecs[s : s + cfg.micro].to(device)):
                nll, m = token_losses(model, batch, device, shared)
            tot += float((nll * m).sum())
            cnt += float(m.sum())
        return tot / max(cnt, 1.0)

    def evaluate(step: int) -> dict[str, float]:
        n = min(len(eval_ex), cfg.eval_max_rows)
        if n < 2:
            return {}
        rows, vecs = eval_ex[:n], eval_v[:n]
        real = eval_loss(rows, vecs)
        # roll by one row: every row gets another row's vector, deterministic, no RNG use
        shuffled = eval_loss(rows, torch.roll(vecs, 1, dims=0))
        return {"eval_loss": real, "eval_loss_shuffled": shuffled, "eval_vector_gap": shuffled - real}

    def smoke(step: int) -> dict[str, Any]:
        n = min(cfg.smoke_num, len(eval_ex))
        if n == 0:
            return {}
        prompts = [e.prompt_ids for e in eval_ex[:n]]
        T = max(len(p) for p in prompts)
        ids = torch.full((n, T), pad_id, dtype=torch.long)
        mask = torch.zeros((n, T), dtype=torch.long)
        for b, p in enumerate(prompts):  # generation always pads on the left
            ids[b, T - len(p) :] = torch.tensor(p)
            mask[b, T - len(p) :] = 1
        with torch.no_grad(), hook.vectors(eval_v[:n].to(device)):
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=cfg.smoke_max_new_tokens, pad_token_id=pad_id)
        texts = tok.batch_decode(out[:, T:], skip_special_tokens=True)
        flagged = 0
        for i, t in enumerate(texts):
            why = smoke_flags(t, side.injection_char)
            if why:
                flagged += 1
                logger.warning("AV smoke check at step %d, eval row %d flagged %s: %r", step, i, why, t[:200])
        return {"smoke_flagged": flagged, "smoke_checked": n, "smoke_sample": texts[0][:200]}

    def save_model(directory: Path, step: int) -> dict[str, Any]:
        # + nla_injection_adapter.safetensors when the AV has one; base + LoRA merged under LoRA
        save_av_checkpoint(model, tok, side.replace(base_model=side.base_model or base), directory,
                           merged_state_dict(model) if lora.enabled else None, lr=cfg.lr,
                           batch_size=cfg.batch_size, step=step, parent_dataset=str(Path(cfg.dataset).resolve()),
                           stage="av_warm_start")
        if lora.enabled:  # the adapter alone, in peft's format: resume reads it; NLAClient loads it too
            save_adapter(model, directory / LORA_SUBDIR, base, nla_dir=directory)
        with torch.no_grad():
            return smoke(step)

    spec = LoopSpec(name="av", model=model, n_train=len(train_ex), micro_loss=micro_loss, evaluate=evaluate,
                    save_model=save_model, plot_keys=["loss", "eval_loss", "eval_loss_shuffled", "eval_vector_gap"],
                    resume_from=resume_from,
                    lr_scales=None if adapter is None else {ADAPTER_ATTR: cfg.injection_adapter_lr_scale})
    try:
        return run_training_loop(cfg, spec)
    finally:
        hook.remove()
