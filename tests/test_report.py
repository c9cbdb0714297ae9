"""nla.eval.report: the quickstart page from hand-made stage results."""

from __future__ import annotations

import json

from nla.eval.report import faithfulness_summary, unread_kinds, write_report
from nla.quickstart import StageRecord


def _eval(fve: float, frozen: float, recall: float, degenerate: float) -> dict:
    faith = {"recall": recall, "precision": 0.9, "by_kind": {}, "n": 4}
    row = {"fve": fve, "cosine": 0.8, "failure_rate": 0.0, "faithfulness": faith, "degenerate": {"any": degenerate}}
    return {"n_rows": 4, "d_model": 8, "baseline_raw_mean_mse": 0.8, "samples": [],
            "rows": [{"name": "AV → AR round trip", **row},
                     {"name": "AV → frozen warm-start AR", **row, "fve": frozen},
                     {"name": "AV on shuffled vectors → AR", **row, "fve": -0.9,
                      "faithfulness": {**faith, "recall": 0.1}}]}


def test_report_headline_probe_and_stuck_warning(tmp_path):
    warm, rl = _eval(0.5, 0.5, 0.8, 0.0), _eval(0.6, 0.45, 0.7, 0.25)
    probe = {"default_layer": 1, "layers": [
        {"layer": 0, "mean_top1": 0.2, "mean_chance": 0.1, "kinds": [{"kind": "place", "top1": 0.2}]},
        {"layer": 1, "mean_top1": 0.9, "mean_chance": 0.1, "kinds": [{"kind": "place", "top1": 0.9}]}]}
    rl_info = {"metrics": {"stuck_warnings": ["RL: gradient norm 0 for 10 steps (3..12)"]}}
    path = write_report(tmp_path, preset="x", stages=[StageRecord("rl", 1.0, False)], configs={}, world={},
                        warm_eval=warm, rl_eval=rl, ar_info={}, av_info={}, rl_info=rl_info, probe=probe)
    md = path.read_text()
    assert "> **Warning: a stage looked stuck.**" in md and "- **RL**: RL: gradient norm 0 for 10 steps" in md
    assert "| 1 (extraction layer) | 0.90 | **0.900** | 0.100 |" in md
    # recall fell and the frozen reader fell while the live one rose: the headline shows both
    assert "recall **0.800 → 0.700**" in md and "frozen warm-start AR: FVE 0.500 → 0.450" in md
    head = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert head["probe_mean_top1"] == 0.9 and head["degenerate_rl"] == 0.25 and head["shuffled_recall_rl"] == 0.1
    assert faithfulness_summary(warm, rl)["frozen_ar_fve_rl"] == 0.45
    # no warning when nothing was stuck
    clean = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                         ar_info={}, av_info={}, rl_info={}, probe=None).read_text()
    assert "looked stuck" not in clean and "What is in the vector" not in clean
    assert "Ceiling:" not in clean and head["oracle_fve_rl"] is None  # no oracle row, no ceiling line


def test_report_ceiling_line_from_the_oracle_rows(tmp_path):
    warm, rl = _eval(0.378, 0.378, 0.589, 0.0), _eval(0.56, 0.523, 0.759, 0.0)
    for ev, oracle in ((warm, 0.751), (rl, 0.7)):
        ev["rows"].append({"name": "oracle: every true fact → AR", "fve": oracle, "cosine": 0.9, "failure_rate": 0.0})
    md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                      ar_info={}, av_info={}, rl_info={}).read_text()
    # 0.56 / 0.7 = 80 %
    assert ("scores FVE 0.700 after RL (0.751 with the warm-start AR); the RL'd verbalizer reaches 0.560 "
            "(80% of it).") in md
    head = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert head["oracle_fve_warmstart"] == 0.751 and head["oracle_fve_rl"] == 0.7


