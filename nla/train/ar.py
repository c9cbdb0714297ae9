"""AR warm-start: regress the activation from its explanation text.

Notation: B rows, T tokens, d width. Loss = mean over rows of ``mse_nrm`` between the
reconstructor's value at the last real token and the RAW gold vector, both normalised to
the sidecar's ``mse_scale`` (docs/design.md §1).

Departures from a plain regression recipe:
1. Texts are truncated on the LEFT (``max_length``), so the constant AR suffix that the
   prediction is read at always survives.
2. The train-batch ``fve_nrm`` uses the raw-mean baseline computed once over the whole
   training set (not per batch), so it is comparable across steps; held-out ``eval_fve``
   uses the eval split's own baseline (``nla.core.vectors.fve``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nla.core import arch
from nla.core.graders import shuffle_sentences
from nla.core.lora import LORA_SUBDIR, apply_sft_lora, merged_state_dict, save_adapter
from nla.core.reconstructor import (
    EXIT_MIN_BLOCK,
    Reconstructor,
    check_ar_max_length,
    exit_map,
    reconstruction_loss,
    tokenize_ar_texts,
)
from nla.core.sidecar import NLAConfig, resolve_sidecar
from nla.core.token_ids import checked_ar_suffix, derive_token_ids
from nla.core.vectors import check_spread, fve, mse_nrm
from nla.datagen.io import read_parquet, read_vectors
from nla.train.checkpoint import find_resume_checkpoint, seed_everything
from nla.train.config import ARTrainConfig
from nla.train.device import resolve_device, resolve_dtype
from nla.train.loop import LoopSpec, TrainResult, run_training_loop
from nla.util.checkpoint_files import check_model_source
from nla.util.precision import prepare_autocast
from nla.util.threads import apply_threads

logger = logging.getLogger(__name__)


class ARTrainError(ValueError):
    """A problem found before AR training starts; the message names the field and the fix."""


def check_ar_suffix(input_ids: torch.Tensor, attention_mask: torch.Tensor, suffix: tuple[int, ...],
                    rows: np.ndarray | None = None) -> None:
    """Every row's last real tokens must equal ``suffix`` (the recorded ``critic_suffix_ids`` where they
    hold on this tokenizer: ``nla.core.token_ids.checked_ar_suffix``; its last id is the token the AR
    reads its prediction at); raise naming the row."""
    n = len(suffix)
    lengths = attention_mask.long().sum(1)
    for i in range(input_ids.shape[0]):
        real = input_ids[i][attention_mask[i].bool()]
        tail = tuple(int(t) for t in real[-n:])
        if int(lengths[i]) < n or tail != tuple(suffix):
            row = int(rows[i]) if rows is not None else i
            raise ARTrainError(
                f"critic_suffix_ids: training row {row} ends in token ids {list(tail)}, expected the AR "
                f"suffix {list(suffix)}; the dataset's `prompt` must be cfg.ar_text(explanation) built with "
                "this tokenizer's sidecar (rebuild the dataset, or check that the tokenizer does not append "
                "EOS after the text)"
            )


def _split_eval(table, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train/eval row indices; whole documents go to eval when there is a ``doc_id`` column."""
    n = table.num_rows
    if frac <= 0:
        return np.arange(n), np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([seed, 7919])
    if "doc_id" in table.column_names:
        docs = np.asarray(table.column("doc_id").to_pylist(), dtype=object)
        uniq = sorted(set(docs.tolist()), key=str)
        n_eval = max(1, round(frac * len(uniq))) if len(uniq) > 1 else 0
        held = set(rng.permutation(len(uniq))[:n_eval].tolist())
        held_docs = {uniq[i] for i in held}
        is_eval = np.array([d in held_docs for d in docs])
    else:
        n_eval = max(1, round(frac * n)) if n > 1 else 0
        is_eval = np.zeros(n, dtype=bool)
        is_eval[rng.permutation(n)[:n_eval]] = True
    return np.flatnonzero(~is_eval), np.flatnonzero(is_eval)


