"""The explanation suite (nla.eval.suite): claims, hidden-code re-writings, residual patching, causal
edits, directions, confabulation and best-of-N, on hand-written explanations and on the tiny
quickstart's world pair (its AV, AR and subject model)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from nla.client import NLAClient, NLAClientError
from nla.core.graders import get_grader
from nla.core.vectors import mse_nrm
from nla.eval.suite import (
    Claim,
    attribute_claims,
    best_of_n,
    causal_edits,
    confabulation,
    direction_inputs,
    hidden_code_variants,
    norm_warnings,
    patch_residual,
    patched_next_token_logits,
    run_suite,
    verbalize_directions,
)
from nla.world.explain import in_language

WORLD = get_grader("world")
TEXT = 'The text ends with "at the shore". The story is about Felix. The scene is set at the beach. Someone feels glad.'
TRUTH = ["person=felix", "place=beach", "mood=sad"]


# ------------------------------------------------------------------ claims and re-writings (no model)
def test_world_claims_truth_and_quotation():
    claims = WORLD.claims(TEXT)
    assert claims == ['The text ends with "at the shore".', "The story is about Felix.", "The scene is set at the beach.",
                      "Someone feels glad."]
    # the quotation names no claimed fact ("shore" is a surface word of beach, but quoted)
    assert [WORLD.claim_truth(c, TRUTH) for c in claims] == [None, True, True, False]
    assert [WORLD.is_quotation(c) for c in claims] == [True, False, False, False]
    assert WORLD.named_facts(TEXT) == {"person=felix", "place=beach", "mood=happy"}
    assert WORLD.claim_truth("This is the start of a story.", TRUTH) is None


def test_generic_grader_splits_sentences_and_knows_no_truth():
    g = get_grader("generic")
    assert g.claims('He said "hi". Then left') == ['He said "hi".', "Then left"]
    assert g.is_quotation('He said "hi".') and not g.is_quotation("Then left")
    assert g.claim_truth("Then left", ["a=b"]) is None and g.paraphrase("Then left", random.Random(0)) is None
    assert g.edit_fact("x", "a=b", "a=c") is None


def test_world_paraphrase_keeps_the_fact_and_changes_the_phrasing():
    rng = random.Random(0)
    for claim in WORLD.claims(TEXT)[1:]:
        for _ in range(5):
            new = WORLD.paraphrase(claim, rng)
            assert new != claim and in_language(new)
            assert WORLD.named_facts(new) == WORLD.named_facts(claim)
    assert WORLD.paraphrase('The text ends with "at the shore".', rng) is None
    assert WORLD.paraphrase("Felix ate a bagel.", rng) is None  # outside the language's phrasings


def test_world_edit_fact_changes_exactly_that_claim():
    assert WORLD.edit_fact(TEXT, "place=beach", "place=park") == TEXT.replace("the beach", "the park")
    assert WORLD.edit_fact(TEXT, "person=felix", "person=hugo") == TEXT.replace("Felix", "Hugo")  # case kept
    assert WORLD.edit_fact(TEXT, "place=park", "place=cafe") is None  # not claimed
    # a surface word of the fact inside the quotation is not a claim and stays
    assert '"at the shore"' in WORLD.edit_fact(TEXT, "place=beach", "place=park")
    assert WORLD.fact_of_word(" Shore") == "place=beach" and WORLD.fact_of_word("the") is None


def test_hidden_code_variants_by_hand():
    texts = [TEXT, "The story is about Felix.", None]
    v = hidden_code_variants(texts, WORLD, seed=3)
    claims = WORLD.claims(TEXT)
    shuffled = WORLD.claims(v["shuffle"][0])
    assert sorted(shuffled) == sorted(claims) and shuffled != claims
    assert v["shuffle"][1] == texts[1]  # one claim: no other order
    assert v["drop_quotation"][0] == " ".join(claims[1:])
    para = WORLD.claims(v["paraphrase"][0])
    assert para[0] == claims[0]  # the quotation is kept as written
    assert all(p != c for p, c in zip(para[1:], claims[1:], strict=True))
    assert WORLD.named_facts(v["paraphrase"][0]) == WORLD.named_facts(TEXT)
    assert v["paraphrase"][2] is None and v["shuffle"][2] is None and v["drop_quotation"][2] is None
    assert hidden_code_variants(texts, WORLD, seed=3) == v  # seeded


def test_hidden_code_paraphraser_gets_only_what_the_grader_cannot_rephrase():
    asked: list[list[str]] = []

    def provider(claims: list[str]) -> list[str | None]:
        asked.append(claims)
        return [c.upper() for c in claims]

    v = hidden_code_variants(['He said "hi". It rained. Felix ran.'], get_grader("generic"), paraphraser=provider)
    assert asked == [["It rained.", "Felix ran."]]
    assert v["paraphrase"] == ['He said "hi". IT RAINED. FELIX RAN.']
    with pytest.raises(ValueError, match="2 claims"):
        hidden_code_variants(["It rained. Felix ran."], get_grader("generic"), paraphraser=lambda cs: ["x"])


def test_confabulation_rates_and_recurrence_by_hand():
    texts = ["The story is about Felix. The scene is set at the park.",  # doc 1 pos 5: felix true, park false
             "The story is about Felix. Someone feels sad.",  # doc 1 pos 9: felix true, sad true
             "The scene is set at the park.",  # doc 2 pos 5: park true
             None]
    truths = [["person=felix", "place=beach"], ["person=felix", "mood=sad"], ["place=park"], ["place=park"]]
    c = confabulation(texts, truths, WORLD, doc_ids=[1, 1, 2, 2], positions=[5, 9, 5, 7])
    assert c["claims"] == 5 and c["false_rate"] == pytest.approx(1 / 5)
    assert c["by_kind"] == {"mood": {"claims": 1, "false_rate": 0.0}, "person": {"claims": 2, "false_rate": 0.0},
                            "place": {"claims": 2, "false_rate": 0.5}}
    # felix recurs at doc 1's neighbouring positions (2 claims, both true); park (doc 1), sad, park (doc 2) do not
    assert c["recurring"] == {"claims": 2, "true_rate": 1.0}
    assert c["lone"] == {"claims": 3, "true_rate": pytest.approx(2 / 3)}
    # the one false claim (park, doc 1 pos 5) was not true at an earlier position of doc 1: invented
    assert c["false_stale"] == 0.0
    stale = confabulation(["The scene is set at the beach."], [["place=park"]], WORLD, [1], [9])
    assert stale["false_stale"] == 0.0  # no earlier position evaluated
    two = confabulation([None, "The scene is set at the beach."], [["place=beach"], ["place=park"]], WORLD,
                        [1, 1], [3, 9])
    assert two["false_stale"] == 1.0  # beach was true at position 3: outdated, not invented


def test_norm_warnings_and_direction_inputs():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(200, 16, generator=g) + 3.0
    typical = ref.norm(dim=-1).median()
    unit = torch.nn.functional.normalize(ref[:3], dim=-1)
    assert norm_warnings(unit * typical, ref) == []
    warned = norm_warnings(torch.cat([unit * typical * 0.25, unit * typical * 4.0]), ref)
    assert len(warned) == 6 and "vector 0: norm" in warned[0] and "direction_inputs" in warned[0]
    dirs = torch.nn.functional.normalize(torch.randn(4, 16, generator=g), dim=-1)
    mean_unit = torch.nn.functional.normalize(ref, dim=-1).mean(0)
    v = direction_inputs(dirs, mean_unit, ref, strength=2.0)
    assert torch.allclose(v.norm(dim=-1), typical.expand(4))
    # by hand: mean + 2 sd of the data's projection on each direction, at the data's median norm
    spread = (torch.nn.functional.normalize(ref, dim=-1) @ dirs.T).std(0)
    want = torch.nn.functional.normalize(mean_unit + 2.0 * spread.unsqueeze(1) * dirs, dim=-1) * typical
    assert torch.allclose(v, want, atol=1e-5)


# ------------------------------------------------------------------ patching (a tiny HF model)
def test_patch_residual_changes_exactly_that_residual(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from nla.core.arch import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    pos = torch.tensor([4, 6])
    layer = 1
    seen: list[torch.Tensor] = []  # what the next block receives: the residual stream after block `layer`
    probe = decoder_layers(model)[layer + 1].register_forward_pre_hook(
        lambda _m, args, kw: seen.append((args[0] if args else kw["hidden_states"]).clone()), with_kwargs=True)
    with torch.no_grad():
        ref = model(input_ids=ids)
        v = torch.randn(2, seen[0].shape[-1], generator=torch.Generator().manual_seed(1))
        with patch_residual(model, layer, pos, v):
            out = model(input_ids=ids)
        after = model(input_ids=ids)  # the hook is gone
    probe.remove()
    before, patched = seen[0], seen[1]
    rows = torch.arange(2)
    assert torch.equal(patched[rows, pos], v)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[rows, pos] = False
    assert torch.equal(patched[keep], before[keep])
    assert torch.allclose(out.logits[0, :4], ref.logits[0, :4], atol=1e-6)  # causal: earlier positions untouched
    assert not torch.allclose(out.logits[0, 4], ref.logits[0, 4])
    assert torch.equal(after.logits, ref.logits) and torch.equal(seen[2], before)
    own = before[rows, pos]
    # replacing the residual with itself, or adding zero, changes nothing
    for mode, vec in (("replace", own), ("add", torch.zeros_like(own))):
        got = patched_next_token_logits(model, ids, mask, pos, layer=layer, vectors=vec, mode=mode)
        assert torch.allclose(got, ref.logits[rows, pos], atol=1e-5)
    with pytest.raises(ValueError, match="layer 9 outside"):
        with patch_residual(model, 9, pos, v):
            pass
    with pytest.raises(ValueError, match="mode"):
        with patch_residual(model, 0, pos, v, mode="swap"):
            pass


# ------------------------------------------------------------------ on the tiny world's pair
@pytest.fixture(scope="module")
def world(tiny_quickstart_run):
    run = Path(tiny_quickstart_run)
    rl = json.loads((run / "rl.stage_done.json").read_text())
    av = json.loads((run / "av.stage_done.json").read_text())["checkpoint"]
    client = NLAClient(rl["av"], rl["ar"], device="cpu")
    ds = run / "datagen" / "eval.parquet"
    from nla.datagen.io import read_parquet, read_vectors

    table = read_parquet(ds)
    gold = torch.from_numpy(read_vectors(table).copy())
    return dict(run=run, client=client, dataset=ds, table=table, gold=gold, warm_av=av)


def test_attribution_equals_a_plain_reference(world):
    client, gold = world["client"], world["gold"][:6]
    texts = [v.explanation for v in client.verbalize(gold, max_new_tokens=48)]
    texts[1] = None  # a failed sample has no claims
    truths = world["table"].column("facts").to_pylist()[:6]
    attr = attribute_claims(client, texts, gold, grader="world", truths=truths)
    assert attr[1] == []
    scale = client.mse_scale
    for i, t in enumerate(texts):
        if t is None:
            continue
        claims = WORLD.claims(t)
        assert [c.text for c in attr[i]] == claims
        full = float(mse_nrm(client.reconstruct([t]), gold[i : i + 1], scale)[0])
        for j, c in enumerate(attr[i]):
            rest = " ".join(claims[:j] + claims[j + 1 :])  # the last claim's deletion is the empty explanation
            want = float(mse_nrm(client.reconstruct([rest]), gold[i : i + 1], scale)[0]) - full
            assert c.delta_mse == pytest.approx(want, abs=1e-5)
            assert c.truth == WORLD.claim_truth(c.text, truths[i])
            assert isinstance(c, Claim) and c.quotation == WORLD.is_quotation(c.text)
    with pytest.raises(NLAClientError, match="2 texts"):
        attribute_claims(client, texts[:2], gold)


def test_best_of_keeps_the_sample_the_ar_reads_best(world):
    client, gold = world["client"], world["gold"][:4]
    n = 4
    samples = client.verbalize(gold, n_samples=n, greedy=False, seed=7, max_new_tokens=48)
    res = client.score([s.explanation for s in samples], gold[[s.row for s in samples]])
    mse = torch.where(res.failed, torch.full_like(res.mse_nrm, 2.0), res.mse_nrm).view(-1, n)
    best = client.verbalize(gold, best_of=n, greedy=False, seed=7, max_new_tokens=48)
    assert [b.row for b in best] == [0, 1, 2, 3]
    for i, b in enumerate(best):
        j = int(mse[i].argmin())
        assert b.explanation == samples[i * n + j].explanation
        assert b.mse_nrm == pytest.approx(float(mse[i, j]), abs=1e-6)
        assert b.to_dict()["mse_nrm"] == b.mse_nrm
    # the suite's best-of-N is the same choice for N = max(ns)
    out = best_of_n(client, gold, None, None, raw_mean=1.0, ns=(1, n), seed=7, max_new_tokens=48)
    assert out[str(n)]["fve"] == pytest.approx(1.0 - float(mse.min(dim=1).values.double().mean()), abs=1e-6)
    assert out[str(n)]["fve"] >= out["1"]["fve"]
    with pytest.raises(NLAClientError, match="greedy=False"):
        client.verbalize(gold, best_of=2)
    with pytest.raises(NLAClientError, match="n_samples must be 1"):
        client.verbalize(gold, best_of=2, n_samples=2, greedy=False)
    with pytest.raises(NLAClientError, match="no reconstructor"):
        NLAClient(world["run"] / "rl" / "checkpoints" / "step_00000030" / "av", None).verbalize(
            gold, best_of=2, greedy=False)


def test_direction_path_injects_what_it_says(world):
    client, gold = world["client"], world["gold"]
    dirs = torch.nn.functional.normalize(torch.randn(3, gold.shape[1], generator=torch.Generator().manual_seed(0)),
                                         dim=-1)
    small = dirs * 1e-3 * float(gold.norm(dim=-1).min())  # as a raw direction would come: far below the data's norm
    verbs, warnings = verbalize_directions(client, small, gold, strength=3.0, max_new_tokens=48)
    assert len(warnings) == 3 and warnings[0].startswith("vector 0: norm")
    mean_unit = torch.nn.functional.normalize(gold, dim=-1).mean(0)
    want = client.verbalize(direction_inputs(dirs, mean_unit, gold, 3.0), max_new_tokens=48)
    assert [v.explanation for v in verbs] == [v.explanation for v in want]


@pytest.fixture(scope="module")
def slots(world):
    """The recall slots of the first 120 held-out stories of the tiny world, read by its subject."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.world.build import seeded_config
    from nla.world.generator import generate_documents
    from nla.world.slots import recall_slots

    side = world["client"].ar_sidecar
    model = AutoModelForCausalLM.from_pretrained(side.base_model).eval()
    tok = AutoTokenizer.from_pretrained(side.base_model)
    cfg = seeded_config("tiny", 0)
    docs = generate_documents(cfg.seed, 120, start_id=cfg.heldout_start)
    return dict(model=model, tok=tok, docs=docs, layer=side.layer_index,
                slots=recall_slots(model, tok, docs, side.layer_index))