def test_report_warns_of_a_kind_the_warm_start_does_not_read(tmp_path, caplog):
    # seed 2's mean-invariant AV (dev/LOG.md, 2026-12-03): place 0.13 on real vectors and 0.13 on shuffled ones
    warm, rl = _eval(0.38, 0.38, 0.49, 0.0), _eval(0.61, 0.58, 0.66, 0.0)
    warm["rows"][0]["faithfulness"]["by_kind"] = {"place": [0.13, 0.11], "person": [0.90, 0.95],
                                                  "activity": [0.37, 0.40], "time": [0.31, 0.31]}
    warm["rows"][2]["faithfulness"]["by_kind"] = {"place": [0.13, 0.08], "person": [0.08, 0.08],
                                                  "activity": [0.34, 0.02], "time": [0.05, 0.05]}
    # 0.13 - 0.13 = 0 and 0.37 - 0.34 = 0.03 are under the 0.05 margin; 0.90 - 0.08 and 0.31 - 0.05 are not
    assert unread_kinds(warm) == {"place": [0.13, 0.13], "activity": [0.37, 0.34]}
    assert unread_kinds(warm, margin=0.02) == {"place": [0.13, 0.13]}
    assert unread_kinds(rl) == {}  # no per-kind rows: nothing to say
    # sentences in no claim form (the wiki grader's "other"): recall 1.0 on both rows by convention,
    # never an unread kind, and no recall in the table (precision only)
    warm["rows"][0]["faithfulness"]["by_kind"]["other"] = [1.0, 0.0]
    warm["rows"][2]["faithfulness"]["by_kind"]["other"] = [1.0, 0.0]
    assert "other" not in unread_kinds(warm)
    from nla.eval.report import kind_table

    assert "| other | – | – | 0.00 | – | – |" in kind_table(warm, rl)
    with caplog.at_level("WARNING", logger="nla.eval.report"):
        md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                          ar_info={}, av_info={}, rl_info={}).read_text()
    assert "> **Warning: the warm-started AV does not read every kind.**" in md
    assert "- **place**: recall 0.13, on shuffled vectors 0.13" in md
    assert "- **activity**: recall 0.37, on shuffled vectors 0.34" in md and "- **time**" not in md
    assert any("does not read place, activity" in r.message for r in caplog.records)
    head = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert head["unread_kinds_warmstart"] == {"place": [0.13, 0.13], "activity": [0.37, 0.34]}
    # a kind the probe reads on fewer than half the rows is not in the vector: noted, not warned about
    probe = {"default_layer": 2, "layers": [{"layer": 2, "mean_top1": 0.6, "mean_chance": 0.1, "kinds": [
        {"kind": "place", "top1": 0.29}, {"kind": "activity", "top1": 0.94}, {"kind": "person", "top1": 1.0},
        {"kind": "time", "top1": 1.0}]}]}
    caplog.clear()
    with caplog.at_level("WARNING", logger="nla.eval.report"):
        md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                          ar_info={}, av_info={}, rl_info={}, probe=probe).read_text()
    assert "- **activity**: recall 0.37, on shuffled vectors 0.34" in md and "- **place**" not in md
    assert ("The warm-started AV names place no more truly than from shuffled vectors, and the vectors hold "
            "little of it: a linear probe reads it on 0.29 of rows at this layer") in md
    assert [r.message for r in caplog.records if "does not read" in r.message][0].startswith(
        "the warm-started AV does not read activity (")
    # every kind read: no warning
    warm["rows"][2]["faithfulness"]["by_kind"] = {k: [0.0, 0.0] for k in ("place", "person", "activity", "time")}
    clean = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                         ar_info={}, av_info={}, rl_info={}).read_text()
    assert "does not read every kind" not in clean


def test_the_kind_table_shows_the_quotation_beside_its_probe():
    from nla.eval.report import kind_table, probe_table

    warm, rl = _eval(0.5, 0.5, 0.8, 0.0), _eval(0.6, 0.6, 0.8, 0.0)
    for ev, q0 in ((warm, (0.9, 0.95)), (rl, (0.85, 0.97))):
        faith = ev["rows"][0]["faithfulness"]
        faith["by_kind"] = {"place": [1.0, 1.0]}
        # one unit quoted (quote_units=1): quote[1] is never said (recall 0, no precision): no row
        faith["quote"] = {"by_position": {"quote[0]": list(q0), "quote[1]": [0.0, None]}}
    probe = {"default_layer": 1, "layers": [
        {"layer": 1, "mean_top1": 0.9, "mean_chance": 0.1, "kinds": [{"kind": "place", "top1": 0.9}],
         "quotes": [{"kind": "quote[0]", "top1": 0.95}, {"kind": "quote[1]", "top1": 0.7}]}]}
    lines = kind_table(warm, rl, probe)
    assert "| quote[0] (quotation) | 0.95 | 0.90 | 0.95 | 0.85 | 0.97 |" in lines
    assert not any(line.startswith("| quote[1]") for line in lines)
    assert "| 1 (extraction layer) | 0.90 | **0.900** | 0.100 | 0.95 | 0.70 |" in probe_table(probe)
    # a probe written before the quotation probe: the table as it was
    old = {"default_layer": 1, "layers": [{"layer": 1, "mean_top1": 0.9, "mean_chance": 0.1,
                                           "kinds": [{"kind": "place", "top1": 0.9}]}]}
    assert probe_table(old)[0] == "| layer | place | mean top-1 | chance |"
    assert "| quote[0] (quotation) | – | 0.90 | 0.95 | 0.85 | 0.97 |" in kind_table(warm, rl, old)
    # facts said unsure (fact_unheld: hedge): two columns, the share of rows and how often true
    rl["rows"][0]["faithfulness"]["hedged"] = {"place": [0.25, 0.4]}
    lines = kind_table(warm, rl, probe)
    assert lines[0].endswith("| unsure warm (true) | unsure RL (true) |")
    assert "| place | 0.90 | 1.00 | 1.00 | 1.00 | 1.00 | – | 0.25 (0.40) |" in lines
    assert "| quote[0] (quotation) | 0.95 | 0.90 | 0.95 | 0.85 | 0.97 | – | – |" in lines