def load_split(cfg: Any, text_column: str) -> tuple[Any, np.ndarray, Any, np.ndarray]:
    """(train table, train vectors, eval table, eval vectors) — eval from ``eval_dataset`` or held out by doc."""
    path = Path(cfg.dataset)
    if not path.is_file():
        raise FileNotFoundError(f"dataset: training parquet not found at {path}; run `nla datagen` first or fix the path")
    table = read_parquet(path)
    if text_column not in table.column_names:
        raise ARTrainError(f"dataset {path}: column {text_column!r} missing; found {table.column_names}")
    if table.num_rows == 0:
        raise ARTrainError(f"dataset {path}: the table has no rows; rebuild it with `nla datagen`")
    vectors = read_vectors(table, source=path)
    if cfg.eval_dataset:
        epath = Path(cfg.eval_dataset)
        if not epath.is_file():
            raise FileNotFoundError(f"eval_dataset: parquet not found at {epath}")
        etable = read_parquet(epath)
        if text_column not in etable.column_names:
            raise ARTrainError(
                f"eval_dataset {epath}: column {text_column!r} missing (found {etable.column_names}); the eval set "
                "must be the same kind of split as the training set (e.g. another ar_sft/av_sft parquet, not rl)"
            )
        return table, vectors, etable, read_vectors(etable, source=epath)
    tr, ev = _split_eval(table, cfg.eval_fraction, cfg.seed)
    if len(tr) == 0:
        raise ARTrainError(f"eval_fraction={cfg.eval_fraction} leaves no training rows in {path}; lower it")
    return table.take(tr), vectors[tr], table.take(ev), vectors[ev]


def _text_column(table: Any, column: str, path: Any) -> list[str]:
    """``table[column]`` as strings; another type (an av_sft prompt holds chat messages) is named."""
    values = table.column(column).to_pylist()
    bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
    if bad is not None:
        raise ARTrainError(
            f"dataset {path}: column {column!r} row {bad} holds {type(values[bad]).__name__} "
            f"({str(table.schema.field(column).type)}), expected text; the AR trains on an ar_sft parquet, whose "
            f"{column!r} column holds the explanation texts")
    return values


def _shuffled_prompts(table: Any, side: NLAConfig, cfg: ARTrainConfig) -> list[str]:
    """The AR texts of ``table`` with each explanation's sentences in a random order of the row's own
    (``ARTrainConfig.shuffle_sentences``)."""
    if "explanation" not in table.column_names:
        raise ARTrainError(f"shuffle_sentences: dataset {cfg.dataset} has no 'explanation' column (found "
                           f"{table.column_names}); it re-orders the explanation's sentences, so train on an "
                           "ar_sft parquet, or set shuffle_sentences: false")
    explanations = _text_column(table, "explanation", cfg.dataset)
    rows = table.column("doc_id").to_pylist() if "doc_id" in table.column_names else range(len(explanations))
    positions = table.column("position").to_pylist() if "position" in table.column_names else [0] * len(explanations)
    if side.layers is None:
        return [side.ar_text(shuffle_sentences(e, np.random.default_rng([cfg.seed, int(d), int(p)])))
                for e, d, p in zip(explanations, rows, positions, strict=True)]
    if "activation_layer" not in table.column_names:
        raise ARTrainError(f"shuffle_sentences: dataset {cfg.dataset} is for blocks {list(side.layers)} but has no "
                           "activation_layer column (each row's AR text names its block); rebuild it with nla datagen")
    blocks = table.column("activation_layer").to_pylist()
    return [side.ar_text(shuffle_sentences(e, np.random.default_rng([cfg.seed, int(d), int(p), int(k)])), layer=int(k))
            for e, d, p, k in zip(explanations, rows, positions, blocks, strict=True)]


def _blocks_column(table: Any, dataset: str) -> np.ndarray:
    if "activation_layer" not in table.column_names:
        raise ARTrainError(f"exits: dataset {dataset} has no activation_layer column (each row's block, which an AR "
                           "reading each row at its own block needs); rebuild it with nla datagen for several layers")
    return np.asarray(table.column("activation_layer").to_pylist(), dtype=np.int64)


def resolve_sidecar_and_base(cfg: Any) -> tuple[NLAConfig, str]:
    side = resolve_sidecar(cfg.sidecar, None, cfg.dataset)
    base = cfg.base_model or side.base_model
    if not base:
        raise ARTrainError(
            "base_model: neither the train config nor the dataset sidecar names the base model; "
            "set base_model in the config (or --set base_model=PATH)"
        )
    return side, check_model_source(str(base), "base_model")


def own_model(base: str, side: NLAConfig) -> str | None:
    """``base`` when it is not the subject the dataset was extracted from (a cross-model pair: the
    checkpoint records it as ``model.base_model``); None when ``base`` is the subject, a copy of it,
    or an nla checkpoint of it (which passes its own ``model_base`` on)."""
    from nla.core.provenance import same_subject
    from nla.core.sidecar import SIDECAR_NAME, load_sidecar

    if side.base_model is None or same_subject(str(base), str(side.base_model)):
        return None
    path = Path(base)
    if (path / SIDECAR_NAME).is_file():
        mine = load_sidecar(path)
        if mine.kind == "nla_model" and mine.base_model and same_subject(str(mine.base_model), str(side.base_model)):
            return mine.model_base
    return str(path.resolve()) if path.is_dir() else str(base)


