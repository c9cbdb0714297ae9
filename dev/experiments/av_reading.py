"""How well a warm-started AV *reads* each fact kind from the injected vector (issue 25).

    python -m dev.experiments.av_reading runs/quickstart-default [RUN...] [--rows 800]

Greedy recall mixes two things: whether the AV can read a kind from the vector and whether it
chooses to name it. This measures the first alone: teacher-forced on the last ``--rows`` rows of
the run's ``datagen/av_sft.parquet`` (the rows the AV's own held-out loss is computed on), at
every response token that is a fact value's word (not the quoted current word), is the AV's
argmax that token? One accuracy per kind, beside the probe's top-1 of the same run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch


def reading_by_kind(av_dir: Path, dataset: Path, rows: int, batch: int = 64) -> dict[str, tuple[float, int]]:
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.core.injection import InjectionHook
    from nla.core.sidecar import load_sidecar
    from nla.train.av import IGNORE_INDEX, build_examples, collate
    from nla.world.facts import SURFACE_INDEX

    tok = AutoTokenizer.from_pretrained(av_dir)
    model = AutoModelForCausalLM.from_pretrained(av_dir).eval()
    side = load_sidecar(av_dir)
    hook = InjectionHook.from_config(model, side)
    table = pq.read_table(dataset)
    table = table.slice(max(0, table.num_rows - rows))
    vec = torch.tensor(table.column("activation_vector").to_pylist(), dtype=torch.float32)
    examples = build_examples(tok, table.column("prompt").to_pylist(), table.column("response").to_pylist(),
                              side.injection_char, 160)
    hit, total = Counter(), Counter()
    try:
        for s in range(0, len(examples), batch):
            b = collate(examples[s : s + batch], tok.pad_token_id, "right")
            with torch.no_grad(), hook.vectors(vec[s : s + batch]):
                logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                               position_ids=b.position_ids).logits
            pred, labels = logits[:, :-1].argmax(-1), b.labels[:, 1:]
            for i, j in (labels != IGNORE_INDEX).nonzero().tolist():
                label = int(labels[i, j])
                word = tok.decode([label]).strip().lower()
                fact = SURFACE_INDEX.get(word)
                if fact is None or tok.decode([int(b.input_ids[i, j])]).strip().endswith('"'):
                    continue  # not a fact word, or the quoted current word
                total[fact.kind] += 1
                hit[fact.kind] += int(pred[i, j]) == label
    finally:
        hook.remove()
    return {k: (hit[k] / total[k], total[k]) for k in sorted(total)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="quickstart run directories")
    ap.add_argument("--rows", type=int, default=800, help="last rows of av_sft.parquet to read (default 800)")
    args = ap.parse_args(argv)
    print("| run | kind | teacher-forced reading | tokens | probe top-1 |")
    print("|---|---|---|---|---|")
    for run in args.runs:
        marker = run / "av.stage_done.json"
        if not marker.is_file():
            raise SystemExit(f"av_reading: {marker} not found; pass run directories of `nla quickstart`")
        # the stage marker names the checkpoint relative to where the quickstart was launched
        av_dir = Path(json.loads(marker.read_text())["checkpoint"])
        if not av_dir.is_dir():
            av_dir = run / "av" / "checkpoints" / av_dir.name
        probe = json.loads((run / "report.json").read_text())["headline"].get("probe_by_kind", {}) \
            if (run / "report.json").is_file() else {}
        for kind, (acc, n) in reading_by_kind(av_dir, run / "datagen" / "av_sft.parquet", args.rows).items():
            p = probe.get(kind)
            print(f"| {run.name} | {kind} | {acc:.2f} | {n} | {'' if p is None else f'{p:.2f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