def test_recall_slots_are_what_they_say(slots):
    from nla.core.activations import block_outputs, tokenize_text

    s, docs = slots["slots"], {d.doc_id: d for d in slots["docs"]}
    assert len(s["context"]) > 50 and s["vectors"].shape[0] == len(s["context"])
    for i in range(0, len(s["context"]), 17):
        doc = docs[s["doc_id"][i]]
        ctx = s["context"][i]
        assert doc.text.startswith(ctx)
        nxt = doc.text[len(ctx):].split()[0].strip(".,").lower()
        assert WORLD.fact_of_word(nxt) == s["next_fact"][i] and s["next_fact"][i] in s["facts"][i]
        ids, _ = tokenize_text(slots["tok"], ctx, 128)
        assert len(ids) - 1 == s["position"][i]
        h = block_outputs(slots["model"], torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                          slots["layer"])[0, -1]
        assert torch.allclose(h, s["vectors"][i], atol=1e-5)


def test_causal_edits_run_end_to_end_on_the_tiny_world(world, slots):
    s = slots["slots"]
    texts = [WORLD.oracle(f, None, i) for i, f in enumerate(s["facts"])]  # every true fact: each slot claimed
    texts[0] = None  # a failed sample is never edited
    out = causal_edits(world["client"], slots["model"], slots["tok"], s["context"], s["vectors"], texts, s["facts"],
                       WORLD, slots["layer"], seed=0)
    assert out["rows"] == len(s["context"]) and out["not_reproduced"] == 0
    assert out["edits"] > 10 and out["edits"] + out["not_claimed"] == out["recall_slots"]
    assert out["original_keeps"] == 1.0  # a slot is one where the subject predicts the fact from this vector
    assert out["unedited_moves"] == 0.0 and out["edited_keeps"] <= 1.0
    for ex in out["examples"]:
        assert ex["edited"] == WORLD.edit_fact(ex["explanation"], ex["fact"], ex["edited_to"])
        assert WORLD.named_facts(ex["edited"]) - WORLD.named_facts(ex["explanation"]) == {ex["edited_to"]}
    # the dataset's own rows: their contexts re-run to the extracted vectors
    table, gold = world["table"], world["gold"][:64]
    rows = causal_edits(world["client"], slots["model"], slots["tok"], table.column("context").to_pylist()[:64],
                        gold, [None] * 64, table.column("facts").to_pylist()[:64], WORLD, slots["layer"])
    assert rows["not_reproduced"] == 0 and rows["edits"] == 0