def _check_d_model(side: NLAConfig, model_d: int, vectors: np.ndarray, where: str) -> None:
    if model_d != side.d_model:
        raise ARTrainError(
            f"d_model: the sidecar says {side.d_model} but the model at {where} has width {model_d}; "
            "use the base model the dataset was extracted from"
        )
    if vectors.shape[1] != side.d_model:
        raise ARTrainError(
            f"activation_vector: vectors have {vectors.shape[1]} dims but the sidecar's d_model is {side.d_model}"
        )


HEAD_FIT_ROWS = 4096  # training rows the cross-model head's ridge fit reads (seeded subset)


def _fit_cross_model_head(model: Reconstructor, tok: Any, texts: list[str], gold: torch.Tensor, scale: float | None,
                          cfg: ARTrainConfig, device: torch.device, baseline: float) -> None:
    """Start a cross-model AR's head as the ridge probe of its base's features (``Reconstructor.fit_head``)."""
    rng = np.random.default_rng([cfg.seed, 4099])
    idx = np.sort(rng.permutation(len(texts))[:HEAD_FIT_ROWS])
    feats = []
    for s in range(0, len(idx), cfg.micro):
        enc = tokenize_ar_texts(tok, [texts[i] for i in idx[s : s + cfg.micro]], cfg.max_length)
        feats.append(model.read_features(enc["input_ids"].to(device), enc["attention_mask"].to(device)).float().cpu())
    mse = model.fit_head(torch.cat(feats), gold[torch.from_numpy(idx)], scale)
    if model.exits is not None:  # each block's head starts as the fit (of block K's features)
        with torch.no_grad():
            for h in model.exit_heads.values():
                h.weight.copy_(model.value_head.weight)
    logger.info("AR: cross-model head fitted by ridge regression on %d rows: fve_nrm %.4f before training",
                len(idx), 1.0 - mse / baseline)


