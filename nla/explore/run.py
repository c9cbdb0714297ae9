"""The run view: what a quickstart or RL output directory says, as plain JSON for the page.

Two layouts are read, both as written by this library (nothing else is opened):

1. A quickstart run (``report.json``, ``nla.eval.report.write_report``): the headline, the
   warm-start vs RL evaluation table, fact recall/precision by kind, time per stage, the
   curve PNGs and the held-out example explanations, each claim graded against its facts.
2. An RL output directory (``rl_summary.json``, ``rl.jsonl``, ``rl_curves.png``,
   ``nla.rl.loop.run_rl``): the final metrics and the curves.

Only the PNGs listed here are served (by name, never by a path from the request), and every
file read goes through ``nla.util.fsutil.run_file``: a symbolic link that leads out of the run
directory is refused (a plot linked to ``/etc/passwd`` was served as an image, issue 58). A file
that is not the JSON nla writes is a :class:`RunFileError` naming the file and what was wrong,
never a traceback.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nla.util.fsutil import run_file
from nla.util.validation import InputError

__all__ = ["RunFileError", "RunSummary", "load_run"]


class RunFileError(InputError):
    """A file of the run directory is not what nla writes there (malformed JSON, a wrong shape)."""


def _read_json(root: Path, name: str) -> Any:
    path = run_file(root, name, "run file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise RunFileError(f"--run: {path} is not UTF-8 text ({err.reason} at byte {err.start}); expected the JSON "
                           "nla writes there: rerun the command that wrote it, or pass another --run") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as err:
        where = f"line {err.lineno}, column {err.colno}: {err.msg}" if isinstance(err, json.JSONDecodeError) else \
            type(err).__name__
        raise RunFileError(f"--run: {path} is not valid JSON ({where}); expected the JSON nla writes there: rerun "
                           "the command that wrote it, or pass another --run") from None


def _object(value: Any, path: Path, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RunFileError(f"--run: {path}: {what}: expected a JSON object, found {type(value).__name__}; the file "
                           "is not the one nla writes: rerun the command that wrote it, or pass another --run")
    return value

_PLOT_TITLES = {"world_loss": "Subject model pretraining", "ar_curves": "AR warm-start",
                "av_curves": "AV warm-start", "rl_curves": "RL"}
_RL_KEYS = ("step", "reward_mean", "mse_nrm", "fve_nrm", "fact_recall", "fact_precision", "extraction_fail_rate",
            "truncation_rate", "response_len", "kl", "eval_mse_nrm", "eval_fve_nrm", "eval_fact_recall",
            "eval_fact_precision")


@dataclass
class RunSummary:
    """What ``GET /api/run`` returns (:meth:`to_dict`); ``plots`` maps a plot name to its PNG file."""

    path: Path
    kind: str  # "quickstart" | "rl"
    headline: list[dict[str, Any]] = field(default_factory=list)  # [{label, value}]
    tables: list[dict[str, Any]] = field(default_factory=list)  # [{title, columns, rows}]
    plots: dict[str, Path] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "headline": self.headline, "tables": self.tables,
                "plots": [{"name": n, "title": _PLOT_TITLES.get(n, n), "url": f"/api/run/plots/{n}"}
                          for n in self.plots],
                "examples": self.examples}


def _num(x: Any, nd: int = 3) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return round(float(x), nd) if isinstance(x, float) else x


def load_run(path: str | Path) -> RunSummary:
    """Read a quickstart run dir (``report.json``) or an RL output dir (``rl_summary.json``)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--run: no directory at {path}")
    try:
        if (path / "report.json").is_file():
            return _quickstart(path)
        if (path / "rl_summary.json").is_file():
            return _rl(path)
    except (KeyError, TypeError, AttributeError, IndexError) as err:  # valid JSON of another shape
        raise RunFileError(f"--run: {path}: report.json / rl_summary.json / rl.jsonl are not in the layout nla "
                           f"writes ({type(err).__name__}: {err}); rerun the command that wrote them, or pass "
                           "another --run") from None
    raise FileNotFoundError(
        f"--run: {path} has neither report.json (a quickstart run) nor rl_summary.json (an nla rl output dir); "
        "pass the directory `nla quickstart --out` or `nla rl` wrote")


def _quickstart(path: Path) -> RunSummary:
    report = _object(_read_json(path, "report.json"), path / "report.json", "the whole file")
    h = _object(report.get("headline", {}), path / "report.json", "headline")
    labels = (("preset", "preset"), ("round_trip_fve_warmstart", "round-trip FVE, warm-start"),
              ("round_trip_fve_rl", "round-trip FVE, after RL"), ("ar_heldout_fve_warmstart", "AR held-out FVE"),
              ("av_vector_gap", "AV vector gap"), ("rl_final_reward_mean", "final RL reward"),
              ("subject_heldout_loss", "subject held-out loss"), ("total_seconds", "seconds"))
    run = RunSummary(path, "quickstart", headline=[{"label": lab, "value": _num(h[k])} for k, lab in labels if k in h])
    warm, after = report.get("eval_warmstart") or {}, report.get("eval_rl") or {}
    run.tables.append(_eval_table(warm, after))
    kinds = _by_kind_table(after)
    if kinds:
        run.tables.append(kinds)
    quotes = _quote_table(warm, after)
    if quotes:
        run.tables.append(quotes)
    stages = report.get("stages") or []
    if stages:
        run.tables.append({"title": "Time per stage", "columns": ["stage", "seconds", "cached"],
                           "rows": [[s["name"], _num(s["seconds"], 1), "yes" if s["cached"] else "no"]
                                    for s in stages]})
    for name, file in _object(report.get("plots") or {}, path / "report.json", "plots").items():
        png = run_file(path, Path(str(file)).name, f"plot {name!r} of report.json")
        if png.is_file() and png.suffix == ".png":
            run.plots[str(name)] = png
    run.examples = _examples(warm, after)
    return run


