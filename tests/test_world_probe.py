"""nla.world.probe: planted linear features are recovered, noise scores chance, layers are swept."""

from __future__ import annotations

import numpy as np
import pytest

from nla.world.facts import VOCAB, Fact
from nla.world.probe import KindProbe, LayerProbe, best_layer, probe_kinds, probe_table_markdown

KINDS = ("place", "mood")


def _planted(rng: np.random.Generator, n: int, dirs: dict[str, np.ndarray], noise: float):
    """Rows with one true fact per kind; the vector is the sum of the facts' directions plus noise."""
    x, facts = [], []
    for _ in range(n):
        fs = [str(Fact(k, rng.choice(sorted(VOCAB[k])))) for k in KINDS]
        x.append(sum(dirs[f] for f in fs) + noise * rng.standard_normal(len(next(iter(dirs.values())))))
        facts.append(fs)
    return np.asarray(x, dtype=np.float32), facts


def test_planted_feature_is_recovered_and_noise_is_chance():
    rng = np.random.default_rng(0)
    d = 48
    dirs = {str(Fact(k, v)): rng.standard_normal(d) for k in KINDS for v in VOCAB[k]}
    x_tr, f_tr = _planted(rng, 1500, dirs, noise=0.5)
    x_te, f_te = _planted(rng, 600, dirs, noise=0.5)
    got = {p.kind: p for p in probe_kinds(x_tr, f_tr, x_te, f_te, kinds=KINDS)}
    # one true fact per row: chance is 1 / n_facts exactly (12 places, 8 moods)
    assert got["place"].chance == pytest.approx(1 / 12) and got["mood"].chance == pytest.approx(1 / 8)
    assert got["place"].n_rows == 600 and got["place"].n_facts == 12
    assert got["place"].top1 > 0.97 and got["mood"].top1 > 0.97
    # Pure noise carries nothing: top-1 within sampling error of chance (600 rows: sd ~ 0.011 / 0.014).
    noise = {p.kind: p for p in probe_kinds(rng.standard_normal((1500, d)), f_tr, rng.standard_normal((600, d)), f_te,
                                            kinds=KINDS)}
    assert abs(noise["place"].top1 - 1 / 12) < 0.05 and abs(noise["mood"].top1 - 1 / 8) < 0.05


def test_only_present_rows_count_and_absent_kinds_are_skipped():
    rng = np.random.default_rng(1)
    d = 16
    beach = rng.standard_normal(d)
    # place=beach planted on half the rows; the other half has no place at all.
    x = rng.standard_normal((400, d)).astype(np.float32) * 0.1
    facts = [["place=beach"] if i % 2 == 0 else [] for i in range(400)]
    x[::2] += beach
    got = probe_kinds(x[:300], facts[:300], x[300:], facts[300:], kinds=("place", "time"))
    assert [p.kind for p in got] == ["place"]  # no time fact anywhere: left out
    assert got[0].n_rows == 50 and got[0].top1 == pytest.approx(1.0)
    assert got[0].chance == pytest.approx(1 / 12)


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="must match one to one"):
        probe_kinds(np.zeros((3, 4)), [[]] * 2, np.zeros((2, 4)), [[]] * 2)


def test_best_layer_and_table():
    r = [LayerProbe(0, (KindProbe("place", 12, 10, 0.2, 0.1),)), LayerProbe(1, (KindProbe("place", 12, 10, 0.9, 0.1),)),
         LayerProbe(2, (KindProbe("place", 12, 10, 0.9, 0.1),))]
    assert best_layer(r) == 1  # ties go to the earlier layer
    md = probe_table_markdown(r, chosen=1)
    assert "| 1 (chosen) | 0.90 | **0.900** | 0.100 |" in md
    with pytest.raises(ValueError, match="no probe results"):
        best_layer([])
