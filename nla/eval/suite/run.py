"""``run_suite``: the suite's parts on a held-out dataset (``nla eval --suite``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from nla.client import BlockView, NLAClient, NLAClientError
from nla.core.graders import DatasetGrader, get_grader, grader_for_table
from nla.core.vectors import check_spread
from nla.eval.suite.best_of import best_of_n
from nla.eval.suite.causal import causal_edits
from nla.eval.suite.claims import attribute_claims, claims_summary
from nla.eval.suite.common import PARTS, earlier_truths
from nla.eval.suite.confabulation import confabulation
from nla.eval.suite.directions import MIN_DIRECTION_ROWS, directions_summary
from nla.eval.suite.hidden_code import Paraphraser, hidden_code_summary
from nla.eval.suite.report import SuiteByBlock, SuiteReport
from nla.util.validation import check_sampling

logger = logging.getLogger(__name__)


def load_subject(path: str | os.PathLike, device: torch.device, d_model: int | None = None,
                 layer: int | None = None) -> tuple[nn.Module, Any]:
    """The subject model and tokenizer at ``path``; ``d_model`` / ``layer``: what the vectors were
    read from (the dataset's sidecar), checked against the model before any forward."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nla.core import arch

    p = Path(path)
    if not (p / "config.json").is_file():
        raise NLAClientError(f"subject: {p} is no model directory (no config.json); pass the subject model the "
                             "dataset was extracted from (--subject DIR)")
    config = AutoConfig.from_pretrained(str(p))
    width, blocks = arch.hidden_size(config), arch.num_layers(config)
    if d_model is not None and width != d_model:
        raise NLAClientError(f"subject: {p} has width {width}, but the dataset's vectors are {d_model}-d; it is not "
                             "the model they were extracted from: pass that one (--subject DIR)")
    if layer is not None and not 0 <= layer < blocks:
        raise NLAClientError(f"subject: {p} has {blocks} blocks, but the vectors were read at layer {layer}; it is "
                             "not the model they were extracted from: pass that one (--subject DIR)")
    tok = AutoTokenizer.from_pretrained(str(p))
    model = AutoModelForCausalLM.from_pretrained(str(p), use_safetensors=True).to(device).eval()
    return model, tok


def check_subject_dir(subject: str | os.PathLike) -> None:
    """``--subject`` must be the subject model, not one of nla's checkpoints: the verbalizer given as the
    subject ran the causal edits on the wrong model and reported 0.000 (issue 58)."""
    from nla.core.sidecar import SIDECAR_NAME
    from nla.util.validation import load_yaml

    side = Path(subject) / SIDECAR_NAME
    if not side.is_file():
        return
    try:
        doc = load_yaml(side, "sidecar")
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "nla_model":
        role = {"critic": "ar"}.get(doc.get("role"), doc.get("role"))
        what = {"av": "a verbalizer (AV)", "ar": "a reconstructor (AR)"}.get(role, "an nla model")
        base = (doc.get("extraction") or {}).get("base_model") if isinstance(doc.get("extraction"), dict) else None
        raise NLAClientError(
            f"--subject: {subject} is {what} checkpoint ({side}, kind nla_model), not the subject model whose "
            "activations the dataset holds; the causal edits patch the subject's residual stream. Pass the "
            f"subject's model dir{f' (the sidecar records {base})' if base else ''}, or leave --subject out to use the "
            "one the dataset's sidecar records")


def run_suite(
    client: NLAClient,
    dataset_path: str | os.PathLike,
    *,
    parts: Sequence[str] = PARTS,
    subject: str | os.PathLike | None = None,
    baseline_av: NLAClient | None = None,
    grader: str | DatasetGrader | None = None,
    max_rows: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 150,
    best_of: Sequence[int] = (1, 4, 8),
    temperature: float = 0.7,
    strengths: Sequence[float] = (2.0, 4.0, 8.0),
    paraphraser: Paraphraser | None = None,
    n_show: int = 6,
    layer: int | None = None,
) -> SuiteReport:
    """Run the suite's ``parts`` on a held-out dataset (module docstring). ``client`` holds the pair
    (AV and AR); ``temperature``: best-of-N's sampling temperature (0.7: on the default world best-of-8
    adds 0.056-0.061 FVE over greedy at 0.7 and 0.049-0.054 at 1.0 on the suite's first pass, dev/LOG.md); ``baseline_av`` a client with the warm-start AV (confabulation compares the two);
    ``subject``: the subject model's directory for causal edits (default: the one the dataset's
    sidecar records, when it exists). Parts that need truth the grader lacks, or a subject that
    cannot be found, are listed in ``skipped`` with the reason. ``layer``: the block a pair for several
    blocks is tested at (required there; :func:`run_suite_by_block` runs each): the dataset's rows of that
    block (``activation_layer``), ``max_rows`` of them, every call at that block (``NLAClient.at_block``),
    the causal edits patching the subject's block ``layer``."""
    from nla.eval.evaluate import load_eval_table

    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise NLAClientError(f"suite parts: expected some of {list(PARTS)}, found {bad}")
    side = client.av_sidecar or client.ar_sidecar
    blocks = None if side is None else side.layers
    if blocks is not None and layer is None:
        raise NLAClientError(f"suite: the pair reads several blocks ({list(blocks)}) and the suite reads one at a "
                             "time: give layer=K (nla eval --suite --layer K), or run_suite_by_block for every block")
    if layer is not None:  # every call at that block; one the pair was not trained on is refused here
        client = client.at_block(layer)
        baseline_av = None if baseline_av is None else baseline_av.at_block(layer)
    if subject is not None:
        check_subject_dir(subject)
    if "best_of" in parts:  # before any work (nla.util.validation.check_sampling, the one check)
        try:
            check_sampling(temperature, what="suite: best_of temperature")
        except ValueError as err:
            raise NLAClientError(str(err)) from None
    client.require_av("run_suite")
    side = client.require_ar("run_suite")
    path = Path(dataset_path)
    rng = np.random.default_rng(seed)
    if blocks is None:
        table, gold, dataset_rows = load_eval_table(client, path, max_rows, rng)
    else:
        table, gold, dataset_rows = block_rows(client, path, layer, max_rows, rng)
    read_at = side.layer_index if blocks is None else layer  # the block the causal edits patch
    try:
        base = check_spread(gold, side.mse_scale_value(), f"dataset {path}")
    except ValueError as err:
        raise NLAClientError(str(err)) from None
    if isinstance(grader, str):
        grader = get_grader(grader)
    elif grader is None:
        grader = grader_for_table(table) or get_grader("generic")
    cols = table.column_names
    truths = table.column("facts").to_pylist() if "facts" in cols else None
    no_truth = "the dataset's grader knows no facts"
    if truths is not None and all(t is None for t in truths):
        # facts null on every row: no ground truth (it was a traceback, issue 58); the parts that need
        # truth are skipped with that reason
        logger.warning("suite: facts is null on every row of %s: no ground truth, the parts that need it are "
                       "skipped", path)
        truths = None
        no_truth = f"facts is null on every row of {path.name}: no ground truth to grade by"
    has_truth = truths is not None and grader.grade("", next(t for t in truths if t is not None)) is not None
    if not has_truth:
        truths = None
    quotes = grader.quote_truths(table, Path(path)) if truths is not None else None  # what each row's text ends with
    report = SuiteReport(dataset=str(path), n_rows=int(gold.shape[0]), seed=seed, block=None if blocks is None else layer)
    logger.info("suite: verbalizing %d rows", gold.shape[0])
    verbs = client.verbalize(gold, max_new_tokens=max_new_tokens, batch_size=batch_size)
    texts = [v.explanation for v in verbs]

    if "claims" in parts:
        logger.info("suite: claim attribution")
        attr = attribute_claims(client, texts, gold, grader=grader, truths=truths, quotes=quotes,
                                batch_size=batch_size)
        earlier = (earlier_truths(truths, table.column("doc_id").to_pylist(), table.column("position").to_pylist())
                   if truths is not None and {"doc_id", "position"} <= set(cols) else None)
        report.sections["claims"] = claims_summary(attr, base.raw_mean, grader, truths, earlier)
        for i in sorted(rng.choice(len(texts), size=min(n_show, len(texts)), replace=False).tolist()):
            report.samples.append({"row": int(dataset_rows[i]), "explanation": texts[i],
                                   "facts": truths[i] if truths else None, "claims": [c.to_dict() for c in attr[i]]})
    if "hidden_code" in parts:
        logger.info("suite: hidden-code tests")
        oracle = None
        if truths is not None:
            words = grader.quotes(table, path)
            oracle = [grader.oracle(t, w, int(r)) for t, w, r in zip(truths, words, dataset_rows, strict=True)]
            oracle = None if any(o is None for o in oracle) else oracle
        report.sections["hidden_code"] = hidden_code_summary(client, texts, gold, grader, base.raw_mean, seed,
                                                              batch_size, paraphraser, oracle)
    if "causal" in parts:
        subject_dir = subject or side.base_model
        if truths is None:
            report.skipped["causal"] = no_truth
        elif "context" not in cols:
            report.skipped["causal"] = "the dataset has no context column (the text each vector was read at)"
        elif subject is not None and not (Path(subject) / "config.json").is_file():
            raise NLAClientError(f"subject: {subject} is no model directory (no config.json); pass the subject model "
                                 "the dataset was extracted from (--subject DIR)")
        elif not subject_dir or not (Path(subject_dir) / "config.json").is_file():
            report.skipped["causal"] = (f"no subject model at {subject_dir!r} (the sidecar's extraction.base_model); "
                                        "pass --subject DIR")
        else:
            logger.info("suite: causal edits on the subject %s", subject_dir)
            from nla.client import device_of

            model, tok = load_subject(subject_dir, device_of(client.ar), side.d_model, read_at)
            slots = grader.recall_slots(table, path, model, tok, read_at, max_rows, seed=seed)
            if slots is not None and len(slots["context"]):
                logger.info("suite: verbalizing %d recall slots of the dataset's documents", len(slots["context"]))
                sv = slots["vectors"]
                stexts = [v.explanation for v in client.verbalize(sv, max_new_tokens=max_new_tokens,
                                                                  batch_size=batch_size)]
                res = causal_edits(client, model, tok, slots["context"], sv, stexts, slots["facts"], grader,
                                   read_at, seed=seed)
                res["source"] = "recall slots of the dataset's documents"
            else:
                res = causal_edits(client, model, tok, table.column("context").to_pylist(), gold, texts, truths,
                                   grader, read_at, seed=seed)
                res["source"] = "the dataset's rows"
            report.sections["causal"] = res
    if "directions" in parts:
        if truths is None:
            report.skipped["directions"] = f"{no_truth} (no facts to take directions of)"
        else:
            logger.info("suite: probe directions")
            res = directions_summary(client, gold, truths, grader, strengths, batch_size, max_new_tokens)
            if res is None:
                report.skipped["directions"] = (f"no fact holds on {MIN_DIRECTION_ROWS} or more of the {len(truths)} "
                                                "rows: no direction to fit; evaluate more rows")
            else:
                report.sections["directions"] = res
    if "confabulation" in parts:
        if truths is None:
            report.skipped["confabulation"] = no_truth
        else:
            docs = table.column("doc_id").to_pylist() if "doc_id" in cols else None
            pos = table.column("position").to_pylist() if "position" in cols else None
            conf = {"pair": confabulation(texts, truths, grader, docs, pos, quotes)}
            if baseline_av is not None:
                logger.info("suite: the baseline AV's explanations")
                btexts = [v.explanation for v in baseline_av.verbalize(gold, max_new_tokens=max_new_tokens,
                                                                         batch_size=batch_size)]
                conf = {"baseline": confabulation(btexts, truths, grader, docs, pos, quotes), **conf}
            report.sections["confabulation"] = conf
    if "best_of" in parts:
        logger.info("suite: best-of-%d", max(best_of))
        report.sections["best_of"] = best_of_n(client, gold, truths, grader if truths else None, base.raw_mean,
                                               best_of, seed=seed, temperature=temperature,
                                               batch_size=batch_size, max_new_tokens=max_new_tokens,
                                               greedy_texts=texts)
        report.sections["best_of"]["temperature"] = temperature
    return report


def block_rows(client: NLAClient | BlockView, path: Path, layer: int, max_rows: int | None, rng: np.random.Generator
               ) -> tuple[Any, Tensor, np.ndarray]:
    """(table, RAW gold, parquet rows) of the dataset's rows of block ``layer`` (``activation_layer``), a
    seeded subset of ``max_rows`` of them when there are more: ``load_eval_table`` a block at a time."""
    from nla.eval.evaluate import load_eval_table, row_blocks

    table, gold, rows = load_eval_table(client, path, None, rng)
    blocks = row_blocks(table, path, client.require_ar("run_suite").layers)
    idx = np.flatnonzero(np.asarray(blocks) == layer)
    if len(idx) < 2:
        found = sorted(set(blocks))
        raise NLAClientError(f"dataset: {path} has {len(idx)} rows of block {layer} (its blocks: {found}); the suite "
                             "needs at least 2 at the block it tests (FVE): give a block the dataset holds")
    if max_rows is not None and max_rows < len(idx):
        if max_rows < 2:
            raise NLAClientError(f"max_rows: FVE needs at least 2 rows, found {max_rows}")
        idx = np.sort(rng.choice(idx, size=max_rows, replace=False))
    return table.take(idx), gold[torch.as_tensor(idx)], rows[idx]


def run_suite_by_block(client: NLAClient, dataset_path: str | os.PathLike, **kwargs: Any) -> SuiteByBlock:
    """:func:`run_suite` at every block of a pair for several blocks (``extraction.layers``), each on the
    dataset's rows of its block (``max_rows`` of each), in the order the pair lists them."""
    side = client.av_sidecar or client.ar_sidecar
    if side is None or side.layers is None:
        raise NLAClientError("suite by block: the pair reads one block (no extraction.layers); run run_suite")
    if "layer" in kwargs:
        raise NLAClientError("suite by block: runs every block of the pair; for one, call run_suite(layer=K)")
    out = SuiteByBlock(dataset=str(dataset_path))
    for k in side.layers:
        logger.info("suite: block %d", k)
        out.reports[int(k)] = run_suite(client, dataset_path, layer=int(k), **kwargs)
    return out
