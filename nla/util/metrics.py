"""Scalar metrics: JSONL (always), TensorBoard (when importable), and PNG curves."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Append ``{"step": s, key: value, ...}`` lines to ``{out_dir}/{name}.jsonl``.

    A resumed run reopens the file in append mode; :meth:`read` keeps the last record per
    step so the curves never double back.
    """

    def __init__(self, out_dir: str | os.PathLike, name: str, tensorboard: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        from nla.util.fsutil import run_file

        # a link out of the run dir is refused, not followed (its target lost its last line, then
        # got metrics appended: issue 58)
        self.path = run_file(self.out_dir, f"{name}.jsonl", "metrics log")
        _drop_torn_tail(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard" / name))
            except Exception as exc:  # tensorboard is optional; JSONL is the record
                logger.debug("TensorBoard disabled (%s): logging to JSONL only", exc)

    def log(self, step: int, **scalars: Any) -> None:
        """Record scalars at ``step``. Non-numeric values go to JSONL only (e.g. flags, text)."""
        record: dict[str, Any] = {"step": int(step)}
        for key, value in scalars.items():
            record[key] = _plain(value)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, int(step))

    def read(self) -> list[dict[str, Any]]:
        """All records so far, ordered by step, the last record winning when keys repeat at a step."""
        return read_metrics(self.path)

    def plot(self, png_path: str | os.PathLike, keys: list[str], title: str = "") -> Path | None:
        """Save a PNG with one panel per key (x = step). Returns the path, or None when nothing to plot."""
        return plot_metrics(self.read(), png_path, keys, title)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that a kill left half-written (no newline at the end of the file), so a
    resumed run appends whole records; the dropped bytes are logged. Whole lines are untouched."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1  # 0 when the only line is torn
    with open(path, "r+b") as fh:
        fh.truncate(keep)
    logger.warning("%s: dropped a torn last line (%d bytes, %r...) left by an interrupted run", path,
                   len(data) - keep, data[keep : keep + 60].decode("utf-8", "replace"))


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parse a metrics JSONL; records with the same step and key: the later one wins.

    A torn last line (an interrupted write, no newline after it) is skipped with a warning; a
    line that does not parse anywhere else is an error naming the file and the line.
    """
    merged: dict[int, dict[str, Any]] = {}
    p = Path(path)
    if not p.is_file():
        return []
    text = p.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError) as err:
            if i == len(lines):  # the last line, with no newline after it: torn by a kill
                logger.warning("%s: skipping a torn last line (%r...)", p, line[:60])
                continue
            raise ValueError(f"{p}: line {i} is not a metrics record ({err}); the file was edited or "
                             "damaged: remove that line, or the file to start its curves afresh") from None
        merged.setdefault(step, {}).update(rec)
    return [merged[s] for s in sorted(merged)]


def plot_metrics(
    records: list[dict[str, Any]], png_path: str | os.PathLike, keys: list[str], title: str = ""
) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records)]
    if not present:
        logger.info("plot %s: none of %s were logged, no figure written", png_path, keys)
        return None
    ncols = 1 if len(present) < 3 else 2
    nrows = -(-len(present) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 2.6 * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax, key in zip(flat, present, strict=False):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        xs, ys = zip(*pts, strict=True)
        if len(xs) >= 20:
            # Noisy per-step RL metrics: the raw curve faint, a trailing moving average on top.
            ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=1, label="per step")
            ax.plot(xs, moving_average(ys, max(5, len(ys) // 15)), color="tab:blue", linewidth=2,
                    label="moving average")
            ax.legend(fontsize=7, loc="best")
        else:
            ax.plot(xs, ys, marker=".", color="tab:blue")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in flat[len(present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    import tempfile

    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a temp file renamed into place: a link at ``out`` is replaced, never written through
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100, format="png")
        from nla.util.fsutil import default_file_mode

        os.chmod(tmp, default_file_mode())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out


def moving_average(values: list[float] | tuple[float, ...], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (shorter at the start), same length as ``values``."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
