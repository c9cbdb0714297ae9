"""Issue 58: one rule for the files nla reads or writes in a run directory (``nla.util.fsutil.run_file``).

Each test builds a run dir on disk with a symbolic link planted where nla reads or writes, and runs
the real component: the explorer's run view over real HTTP, the run lock, the metrics log, the
plots, and ``--overwrite`` beside a ``checkpoints/`` folder nla never wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from nla.explore import create_app, load_run
from nla.explore.run import RunFileError
from nla.train.rundir import RunDirError, lock_run_dir, prepare_run_dir
from nla.util.fsutil import run_file
from nla.util.http import BackgroundServer
from nla.util.metrics import MetricsLogger, plot_metrics
from nla.util.validation import InputError

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("root:x:0:0\nlast line\n")
    return secret


def _quickstart_dir(root: Path, plots: dict[str, str]) -> Path:
    root.mkdir()
    (root / "report.json").write_text(json.dumps({"headline": {"preset": "tiny"}, "plots": plots}))
    return root


def test_run_file_refuses_a_link_out_and_follows_one_inside(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "a.txt").write_text("a")
    os.symlink(run / "a.txt", run / "inside.txt")
    os.symlink(_secret(tmp_path), run / "out.txt")
    assert run_file(run, "inside.txt") == run / "inside.txt"
    assert run_file(run, run / "missing.txt") == run / "missing.txt"  # a file to be written
    with pytest.raises(InputError, match=r"out.txt: the plot leads out of the run directory .*run \(through the "
                                         r"symbolic link .*out.txt -> .*secret.txt\).*Remove the link"):
        run_file(run, "out.txt", "plot")


def test_explorer_refuses_a_plot_linked_out_of_the_run_and_serves_its_own(tmp_path):
    """report.json named a plot that was a link to a file outside the run: served as an image."""
    secret = _secret(tmp_path)
    run = _quickstart_dir(tmp_path / "qs", {"ar_curves": "ar_curves.png"})
    os.symlink(secret, run / "ar_curves.png")
    with pytest.raises(InputError, match="ar_curves.png: the plot 'ar_curves' of report.json leads out of the run"):
        load_run(run)
    # the same run with its own plot: served over real HTTP, byte for byte
    (run / "ar_curves.png").unlink()
    (run / "ar_curves.png").write_bytes(PNG)
    with BackgroundServer(create_app(None, run=load_run(run), setup_error="no models: the run view only")) as srv:
        r = httpx.get(f"{srv.url}/api/run/plots/ar_curves")
        assert r.status_code == 200 and r.content == PNG
        assert httpx.get(f"{srv.url}/api/run/plots/secret").status_code == 404


def test_explorer_refuses_an_rl_dir_whose_curves_link_out(tmp_path):
    run = tmp_path / "rl"
    run.mkdir()
    (run / "rl_summary.json").write_text(json.dumps({"fve_nrm": 0.5}))
    os.symlink(_secret(tmp_path), run / "rl_curves.png")
    with pytest.raises(InputError, match="rl_curves.png: the RL curves leads out of the run directory"):
        load_run(run)


@pytest.mark.parametrize("files, message", [
    ({"report.json": "{not json"}, r"report.json is not valid JSON \(line 1, column 2: Expecting property name"),
    ({"report.json": "[1, 2]"}, r"report.json: the whole file: expected a JSON object, found list"),
    ({"report.json": '{"headline": 3}'}, r"report.json: headline: expected a JSON object, found int"),
    ({"report.json": '{"eval_rl": {"rows": [{"x": 1}]}}'}, r"not in the layout nla writes \(KeyError"),
    ({"rl_summary.json": "{}", "rl.jsonl": '{"step": 1}\n{"step": 2\n{"step": 3}\n'},
     r"rl.jsonl: line 2 is not a metrics record"),
    ({"rl_summary.json": "\xff\xfe"}, r"rl_summary.json is not valid JSON"),
])
def test_explorer_run_with_malformed_files_is_a_clear_error(tmp_path, files, message):
    """A malformed report.json or rl.jsonl was a traceback of `nla explore --run`."""
    run = tmp_path / "run"
    run.mkdir()
    for name, text in files.items():
        (run / name).write_text(text)
    with pytest.raises(RunFileError, match=message):
        load_run(run)


def test_a_lock_file_link_is_refused_and_its_target_kept(tmp_path):
    """A .nla.lock link had its target truncated and overwritten with the lock record."""
    secret = _secret(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(secret, run / ".nla.lock")
    with pytest.raises(RunDirError, match=r"\.nla\.lock is a symbolic link \(to .*secret.txt\); nla's run lock is a "
                                          "plain file"):
        lock_run_dir(run)
    assert secret.read_text() == "root:x:0:0\nlast line\n"


def test_a_metrics_log_link_out_of_the_run_is_refused_and_its_target_kept(tmp_path):
    """An av.jsonl link had its target's last line cut, then metrics appended."""
    secret = tmp_path / "outside" / "log.txt"
    secret.parent.mkdir()
    secret.write_bytes(b"first\nno newline at the end")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(secret, run / "av.jsonl")
    with pytest.raises(InputError, match=r"av.jsonl: the metrics log leads out of the run directory"):
        MetricsLogger(run, "av", tensorboard=False)
    assert secret.read_bytes() == b"first\nno newline at the end"


