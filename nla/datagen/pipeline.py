"""`run`: all datagen stages in order, each skipped when its output is done for the same settings.

Layout of `out_dir`:
    datagen_config.yaml        the resolved config (world defaults filled in)
    datagen_summary.json       rows written / dropped (and why) per stage
    .done/<stage>.json         done-marker: settings hash + the stage summary
    activations.parquet        extract (+ shards/ while running)
    splits/{av_sft,ar_sft,rl}.parquet
    explained/{av_sft,ar_sft}.parquet
    av_sft.parquet, ar_sft.parquet, rl.parquet (+ .nla_meta.yaml, + *.shuffled.parquet)

A stage is skipped when its done-marker exists and records the same hash of
the settings it (and every stage before it) depends on; otherwise, or with
`force`, its outputs are removed and it runs again. Markers are written last,
so an interrupted stage is never mistaken for a finished one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from nla.datagen.config import SPLITS, DatagenConfig, WikiExplainerConfig
from nla.datagen.io import DatagenError, read_parquet, write_json_atomic
from nla.util.fsutil import write_text_atomic
from nla.util.threads import apply_threads
from nla.util.validation import load_json

log = logging.getLogger(__name__)

STAGES = ("extract", "split", "explain", "build")
CONFIG_FILE = "datagen_config.yaml"
SUMMARY_FILE = "datagen_summary.json"

# Settings each stage adds to the ones of the stages before it.
_STAGE_FIELDS = {
    "extract": ("source", "world_preset", "world_seed", "n_docs", "doc_start_id", "corpus_path", "text_column", "model_dir",
                "layer_index", "layers", "positions_per_doc", "skip_first", "seed", "batch_size", "max_len",
                "batches_per_shard", "bad_vectors"),
    "split": ("split_fractions",),
    "explain": ("explainer", "world_explainer", "wiki_explainer", "provider"),
    "build": ("av_template", "ar_template", "injection_char", "injection_scale", "mse_scale", "shuffled_baseline",
              "center"),
}  # fmt: skip


def _outputs(stage: str, out: Path) -> list[Path]:
    return {
        "extract": [out / "activations.parquet", out / "shards"],
        "split": [out / "splits"],
        "explain": [out / "explained"],
        "build": [out / f"{n}{s}" for n in SPLITS for s in (".parquet", ".parquet.nla_meta.yaml")]
        + [
            out / f"{n}.shuffled{s}"
            for n in ("av_sft", "ar_sft")
            for s in (".parquet", ".parquet.nla_meta.yaml")
        ],
    }[stage]


def stage_hash(cfg: DatagenConfig, stage: str) -> str:
    d = cfg.to_dict()
    # a setting at its default leaves the hash of data written before it was a setting
    for key, default in (("quote_units", None), ("quote_min_prob", None), ("quote_unheld", "omit"),
                         ("fact_min_prob", None), ("fact_unheld", "omit"), ("fact_gate_below", None),
                         ("fact_omit_below", None), ("fact_every_own", None)):
        if d["world_explainer"].get(key) == default:
            d["world_explainer"] = {k: v for k, v in d["world_explainer"].items() if k != key}
    if d["wiki_explainer"] == dataclasses.asdict(WikiExplainerConfig()):
        del d["wiki_explainer"]
    if d["layers"] is None:
        del d["layers"]
    keys: list[str] = []
    for s in STAGES[: STAGES.index(stage) + 1]:
        keys += _STAGE_FIELDS[s]
    blob = json.dumps({k: d[k] for k in keys if k in d}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The config with world defaults filled in, plus the corpus loader's inputs."""

    cfg: DatagenConfig
    world_seed: int | None = None


def resolve(cfg: DatagenConfig) -> Resolved:
    """Fill model_dir / layer_index / n_docs from the world build when source=world (builds it if needed)."""
    if cfg.layers is not None and cfg.layer_index is None:
        cfg = cfg.replace(layer_index=cfg.layers[-1])  # the deepest: the AR's depth
    if cfg.source == "wikipedia" and cfg.model_dir is None:
        from nla.datagen.real_sources import smollm2_dir

        return Resolved(cfg.replace(model_dir=str(smollm2_dir())))
    if cfg.source != "world":
        return Resolved(cfg)
    from nla.world import build_world
    from nla.world.build import seeded_config

    world = seeded_config(cfg.world_preset, cfg.world_seed)
    if not cfg.model_dir and cfg.max_len > world.seq_len:  # before the world is built (minutes)
        raise DatagenError(
            f"max_len: {cfg.max_len} tokens per document, but the world {cfg.world_preset!r}'s subject has "
            f"{world.seq_len} positions (its seq_len, the model's max_position_embeddings); activations past position "
            f"{world.seq_len - 1} are not what the model computes on text it was built for. Set max_len <= "
            f"{world.seq_len} (--set max_len={world.seq_len})")
    arts = build_world(seeded_config(cfg.world_preset, cfg.world_seed), out=cfg.world_out, progress=cfg.progress)
    return Resolved(
        cfg.replace(
            model_dir=cfg.model_dir or str(arts.subject_dir),
            layer_index=arts.config.default_layer if cfg.layer_index is None else cfg.layer_index,
            n_docs=cfg.n_docs or arts.config.n_docs,
        ),
        world_seed=arts.config.seed,
    )


