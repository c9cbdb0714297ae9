import json

from nla.metrics import MetricsLogger, read_metrics


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
    from nla.metrics import moving_average

    # window 2: [1], [1,2], [2,3], [3,4] -> 1, 1.5, 2.5, 3.5
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([5.0], 3) == [5.0]
