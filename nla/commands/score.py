"""`nla score --ar DIR (--texts FILE | --dataset PARQUET) [--vectors ...] [--out jsonl]`: reconstruct and score.

``--texts`` is a text file with one explanation per ``\n``-terminated line, or a JSONL file (e.g. the output of
``nla verbalize``) whose objects carry an ``explanation`` (null = failed sample). When every object
also carries the ``row`` that ``nla verbalize`` writes (the vector's row; several samples of one
vector share it), each explanation is scored against that row's vector, not the one at its line
number (issue 58: a file sorted or filtered after verbalize was scored against the wrong vectors).
A UTF-8 byte-order mark at the start of the file is dropped (it stayed in the first explanation). ``--dataset``
takes the ``explanation`` column and, unless ``--vectors`` is given, the vectors of the same parquet.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from nla.commands.eval import add_layer_arg, add_model_args, apply_threads_flag, vector_blocks
from nla.util.flags import positive_int

log = logging.getLogger("nla.score")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="reconstruct explanations with the AR and score them against vectors")
    p.add_argument("--ar", required=True, help="reconstructor checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--texts", help="explanations: one per line (.txt) or JSONL with an 'explanation' field")
    src.add_argument("--dataset", help="parquet with an explanation column (and activation_vector)")
    p.add_argument("--vectors", help="parquet with activation_vector, or .npy [N, d]; default: --dataset's")
    p.add_argument("--rows", type=positive_int, help="only the first N rows")
    p.add_argument("--out", help="JSONL of per-row scores; default: only the summary is printed")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="drop vectors with NaN/Inf, zero or overflowing norms (counted and named) instead of refusing")
    p.add_argument("--batch-size", type=positive_int, default=64)
    add_layer_arg(p)
    add_model_args(p)
    p.set_defaults(func=run)


def read_texts(path: str) -> list[str | None]:
    """Explanations from a .jsonl (``explanation`` field) or a plain text file (one per line)."""
    return read_texts_and_rows(path)[0]


def read_texts_and_rows(path: str) -> tuple[list[str | None], list[int] | None]:
    """Explanations from a .jsonl (``explanation`` field) or a plain text file (one per line), and
    the vector row of each when every JSONL object names one (``row``, as nla verbalize writes), else None.

    Lines end at ``\n`` only (a trailing ``\r`` is dropped): ``str.splitlines`` also breaks at
    U+2028, NEL, form feeds and lone CRs, which would shift every later explanation onto the
    wrong vector. In a text file an empty line is an empty explanation (a row, scored as a failed
    sample: it says nothing); blank lines of a JSONL file are skipped (they hold no object).
    """
    import json
    from pathlib import Path

    p = Path(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")  # not read_text: it turns lone CRs into row breaks
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{p}: line {line} is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
                         "save the explanations as UTF-8") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark is no part of the first explanation
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file's final newline ends the last row, it does not start a new one
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]
    if p.suffix != ".jsonl":
        return lines, None
    out: list[str | None] = []
    rows: list[int | None] = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: line {i + 1} is not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict) or "explanation" not in obj:
            raise ValueError(f"{p}: line {i + 1} has no 'explanation' field; expected the output of nla verbalize")
        if obj["explanation"] is not None and not isinstance(obj["explanation"], str):
            raise ValueError(f"{p}: line {i + 1}: 'explanation' must be a string or null, found "
                             f"{type(obj['explanation']).__name__}")
        row = obj.get("row")
        if row is not None and (isinstance(row, bool) or not isinstance(row, int) or row < 0):
            raise ValueError(f"{p}: line {i + 1}: 'row' must be a vector's row number (an integer >= 0), found "
                             f"{row!r}")
        out.append(obj["explanation"])
        rows.append(row)
    named = [r is not None for r in rows]
    if any(named) and not all(named):
        first = named.index(False) if named[0] else named.index(True)
        raise ValueError(f"{p}: line {first + 1} {'has no' if named[0] else 'has a'} 'row' field and line 1 "
                         f"{'has one' if named[0] else 'has none'}; expected every line to name its vector's row "
                         "(nla verbalize's output) or none (then line i is scored against vector i)")
    return out, (rows if rows and all(named) else None)  # type: ignore[return-value]


def run(args: argparse.Namespace) -> int:

    import torch

    from nla.client import NLAClient, failed_mse, load_vectors
    from nla.core.vectors import fve
    from nla.datagen.io import read_parquet
    from nla.util.fsutil import dumps_json, write_text_atomic
    from nla.util.validation import check_device, check_output_path, check_vectors, drop_bad_rows

    check_device(args.device)
    if args.out:
        check_output_path(args.out, "--out", is_file=True)
    apply_threads_flag(args)
    if args.texts:
        if not args.vectors:
            raise ValueError("--texts needs --vectors (parquet or .npy) to score against")
        texts, text_rows = read_texts_and_rows(args.texts)
    else:
        text_rows = None
        table = read_parquet(args.dataset)
        if "explanation" not in table.column_names:
            raise ValueError(f"{args.dataset} has no explanation column; found {table.column_names}")
        texts = table.column("explanation").to_pylist()
        bad = next((i for i, t in enumerate(texts) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"{args.dataset}: column 'explanation' row {bad} holds {type(texts[bad]).__name__} "
                             f"({table.schema.field('explanation').type}), expected text (or null for a failed sample)")
    source = args.vectors or args.dataset
    raw = load_vectors(source, rows=args.rows, check=False)
    if text_rows is not None:  # each explanation against the vector of its 'row' (nla verbalize's field)
        beyond = [r for r in text_rows if r >= raw.shape[0]]
        if beyond and args.rows is None:
            raise ValueError(f"{args.texts}: 'row' {beyond[0]} names no vector: {source} holds {raw.shape[0]} "
                             "vectors; score the explanations against the vectors they were verbalized from")
        keep = [i for i, r in enumerate(text_rows) if r < raw.shape[0]]
        texts, text_rows = [texts[i] for i in keep], [text_rows[i] for i in keep]
        raw = raw[np.asarray(text_rows, dtype=np.int64)]
        row_of = np.asarray(text_rows, dtype=np.int64)
    else:
        texts = texts[: args.rows] if args.rows is not None else texts
        row_of = None
    if len(texts) != raw.shape[0]:
        raise ValueError(f"{len(texts)} texts for {raw.shape[0]} vectors in {source}; pass exactly one explanation "
                         "per vector (--rows N takes the first N of both)")
    if args.skip_bad_rows:
        vectors, kept, report = drop_bad_rows(raw, f"vectors {source}")
        if report:
            log.warning(report)
        texts = [texts[i] for i in kept]
    else:
        vectors, kept = check_vectors(raw, f"vectors {source}"), np.arange(raw.shape[0])
    if row_of is not None:
        kept = row_of[kept]  # the rows written out are the vectors' rows
    client = NLAClient(None, args.ar, device=args.device, dtype=args.dtype, sidecar=args.sidecar,
                       allow_mixed_provenance=args.allow_mixed_provenance)
    if str(source).endswith(".parquet"):
        client.check_data(source, width=int(raw.shape[1]))
    layer = vector_blocks(args.layer, client.ar_sidecar.layers, source, kept,
                          "--vectors" if args.vectors else "--dataset")  # each row's block: its AR text names it
    res = client.score(texts, vectors, batch_size=args.batch_size, layer=layer)
    ok = ~res.failed
    summary = {"rows": res.n, "skipped_rows": int(raw.shape[0] - res.n), "failure_rate": res.failure_rate,
               "mse_nrm_mean": float(res.mse_nrm[ok].mean()) if ok.any() else None,
               "cosine_mean": float(res.cosine[ok].mean()) if ok.any() else None}
    gold = torch.from_numpy(np.array(vectors))  # a copy: arrow-backed arrays are read-only
    if int(ok.sum()) >= 2:
        try:
            summary["fve_completed_rows"] = fve(res.predictions[ok], gold[ok], client.mse_scale)
        except ValueError as err:  # every gold the same direction: the per-row scores stand, FVE does not
            log.warning("%s; fve_completed_rows is null", err)
            summary["fve_completed_rows"] = None
    if res.failed.any():
        fm = failed_mse(gold, client.mse_scale)
        summary["mse_nrm_mean_failed_as_orthogonal"] = float(torch.where(res.failed, fm, res.mse_nrm).mean())
    if args.out:
        rows = "".join(dumps_json({"row": int(kept[i]), "failed": bool(res.failed[i]),
                                   "mse_nrm": None if res.failed[i] else float(res.mse_nrm[i]),
                                   "cosine": None if res.failed[i] else float(res.cosine[i])}) + "\n"
                       for i in range(res.n))
        write_text_atomic(rows, args.out)
        log.info("wrote %d rows to %s", res.n, args.out)
    print(dumps_json(summary, indent=2))
    return 0
