"""Issue 59's per-kind measure over finished runs: each run's (kind, block) cells met three ways.

Reads ``report.json`` of finished ``nla quickstart`` run directories (nothing is trained or evaluated again;
a run evaluated before the measure existed has no ``headline.kind_cells``: rerun its probe and evaluations,
deleting ``probe.stage_done.json``, ``eval_warmstart.stage_done.json`` and ``eval_rl.stage_done.json`` and
running the same command, the trained stages cached). Prints, as markdown:

- per run, the cells met against the probe's top-1, against it as fact recall, and against the reader at 0.90
  true (``nla.eval.report.kind_cells``), the cells whose claims are at least 0.90 true, and beside them the
  recall-only count of sessions 15-22 (recall within 0.10 of the top-1 either way, claims not read);
- with ``--kinds``, each block's kinds: the probe's top-1 (as fact recall; at 0.90 true) · the AV's recall ·
  the share of its claims true.

    python -m dev.experiments.kind_cells RUN [RUN ...] [--kinds]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nla.eval.report import KIND_RECALL_MARGIN


def _blocks(head: dict) -> dict[str, dict]:
    return head.get("by_block") or {}


def recall_only(head: dict) -> int:
    """Sessions 15-22's count: recall after RL within the margin of the probe's top-1, either way."""
    return sum(1 for b in _blocks(head).values() for kind, top1 in b["probe_by_kind"].items()
               if (r := b["by_kind_rl"].get(kind)) and r[0] is not None and abs(r[0] - top1) <= KIND_RECALL_MARGIN)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--kinds", action="store_true", help="each block's kinds too")
    args = ap.parse_args(argv)
    print("| run | cells | top-1 | top-1 as recall | at 0.90 true | claims ≥ 0.90 true | recall only (top-1) |")
    print("|---|---|---|---|---|---|---|")
    details = []
    for run in args.runs:
        path = run / "report.json"
        if not path.is_file():
            raise SystemExit(f"{run}: no report.json; finish the run (nla quickstart ... --out {run}) first")
        head = json.loads(path.read_text())["headline"]
        c = head.get("kind_cells")
        if not c:
            raise SystemExit(f"{run}: its report has no headline.kind_cells (evaluated before the measure): rerun "
                             "its probe and evaluations as this module's docstring says")
        print(f"| {run.name} | {c['cells']} | {c['top1']} | {c['top1_recall']} | {c['p90']} | {c['claims_true']} | "
              f"{recall_only(head) if _blocks(head) else '–'} |")
        if args.kinds:
            for k, b in _blocks(head).items():
                cells = []
                for kind, top1 in b["probe_by_kind"].items():
                    r, s = b["by_kind_rl"].get(kind), (b.get("said_by_kind_rl") or {}).get(kind)
                    cells.append(f"{kind} {top1:.2f} ({b['probe_recall_top1_by_kind'][kind]:.2f}; "
                                 f"{b['probe_recall_p90_by_kind'][kind]:.2f}) · {r[0]:.2f} · "
                                 + (f"{s[1]:.2f}" if s else "–"))
                details.append(f"- {run.name}, block {k}: " + "; ".join(cells))
            misses = c.get("misses", {}).get("p90")
            if misses:
                details.append(f"- {run.name}, missed at 0.90 true: {', '.join(misses)}")
    if details:
        print("\n" + "\n".join(details))


if __name__ == "__main__":
    main()