def load_corpus(res: Resolved) -> list:
    from nla.datagen.corpus import read_text_corpus, world_corpus

    cfg = res.cfg
    if cfg.source == "world":
        return world_corpus(res.world_seed or 0, cfg.n_docs, start_id=cfg.doc_start_id)
    if cfg.source == "wikipedia":
        from nla.datagen.real_sources import wikipedia_corpus

        return wikipedia_corpus(cfg.n_docs, cfg.seed)
    return read_text_corpus(cfg.corpus_path, cfg.text_column)


# --- stages ------------------------------------------------------------------
def _extract(res: Resolved, out: Path) -> dict[str, Any]:
    from nla.datagen.extract import extract_activations

    c = res.cfg
    r = extract_activations(
        c.model_dir, load_corpus(res), c.layers or c.layer_index, c.positions_per_doc, c.skip_first, c.seed, c.batch_size,
        out, c.max_len, bad_vectors=c.bad_vectors, batches_per_shard=c.batches_per_shard, device=c.device,
        progress=c.progress,
    )  # fmt: skip
    shutil.rmtree(out / "shards", ignore_errors=True)  # consolidated; the shards were only for resume
    return {"rows": r.n_rows, "docs": r.n_docs, "d_model": r.d_model, "tokens": r.n_tokens, "dropped": r.dropped,
            "path": str(r.path)}  # fmt: skip


def _split(res: Resolved, out: Path) -> dict[str, Any]:
    from nla.datagen.io import write_parquet_atomic
    from nla.datagen.split import split_table

    parts = split_table(read_parquet(out / "activations.parquet"), res.cfg.split_fractions, res.cfg.seed)
    summary = {}
    for name, t in parts.items():
        write_parquet_atomic(t, out / "splits" / f"{name}.parquet")
        summary[name] = {"rows": t.num_rows, "docs": len(set(t.column("doc_id").to_pylist()))}
        log.info("split: wrote %s (%d rows, %d docs)", out / "splits" / f"{name}.parquet", t.num_rows,
                 summary[name]["docs"])  # fmt: skip
    return summary


def _explain(res: Resolved, out: Path) -> dict[str, Any]:
    from nla.datagen.explain import explain_table, make_explainer
    from nla.datagen.io import write_parquet_atomic

    explainer = make_explainer(res.cfg.explainer, res.cfg)
    summary: dict[str, Any] = {"explainer": res.cfg.explainer}
    tables = {name: read_parquet(out / "splits" / f"{name}.parquet") for name in ("av_sft", "ar_sft")}
    min_prob = res.cfg.world_explainer.quote_min_prob if res.cfg.explainer == "world" else None
    fact_prob = res.cfg.world_explainer.fact_min_prob if res.cfg.explainer == "world" else None
    gated = res.cfg.wiki_explainer.min_prob() if res.cfg.explainer == "wiki" else {}
    if min_prob is not None or gated or fact_prob is not None:
        tables["rl"] = read_parquet(out / "splits" / "rl.parquet")
        from nla.datagen.explain import add_quote_held, by_block

        if gated:
            from nla.datagen.wiki import add_claims_held

            tables, summary["claims_held"] = by_block(tables, lambda t: add_claims_held(t, gated))
        else:
            if min_prob is not None:
                tables, summary["quote_held"] = by_block(tables, lambda t: add_quote_held(t, min_prob))
            if fact_prob is not None:
                from nla.datagen.explain import add_facts_held

                w = res.cfg.world_explainer
                tables, summary["facts_held"] = by_block(
                    tables, lambda t: add_facts_held(t, fact_prob, w.every_own, w.fact_gate_below,
                                                    w.fact_omit_below))
        # the RL split keeps its flag for the oracle row and the text explainer of eval (not explained)
        write_parquet_atomic(tables.pop("rl"), out / "explained" / "rl.parquet")
    else:
        (out / "explained" / "rl.parquet").unlink(missing_ok=True)  # a flag of an earlier setting
    try:
        for name, table in tables.items():
            done, dropped = explain_table(table, explainer, desc=f"explain {name}")
            path = write_parquet_atomic(done, out / "explained" / f"{name}.parquet")
            summary[name] = {"rows_in": table.num_rows, "rows": done.num_rows, "dropped": dict(dropped)}
            log.info("explain: wrote %s (%d of %d rows; dropped %s)", path, done.num_rows, table.num_rows,
                     dict(dropped) or "none")  # fmt: skip
            if table.num_rows and done.num_rows == 0:
                raise DatagenError(
                    f"explain: every row of {name} was dropped ({dict(dropped)}); check the explainer settings"
                )
        retries = getattr(explainer, "retries", None)
        if retries:
            summary["retries"] = dict(retries)
    finally:
        explainer.close()
    return summary