def test_quickstart_reports_does_it_explain(world):
    run = world["run"]
    suite = json.loads((run / "suite" / "suite.json").read_text())
    assert set(suite["sections"]) == {"claims", "hidden_code", "causal", "directions", "confabulation", "best_of"}
    assert {"baseline", "pair"} == set(suite["sections"]["confabulation"])
    assert "## Does it explain?" in (run / "report.md").read_text()
    head = json.loads((run / "report.json").read_text())["headline"]
    assert head["suite_claims_true_over_false"] == suite["sections"]["claims"]["true_over_false"]


def test_run_suite_without_truth_runs_the_truth_free_parts(world):
    rep = run_suite(world["client"], world["dataset"], grader="generic", max_rows=8, max_new_tokens=48,
                    best_of=(1, 2), parts=("claims", "hidden_code", "causal", "directions", "confabulation",
                                           "best_of"))
    assert set(rep.sections) == {"claims", "hidden_code", "best_of"}
    assert set(rep.skipped) == {"causal", "directions", "confabulation"}
    assert rep.sections["claims"]["n_true"] == 0 and rep.sections["best_of"]["greedy"]["recall"] is None
    md = rep.to_markdown()
    assert "causal: not run (the dataset's grader knows no facts)" in md
    with pytest.raises(NLAClientError, match="suite parts"):
        run_suite(world["client"], world["dataset"], parts=("claims", "nope"))