def _eval_table(warm: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    cols = ["predictor", "FVE warm", "FVE RL", "cosine warm", "cosine RL", "recall warm", "recall RL",
            "precision warm", "precision RL", "failed warm", "failed RL"]
    rows_after = {r["name"]: r for r in after.get("rows", [])}
    rows = []
    for r in warm.get("rows", []):
        a = rows_after.get(r["name"], {})
        fw, fa = r.get("faithfulness") or {}, a.get("faithfulness") or {}
        rows.append([r["name"], _num(r.get("fve")), _num(a.get("fve")), _num(r.get("cosine")), _num(a.get("cosine")),
                     _num(fw.get("recall")), _num(fa.get("recall")), _num(fw.get("precision")),
                     _num(fa.get("precision")), _num(r.get("failure_rate"), 2), _num(a.get("failure_rate"), 2)])
    n = warm.get("n_rows")
    return {"title": f"Evaluation on held-out documents ({n} rows)" if n else "Evaluation", "columns": cols,
            "rows": rows}


def _by_kind_table(after: dict[str, Any]) -> dict[str, Any] | None:
    rows = [r for r in after.get("rows", []) if (r.get("faithfulness") or {}).get("by_kind")]
    if not rows:
        return None
    kinds = sorted(rows[0]["faithfulness"]["by_kind"])
    out = []
    for r in rows:
        bk = r["faithfulness"]["by_kind"]
        out.append([r["name"]] + [f"{bk[k][0]:.2f} / {bk[k][1]:.2f}" if k in bk else "–" for k in kinds])
    return {"title": "After RL: fact recall / precision by kind", "columns": ["predictor", *kinds], "rows": out}


def _quote_table(warm: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """The round trip's quotation of the text's end graded per position (``nla.eval.report.quote_table``)."""
    from nla.eval.report import quote_table

    lines = quote_table(warm, after)
    if not lines:
        return None
    rows = [[c.strip() or None for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return {"title": "The quotation of the text's end, unit by unit (AV → AR round trip)",
            "columns": ["unit", "recall warm", "precision warm", "recall RL", "precision RL"],
            "rows": [[r[0], *[None if c in (None, "–") else float(c) for c in r[1:]]] for r in rows]}


def _grader_of(ev: dict[str, Any]) -> Any:
    """The grader the eval's dataset names in its parquet metadata (``wiki`` for the smollm2 preset);
    when the dataset is gone or names none, the first of the world's and the wiki's graders whose kinds
    hold every fact kind of the samples (the world's when they have none)."""
    from nla.core.graders import GRADER_METADATA_KEY, get_grader

    path = ev.get("dataset")
    try:
        import pyarrow.parquet as pq

        name = (pq.read_schema(path).metadata or {}).get(GRADER_METADATA_KEY) if isinstance(path, str) else None
        if name:
            return get_grader(name.decode())
    except (OSError, ValueError, KeyError):
        pass
    kinds = {str(f).partition("=")[0] for s in ev.get("samples", []) for f in s.get("facts") or []}
    return next((g for g in map(get_grader, ("world", "wiki")) if kinds <= set(g.kinds)), get_grader("world"))


def _examples(warm: dict[str, Any], after: dict[str, Any], n: int = 8) -> list[dict[str, Any]]:
    from nla.explore.engine import grade_claims

    grader = _grader_of(after)
    by_row = {s["row"]: s for s in warm.get("samples", [])}
    out = []
    for s in after.get("samples", [])[:n]:
        w = by_row.get(s["row"], {})
        facts = s.get("facts")
        out.append({
            "row": s["row"], "context": s.get("context"), "facts": facts, "reference": s.get("reference"),
            "warmstart": {"explanation": w.get("explanation"), "status": w.get("status"),
                          "mse_nrm": _num(w.get("mse_nrm")),
                          **grade_claims(w.get("explanation"), facts, s.get("context"), grader)},
            "rl": {"explanation": s.get("explanation"), "status": s.get("status"), "mse_nrm": _num(s.get("mse_nrm")),
                   **grade_claims(s.get("explanation"), facts, s.get("context"), grader)},
        })
    return out


def _rl(path: Path) -> RunSummary:
    summary = _object(_read_json(path, "rl_summary.json"), path / "rl_summary.json", "the whole file")
    run = RunSummary(path, "rl", headline=[{"label": k, "value": _num(summary[k])} for k in _RL_KEYS
                                           if k in summary])
    log = run_file(path, "rl.jsonl", "RL log")
    if log.is_file():
        from nla.util.metrics import read_metrics

        try:
            lines = read_metrics(log)
        except ValueError as err:
            raise RunFileError(f"--run: {' '.join(str(err).split())}; rerun the command that wrote it, or pass "
                               "another --run") from None
        cols = [k for k in ("step", "reward_mean", "mse_nrm", "fve_nrm", "fact_recall", "fact_precision",
                            "extraction_fail_rate", "kl") if any(k in r for r in lines)]
        every = max(1, len(lines) // 12)
        picked = lines[::every] + ([lines[-1]] if lines and (len(lines) - 1) % every else [])
        run.tables.append({"title": f"RL log (every {every} steps)", "columns": cols,
                           "rows": [[_num(r.get(c)) for c in cols] for r in picked]})
    curves = run_file(path, "rl_curves.png", "RL curves")
    if curves.is_file():
        run.plots["rl_curves"] = curves
    return run
