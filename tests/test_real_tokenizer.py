"""Qwen2.5's real tokenizer (151,669 entries, byte-level BPE, `<|im_start|>` chat turns, no BOS, EOS
`<|im_end|>`) through nla: the sidecar's token fields, the AR's read position, and the whole pipeline
(datagen -> train ar / av -> rl full and LoRA -> eval -> verbalize / score -> explore) on a
Qwen2-architecture model at test width with the real 151,936-row vocabulary and real English text.

Expected ids were read off the tokenizer by hand (``tok.convert_ids_to_tokens``): "㈎" = 149705;
" <<" = 1115 and ">>" = 2452 around it in the default AV prompt; "Summary", " vector", ":" =
19237, 4621, 25; "\\n" = 198 alone but ".\\n" = 624 and '"\\n' = 698 after an explanation; "</" = 522
alone but ".</" = 3918 and '"</' = 21522 after one; "text", ">", " <", "summary", ">" = 1318, 29, 366,
1708, 29.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import QWEN_MARKER_ID, QWEN_VOCAB_ROWS

from nla.core.sidecar import NLAConfig, token_id_changes, write_sidecar
from nla.core.sidecar_errors import ARSuffixMismatchError, MarkerNotSingleTokenError, SidecarError
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
from nla.core.token_ids import canonical_av_prompt_ids, checked_ar_suffix, stable_ar_suffix, verify_tokenizer

PUBLISHED_AR_TEMPLATE = "Summary of the following text: <text>{explanation}</text> <summary>"
ENGLISH = Path(__file__).parent / "fixtures" / "english.txt"


def _side(tok, ar_template: str = DEFAULT_AR_TEMPLATE) -> NLAConfig:
    return NLAConfig.from_tokenizer(tok, kind="nla_model", role="av", d_model=64, layer_index=1,
                                    av_template=DEFAULT_AV_TEMPLATE, ar_template=ar_template,
                                    injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model")


def test_the_published_marker_and_its_neighbours_through_the_chat_template(qwen_tokenizer):
    tok = qwen_tokenizer
    assert len(tok) == 151669 and tok.bos_token_id is None and tok.eos_token == "<|im_end|>"
    side = _side(tok)
    assert (side.injection_token_id, side.injection_left_neighbor_id, side.injection_right_neighbor_id) == (
        QWEN_MARKER_ID, 1115, 2452)
    prompt = canonical_av_prompt_ids(tok, side.av_messages())
    assert tok.decode(prompt) == ("<|im_start|>user\nExplain the hidden state <<㈎>> in a few short sentences."
                                  "<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.count(QWEN_MARKER_ID) == 1
    verify_tokenizer(side, tok)


def test_the_ar_suffix_is_what_every_explanation_shares(qwen_tokenizer):
    # The default tail "\nSummary vector:" is [198, 19237, 4621, 25] alone, but the newline merges
    # with an explanation's last '.' or '"': only "Summary vector:" is the same for every explanation.
    tok = qwen_tokenizer
    assert tok.encode("\nSummary vector:", add_special_tokens=False) == [198, 19237, 4621, 25]
    assert tok.encode("A short explanation.\nSummary vector:", add_special_tokens=False)[-4:] == [624, 19237, 4621, 25]
    assert stable_ar_suffix(tok, DEFAULT_AR_TEMPLATE) == (19237, 4621, 25)
    assert _side(tok).critic_suffix_ids == (19237, 4621, 25)
    # the published AR template: ".</" and '"</' are single tokens, the last five ids are shared
    assert stable_ar_suffix(tok, PUBLISHED_AR_TEMPLATE) == (1318, 29, 366, 1708, 29)
    side = _side(tok, PUBLISHED_AR_TEMPLATE)
    verify_tokenizer(side, tok)
    for explanation in ("The cat sat.", 'He said "no"', "a word"):
        assert tok.encode(side.ar_text(explanation), add_special_tokens=False)[-5:] == [1318, 29, 366, 1708, 29]


def test_a_longer_recorded_tail_is_checked_where_it_holds_and_the_read_token_always(qwen_tokenizer, tmp_path):
    tok = qwen_tokenizer
    # what the standalone tail gives (and what nla wrote before): [198, ...] and [522, ...]
    for template, recorded, shared in ((DEFAULT_AR_TEMPLATE, (198, 19237, 4621, 25), (19237, 4621, 25)),
                                       (PUBLISHED_AR_TEMPLATE, (522, 1318, 29, 366, 1708, 29),
                                        (1318, 29, 366, 1708, 29))):
        side = _side(tok, template).replace(critic_suffix_ids=recorded)
        assert checked_ar_suffix(side, tok) == shared
        verify_tokenizer(side, tok)
        path = tmp_path / "ckpt"
        path.mkdir(exist_ok=True)
        write_sidecar(path / "nla_meta.yaml", side)
        assert token_id_changes(path, tok) == {}  # `nla sidecar fix-tokens` has nothing to change
        # another read token is refused, and the message says that is what the AR reads at
        wrong = side.replace(critic_suffix_ids=(*recorded[:-1], 13))
        with pytest.raises(ARSuffixMismatchError, match=r"reads its prediction at the last token of the AR text; "
                                                        r"the sidecar records 13 \(\['\.'\]\)"):
            verify_tokenizer(wrong, tok)
        # the read token right but a shared id before it wrong: refused too, naming what must match
        wrong = side.replace(critic_suffix_ids=(*recorded[:-2], 7, recorded[-1]))
        with pytest.raises(ARSuffixMismatchError, match=r"the last \d ids, which every explanation shares"):
            verify_tokenizer(wrong, tok)


def test_a_template_whose_read_token_depends_on_the_explanation_is_refused(qwen_tokenizer):
    # "{explanation}." ends in ".", "..", '".', "?." ...: Qwen merges the final "." with what precedes it
    with pytest.raises(SidecarError, match=r"ar_template: the AR reads its prediction at the last token .* depends "
                                           r"on the explanation \(it is one of \[.*'\.\.'"):
        stable_ar_suffix(qwen_tokenizer, "Explanation: {explanation}.")


def test_ar_training_rows_with_the_real_tokenizer_end_in_the_checked_suffix(qwen_tokenizer):
    from nla.core.reconstructor import tokenize_ar_texts
    from nla.train.ar import ARTrainError, check_ar_suffix

    tok = qwen_tokenizer
    side = _side(tok).replace(critic_suffix_ids=(198, 19237, 4621, 25))  # a sidecar written before
    texts = [side.ar_text(e) for e in ("It rains.", 'She said "yes"', "bakery", "(see the map)")]
    enc = tokenize_ar_texts(tok, texts, 64)
    check_ar_suffix(enc["input_ids"], enc["attention_mask"], checked_ar_suffix(side, tok))
    with pytest.raises(ARTrainError, match=r"training row 0 ends in token ids \[624, 19237, 4621, 25\]"):
        check_ar_suffix(enc["input_ids"], enc["attention_mask"], side.critic_suffix_ids)


def test_a_marker_of_several_tokens_is_refused_before_extract_with_ones_the_tokenizer_has(qwen_model_dir, tmp_path):
    # "㈀" (U+3200) is two tokens on Qwen2.5 ([124021, 222]). Datagen checks the tokenizer before it
    # extracts anything (extract can take hours; build, which needs the marker, comes last), and names
    # characters of the marker's own Unicode block that are single tokens here, rarest (highest id)
    # first: "㊥" 151633, "㈼" 151617, "㉫" 151605 (read off the tokenizer by hand).
    from nla.datagen.config import DatagenConfig
    from nla.datagen.pipeline import run

    assert qwen_tokenizer_encode(qwen_model_dir, "㈀") == [124021, 222]
    cfg = DatagenConfig(out_dir=str(tmp_path / "dg"), source="file", corpus_path=str(ENGLISH),
                        model_dir=str(qwen_model_dir), layer_index=1, positions_per_doc=2, skip_first=2, max_len=64,
                        explainer="context", injection_char="㈀", device="cpu")
    with pytest.raises(MarkerNotSingleTokenError, match=r"injection_char: expected '㈀' to encode to exactly 1 token, found 2 "
                                           r"tokens \[124021, 222\]; set injection_char .* \(this tokenizer has, as "
                                           r"single tokens: '㊥' id 151633, '㈼' id 151617, '㉫' id 151605; pick one "
                                           r"your text never contains\)"):
        run(cfg)
    assert not (tmp_path / "dg" / "activations.parquet").exists()  # refused before extract
    run(cfg.replace(injection_char="㊥"))  # the first one named builds
    side = yaml.safe_load((tmp_path / "dg" / "av_sft.parquet.nla_meta.yaml").read_text())
    assert side["tokens"]["injection_token_id"] == 151633


def qwen_tokenizer_encode(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)


# ------------------------------------------------------------------ the whole pipeline
FIXED = "The text is about the harbour at dawn."


def _cli(*argv: str) -> None:
    from nla.cli import main

    assert main(list(argv)) == 0, argv


def _teach_a_fixed_answer(av_dir: Path, out: Path, steps: int = 100) -> None:
    """A copy of the AV checkpoint fine-tuned to answer every vector with ``FIXED`` in the
    explanation tags, then EOS: a random 151k-vocabulary model never closes its tags, so RL would
    score only failures; this one's rollouts complete and reach the AR."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.core.injection import InjectionHook
    from nla.core.sidecar import load_sidecar
    from nla.util.checkpoint_files import write_checksums

    shutil.copytree(av_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    side = load_sidecar(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = canonical_av_prompt_ids(tok, side.av_messages())
    seq = torch.tensor(prompt + tok.encode(f"<explanation>\n{FIXED}\n</explanation>", add_special_tokens=False)
                       + [tok.eos_token_id])
    hook = InjectionHook.from_config(model, side)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(steps):
        x = seq.expand(2, -1)
        with hook.vectors(torch.randn(2, side.d_model, generator=g)):
            logits = model(input_ids=x).logits[:, len(prompt) - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, len(prompt):].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    hook.remove()
    model.save_pretrained(out)
    write_checksums(out)


@pytest.mark.slow
def test_the_pipeline_on_a_qwen2_model_with_the_real_tokenizer(qwen_model_dir, tmp_path, monkeypatch, capsys):
    from starlette.testclient import TestClient

    from nla.client import NLAClient
    from nla.explore import Explorer, create_app

    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[1]
    # datagen: the documented real-model command, on real English text
    _cli("datagen", "run", "--config", str(repo / "configs/datagen/hf_text_example.yaml"), "--threads", "1",
         "--set", f"model_dir={qwen_model_dir}", "--set", f"corpus_path={ENGLISH}", "--set", "layer_index=1",
         "--set", "out_dir=dg", "--set", "device=cpu", "--set", "positions_per_doc=8", "--set", "skip_first=2",
         "--set", "max_len=128")
    side = yaml.safe_load(Path("dg/ar_sft.parquet.nla_meta.yaml").read_text())
    assert side["tokens"]["injection_token_id"] == QWEN_MARKER_ID
    assert side["tokens"]["critic_suffix_ids"] == [19237, 4621, 25]
    assert (side["tokens"]["injection_left_neighbor_id"], side["tokens"]["injection_right_neighbor_id"]) == (1115, 2452)
    import pyarrow.parquet as pq

    row = pq.read_table("dg/av_sft.parquet").slice(0, 1).to_pylist()[0]
    assert row["response"].startswith("<explanation>\n") and row["response"].endswith("\n</explanation>")

    short = ["--set", "max_steps=4", "--set", "warmup_steps=0", "--set", "batch_size=8", "--set",
             "micro_batch_size=4", "--set", "eval_every=4", "--set", "save_every=4", "--set", "lr=1e-3", "--threads", "1"]
    _cli("train", "ar", "--dataset", "dg/ar_sft.parquet", "--out", "ar", *short)
    _cli("train", "av", "--dataset", "dg/av_sft.parquet", "--out", "av", *short)
    av_ckpt = Path("av/checkpoints/step_00000004")
    av = NLAClient(av_ckpt, None)
    assert len(av.av_tokenizer) == 151669 and av.av_model.get_input_embeddings().weight.shape[0] == QWEN_VOCAB_ROWS
    _teach_a_fixed_answer(av_ckpt, Path("av_fixed"))

    Path("rl.yaml").write_text(yaml.safe_dump({
        "av": "av_fixed", "ar": "ar/checkpoints/step_00000004", "dataset": "dg/rl.parquet", "out_dir": "rl",
        "steps": 2, "eval_every": 2, "seed": 0,
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "max_response_len": 24},
        "optimiser": {"lr": 1e-4, "micro_batch_size": 4}, "reconstructor": {"lr": 3e-4},
        "checkpointing": {"save_every": 2}}))
    for name, extra in (("rl", []), ("rl_lora", ["--set", "lora.r=4"])):
        _cli("rl", "--config", "rl.yaml", "--out", name, "--threads", "1", *extra)
        log = [json.loads(x) for x in Path(name, "rl.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in log if "reward_mean" in r]
        assert len(steps) == 2
        for r in steps:  # the AV's rollouts completed, the live AR scored them and trained on them
            assert r["ar_rows"] > 0 and np.isfinite(r["ar_loss"]) and np.isfinite(r["reward_mean"])
            assert r["extraction_fail_rate"] < 1.0  # sampled at temperature 1: some, not all, close their tags
    assert (Path("rl_lora/checkpoints/step_00000002/av_adapter")).is_dir()

    pair = Path("rl/checkpoints/step_00000002")
    _cli("eval", "--av", str(pair / "av"), "--ar", str(pair / "ar"), "--dataset", "dg/rl.parquet", "--max-rows", "8",
         "--max-new-tokens", "24", "--out", "eval")
    report = json.loads(Path("eval/eval.json").read_text())
    assert report["rows"][0]["name"] == "AV → AR round trip" and np.isfinite(report["rows"][0]["fve"])

    _cli("verbalize", "--av", str(pair / "av"), "--vectors", "dg/rl.parquet", "--rows", "3", "--max-new-tokens", "24",
         "--out", "verbs.jsonl")
    verbs = [json.loads(x) for x in Path("verbs.jsonl").read_text().splitlines()]
    assert [v["status"] for v in verbs] == ["completed"] * 3 and all(v["explanation"] for v in verbs)
    Path("texts.txt").write_text("\n".join(v["explanation"] for v in verbs) + "\n")
    _cli("score", "--ar", str(pair / "ar"), "--texts", "texts.txt", "--vectors", "dg/rl.parquet", "--rows", "3",
         "--out", "scores.jsonl")
    scores = [json.loads(x) for x in Path("scores.jsonl").read_text().splitlines()]
    vecs = np.stack(pq.read_table("dg/rl.parquet").column("activation_vector").to_numpy(zero_copy_only=False)[:3])
    direct = NLAClient(None, pair / "ar").score([v["explanation"] for v in verbs], vecs)
    assert [s["mse_nrm"] for s in scores] == pytest.approx(direct.mse_nrm.tolist(), rel=1e-5)

    explorer = Explorer.load(pair / "av", pair / "ar", qwen_model_dir, device="cpu")
    api = TestClient(create_app(explorer))
    r = api.post("/api/explain", json={"text": "The harbour was quiet before dawn.", "positions": [1, 3]})
    assert r.status_code == 200, r.text
    for out in r.json()["results"]:
        assert out["greedy"]["status"] == "completed" and np.isfinite(out["greedy"]["mse_nrm"])