def _build(res: Resolved, out: Path) -> dict[str, Any]:
    from nla.datagen.build import build_datasets

    c = res.cfg
    splits = {n: read_parquet(out / "explained" / f"{n}.parquet") for n in ("av_sft", "ar_sft")}
    # explained/rl.parquet: the RL split with what explain added to it (quote_held, claims_held)
    rl = out / "explained" / "rl.parquet"
    splits["rl"] = read_parquet(rl if rl.is_file() else out / "splits" / "rl.parquet")
    r = build_datasets(
        splits, c.model_dir, c.layers or c.layer_index, out, av_template=c.av_template, ar_template=c.ar_template,
        injection_char=c.injection_char, injection_scale=c.injection_scale, mse_scale=c.mse_scale,
        shuffled_baseline=c.shuffled_baseline, seed=c.seed, center=c.center,
        grader="wiki" if c.source == "wikipedia" else None,
        provenance={"datagen_config": str(out / CONFIG_FILE), "explainer": c.explainer},
    )  # fmt: skip
    return {"files": r.files}


def _check_tokenizer(res: Resolved) -> None:
    """What build will check of the model's tokenizer (the marker is one token, the chat template
    builds the AV prompt, the AR's read token, the layer), checked before extract: it reads only the
    tokenizer and config, where extract may take hours before build would refuse."""
    from nla.datagen.build import dataset_config

    c = res.cfg
    dataset_config(c.model_dir, c.layers or c.layer_index, av_template=c.av_template, ar_template=c.ar_template,
                   injection_char=c.injection_char, injection_scale=c.injection_scale, mse_scale=c.mse_scale)


def _check_positions(c: DatagenConfig) -> None:
    """``max_len`` against the subject's positions, before any document is read (and, when the config
    names the model dir, before a world is built for it): with max_len 1000 on a 128-position model,
    extract wrote rows at positions 128-923 the model never saw (issue 58)."""
    from transformers import AutoConfig

    from nla.core.arch import max_positions

    if not c.model_dir:
        return
    try:
        n = max_positions(AutoConfig.from_pretrained(c.model_dir, local_files_only=True))
    except (OSError, ValueError):
        return  # extract's own checks name a missing or broken model dir
    if n is not None and c.max_len > n:
        raise DatagenError(
            f"max_len: {c.max_len} tokens per document, but the subject model {c.model_dir} has {n} positions "
            f"(max_position_embeddings in its config.json); activations past position {n - 1} are not what the "
            f"model computes on text it was built for. Set max_len <= {n} (--set max_len={n})")


_RUNNERS = {"extract": _extract, "split": _split, "explain": _explain, "build": _build}


def run(cfg: DatagenConfig, stages: Sequence[str] | None = None, force: bool = False) -> dict[str, Any]:
    """Run `stages` (default: all, in order); returns and saves the summary of every stage done so far."""
    stages = list(stages or STAGES)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise DatagenError(f"unknown stage(s) {bad}; valid stages: {list(STAGES)}")
    apply_threads(cfg.threads)
    if "extract" in stages:
        _check_positions(cfg)  # a model dir named in the config: before resolve builds a world (minutes)
    # the run's summary, read before resolve too: a malformed one is refused before any world is built
    summary_path = Path(cfg.out_dir) / SUMMARY_FILE
    summary = load_json(summary_path, "datagen summary", "delete it (datagen writes it again)"
                        ) if summary_path.exists() else {}
    res = resolve(cfg)
    if "extract" in stages and not cfg.model_dir:  # a model dir the world build chose: checked now
        _check_positions(res.cfg)
    if "build" in stages:
        _check_tokenizer(res)
    out = Path(res.cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        yaml.safe_dump(res.cfg.to_dict(), sort_keys=False, allow_unicode=True), out / CONFIG_FILE
    )
    for stage in STAGES:
        if stage not in stages:
            continue
        marker = out / ".done" / f"{stage}.json"
        h = stage_hash(res.cfg, stage)
        force_stage = force
        if not force and marker.exists():
            old = load_json(marker, f"{stage} stage's done-marker", f"delete it (the {stage} stage runs again)")
            if old.get("hash") == h:
                log.info(
                    "%s: already done for these settings (%s); skipping (use --force to redo)", stage, marker
                )
                summary[stage] = old["summary"]
                continue
            log.info("%s: settings changed since the last run; redoing it", stage)
            force_stage = True
        else:
            # no marker: an interrupted run keeps its partial work (extract resumes from its shards)
            force_stage = force
        marker.unlink(missing_ok=True)
        if force_stage:
            for p in _outputs(stage, out):
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
        for later in STAGES[STAGES.index(stage) + 1 :]:  # downstream results are stale now
            (out / ".done" / f"{later}.json").unlink(missing_ok=True)
        summary[stage] = _RUNNERS[stage](res, out)
        write_json_atomic({"hash": h, "summary": summary[stage]}, marker)
        write_json_atomic(summary, summary_path)
        log.info("%s: done; summary in %s", stage, summary_path)
    return summary