def test_a_plot_link_is_replaced_not_written_through(tmp_path):
    secret = _secret(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(secret, run / "av_curves.png")
    out = plot_metrics([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}], run / "av_curves.png", ["loss"])
    assert out == run / "av_curves.png" and not out.is_symlink()
    assert out.read_bytes()[:8] == PNG[:8]
    assert secret.read_text() == "root:x:0:0\nlast line\n"


def test_overwrite_refuses_a_checkpoints_folder_nla_did_not_write(tmp_path):
    """--overwrite deleted a user's model in checkpoints/ as 'the previous run'."""
    run = tmp_path / "run"
    (run / "checkpoints" / "my_model").mkdir(parents=True)
    (run / "checkpoints" / "my_model" / "model.safetensors").write_bytes(b"weights")
    (run / "av.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match=r"--overwrite would delete what nla did not write in .*run: .*my_model "
                                          r"\(no training_state.pt or rl_state.pt: not a checkpoint nla wrote\)"):
        prepare_run_dir(run, {}, "train_config.yaml", resume=False, overwrite=True)
    assert (run / "checkpoints" / "my_model" / "model.safetensors").read_bytes() == b"weights"
    assert (run / "av.jsonl").is_file()
    # nla's own step dir beside it: still refused while the stranger is there; alone, deleted
    (run / "checkpoints" / "step_00000002").mkdir()
    (run / "checkpoints" / "step_00000002" / "training_state.pt").write_bytes(b"state")
    with pytest.raises(RunDirError, match="my_model"):
        prepare_run_dir(run, {}, "train_config.yaml", resume=False, overwrite=True)
    (run / "checkpoints" / "my_model" / "model.safetensors").rename(tmp_path / "model.safetensors")
    (run / "checkpoints" / "my_model").rmdir()
    prepare_run_dir(run, {}, "train_config.yaml", resume=False, overwrite=True).release()
    assert not (run / "checkpoints").exists() and not (run / "av.jsonl").exists()


def test_overwrite_keeps_a_quickstart_reports_plots(tmp_path):
    """On a quickstart dir --overwrite deleted the report's plots (ar/av/rl_curves.png at its top)."""
    run = _quickstart_dir(tmp_path / "qs", {"av_curves": "av_curves.png", "rl_curves": "rl_curves.png"})
    for name in ("av_curves.png", "rl_curves.png"):
        (run / name).write_bytes(PNG)
    (run / "rl.jsonl").write_text('{"step": 1}\n')  # an nla rl run there before: its log and curves go
    prepare_run_dir(run, {}, "rl_config.yaml", resume=False, overwrite=True).release()
    assert (run / "av_curves.png").read_bytes() == PNG and (run / "report.json").is_file()
    assert not (run / "rl.jsonl").exists() and not (run / "rl_curves.png").exists()