def train_ar(cfg: ARTrainConfig, *, resume: bool = False) -> TrainResult:
    """Warm-start the reconstructor on ``cfg.dataset`` (``ar_sft.parquet``). See module docstring."""
    # autocast: lift the CPU pin's oneDNN cap before this process's first matmul (nla.util.precision)
    prepare_autocast(cfg.autocast, resolve_device(cfg.device), "ar.autocast")
    seed_everything(cfg.seed)
    side, base = resolve_sidecar_and_base(cfg)
    side.need_ar("AR training")
    check_ar_max_length(cfg.max_length, side.critic_suffix_ids, "max_length")
    train_tab, train_vec, eval_tab, eval_vec = load_split(cfg, "prompt")
    scale = side.mse_scale_value()
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    apply_threads(cfg.threads)
    resume_from = find_resume_checkpoint(cfg.out_dir) if resume else None
    own = own_model(base, side)  # another model reading the subject's vectors: its head maps to d_model
    lora = cfg.lora.settings()
    if resume_from is not None and not lora.enabled:
        model = Reconstructor.from_pretrained(resume_from)
    else:
        layer = cfg.layer_index if cfg.layer_index is not None else side.need_layer("building the AR from the base model")
        model = Reconstructor.from_base(base, layer, out_dim=side.d_model if own is not None else None)
        if resume_from is not None:  # LoRA resumes as base + the saved adapter; the head trains in full
            model.load_head(resume_from)
    min_block = EXIT_MIN_BLOCK if cfg.exit_min_block is None else cfg.exit_min_block
    if cfg.exits and model.exits is None:  # (a resumed AR has them already)
        if side.layers is None:
            raise ARTrainError(f"exits: dataset {cfg.dataset} is for one block ({side.layer_index}); an AR reads each "
                               "row at its own block only for a pair of several (extraction.layers): set exits: false")
        model.set_exits(side.layers, min_block=min_block)
        logger.info("AR: each row read at its own block: block -> read after %s", model.exits)
    elif cfg.exits:
        want = exit_map(model.exits, model.layer_index, min_block)
        if want != model.exits:
            raise ARTrainError(f"exit_min_block: {min_block} reads the blocks after {want}, but the checkpoint "
                               f"resumed from ({resume_from}) reads them after {model.exits}; resume with the "
                               "exit_min_block it was trained with, or start a new run")
    elif model.exits is not None and not cfg.exits:
        raise ARTrainError(f"exits: the checkpoint resumed from ({resume_from}) reads each row at its own block; "
                           "set exits: true to go on training it")
    if lora.enabled:
        apply_sft_lora(model, lora, resume_from,
                       train=[model.value_head, *([] if model.exits is None else model.exit_heads.values())])
    if model.tokenizer is None:
        raise ARTrainError(f"base_model: no tokenizer files in {base}; save the tokenizer beside the model")
    width = arch.hidden_size(model.config)
    if own is not None:
        try:  # the AR template's tail ids are its own tokenizer's
            side = side.replace(**derive_token_ids(model.tokenizer, None, None, side.ar_template))
        except ValueError as err:
            raise ARTrainError(f"base_model: {base}'s tokenizer cannot hold the AR template: {err}") from None
        side = side.replace(model_base=own, model_width=width if width != side.d_model else None)
        _check_d_model(side, side.d_model, train_vec, base)  # the vectors against the subject's width
    else:
        _check_d_model(side, width, train_vec, base)
    model.to(device=device, dtype=dtype)
    if cfg.gradient_checkpointing:
        arch.enable_gradient_checkpointing(model.base)
    tok = model.tokenizer
    texts = _text_column(train_tab, "prompt", cfg.dataset)
    if cfg.shuffle_sentences:
        texts = _shuffled_prompts(train_tab, side, cfg)
    eval_texts = _text_column(eval_tab, "prompt", cfg.eval_dataset or cfg.dataset)
    # each row's block, for an AR reading each row at its own block (its text names it too)
    blocks = None if model.exits is None else _blocks_column(train_tab, cfg.dataset)
    eval_blocks = None if model.exits is None else _blocks_column(eval_tab, cfg.eval_dataset or cfg.dataset)
    gold_all = torch.from_numpy(np.ascontiguousarray(train_vec))
    try:
        baselines = check_spread(gold_all, scale, f"dataset {cfg.dataset}")
    except ValueError as err:
        raise ARTrainError(str(err)) from None
    if own is not None and resume_from is None:
        _fit_cross_model_head(model, tok, texts, gold_all, scale, cfg, device, baselines.raw_mean)
    logger.info("AR: %d train / %d eval rows, K=%d, mse_scale=%s, raw-mean baseline %.4f (normalised-mean %.4f)",
                len(texts), len(eval_texts), model.layer_index, scale, baselines.raw_mean, baselines.normalized_mean)
    checked = {"suffix": False}

    def micro_loss(idx: np.ndarray) -> tuple[torch.Tensor, dict[str, float]]:
        enc = tokenize_ar_texts(tok, [texts[i] for i in idx], cfg.max_length)
        if not checked["suffix"]:
            check_ar_suffix(enc["input_ids"], enc["attention_mask"], checked_ar_suffix(side, tok), idx)
            checked["suffix"] = True
        loss, pred = reconstruction_loss(model, enc["input_ids"].to(device), enc["attention_mask"].to(device),
                                         gold_all[torch.from_numpy(idx)], scale,
                                         None if blocks is None else blocks[idx])
        return loss, {
            "fve_nrm": 1.0 - float(loss.detach()) / baselines.raw_mean,
            "pred_norm": float(pred.detach().float().norm(dim=-1).mean()),
        }

    def evaluate(step: int) -> dict[str, float]:
        out: dict[str, float] = {"baseline_raw_mean": baselines.raw_mean,
                                 "baseline_normalized_mean": baselines.normalized_mean}
        n = min(len(eval_texts), cfg.eval_max_rows)
        if n < 2:
            return out
        preds = []
        for s in range(0, n, cfg.micro):
            enc = tokenize_ar_texts(tok, eval_texts[s : min(s + cfg.micro, n)], cfg.max_length)
            kw = {} if eval_blocks is None else {"blocks": eval_blocks[s : min(s + cfg.micro, n)]}
            preds.append(model.predict(enc["input_ids"].to(device), enc["attention_mask"].to(device), **kw)
                         .float().cpu())
        pred = torch.cat(preds)
        gold = torch.from_numpy(np.ascontiguousarray(eval_vec[:n]))
        out["eval_mse"] = float(mse_nrm(pred, gold, scale).mean())
        out["eval_fve"] = fve(pred, gold, scale)
        return out

    def save_model(directory: Path, step: int) -> dict[str, Any]:
        meta = side.replace(kind="nla_model", role="ar", base_model=side.base_model or base)
        model.save_pretrained(directory, sidecar=meta, lr=cfg.lr, batch_size=cfg.batch_size, step=step,
                              parent_dataset=str(Path(cfg.dataset).resolve()), stage="ar_warm_start",
                              state_dict=merged_state_dict(model) if lora.enabled else None)
        if lora.enabled:  # base + adapter, for --resume (the checkpoint itself holds the merged AR)
            save_adapter(model, directory / LORA_SUBDIR, base)
        return {}

    spec = LoopSpec(name="ar", model=model, n_train=len(texts), micro_loss=micro_loss, evaluate=evaluate,
                    save_model=save_model, plot_keys=["loss", "fve_nrm", "eval_fve", "pred_norm"],
                    resume_from=resume_from)
    return run_training_loop(cfg, spec)