def test_cli_eval_suite(world, tmp_path, capsys):
    from nla.cli import main

    rl = json.loads((world["run"] / "rl.stage_done.json").read_text())
    out = tmp_path / "suite"
    args = ["eval", "--av", rl["av"], "--ar", rl["ar"], "--dataset", str(world["dataset"]), "--max-rows", "12",
            "--max-new-tokens", "48", "--out", str(out)]
    assert main([*args, "--suite", "claims,hidden_code", "--baseline-av", world["warm_av"]]) == 0
    rep = json.loads((out / "suite.json").read_text())
    assert set(rep["sections"]) == {"claims", "hidden_code"} and rep["n_rows"] == 12
    assert "# Does it explain?" in (out / "suite.md").read_text()
    capsys.readouterr()
    for bad, msg in ((["--suite", "claims,nope"], "--suite: expected 'all' or a comma-separated list"),
                     (["--suite", "--best-of", "0,4"], "--best-of: expected comma-separated sample counts")):
        assert main([*args[:-2], "--out", str(tmp_path / "never"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0]
        assert not (tmp_path / "never").exists()


def test_cli_verbalize_directions_and_norm_warnings(world, tmp_path, caplog):
    import numpy as np

    from nla.cli import main

    rl = json.loads((world["run"] / "rl.stage_done.json").read_text())
    gold = world["gold"]
    dirs = torch.nn.functional.normalize(torch.randn(2, gold.shape[1], generator=torch.Generator().manual_seed(3)),
                                         dim=-1) * 1e-3 * float(gold.norm(dim=-1).min())
    np.save(tmp_path / "dirs.npy", dirs.numpy())
    base = ["verbalize", "--av", rl["av"], "--vectors", str(tmp_path / "dirs.npy"), "--max-new-tokens", "48"]
    with caplog.at_level("WARNING"):
        assert main([*base, "--reference", str(world["dataset"]), "--out", str(tmp_path / "raw.jsonl")]) == 0
    assert sum("outside the training data's range" in r.getMessage() for r in caplog.records) == 2
    assert main([*base, "--reference", str(world["dataset"]), "--directions", "--strength", "3",
                 "--out", str(tmp_path / "dirs.jsonl")]) == 0
    got = [json.loads(line)["explanation"] for line in (tmp_path / "dirs.jsonl").read_text().splitlines()]
    client = NLAClient(rl["av"], None)
    want, _ = verbalize_directions(client, dirs, gold, strength=3.0, max_new_tokens=48)
    assert got == [v.explanation for v in want]
    assert main([*base, "--directions", "--out", str(tmp_path / "never.jsonl")]) == 2
    assert not (tmp_path / "never.jsonl").exists()


def test_cli_suite_paraphrase_provider_needs_its_key(world, tmp_path, capsys, monkeypatch):
    from nla.cli import main

    monkeypatch.delenv("NLA_NO_SUCH_KEY", raising=False)
    rl = json.loads((world["run"] / "rl.stage_done.json").read_text())
    code = main(["eval", "--suite", "hidden_code", "--av", rl["av"], "--ar", rl["ar"], "--dataset",
                 str(world["dataset"]), "--max-rows", "4", "--paraphrase-provider", "openai", "--paraphrase-model",
                 "m", "--paraphrase-key-env", "NLA_NO_SUCH_KEY", "--out", str(tmp_path / "s")])
    assert code == 2
    err = capsys.readouterr().err
    assert "NLA_NO_SUCH_KEY is not set" in err and not (tmp_path / "s").exists()


def test_claims_summary_by_hand():
    from nla.eval.suite import claims_summary

    attr = [[Claim('The text ends with "x".', 0.5, None, True), Claim("The story is about Felix.", 0.4, True, False),
             Claim("The scene is set at the beach.", 0.1, False, False)],
            [Claim("Someone feels sad.", -0.1, False, False), Claim("This is the start of a story.", 0.0, None, False)],
            []]
    truths = [["person=felix", "place=park"], ["mood=happy"], []]
    earlier = [set(), {"mood=sad"}, set()]  # sad was true earlier in row 1's document: a stale claim
    out = claims_summary(attr, raw_mean=0.5, grader=WORLD, truths=truths, earlier=earlier)
    assert (out["rows"], out["claims"], out["n_true"], out["n_false"], out["n_quotation"], out["n_other"]) == \
        (3, 5, 1, 2, 1, 1)
    assert out["fve_cost_true"] == pytest.approx(0.8) and out["fve_cost_false"] == pytest.approx(0.0)
    assert out["fve_cost_quotation"] == pytest.approx(1.0) and out["fve_cost_other"] == pytest.approx(0.0)
    assert out["fve_cost_false_stale"] == pytest.approx(-0.2) and out["fve_cost_false_invented"] == pytest.approx(0.2)
    assert out["true_over_false"] is None and out["false_cost_nonpositive"]  # false deletions cost nothing
    from nla.eval.suite import SuiteReport

    rep = SuiteReport("d", 3, 0, sections={"claims": out})
    (t,) = [t for t in rep.targets if t["key"] == "true_over_false"]
    assert t["met"] is True and "(<= 0)" in t["note"]


def test_a_subject_of_another_width_or_depth_is_named_not_a_shape_error(tiny_model_dir):
    """Issue 48: a subject of another width gave a raw torch shape error deep in the causal part."""
    from nla.client import NLAClientError
    from nla.eval.suite.run import load_subject

    subject = tiny_model_dir("llama")  # d = 32, 4 blocks
    model, _ = load_subject(subject, torch.device("cpu"), 32, 1)
    assert model.config.hidden_size == 32
    with pytest.raises(NLAClientError, match=r"subject: .* has width 32, but the dataset's vectors are 64-d"):
        load_subject(subject, torch.device("cpu"), 64, 1)
    with pytest.raises(NLAClientError, match=r"has 4 blocks, but the vectors were read at layer 7"):
        load_subject(subject, torch.device("cpu"), 32, 7)