def test_the_report_says_how_often_the_quotation_is_said_unsure(tmp_path):
    from nla.eval.report import quote_summary, quote_table

    warm, rl = _eval(0.5, 0.5, 0.8, 0.0), _eval(0.6, 0.6, 0.8, 0.0)
    for ev, hedged in ((warm, 0.5), (rl, 0.25)):
        ev["rows"][0]["faithfulness"]["quote"] = {"n": 4, "said": 1 - hedged, "exact": 0.5, "all_true": 1.0,
                                                  "by_position": {"quote[0]": [1 - hedged, 1.0]}, "hedged": hedged,
                                                  "hedged_true": 0.5}
    head = quote_summary(warm, rl)
    assert head["quote_hedged_warmstart"] == 0.5 and head["quote_hedged_rl"] == 0.25 and head["quote_hedged_true_rl"] == 0.5
    lines = quote_table(warm, rl)
    assert '| says it unsure, "may end with" (share of rows) | 0.50 | | 0.25 | |' in lines
    assert "| ... and is right anyway (share of those) | 0.50 | | 0.50 | |" in lines
    md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                      ar_info={}, av_info={}, rl_info={}).read_text()
    assert 'said unsure ("may end with", not counted as said) on 0.500 → 0.250 of rows.' in md
    # a language that never hedges: the table as it was
    plain = _eval(0.5, 0.5, 0.8, 0.0)
    plain["rows"][0]["faithfulness"]["quote"] = {"said": 1.0, "by_position": {"quote[0]": [1.0, 1.0]}}
    assert not any("unsure" in line for line in quote_table(plain, plain))


def test_a_kind_said_unsure_and_read_is_noted_not_warned_about(tmp_path, caplog):
    # SmolLM2's warm-start (session 13's run, AMD): topic, next token and position said unsure on every row
    # (recall 0: "may" is not said), the unsure values true on 0.33 / 0.18 / 0.50, from shuffled vectors on
    # 0.18 / 0.02 / 0.50: topic and next read (0.15 and 0.16 above the margin 0.05), position not (0.00)
    warm, rl = _eval(0.37, 0.37, 0.1, 0.0), _eval(0.36, 0.37, 0.1, 0.0)
    zero = {"topic": [0.0, 1.0], "next": [0.0, 1.0], "position": [0.0, 1.0]}
    warm["rows"][0]["faithfulness"]["by_kind"] = dict(zero)
    warm["rows"][2]["faithfulness"]["by_kind"] = dict(zero)
    warm["rows"][0]["faithfulness"]["hedged"] = {"topic": [1.0, 0.33], "next": [1.0, 0.18], "position": [0.98, 0.50]}
    warm["rows"][2]["faithfulness"]["hedged"] = {"topic": [1.0, 0.18], "next": [1.0, 0.02], "position": [0.98, 0.50]}
    from nla.eval.report import hedged_read_kinds

    assert hedged_read_kinds(warm, ["topic", "next", "position"]) == {"topic": [1.0, 0.33, 0.18],
                                                                     "next": [1.0, 0.18, 0.02]}
    # said unsure on fewer than half the rows: a kind not said, whatever is true of it
    half = {**warm, "rows": [dict(r) for r in warm["rows"]]}
    half["rows"][0] = {**warm["rows"][0], "faithfulness": {**warm["rows"][0]["faithfulness"],
                                                           "hedged": {"topic": [0.49, 0.9]}}}
    assert hedged_read_kinds(half, ["topic"]) == {}
    with caplog.at_level("WARNING", logger="nla.eval.report"):
        md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                          ar_info={}, av_info={}, rl_info={}).read_text()
    assert "- **position**: recall 0.00, on shuffled vectors 0.00" in md and "- **topic**" not in md
    assert ('The warm-started AV says topic, next unsure on most rows ("may": not counted as said), as its data '
            "does where a probe does not hold them, and reads them all the same: true on topic 0.33 of the rows "
            "that say it unsure, 0.18 from shuffled vectors; next 0.18 of the rows that say it unsure, 0.02 from "
            "shuffled vectors.") in md
    assert [r.message for r in caplog.records if "does not read" in r.message][0].startswith(
        "the warm-started AV does not read position (")
    head = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert head["unsure_read_kinds_warmstart"] == {"topic": [1.0, 0.33, 0.18], "next": [1.0, 0.18, 0.02]}


