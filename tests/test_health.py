"""StuckRunMonitor: one loud warning per streak of zero / non-finite gradients or all-failed rollouts."""

import logging

import pytest

from nla.train.health import StuckRunMonitor


def test_zero_or_nonfinite_grad_streak_warns_once(caplog):
    mon = StuckRunMonitor("ar", patience=3)
    with caplog.at_level(logging.WARNING, logger="nla.train.health"):
        # steps 1..7: 0.5 resets; 0, nan, 0 is a streak of 3 at step 4; inf at step 5 continues it (no 2nd
        # warning); 0.1 resets; then 0, 0, 0 at steps 7..9 is a new streak warned at step 9.
        norms = [0.5, 0.0, float("nan"), 0.0, float("inf"), 0.1, 0.0, 0.0, 0.0]
        fired = [step for step, g in enumerate(norms, start=1) if mon.observe(step, grad_norm=g)]
    assert fired == [4, 9]
    assert len(mon.warnings) == 2 and "gradient norm has been zero or non-finite for 3 steps" in mon.warnings[0]
    assert sum("looks stuck" in r.message for r in caplog.records) == 2


def test_all_failed_streak_and_unmeasured_signals():
    mon = StuckRunMonitor("rl", patience=2)
    assert mon.observe(1, failure_rate=1.0) == []
    assert mon.observe(2, grad_norm=None, failure_rate=0.99) == []  # one success breaks the streak
    assert mon.observe(3, failure_rate=1.0) == []
    (msg,) = mon.observe(4, grad_norm=None, failure_rate=1.0)
    assert "every sample has failed for 2 steps in a row (step 4)" in msg
    with pytest.raises(ValueError, match="patience: expected an integer >= 1, found 0"):
        StuckRunMonitor("x", patience=0)
