"""Issue 48's hostile-user findings, probed again through the CLI on a copy of a quickstart run.

Each probe builds its input in a scratch dir, runs ``nla ...`` as a user would (a real process),
and checks the outcome the issue asks for: a clear error (exit 2, one ``nla CMD: error:`` line, no
traceback) or the correct result, and that nothing already there was deleted or changed.

    python -m dev.experiments.probe_issue48 --run runs/quickstart-default [--scratch /tmp/probe48]

``--run``: a finished ``nla quickstart`` dir (its RL pair, datagen and rl_config.yaml are copied;
the run itself is only read, except probe 4, which runs ``nla quickstart --threads 1`` on the run
to check it is refused and leaves every file as it was). Prints a table and exits 1 if any probe fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

NLA = [sys.executable, "-m", "nla.cli"]


def run(*args: str, timeout: float = 600) -> tuple[int, str]:
    proc = subprocess.run([*NLA, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr + proc.stdout


def clear_error(code: int, out: str, command: str, *parts: str) -> str | None:
    """None when the output is one clear error line with ``parts``; else what is wrong."""
    if code != 2:
        return f"exit {code}, expected 2: {out[-300:]!r}"
    if "Traceback" in out:
        return "a traceback"
    errors = [ln for ln in out.splitlines() if ln.startswith(f"nla {command}: error: ")]
    if len(errors) != 1:
        return f"{len(errors)} error lines: {out[-300:]!r}"
    missing = [p for p in parts if p not in errors[0]]
    return f"the error does not say {missing}: {errors[0]!r}" if missing else None


def digest(root: Path) -> dict[str, str]:
    """Content hash of every file under ``root`` (what 'nothing changed' compares)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".nla.lock"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--scratch", default="/tmp/probe48")
    args = ap.parse_args()
    run_dir = Path(args.run).resolve()
    scratch = Path(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    rl_ckpt = sorted((run_dir / "rl" / "checkpoints").glob("step_*"))[-1]
    rl_config = run_dir / "rl" / "rl_config.yaml"
    data = run_dir / "datagen"
    results: list[tuple[str, str | None]] = []

    def probe(name: str, fn: Callable[[], str | None]) -> None:
        t0 = time.perf_counter()
        try:
            why = fn()
        except Exception as err:  # noqa: BLE001 - a probe that crashes is a failed probe
            why = f"the probe crashed: {type(err).__name__}: {err}"
        results.append((name, why))
        print(f"{'ok  ' if why is None else 'FAIL'} {name} ({time.perf_counter() - t0:.1f} s)"
              + (f": {why}" if why else ""), flush=True)

    def rl_run_copy(name: str) -> Path:
        x = scratch / name
        (x / "checkpoints").mkdir(parents=True)
        shutil.copytree(rl_ckpt, x / "checkpoints" / rl_ckpt.name)
        shutil.copy(run_dir / "rl" / "rl.jsonl", x / "rl.jsonl")
        return x

    rl_common = ["--config", rl_config, "--steps", "1", "--set", "progress=false", "--set", "tensorboard=false",
                 "--set", "eval_every=1000", "--threads", "1"]

    # ---- data loss
    def overwrite_own_input() -> str | None:
        x = rl_run_copy("own_input")
        before = digest(x)
        code, out = run("rl", *rl_common, "--out", x, "--av", x / "checkpoints" / rl_ckpt.name / "av",
                        "--ar", rl_ckpt / "ar", "--overwrite")
        why = clear_error(code, out, "rl", "--overwrite would delete inputs of this run", "av = ")
        return why or (None if digest(x) == before else "the run dir changed")

    def overwrite_keeps_user_files() -> str | None:
        x = rl_run_copy("keeps")
        (x / "notes.txt").write_text("mine")
        shutil.copytree(data, x / "datagen", ignore=shutil.ignore_patterns("activations.parquet", "explained"))
        code, out = run("rl", *rl_common, "--out", x, "--av", rl_ckpt / "av", "--ar", rl_ckpt / "ar", "--overwrite",
                        "--dataset", x / "datagen" / "rl_train.parquet", "--set", "eval_dataset=null")
        if code != 0:
            return f"exit {code}: {out[-400:]!r}"
        if (x / "notes.txt").read_text() != "mine" or not (x / "datagen" / "rl.parquet").is_file():
            return "a file nla did not write was deleted"
        return None if "keeping what a run does not write: datagen, notes.txt" in out else "the log does not say what it keeps"

    def two_writers() -> str | None:
        x = scratch / "two"
        first = subprocess.Popen([*NLA, "rl", *rl_common, "--steps", "50", "--out", x, "--av", rl_ckpt / "av",
                                  "--ar", rl_ckpt / "ar"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(600):  # until the first holds the lock
                if (x / ".nla.lock").is_file() and (x / ".nla.lock").read_text():
                    break
                time.sleep(0.1)
            code, out = run("rl", *rl_common, "--out", x, "--av", rl_ckpt / "av", "--ar", rl_ckpt / "ar")
            return clear_error(code, out, "rl", "is in use by another nla run", f"pid {first.pid}")
        finally:
            first.kill()
            first.wait()

    def quickstart_other_threads() -> str | None:
        before = digest(run_dir)
        code, out = run("quickstart", "--out", run_dir, "--threads", "1", "--no-progress")
        why = clear_error(code, out, "quickstart", "finished there with another config", "--overwrite")
        return why or (None if digest(run_dir) == before else "the run dir changed")

    # ---- silently wrong
    def facts_all_null() -> str | None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        t = pq.read_table(data / "eval.parquet").slice(0, 16)
        t = t.set_column(t.schema.get_field_index("facts"), "facts", pa.nulls(len(t), t.schema.field("facts").type))
        ds = scratch / "null_facts.parquet"
        pq.write_table(t, ds)
        shutil.copy(str(data / "eval.parquet") + ".nla_meta.yaml", str(ds) + ".nla_meta.yaml")
        code, out = run("eval", "--av", rl_ckpt / "av", "--ar", rl_ckpt / "ar", "--dataset", ds, "--out",
                        scratch / "null_eval", "--max-new-tokens", "40", "--threads", "1")
        if code != 0:
            return f"exit {code}: {out[-400:]!r}"
        report = json.loads(next((scratch / "null_eval").glob("*.json")).read_text())
        text = json.dumps(report)
        return None if '"recall": 1.0' not in text and "no ground truth" in text else "recall graded without truth"

    def duplicate_keys() -> str | None:
        cfg = scratch / "dup.yaml"
        cfg.write_text(rl_config.read_text() + "\nsteps: 3\n")
        code, out = run("rl", "--config", cfg, "--out", scratch / "dup")
        return clear_error(code, out, "rl", "repeats the key 'steps'")

    def nan_config() -> str | None:
        code, out = run("rl", *rl_common, "--out", scratch / "nan", "--set", "loss.kl_coef=.nan")
        why = clear_error(code, out, "rl", "kl_coef", "finite")
        return why or (None if not (scratch / "nan" / "rl.jsonl").exists() else "rl.jsonl left behind")

    def suite_missing_subject() -> str | None:
        code, out = run("eval", "--av", rl_ckpt / "av", "--ar", rl_ckpt / "ar", "--dataset", data / "eval.parquet",
                        "--suite", "causal", "--subject", scratch / "no_such_subject", "--max-rows", "8")
        return clear_error(code, out, "eval", "--subject")

    # ---- tracebacks and bounds
    def best_of_huge() -> str | None:
        t0 = time.perf_counter()
        code, out = run("eval", "--av", rl_ckpt / "av", "--ar", rl_ckpt / "ar", "--dataset", data / "eval.parquet",
                        "--suite", "best_of", "--best-of", "100000", "--max-rows", "8", timeout=120)
        why = clear_error(code, out, "eval", "best")
        return why or (None if time.perf_counter() - t0 < 60 else "it ran before refusing")

    def seeds() -> str | None:
        code, out = run("rl", *rl_common, "--out", scratch / "seed", "--set", "seed=-1")
        why = clear_error(code, out, "rl", "seed")
        if why:
            return why
        code, out = run("quickstart", "--out", scratch / "qs_seed", "--seed", str(10**23))
        return clear_error(code, out, "quickstart", "--seed")

    def threads_everywhere() -> str | None:
        for cmd in (["verbalize", "--av", rl_ckpt / "av", "--vectors", data / "eval.parquet", "--rows", "2",
                     "--max-new-tokens", "4", "--out", scratch / "v.jsonl"],
                    ["score", "--help"], ["eval", "--help"], ["explore", "--help"], ["world", "build", "--help"]):
            code, out = run(*cmd, "--threads", "1")
            if code != 0:
                return f"nla {cmd[0]} --threads 1: exit {code}: {out[-300:]!r}"
        return None

    def resume_trailing_slash() -> str | None:
        x = scratch / "resume"
        code, out = run("rl", *rl_common, "--steps", "2", "--set", "stop_after_steps=1", "--set", "checkpointing.save_every=1",
                        "--out", x, "--av", rl_ckpt / "av", "--ar", rl_ckpt / "ar")
        if code != 0:
            return f"the first run: exit {code}: {out[-300:]!r}"
        code, out = run("rl", *rl_common, "--steps", "2", "--set", "checkpointing.save_every=1", "--out", f"{x}/",
                        "--av", f"{rl_ckpt / 'av'}/", "--ar", f"./{rl_ckpt.relative_to(Path.cwd()) / 'ar'}"
                        if rl_ckpt.is_relative_to(Path.cwd()) else rl_ckpt / "ar", "--resume")
        if code != 0:
            return f"exit {code}: {out[-300:]!r}"
        steps = [json.loads(ln)["step"] for ln in (x / "rl.jsonl").read_text().splitlines() if ln.strip()]
        return None if steps == [1, 2] else f"rl.jsonl steps {steps}, expected [1, 2]"

    for name, fn in (("rl --overwrite with its --av inside the old run", overwrite_own_input),
                     ("--overwrite keeps a user's notes and datagen folder", overwrite_keeps_user_files),
                     ("a second nla rl on one out_dir", two_writers),
                     ("quickstart --threads 1 on a finished run", quickstart_other_threads),
                     ("eval on a dataset whose facts are all null", facts_all_null),
                     ("a repeated key in an RL config", duplicate_keys),
                     ("--set loss.kl_coef=.nan", nan_config),
                     ("eval --suite causal --subject <missing>", suite_missing_subject),
                     ("eval --best-of 100000", best_of_huge),
                     ("seed -1 and a 10**23 seed", seeds),
                     ("--threads on verbalize, score, eval, explore, world", threads_everywhere),
                     ("--resume with trailing slashes", resume_trailing_slash)):
        probe(name, fn)
    failed = [n for n, why in results if why is not None]
    print(f"\n{len(results) - len(failed)} of {len(results)} probes as the issue asks" +
          (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