def test_a_one_block_pair_at_another_block_is_set_beside_the_probe_at_its_own_block(tmp_path):
    """A pair of one block read at block 0 of a world whose default block is 1 (``datagen.layer_index=0``):
    the per-kind probe figures and issue 59's per-kind measure are block 0's, not the default block's."""
    warm, rl = _eval(0.5, 0.5, 0.8, 0.0), _eval(0.6, 0.6, 0.8, 0.0)
    for ev in (warm, rl):
        ev["rows"][0]["faithfulness"]["by_kind"] = {"place": [0.25, 0.5], "mood": [0.6, 1.0]}
        ev["rows"][0]["faithfulness"]["said"] = {"place": [4, 0.5], "mood": [6, 1.0]}
    kinds = [{"kind": "place", "top1": 0.3, "recall_top1": 0.3, "recall_p90": 0.05},
             {"kind": "mood", "top1": 0.75, "recall_top1": 0.75, "recall_p90": 0.62}]
    probe = {"default_layer": 1, "extraction_layer": 0, "layers": [
        {"layer": 0, "mean_top1": 0.525, "mean_chance": 0.1, "kinds": kinds},
        {"layer": 1, "mean_top1": 0.9, "mean_chance": 0.1, "kinds": [{**k, "top1": 0.9} for k in kinds]}]}
    md = write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                      ar_info={}, av_info={}, rl_info={}, probe=probe).read_text()
    head = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert head["probe_by_kind"] == {"place": 0.3, "mood": 0.75} and head["probe_mean_top1"] == 0.525
    assert "| 0 (extraction layer) |" in md and "| 1 (extraction layer) |" not in md
    # place: recall 0.25 within 0.10 of 0.30 and over 0.05 - 0.10, but half its claims false: no rule meets it;
    # mood: 0.60 within 0.10 of 0.62 (the reader at 0.90 true), 0.15 under its top-1 of 0.75, every claim true
    assert head["kind_cells"] == {"cells": 2, "top1": 0, "top1_recall": 0, "p90": 1, "claims_true": 1,
                                  "misses": {"top1": ["place@0", "mood@0"], "top1_recall": ["place@0", "mood@0"],
                                             "p90": ["place@0"]}}
    assert ("At block 0, each kind: the probe's top-1 (as fact recall; the most a reader keeps with 0.90 of its "
            "claims true) · the share of the AV's claims of it true after RL (– where it names none): place 0.30 "
            "(0.30; 0.05) · 0.50; mood 0.75 (0.75; 0.62) · 1.00.") in md
    assert "at least the reader's at 0.90 true less 0.10, **1 of 2**" in md and "Missed at 0.90 true: place@0." in md
    # without extraction_layer (a run at the world's default block): the default block's probe, as before
    write_report(tmp_path, preset="x", stages=[], configs={}, world={}, warm_eval=warm, rl_eval=rl,
                 ar_info={}, av_info={}, rl_info={}, probe={k: v for k, v in probe.items() if k != "extraction_layer"})
    head = json.loads((tmp_path / "report.json").read_text())["headline"]
    assert head["probe_by_kind"] == {"place": 0.9, "mood": 0.9} and head["kind_cells"]["top1"] == 0


def test_the_quickstart_names_a_one_block_pairs_own_block_to_the_report():
    from nla.quickstart import report_probe

    probe = {"default_layer": 2, "layers": []}
    assert report_probe(probe, {"layer_index": 0}) == {"default_layer": 2, "layers": [], "extraction_layer": 0}
    assert report_probe(probe, {}) is probe and report_probe(probe, {"layer_index": None}) is probe
    # a pair of several blocks reads each block's probe itself ("By block"); a real subject has no world probe
    assert report_probe(probe, {"layer_index": 0, "layers": [0, 1]}) is probe
    assert report_probe(None, {"layer_index": 3}) is None
