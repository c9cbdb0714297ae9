import json

from nla.util.metrics import MetricsLogger, read_metrics


def test_jsonl_plot_and_resume_merge(tmp_path):
    m = MetricsLogger(tmp_path, "ar", tensorboard=False)
    m.log(1, loss=1.5, flag="empty")
    m.log(2, loss=1.0, fve=0.2)
    m.close()
    lines = (tmp_path / "ar.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "loss": 1.5, "flag": "empty"}
    # a resumed run appends and re-logs step 2: the later record wins
    m = MetricsLogger(tmp_path, "ar", tensorboard=False)
    m.log(2, loss=0.9)
    m.log(3, loss=float("nan"))
    recs = m.read()
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[1] == {"step": 2, "loss": 0.9, "fve": 0.2}
    assert recs[2]["loss"] == "nan"
    png = m.plot(tmp_path / "curves.png", ["loss", "fve", "absent"], title="t")
    assert png is not None and png.stat().st_size > 1000
    assert m.plot(tmp_path / "none.png", ["absent"]) is None
    m.close()
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_tensorboard_events_written(tmp_path):
    m = MetricsLogger(tmp_path, "av", tensorboard=True)
    m.log(0, loss=2.0)
    m.close()
    if m_tb_available():
        assert list((tmp_path / "tensorboard" / "av").glob("events.*"))


def m_tb_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception:
        return False
    return True


def test_moving_average_by_hand():
    from nla.util.metrics import moving_average

    # window 2: [1], [1,2], [2,3], [3,4] -> 1, 1.5, 2.5, 3.5
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([5.0], 3) == [5.0]


def test_a_torn_last_line_is_dropped_on_resume_and_a_damaged_one_is_named(tmp_path, caplog):
    import logging

    import pytest

    path = tmp_path / "rl.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # read as it is: the torn line skipped
    with caplog.at_level(logging.WARNING, logger="nla.util.metrics"):
        with MetricsLogger(tmp_path, "rl", tensorboard=False) as m:  # the resumed run
            m.log(3, loss=0.3)
    assert "dropped a torn last line (15 bytes" in caplog.text
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "loss": 0.3}\n'
    assert [r["loss"] for r in read_metrics(path)] == [0.5, 0.4, 0.3]
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo\n{"step": 3, "loss": 0.3}\n')  # damaged inside
    with pytest.raises(ValueError, match=r"rl.jsonl: line 2 is not a metrics record .*remove that line"):
        read_metrics(path)
