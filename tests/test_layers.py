"""One pair for several blocks (issue 59), its first part: datagen reads several blocks in one pass,
the prompts name each row's block, the sidecars record the blocks, and both warm-starts train on it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import yaml

from nla.core.sidecar import NLAConfig, load_sidecar, write_sidecar
from nla.core.sidecar_errors import SidecarError
from nla.core.templates import AV_PLACEHOLDER, LAYERED_AR_TEMPLATE, LAYERED_AV_TEMPLATE
from nla.datagen.build import load_dataset
from nla.datagen.config import DatagenConfig
from nla.datagen.explain import by_block
from nla.datagen.io import read_parquet, read_vectors
from nla.datagen.pipeline import run

TEXT = "\n\n".join(
    f"{name} walks to the {place} in the {time} . the {animal} sings ."
    for name in ("Alice", "Bob", "Carol", "Dave", "Eve")
    for place in ("market", "river", "school")
    for time, animal in (("morning", "bird"), ("evening", "dog"))
)  # 30 documents


def _cfg(tmp_path, model_dir, **kw) -> DatagenConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    data = dict(out_dir=str(tmp_path / "out"), source="file", corpus_path=str(corpus), model_dir=str(model_dir),
                positions_per_doc=3, skip_first=2, batch_size=4, max_len=64, batches_per_shard=2, explainer="context",
                threads=1)
    data.update(kw)
    return DatagenConfig.from_dict(data)


def _by_key(table: pa.Table) -> dict[tuple[int, int, int], np.ndarray]:
    v = read_vectors(table)
    keys = zip(table.column("doc_id").to_pylist(), table.column("position").to_pylist(),
               table.column("activation_layer").to_pylist(), strict=True)
    return {k: v[i] for i, k in enumerate(keys)}


def test_several_blocks_in_one_pass_are_each_blocks_own_extraction(tmp_path, tiny_model_dir):
    """Every (document, position) gives a row per block, ordered (doc, position, block), whose vector is
    bit for bit what extracting that block alone gives; the prompts name the row's block."""
    model = tiny_model_dir("llama")
    s = run(_cfg(tmp_path / "both", model, layers=[0, 1]), stages=["extract"])
    assert s["extract"]["rows"] == 30 * 3 * 2 and s["extract"]["dropped"] == {}
    both = read_parquet(tmp_path / "both" / "out" / "activations.parquet")
    keys = list(zip(both.column("doc_id").to_pylist(), both.column("position").to_pylist(),
                    both.column("activation_layer").to_pylist(), strict=True))
    assert keys == sorted(keys) and {k[2] for k in keys} == {0, 1}
    assert keys[:2] == [(keys[0][0], keys[0][1], 0), (keys[0][0], keys[0][1], 1)]
    got = _by_key(both)
    for k in (0, 1):
        run(_cfg(tmp_path / f"b{k}", model, layer_index=k), stages=["extract"])
        alone = _by_key(read_parquet(tmp_path / f"b{k}" / "out" / "activations.parquet"))
        assert len(alone) == 90
        for key, vec in alone.items():
            np.testing.assert_array_equal(got[key], vec)
    # the block-0 and block-1 rows of one position share its text columns
    for col in ("context", "token", "n_raw_tokens"):
        values = both.column(col).to_pylist()
        assert values[0::2] == values[1::2]


def test_the_built_datasets_name_each_rows_block_and_the_sidecar_records_the_blocks(tmp_path, tiny_model_dir):
    run(_cfg(tmp_path, tiny_model_dir("llama"), layers=[0, 1]))
    out = tmp_path / "out"
    av, side = load_dataset(out / "av_sft.parquet")
    assert (side.layers, side.layer_index) == ((0, 1), 1)  # the AR keeps blocks 0..1
    assert side.av_template == LAYERED_AV_TEMPLATE and side.ar_template == LAYERED_AR_TEMPLATE
    for prompt, k in zip(av.column("prompt").to_pylist(), av.column("activation_layer").to_pylist(), strict=True):
        assert prompt == [{"role": "user", "content": f"Explain the hidden state <<{AV_PLACEHOLDER}>> of block {k} in "
                                                      "a few short sentences."}]
    ar, _ = load_dataset(out / "ar_sft.parquet")
    for row in ar.select(["prompt", "explanation", "activation_layer"]).to_pylist():
        assert row["prompt"] == f"Block {row['activation_layer']}. Explanation: {row['explanation']}\nSummary vector:"
    rl, _ = load_dataset(out / "rl.parquet")
    assert [p[0]["content"] for p in rl.column("prompt").to_pylist()] == [
        LAYERED_AV_TEMPLATE.replace("{layer}", str(k)).format(injection_char=AV_PLACEHOLDER)
        for k in rl.column("activation_layer").to_pylist()]
    # per block, the median norm of the training splits' raw vectors (av_sft + ar_sft)
    for k in (0, 1):
        v = np.concatenate([read_vectors(t)[np.asarray(t.column("activation_layer").to_pylist()) == k]
                            for t in (av, ar)])
        assert side.layer_norms[k] == pytest.approx(float(np.median(np.linalg.norm(v.astype(np.float64), axis=1))),
                                                    rel=1e-5)
    doc = yaml.safe_load((out / "rl.parquet.nla_meta.yaml").read_text())
    assert doc["extraction"]["layers"] == [0, 1] and doc["extraction"]["layer_index"] == 1
    assert sorted(doc["extraction"]["layer_norms"]) == [0, 1]
    # a one-block run writes none of these keys (the published layout)
    run(_cfg(tmp_path / "one", tiny_model_dir("llama"), layer_index=1))
    one = yaml.safe_load((tmp_path / "one" / "out" / "rl.parquet.nla_meta.yaml").read_text())
    assert "layers" not in one["extraction"] and "layer_norms" not in one["extraction"]


def test_the_settings_are_checked_by_name(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    for layers, message in (([1], "DatagenConfig.layers: expected two or more integers >= 0"),
                            ([1, 0], "DatagenConfig.layers: expected distinct blocks in increasing order (e.g. [0, 1])"),
                            ([0, 0, 1], "distinct blocks in increasing order"),
                            ([0, -1], "two or more integers >= 0")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                           .replace("]", r"\]")):
            _cfg(tmp_path, model, layers=layers)
    with pytest.raises(ValueError, match=r"DatagenConfig.layer_index: expected null or the deepest of layers \(1"):
        _cfg(tmp_path, model, layers=[0, 1], layer_index=0)
    assert _cfg(tmp_path, model, layers=[0, 1], center=True).center  # one offset a block (below)
    assert _cfg(tmp_path, model, layers=[0, 1], layer_index=1).layers == (0, 1)
    # a block the model has not: refused before any document is read
    from nla.datagen.io import DatagenError

    with pytest.raises(DatagenError, match=r"layer_index 7 is out of range: the model has 4 decoder blocks, valid range 0..3"):
        run(_cfg(tmp_path / "bad", model, layers=[0, 7]))


def test_centred_a_block_at_a_time_each_blocks_rows_lose_their_own_mean(tmp_path, tiny_model_dir):
    """center with several blocks: each block's rows are centred on the mean of that block's training rows
    (av_sft + ar_sft; float64 mean stored float32), recorded per block as extraction.layer_offsets; derived
    here from the same run uncentred."""
    model = tiny_model_dir("llama")
    run(_cfg(tmp_path / "raw", model, layers=[0, 1]))
    run(_cfg(tmp_path / "cen", model, layers=[0, 1], center=True))
    raw = {n: load_dataset(tmp_path / "raw" / "out" / f"{n}.parquet")[0] for n in ("av_sft", "ar_sft", "rl")}
    blocks = {n: np.asarray(t.column("activation_layer").to_pylist()) for n, t in raw.items()}
    want = {k: np.concatenate([read_vectors(raw[n])[blocks[n] == k] for n in ("av_sft", "ar_sft")]).astype(
        np.float64).mean(0).astype(np.float32) for k in (0, 1)}
    assert not np.allclose(want[0], want[1])  # the blocks' means differ: one offset for all would leave some
    for n in ("av_sft", "ar_sft", "rl"):
        tab, side = load_dataset(tmp_path / "cen" / "out" / f"{n}.parquet")
        assert side.vector_offset is None and sorted(side.layer_offsets) == [0, 1]
        for k in (0, 1):
            np.testing.assert_array_equal(np.asarray(side.layer_offsets[k], np.float32), want[k])
        assert tab.column("activation_layer").to_pylist() == blocks[n].tolist()
        np.testing.assert_array_equal(read_vectors(tab), read_vectors(raw[n]) - np.stack([want[k] for k in blocks[n]]))
        # the sidecar maps raw vectors to these, a block a row
        np.testing.assert_array_equal(side.to_pair_space(read_vectors(raw[n]), layer=blocks[n].tolist()),
                                      read_vectors(tab))
    doc = yaml.safe_load((tmp_path / "cen" / "out" / "rl.parquet.nla_meta.yaml").read_text())
    assert sorted(doc["extraction"]["layer_offsets"]) == [0, 1] and "vector_offset" not in doc["extraction"]


def test_a_block_at_a_time_offsets_are_applied_a_row_at_a_time_and_checked():
    import torch

    side = _layered_sidecar(layer_offsets={0: [1.0, 2.0, 0.0, 0.0], 2: [-1.0, 0.5, 0.0, 4.0]})
    assert side.centred and not _layered_sidecar().centred
    raw = np.ones((2, 4), np.float32)
    # by hand: row 0 minus block 0's offset, row 1 minus block 2's
    assert side.to_pair_space(raw, layer=[0, 2]).tolist() == [[0.0, -1.0, 1.0, 1.0], [2.0, 0.5, 1.0, -3.0]]
    assert side.to_pair_space(raw, layer=np.array([2, 2])).tolist() == [[2.0, 0.5, 1.0, -3.0]] * 2
    assert side.to_pair_space(torch.from_numpy(raw), layer=torch.tensor([2, 0])).tolist() == [
        [2.0, 0.5, 1.0, -3.0], [0.0, -1.0, 1.0, 1.0]]
    assert side.to_pair_space(raw[0], layer=np.int64(0)).tolist() == [0.0, -1.0, 1.0, 1.0]
    assert side.to_pair_space(torch.full((4,), 3.0), layer=2).tolist() == [4.0, 2.5, 3.0, -1.0]
    assert side.from_pair_space(side.to_pair_space(raw, layer=[2, 0]), layer=[2, 0]).tolist() == raw.tolist()
    assert _layered_sidecar().to_pair_space(raw, layer=[0, 2]) is raw  # not centred: unchanged
    for layer, message in ((None, r"to_pair_space: this pair reads several blocks \(\[0, 2\], extraction.layers\)"),
                           (1, r"to_pair_space: block 1 is not one this pair was trained on"),
                           ([0, 1], r"to_pair_space: block 1 is not one this pair was trained on"),
                           ([0], r"to_pair_space: layer gives 1 blocks for 2 vector\(s\); give one block for every "
                                 r"vector, or one block for all")):
        with pytest.raises(SidecarError, match=message):
            side.to_pair_space(raw, layer=layer)


@pytest.mark.parametrize("kw, message", [
    (dict(layer_offsets={0: [0.0] * 4}), r"layer_offsets \(extraction.layer_offsets\): expected an offset for each "
                                         r"block of \[0, 2\], found \[0\]"),
    (dict(layer_offsets={0: [0.0] * 4, 2: [0.0] * 3}), r"NLAConfig.layer_offsets\[2\] \(extraction.layer_offsets.2\): "
                                                       r"expected 4 numbers \(d_model\), found 3"),
    (dict(layer_offsets={0: [0.0] * 4, 2: [0.0, float("inf"), 0.0, 0.0]}), r"entry 1 is inf; expected finite"),
    (dict(layer_offsets={0: [0.0] * 4, 2: [0.0] * 4}, vector_offset=[0.0] * 4),
     r"one offset a block, or vector_offset, one for every row; found both"),
])
def test_the_block_offsets_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        _layered_sidecar(**kw)
    with pytest.raises(ValueError, match=r"NLAConfig.layer_offsets \(extraction.layer_offsets\): recorded only with "
                                         r"extraction.layers"):
        NLAConfig(kind="nla_model", role="ar", d_model=4, layer_index=3, critic_suffix_ids=(5,),
                  ar_template="Explanation: {explanation}\nSummary vector:", layer_offsets={3: [0.0] * 4})


def _layered_sidecar(**kw) -> NLAConfig:
    base = dict(kind="nla_model", role="ar", d_model=4, layer_index=None, critic_suffix_ids=(5,),
                ar_template=LAYERED_AR_TEMPLATE, layers=(0, 2))
    base.update(kw)
    return NLAConfig(**base)


def test_a_pair_of_several_blocks_refuses_a_block_it_was_not_trained_on():
    side = _layered_sidecar()
    assert side.layer_index == 2  # the deepest
    assert side.ar_text("It rains.", layer=0) == "Block 0. Explanation: It rains.\nSummary vector:"
    with pytest.raises(SidecarError, match=r"the AR text: block 1 is not one this pair was trained on \(extraction."
                                           r"layers: \[0, 2\]\); give vectors of one of those blocks"):
        side.ar_text("It rains.", layer=1)
    with pytest.raises(SidecarError, match=r"this pair reads several blocks \(\[0, 2\], extraction.layers\) and its "
                                           r"prompts name the block; say which block each vector comes from"):
        side.ar_text("It rains.")
    one = NLAConfig(kind="nla_model", role="ar", d_model=4, layer_index=3, critic_suffix_ids=(5,),
                    ar_template="Explanation: {explanation}\nSummary vector:")
    assert one.ar_text("x", layer=3) == one.ar_text("x") == "Explanation: x\nSummary vector:"
    with pytest.raises(SidecarError, match=r"block 2 was asked for, but this pair reads block 3 only"):
        one.ar_text("x", layer=2)


@pytest.mark.parametrize("kw, message", [
    (dict(layers=(2,)), r"expected two or more distinct blocks >= 0 in increasing order, found \[2\]"),
    (dict(layers=(2, 0)), r"increasing order, found \[2, 0\]"),
    (dict(layer_index=1), r"NLAConfig.layer_index: expected the deepest of extraction.layers \(2"),
    (dict(ar_template="Explanation: {explanation}\nSummary vector:"), r"\{layer\} must appear exactly once"),
    (dict(layers=None), r"\{layer\} names the block of a pair of several blocks, but the sidecar records no "
                        r"extraction.layers"),
    (dict(layer_norms={0: 1.0}), r"expected a positive number for each block of \[0, 2\]"),
    (dict(layer_norms={0: 1.0, 2: -1.0}), r"expected a positive number for each block"),
])
def test_the_sidecars_blocks_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        _layered_sidecar(**kw)


def test_the_blocks_round_trip_through_the_sidecar_file(tmp_path):
    side = _layered_sidecar(layer_norms={0: 1.5, 2: 30.25}, layer_offsets={0: [1, 2, 3, 4], 2: [0.5, 0, 0, -1]})
    write_sidecar(tmp_path, side)
    assert load_sidecar(tmp_path) == side.replace(mse_scale=2.0)  # written as the number: sqrt(d_model 4)
    assert load_sidecar(tmp_path).layer_norms == {0: 1.5, 2: 30.25}
    assert load_sidecar(tmp_path).layer_offsets == {0: (1.0, 2.0, 3.0, 4.0), 2: (0.5, 0.0, 0.0, -1.0)}


def test_by_block_runs_each_blocks_rows_alone_and_keeps_the_row_order():
    t = pa.table({"activation_layer": [0, 1, 0, 1, 1], "x": [10, 11, 12, 13, 14]})
    u = pa.table({"activation_layer": [1, 0], "x": [20, 21]})
    seen = []

    def fn(tables):
        seen.append({n: tb.column("x").to_pylist() for n, tb in tables.items()})
        block = tables["t"].column("activation_layer")[0].as_py()
        return ({n: tb.append_column("y", pa.array([v * 100 + block for v in tb.column("x").to_pylist()]))
                 for n, tb in tables.items()}, {"block": block})

    out, summary = by_block({"t": t, "u": u}, fn)
    assert seen == [{"t": [10, 12], "u": [21]}, {"t": [11, 13, 14], "u": [20]}]
    assert out["t"].column("y").to_pylist() == [1000, 1101, 1200, 1301, 1401]
    assert out["u"].column("y").to_pylist() == [2001, 2100]
    assert summary == {"by_block": {0: {"block": 0}, 1: {"block": 1}}}
    # one block: fn on the tables themselves
    one = pa.table({"activation_layer": [3, 3], "x": [1, 2]})
    assert by_block({"t": one}, lambda tables: (tables, "whole"))[1] == "whole"


def test_both_warm_starts_train_on_rows_of_several_blocks(tmp_path, tiny_model_dir, capsys):
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.train.config import ARTrainConfig, AVTrainConfig

    run(_cfg(tmp_path, tiny_model_dir("llama"), layers=[0, 1], center=True))  # one offset a block
    dg = tmp_path / "out"
    common = dict(warmup_steps=0, max_steps=1, eval_every=1, save_every=1, batch_size=4, threads=1, progress=False,
                  tensorboard=False)
    ar = train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar"), lr=1e-4,
                                max_length=80, shuffle_sentences=True, **common))
    av = train_av(AVTrainConfig(dataset=str(dg / "av_sft.parquet"), out_dir=str(tmp_path / "av"), lr=1e-4,
                                max_length=128, smoke_num=1, **common))
    offsets = load_sidecar(dg / "rl.parquet").layer_offsets
    for ckpt, role in ((ar.checkpoint_dir, "ar"), (av.checkpoint_dir, "av")):
        side = load_sidecar(ckpt)
        assert (side.role, side.layers, side.layer_index) == (role, (0, 1), 1)
        assert side.layer_offsets == offsets and sorted(offsets) == [0, 1]  # every checkpoint carries them
    from nla.core import arch
    from nla.core.reconstructor import Reconstructor

    assert len(arch.decoder_layers(Reconstructor.from_pretrained(ar.checkpoint_dir).base)) == 2  # blocks 0..1
    # RL on the same rows: each row's prompt names its block, the AR reads each explanation with its block
    import torch

    from nla.core.token_ids import canonical_av_prompt_ids
    from nla.rl.config import RLConfig
    from nla.rl.loop import RLData, reward_items, run_rl
    from nla.rl.roles.rollout import RolloutWorker
    from nla.rl.types import Rollout

    data = RLData.load(dg / "rl.parquet")
    rl_side = load_sidecar(dg / "rl.parquet")
    rows = torch.tensor([0, 1, 2])
    blocks = data.blocks_for(rows, rl_side)
    assert blocks.tolist() == read_parquet(dg / "rl.parquet").column("activation_layer").to_pylist()[:3]
    assert data.ar_inputs(["It rains.", None, "Hi."], rows, rl_side) == [
        f"Block {int(blocks[0])}. Explanation: It rains.\nSummary vector:", None,
        f"Block {int(blocks[2])}. Explanation: Hi.\nSummary vector:"]
    ro = Rollout(prompt_rows=rows, group=rows, vectors=data.vectors[rows], prompt_ids=torch.zeros(3, 2),
                 response_ids=torch.zeros(3, 1, dtype=torch.long), response_mask=torch.ones(3, 1, dtype=torch.long),
                 texts=["", "", ""], explanations=["It rains.", None, "Hi."], status=torch.tensor([0, 2, 0]))
    assert [t for t, _ in reward_items(ro, data, rl_side)] == [
        f"Block {int(blocks[0])}. Explanation: It rains.\nSummary vector:",
        f"Block {int(blocks[2])}. Explanation: Hi.\nSummary vector:"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(av.checkpoint_dir)
    worker = RolloutWorker(AutoModelForCausalLM.from_pretrained(av.checkpoint_dir), tok, load_sidecar(av.checkpoint_dir),
                           torch.device("cpu"))
    want = {k: canonical_av_prompt_ids(tok, [{"role": "user", "content": f"Explain the hidden state <<㈎>> of block {k} "
                                                                          "in a few short sentences."}]) for k in (0, 1)}
    assert worker.prompts_for(torch.tensor([1, 0, 1]), 3).tolist() == [want[1], want[0], want[1]]
    with pytest.raises(SidecarError, match=r"the rollout: block 3 is not one this pair was trained on"):
        worker.prompts_for(torch.tensor([0, 3]), 2)
    with pytest.raises(ValueError, match=r"needs a block for each of the 2 vectors; found None"):
        worker.prompts_for(None, 2)
    r = worker.generate(data.vectors[:2], torch.arange(2), 2, 6, blocks=torch.tensor([1, 0]))
    assert r.prompt_ids.tolist() == [want[1], want[1], want[0], want[0]]
    rl = run_rl(RLConfig.from_dict(dict(
        av=str(av.checkpoint_dir), ar=str(ar.checkpoint_dir), dataset=str(dg / "rl.parquet"), out_dir=str(tmp_path / "rl"),
        steps=1, eval_every=1, eval_max_rows=4, threads=1, progress=False,
        rollout=dict(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=8),
        optimiser=dict(lr=1e-5, micro_batch_size=4),
        reconstructor=dict(replay_dataset=str(dg / "ar_sft.parquet"), replay_fraction=0.5),
        checkpointing=dict(save_every=1, keep_last=1))))
    for role in ("av", "ar"):
        assert load_sidecar(rl.checkpoint_dir / role).layers == (0, 1)
    # the step-0 guard read the AR texts of the rows' blocks through both paddings (the tiny AV writes no
    # explanation yet, so the rewards are the failure cost; reward_items above is what the AR scores)
    assert rl.metrics["step0_guard_diff"] < 1e-4
    # a pair of one block and a pair of several do not mix
    from nla.client import NLAClient, NLAClientError
    from nla.rl.setup import RLSetupError, load_pair_sidecars

    one = tmp_path / "one"
    run(_cfg(one, tiny_model_dir("llama"), layer_index=1))
    ar_one = train_ar(ARTrainConfig(dataset=str(one / "out" / "ar_sft.parquet"), out_dir=str(tmp_path / "ar1"), lr=1e-4,
                                    max_length=80, **common))
    with pytest.raises(RLSetupError, match=r"layers: the AV sidecar reads blocks \(0, 1\) but the AR sidecar None"):
        load_pair_sidecars(av.checkpoint_dir, ar_one.checkpoint_dir)
    with pytest.raises(NLAClientError, match=r"layers: the AV reads blocks \(0, 1\) but the AR None"):
        NLAClient(str(av.checkpoint_dir), str(ar_one.checkpoint_dir))
    # the client takes a block a vector: the AR reads each text with its block named
    client = NLAClient(str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar"))
    vecs = data.vectors[:3]
    texts = ["It rains.", "The dog sings.", None]
    got = client.score(texts, vecs, layer=[0, 1, 1])
    want = client.reconstruct(["It rains.", "The dog sings."], layer=[0, 1])
    ar_model = client.ar
    from nla.core.reconstructor import tokenize_ar_texts

    enc = tokenize_ar_texts(client.ar_tokenizer, ["Block 0. Explanation: It rains.\nSummary vector:",
                                                  "Block 1. Explanation: The dog sings.\nSummary vector:"], 80)
    with torch.no_grad():
        direct = ar_model.predict(enc["input_ids"], enc["attention_mask"]).float()
    torch.testing.assert_close(want, direct)
    torch.testing.assert_close(got.predictions[:2], direct)
    assert got.failed.tolist() == [False, False, True]
    assert not torch.allclose(client.reconstruct(["It rains."], layer=1), direct[:1])  # the block is read
    for call, message in ((lambda: client.score(texts, vecs), r"score: this pair reads several blocks \(\[0, 1\]"),
                          (lambda: client.verbalize(vecs, layer=3), r"verbalize: block 3 is not one this pair was trained"),
                          (lambda: client.verbalize(vecs, layer=[0, 1]), r"verbalize: layer holds 2 blocks for 3 vectors"),
                          (lambda: client.score(texts, vecs, layer=[0, 1, True]), r"layer: expected block numbers")):
        with pytest.raises(NLAClientError, match=message):
            call()
    # a subject's raw vectors into the pair's space and back, each minus / plus its block's offset
    raw = torch.ones(3, vecs.shape[1])
    want_space = raw - torch.tensor([offsets[1], offsets[0], offsets[1]])
    torch.testing.assert_close(client.to_pair_space(raw, layer=[1, 0, 1]), want_space, rtol=0, atol=0)
    torch.testing.assert_close(client.from_pair_space(want_space, layer=[1, 0, 1]), raw)
    with pytest.raises(SidecarError, match=r"to_pair_space: this pair reads several blocks"):
        client.to_pair_space(raw)
    verbs = client.verbalize(vecs, layer=[1, 0, 1], max_new_tokens=4)
    assert [v.row for v in verbs] == [0, 1, 2]
    # nla verbalize and nla score read each row's block from a parquet's activation_layer; --layer names one for
    # every vector (a .npy says none: refused, as is a parquet without the column)
    import json

    from nla.cli import main
    from nla.client import load_vectors

    rl_pq = dg / "rl.parquet"
    column = read_parquet(rl_pq).column("activation_layer").to_pylist()[:6]
    assert sorted(set(column)) == [0, 1]  # both blocks among the rows read
    raw6 = load_vectors(rl_pq, rows=6)
    av_dir, ar_dir = str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar")

    def cli_out(*argv: str) -> list[dict]:
        out = tmp_path / "cli.jsonl"
        assert main([*argv, "--device", "cpu", "--out", str(out)]) == 0
        return [json.loads(line) for line in out.read_text().splitlines()]

    verb = ["verbalize", "--av", av_dir, "--max-new-tokens", "4"]
    own = cli_out(*verb, "--vectors", str(rl_pq), "--rows", "6")
    assert [v["text"] for v in own] == [v.text for v in client.verbalize(raw6, layer=column, max_new_tokens=4)]
    zero = cli_out(*verb, "--vectors", str(rl_pq), "--rows", "6", "--layer", "0")
    assert [v["text"] for v in zero] == [v.text for v in client.verbalize(raw6, layer=0, max_new_tokens=4)]
    texts6 = ["It rains.", "The dog sings.", "Hi.", "It rains.", "A cat.", "Hi."]
    (tmp_path / "t.txt").write_text("\n".join(texts6) + "\n")
    score = ["score", "--ar", ar_dir, "--texts", str(tmp_path / "t.txt"), "--rows", "6"]
    for extra, layer in (((), column), (("--layer", "1"), 1)):
        got6 = [r["mse_nrm"] for r in cli_out(*score, "--vectors", str(rl_pq), *extra)]
        assert got6 == pytest.approx(client.score(texts6, raw6, layer=layer).mse_nrm.tolist(), rel=1e-6)
    assert got6 != pytest.approx([r["mse_nrm"] for r in cli_out(*score, "--vectors", str(rl_pq))], rel=1e-6)
    np.save(tmp_path / "v6.npy", raw6)
    pa_pq = tmp_path / "no_blocks.parquet"
    import pyarrow.parquet as pq

    six = read_parquet(rl_pq).slice(0, 6)
    pq.write_table(six.drop(["activation_layer"]), pa_pq)
    holed = tmp_path / "holed.parquet"
    pq.write_table(six.set_column(six.column_names.index("activation_layer"), "activation_layer",
                                  pa.array([*column[:2], None, *column[3:]], pa.int64())), holed)
    capsys.readouterr()
    for argv, message in (
            ((*verb, "--vectors", str(tmp_path / "v6.npy")),
             "a .npy does not say which block its vectors come from; give --layer K (one of [0, 1])"),
            ((*score, "--vectors", str(tmp_path / "v6.npy")), "a .npy does not say which block"),
            ((*verb, "--vectors", str(pa_pq)), "but it has no activation_layer column; give --layer K (one of [0, 1])"),
            ((*verb, "--vectors", str(holed)), f"--vectors {holed}: row 2: activation_layer is None, expected a block "
                                                "number (one of [0, 1])"),
            ((*verb, "--vectors", str(rl_pq), "--layer", "3"), "verbalize: block 3 is not one this pair was trained on"),
            ((*verb, "--vectors", str(rl_pq), "--reference", str(rl_pq), "--directions"),
             "--directions: this pair reads several blocks ([0, 1], extraction.layers); give --layer K")):
        assert main([*argv, "--device", "cpu"]) == 2
        assert message in capsys.readouterr().err, argv
    # --directions places each direction by the --reference rows of its block only
    from nla.eval.suite import verbalize_directions

    ref = read_parquet(rl_pq)
    ref_raw, ref_blocks = load_vectors(rl_pq), np.asarray(ref.column("activation_layer").to_pylist())
    dirs = cli_out(*verb, "--vectors", str(tmp_path / "v6.npy"), "--rows", "2", "--reference", str(rl_pq),
                   "--directions", "--layer", "0")
    want_dirs, _ = verbalize_directions(client, torch.from_numpy(raw6[:2]), torch.from_numpy(ref_raw[ref_blocks == 0]),
                                        layer=0, max_new_tokens=4)
    assert [v["text"] for v in dirs] == [v.text for v in want_dirs]
    # nla eval reports each block against its own baseline
    from nla.core.vectors import fve_of_mse, predict_mean_baselines
    from nla.eval.evaluate import ROW_ROUND_TRIP, evaluate_pair

    report = evaluate_pair(client, dg / "rl.parquet", max_new_tokens=4, n_show=0)
    blocks_all = read_parquet(dg / "rl.parquet").column("activation_layer").to_pylist()
    assert sorted(report.by_block) == [0, 1]
    gold = data.vectors
    for k in (0, 1):
        rows_k = [i for i, b in enumerate(blocks_all) if b == k]
        cell = report.by_block[k][ROW_ROUND_TRIP]
        assert cell["n"] == len(rows_k)
        # every tiny-AV explanation fails: each row is charged the failure cost, whose FVE is derived by hand
        from nla.core.reward import failed_mse

        charged = failed_mse(gold[rows_k], client.ar_sidecar.mse_scale_value())
        base = predict_mean_baselines(gold[rows_k], client.ar_sidecar.mse_scale_value())
        assert cell["fve"] == pytest.approx(fve_of_mse(charged, base.raw_mean), rel=1e-6)
    assert "## By block" in report.to_markdown() and report.to_dict()["by_block"]
    # nla serve over real HTTP: /info names the blocks, /verbalize and /score take them as the client does
    import httpx

    from nla.serve import ServeLimits
    from nla.serve.app import NLAService, create_app
    from nla.util.http import LOOPBACK, BackgroundServer

    service = NLAService.load(str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar"), device="cpu",
                              limits=ServeLimits(max_new_tokens=16, max_prompt_tokens=256))
    try:
        with BackgroundServer(create_app(service, allowed_hosts=list(LOOPBACK))) as srv:
            assert httpx.get(f"{srv.url}/info", timeout=60).json()["layers"] == [0, 1]
            body = {"texts": ["It rains.", "The dog sings.", None], "vectors": vecs.tolist(), "layer": [0, 1, 1]}
            res = httpx.post(f"{srv.url}/score", json=body, timeout=60).json()["results"]
            assert [r["mse_nrm"] for r in res[:2]] == pytest.approx(got.mse_nrm[:2].tolist(), rel=1e-5)
            bad = httpx.post(f"{srv.url}/score", json={**body, "layer": 2}, timeout=60)
            assert bad.status_code == 400 and "block 2 is not one this pair was trained on" in bad.text, bad.text
            none = httpx.post(f"{srv.url}/verbalize", json={"vectors": vecs.tolist(), "max_new_tokens": 4}, timeout=60)
            assert none.status_code == 400 and "this pair reads several blocks" in none.text, none.text
            ok = httpx.post(f"{srv.url}/verbalize", json={"vectors": vecs.tolist(), "max_new_tokens": 4,
                                                          "layer": [1, 0, 1]}, timeout=120).json()["results"]
            assert [r["text"] for r in ok] == [v.text for v in verbs]
    finally:
        service.close()
    # the suite runs a block at a time: that block's rows of the dataset, every call at that block. Its FVE as
    # written is nla eval's FVE of the block (each block against its own baseline), made by eval's other path:
    # all rows read at once with their blocks, split afterwards
    from nla.eval.evaluate import ROW_ROUND_TRIP, evaluate_pair
    from nla.eval.suite.run import run_suite, run_suite_by_block

    with pytest.raises(NLAClientError, match=r"suite: the pair reads several blocks \(\[0, 1\]\) and the suite reads "
                                             r"one at a time: give layer=K"):
        run_suite(client, rl_pq)
    with pytest.raises(NLAClientError, match=r"at_block: block 3 is not one this pair was trained on"):
        run_suite(client, rl_pq, layer=3)
    import shutil

    from nla.core.sidecar import sidecar_path_for

    shutil.copy(sidecar_path_for(rl_pq), sidecar_path_for(pa_pq))  # a dataset with its sidecar, without the column
    with pytest.raises(NLAClientError, match=r"has no activation_layer column, but the pair reads several blocks"):
        run_suite(client, pa_pq, layer=0)
    ev = evaluate_pair(client, rl_pq, max_new_tokens=4, text_explainer_baseline=False, n_show=0)
    all_blocks = np.asarray(read_parquet(rl_pq).column("activation_layer").to_pylist())
    kw = dict(parts=("hidden_code",), max_new_tokens=4)
    each = run_suite_by_block(client, rl_pq, **kw)
    assert list(each.reports) == [0, 1]
    for k, rep in each.reports.items():
        assert (rep.block, rep.n_rows) == (k, int((all_blocks == k).sum()))
        assert rep.sections["hidden_code"]["fve"] == pytest.approx(ev.by_block[k][ROW_ROUND_TRIP]["fve"], rel=1e-5)
        assert rep.to_dict() == run_suite(client, rl_pq, layer=k, **kw).to_dict()  # one block alone: the same
    md = each.to_markdown()
    assert (f"| test | block 0 ({each.reports[0].n_rows} rows) | block 1 ({each.reports[1].n_rows} rows) | target |"
            in md)
    assert f"## Does it explain? (block 1: {each.reports[1].n_rows} rows of {rl_pq}, seed 0)" in md
    # max_rows: a seeded subset of the block's own rows (the parquet's row numbers kept in the samples)
    three = run_suite(client, rl_pq, layer=1, parts=("claims",), max_new_tokens=4, max_rows=3, n_show=3)
    rng = np.random.default_rng(0)
    want_rows = np.sort(rng.choice(np.flatnonzero(all_blocks == 1), size=3, replace=False)).tolist()
    assert three.n_rows == 3 and [smp["row"] for smp in three.samples] == want_rows
    # nla eval --suite: every block, each its own report in one suite.json; --layer K that block alone
    ev_args = ["eval", "--av", av_dir, "--ar", ar_dir, "--dataset", str(rl_pq), "--suite", "hidden_code",
               "--max-new-tokens", "4", "--device", "cpu"]
    assert main([*ev_args, "--out", str(tmp_path / "suite_all")]) == 0
    got = json.loads((tmp_path / "suite_all" / "suite.json").read_text())
    assert got == json.loads(each.to_json())
    assert main([*ev_args, "--layer", "1", "--out", str(tmp_path / "suite_1")]) == 0
    assert json.loads((tmp_path / "suite_1" / "suite.json").read_text()) == json.loads(each.reports[1].to_json())
    capsys.readouterr()
    assert main(["eval", "--av", av_dir, "--ar", ar_dir, "--dataset", str(rl_pq), "--layer", "1", "--device", "cpu"]) == 2
    assert "--layer: only the suite is run a block at a time" in capsys.readouterr().err
    # the view a block at a time: calls that name no block get it, calls that name one keep it
    at1 = client.at_block(1)
    torch.testing.assert_close(at1.reconstruct(["It rains."]), client.reconstruct(["It rains."], layer=1))
    torch.testing.assert_close(at1.reconstruct(["It rains."], layer=0), client.reconstruct(["It rains."], layer=0))
    assert at1.d_model == client.d_model and at1.ar_sidecar is client.ar_sidecar
    # the explorer reads the block a request names (the deepest when none): that block's output at the token,
    # verbalized and scored with the block named, as the client does
    from starlette.testclient import TestClient

    from nla.core.activations import block_outputs
    from nla.explore import Explorer, create_app
    from nla.util.http import RequestError

    ex = Explorer.load(str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar"))
    assert (ex.info()["layers"], ex.info()["layer_index"]) == ([0, 1], 1)
    inp = ex.text_input(text="the dog sings")
    ids = torch.tensor([inp.ids])
    texts = {}
    for k in (0, 1):
        # the block's output minus the block's own offset (the data was centred a block at a time)
        vec = block_outputs(ex.model, ids, torch.ones_like(ids), k)[0].float()[1:2] - torch.tensor(offsets[k])
        torch.testing.assert_close(ex.activations(inp, k)[1:2], vec, rtol=0, atol=0)
        got = ex.explain(inp, positions=[1], layer=k, max_new_tokens=4)[0]
        want = ex.client.verbalize(vec, layer=k, max_new_tokens=4)[0]
        assert got["layer"] == k and got["greedy"]["text"] == want.text
        texts[k] = got["greedy"]["text"]
    assert ex.explain(inp, positions=[1], max_new_tokens=4)[0]["greedy"]["text"] == texts[1]  # the deepest
    with pytest.raises(RequestError, match=r"layer: block 3 is not one this pair was trained on; it reads blocks 0, 1"):
        ex.explain(inp, positions=[1], layer=3)
    api = TestClient(create_app(ex))
    assert api.get("/api/info").json()["layers"] == [0, 1]
    res = api.post("/api/explain", json={"text": "the dog sings", "positions": [1], "layer": 0, "max_new_tokens": 4})
    assert res.status_code == 200 and res.json()["results"][0]["greedy"]["text"] == texts[0]
    bad = api.post("/api/explain", json={"text": "the dog sings", "positions": [1], "layer": 2})
    assert bad.status_code == 400 and "block 2 is not one this pair was trained on" in bad.text, bad.text
    own = api.post("/api/score", json={"text": "the dog sings", "position": 1, "layer": 0, "texts": ["It rains."]})
    want = ex.client.score(["It rains."], ex.activations(inp, 0)[1:2], layer=0)
    assert own.json()["results"][0]["mse_nrm"] == pytest.approx(float(want.mse_nrm[0]), rel=1e-6)


def test_a_block_is_written_zero_padded_to_the_deepest_ones_digits():
    side = _layered_sidecar(layers=(3, 10))
    assert side.ar_text("x", layer=3) == "Block 03. Explanation: x\nSummary vector:"
    assert side.ar_text("x", layer=10) == "Block 10. Explanation: x\nSummary vector:"
    assert _layered_sidecar().ar_text("x", layer=2) == "Block 2. Explanation: x\nSummary vector:"


def test_an_ar_text_names_its_block_back():
    """``ar_text_layer`` inverts ``ar_text``: an AR reading each row at its own block takes the block from it."""
    side = _layered_sidecar(layers=(3, 10))
    assert [side.ar_text_layer(side.ar_text(e, layer=k)) for e, k in
            (("x", 3), ("Block 10. Explanation: y", 10), ("", 3))] == [3, 10, 3]
    world = _layered_sidecar(ar_template="{layer} Explanation: {explanation}\nSummary vector:", layers=(0, 1, 2, 3))
    assert world.ar_text_layer("2 Explanation: Bob has a kite.\nSummary vector:") == 2
    with pytest.raises(ValueError, match=r"ar_text_layer: 'Block 3. Explanation: x\\nSummary vector:' is no block's AR "
                                         r"text of this pair \(template .*, blocks \[3, 10\]\); give texts made by"):
        side.ar_text_layer("Block 3. Explanation: x\nSummary vector:")  # 03, zero-padded, is block 3's
    with pytest.raises(ValueError, match="this pair reads one block"):
        _layered_sidecar(layers=None, layer_index=2, ar_template="Explanation: {explanation}\nSummary vector:"
                         ).ar_text_layer("Explanation: x\nSummary vector:")


def test_claims_true_counts_the_facts_claimed_not_the_rows_that_claim_nothing():
    """Per-row precision charges a row that claims nothing where something holds 0; the by-block table's
    claims_true is the share of claimed facts that are true (derived by hand)."""
    from types import SimpleNamespace

    from nla.core.graders import get_grader
    from nla.eval.evaluate import _claims_true

    ev = SimpleNamespace(grader=get_grader("world"),
                         facts=[["person=alice"], ["person=bruno", "place=park"], ["time=night"], ["mood=happy"]])
    texts = ["Alice is one of the characters.", "The scene is set at the park. Hugo is one of the characters.",
             None, "The text has only just begun."]
    assert _claims_true(ev, texts, np.arange(4)) == pytest.approx(2 / 3)  # alice, park true; hugo false
    assert _claims_true(ev, [None, None], np.arange(2)) is None  # nothing claimed


# ---------------------------------------------------------------- the quickstart's pair for several blocks


def test_the_quickstart_refuses_several_blocks_where_they_are_not_built(tmp_path):
    from nla.quickstart import QuickstartError, run_quickstart

    layers = ["datagen.layers=[0, 1, 2, 3]"]
    for kw, why in ((dict(preset="default", settings=layers, pair_world="default-d64"), "--pair-world default-d64"),
                    (dict(preset="default", settings=layers, injection_adapter="affine"), "--injection-adapter affine"),
                    (dict(preset="layers", backend="ray"), "--backend ray")):
        with pytest.raises(QuickstartError, match=r"datagen\.layers: \[.*\]: a pair for several blocks is not built "
                                                  rf"for {why}.*datagen\.layer_index=K"):
            run_quickstart(out=tmp_path / "run", **kw)
        assert not (tmp_path / "run").exists()  # refused before any work


def test_the_layers_preset_is_the_default_at_four_blocks_and_1_6x_the_steps():
    from nla.quickstart import PRESETS

    d, p = PRESETS["default"], PRESETS["layers"]
    assert p.datagen["layers"] == [0, 1, 2, 3] and p.datagen["world_explainer"]["fact_min_prob"] == 0.5
    # the data explainer as measured against one-block pairs of it: every held fact (the default's fact_rate 1.0),
    # no wrong one (the default's wrong_rate is 0.1), an unheld fact left out
    assert d.datagen["world_explainer"]["fact_rate"] == 1.0 and d.datagen["world_explainer"]["wrong_rate"] == 0.1
    assert p.datagen["world_explainer"] == {**d.datagen["world_explainer"], "wrong_rate": 0.0, "fact_min_prob": 0.5,
                                            "fact_unheld": "omit", "fact_gate_below": None}
    assert {k: v for k, v in p.datagen.items() if k not in ("layers", "av_template", "ar_template")} == \
        {**d.datagen, "world_explainer": p.datagen["world_explainer"]}
    # each row's block named as a bare number (measured: 2 of the world tokenizer's tokens, not 7 and 8)
    assert p.datagen["av_template"] == "Explain the hidden state <<{injection_char}>> {layer} in a few short sentences."
    assert p.datagen["ar_template"] == "{layer} Explanation: {explanation}\nSummary vector:"
    assert "av_template" not in d.datagen and "ar_template" not in d.datagen
    # 800, 1500 (the default's AV then), 100 x 1.6
    assert (p.ar["max_steps"], p.av["max_steps"], p.rl["steps"]) == (1280, 2400, 160)
    # its AR reads each row at its own block (measured on three seeds); otherwise the default's AR
    assert p.ar["exits"] is True and "exits" not in d.ar
    assert {k: v for k, v in p.ar.items() if k not in ("max_steps", "eval_every", "save_every", "exits")} == \
        {k: v for k, v in d.ar.items() if k not in ("max_steps", "eval_every", "save_every")}
    assert {k: v for k, v in p.av.items() if k not in ("max_steps", "eval_every", "save_every")} == \
        {k: v for k, v in d.av.items() if k not in ("max_steps", "eval_every", "save_every")}


def test_block_tables_set_each_blocks_figures_beside_its_probe():
    from nla.eval.evaluate import ROW_ORACLE, ROW_ROUND_TRIP
    from nla.eval.report import block_summary, block_tables, kind_cells

    def ev(fve0, fve1):
        return {"by_block": {"0": {ROW_ROUND_TRIP: {"n": 4, "fve": fve0, "recall": 0.25, "precision": 1.0,
                                                    "claims_true": 1.0, "by_kind": {"person": [0.5, 1.0]},
                                                    "said": {"person": [2, 1.0]}},
                                   ROW_ORACLE: {"n": 4, "fve": 0.5}},
                             "1": {ROW_ROUND_TRIP: {"n": 4, "fve": fve1, "recall": 0.75, "precision": 0.5,
                                                    "claims_true": None, "by_kind": {"person": [1.0, 0.5],
                                                                                     "other": [1.0, 0.0]},
                                                    "said": {"person": [4, 0.5]}, "stale": {"person": 0.25}}}}}

    probe = {"layers": [{"layer": 0, "mean_top1": 0.3, "kinds": [{"kind": "person", "top1": 0.4, "recall_top1": 0.35,
                                                                  "recall_p90": 0.3}]},
                        {"layer": 1, "mean_top1": 0.8, "kinds": [{"kind": "person", "top1": 0.9, "recall_top1": 0.95,
                                                                  "recall_p90": 0.6}]}]}
    s = block_summary(ev(0.1, 0.2), ev(0.3, 0.4), probe)
    assert list(s) == [0, 1]
    assert s[0] == {"rows": 4, "fve_warmstart": 0.1, "fve_rl": 0.3, "oracle_fve_rl": 0.5, "recall_rl": 0.25,
                    "precision_rl": 1.0, "claims_true_rl": 1.0, "by_kind_rl": {"person": [0.5, 1.0]},
                    "said_by_kind_rl": {"person": [2, 1.0]}, "stale_by_kind_rl": {}, "probe_mean_top1": 0.3,
                    "probe_by_kind": {"person": 0.4},
                    "probe_recall_top1_by_kind": {"person": 0.35}, "probe_recall_p90_by_kind": {"person": 0.3}}
    assert s[1]["oracle_fve_rl"] is None and s[1]["probe_by_kind"] == {"person": 0.9}
    assert s[1]["stale_by_kind_rl"] == {"person": 0.25}  # of its 4 person claims, 1 said of the past
    # a share that rounds to 0.00 is not written
    tiny = block_tables({k: {**b, "stale_by_kind_rl": {"person": 0.004}} for k, b in s.items()})
    assert "earlier" not in "\n".join(tiny[4:])
    # Block 0: recall 0.50, all its claims true: within 0.10 of the top-1 (0.40), 0.15 from it as fact recall
    # (0.35), over the reader at 0.90 true (0.30). Block 1: half its claims false, so no rule meets it.
    assert kind_cells(s) == {"cells": 2, "top1": 1, "top1_recall": 0, "p90": 1, "claims_true": 1,
                             "misses": {"top1": ["person@1"], "top1_recall": ["person@0", "person@1"],
                                        "p90": ["person@1"]}}
    lines = block_tables(s)
    assert lines[2] == "| 0 | 4 | 0.30 | 0.100 | 0.300 | 0.500 | 0.25 | 1.00 | 1.00 |"
    assert lines[3] == "| 1 | 4 | 0.80 | 0.200 | 0.400 | – | 0.75 | 0.50 | – |"
    # "other" (no claim form: its recall means nothing) is not a row; person once, each block beside its probe
    text = "\n".join(lines)
    assert ("| person | 0.40 (0.35; 0.30) · 0.50 / 1.00 · 1.00 | 0.90 (0.95; 0.60) · 1.00 / 0.50 · 0.50 (0.25 "
            "earlier) |") in lines
    assert "(in brackets, the share false but said earlier in the text read" in text
    assert "other" not in text
    assert ("against the probe's top-1, **1 of 2**; against it as fact recall, **0 of 2**; at least the reader's at "
            "0.90 true less 0.10, **1 of 2**. Claims ≥ 0.90 true (or none made) in 1 of 2 cells.") in text
    assert lines[-1] == "Missed at 0.90 true: person@1."
    # a probe written before recall_top1 / recall_p90 were measured: those rules are not counted, not failed
    old = {"layers": [{"layer": k, "mean_top1": 0.5, "kinds": [{"kind": "person", "top1": 0.5}]} for k in (0, 1)]}
    c = kind_cells(block_summary(ev(0.1, 0.2), ev(0.3, 0.4), old))
    assert (c["top1"], c["top1_recall"], c["p90"]) == (1, None, None) and set(c["misses"]) == {"top1"}
    assert "not measured (a probe written before it)" in "\n".join(block_tables(block_summary(ev(0, 0), ev(0, 0), old)))
    assert block_summary({"rows": []}, {"rows": []}) == {} and block_tables({}) == [] and kind_cells({}) == {}


def test_the_quickstart_runs_a_pair_for_two_blocks_and_reports_each(tiny_quickstart_run, tmp_path):
    """The tiny preset at blocks 0 and 1, its world and probe taken from the shared tiny run (the same
    configs: cached stages), a few steps a stage: every stage runs on the rows of both blocks, the
    report has each block's figures beside the probe at that block, and the suite runs a block at a time."""
    import json
    import shutil
    import subprocess
    import sys

    from conftest import user_environment

    from nla.eval.evaluate import ROW_ROUND_TRIP

    out = tmp_path / "run"
    out.mkdir()
    for name in ("world.stage_done.json", "probe.stage_done.json", "probe.json"):
        shutil.copy(tiny_quickstart_run / name, out / name)
    short = {f"{role}.{k}": 10 for role in ("ar", "av") for k in ("max_steps", "eval_every", "save_every")}
    settings = ["datagen.layers=[0, 1]", "datagen.n_docs=200", "ar.exits=true", "ar.warmup_steps=0", "av.warmup_steps=0",
                "av.smoke_num=0", "rl.steps=2", "rl.eval_every=2", "rl.checkpointing.save_every=2",
                "rl.rollout.rollout_batch_size=2", "rl.rollout.n_samples_per_prompt=2", "rl.optimiser.micro_batch_size=4",
                "eval_max_rows=8", *(f"{k}={v}" for k, v in short.items())]
    threads = json.loads((out / "world.stage_done.json").read_text())["config"]["threads"]  # the shared run's
    # a process of its own, as the shared run was made (here earlier tests have chosen the CPU paths)
    proc = subprocess.run([sys.executable, "-m", "nla.cli", "quickstart", "--preset", "tiny", "--out", str(out),
                           "--no-progress", "--threads", str(threads), *(a for x in settings for a in ("--set", x))],
                          env=user_environment(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    suite = json.loads((out / "suite" / "suite.json").read_text())
    assert report["suite"] == suite and sorted(suite["by_block"]) == ["0", "1"]
    for k, one in suite["by_block"].items():  # the tiny preset's 24 held-out rows of each block (or all it has)
        held_out = read_parquet(one["dataset"]).column("activation_layer").to_pylist()
        assert one["block"] == int(k) and one["n_rows"] == min(24, held_out.count(int(k))) >= 2
        for t in one["targets"]:
            assert report["headline"][f"suite_block{k}_{t['section']}_{t['key']}"] == t["value"]
    assert [s["name"] for s in report["stages"]][:2] == ["world", "probe"]  # reused, not rebuilt
    assert all(s["cached"] for s in report["stages"][:2])
    blocks = report["headline"]["by_block"]
    probe = {r["layer"]: r for r in json.loads((out / "probe.json").read_text())["layers"]}
    assert sorted(blocks) == ["0", "1"]
    for k, b in blocks.items():
        cell = report["eval_rl"]["by_block"][k][ROW_ROUND_TRIP]
        assert b["fve_rl"] == cell["fve"] and b["rows"] == cell["n"] and b["recall_rl"] == cell["recall"]
        assert b["probe_by_kind"] == {p["kind"]: p["top1"] for p in probe[int(k)]["kinds"]}
    md = (out / "report.md").read_text()
    assert "### By block" in md and "| block | rows | probe mean top-1 |" in md
    assert "the probe: a linear probe of each kind at that block on held-out stories" in md  # the world's probe ran
    assert "The explanation suite (`nla eval --suite`; docs/suite.md) a block at a time" in md
    assert (f"| test | block 0 ({suite['by_block']['0']['n_rows']} rows) | block 1 "
            f"({suite['by_block']['1']['n_rows']} rows) | target |") in md
    (last,) = sorted((out / "rl" / "checkpoints").glob("step_*"))
    for role in ("av", "ar"):
        assert load_sidecar(last / role).layers == (0, 1)
    # ar.exits: the warm-start AR and RL's read each row at its own block (both after block 1 here, the
    # shallowest's exit), a head a block, trained apart (RL's update of them: tests/test_ar_exits.py)
    import torch
    from safetensors import safe_open

    from nla.core.reconstructor import EXIT_HEADS_FILE

    (warm,) = sorted((out / "ar" / "checkpoints").glob("step_*"))
    heads = {}
    for where in (warm, last / "ar"):
        with safe_open(str(where / EXIT_HEADS_FILE), framework="pt") as f:
            assert json.loads(f.metadata()["read_after"]) == {"0": 1, "1": 1}
            heads[where] = {k: f.get_tensor(k) for k in f.keys()}
    assert not torch.equal(heads[warm]["0"], heads[warm]["1"])
    assert not torch.equal(heads[last / "ar"]["0"], heads[last / "ar"]["1"])
    # dev/experiments/layers_cost.py on this run against the shared one-block run: each stage's seconds are the
    # runs' own, and the pair's AV prompt is longer than the one-block's by exactly its block clause's tokens
    from transformers import AutoTokenizer

    from dev.experiments import layers_cost

    for d in (out, tiny_quickstart_run):
        assert layers_cost.stage_seconds(d) == {
            s: json.loads((d / f"{s}.stage_done.json").read_text())["seconds"] for s in ("datagen", "ar", "av", "rl")}
    pair, one = layers_cost.av_tokens(out, 20), layers_cost.av_tokens(tiny_quickstart_run, 20)
    tok = AutoTokenizer.from_pretrained(str(last / "av"))
    clause = len(tok(" of block 0", add_special_tokens=False)["input_ids"])  # the world's BPE splits at spaces
    assert clause > 1 and pair["prompt"] - one["prompt"] == clause
    assert (pair["steps"], one["steps"]) == (10, 400) and pair["padded"] >= pair["row"] and one["padded"] >= one["row"]
    assert layers_cost.rl_split(out)["steps"] == 2
    layers_cost.main([str(out), str(tiny_quickstart_run), "--batches", "5"])
    # dev/experiments/ar_exits.py's readers before training: a head a block (identity) on the deep reading is nla's
    # AR; read after a row's own block, a row of the deepest block is read as nla's AR reads it, another is not;
    # the shallowest block read after the next one (here the deepest) is nla's AR too
    import torch

    from dev.experiments import ar_exits

    cfg = yaml.safe_load((sorted((out / "ar" / "checkpoints").glob("step_*"))[-1] / "train_config.yaml").read_text())
    data = out / "datagen" / "ar_sft.parquet"
    tab = read_parquet(data)
    texts, blocks = tab.column("prompt").to_pylist(), np.asarray(tab.column("activation_layer").to_pylist())
    rows = np.concatenate([np.flatnonzero(blocks == 0)[:6], np.flatnonzero(blocks == 1)[:6]])
    with torch.no_grad():
        deep, exits, heads, exits2 = (ar_exits.reader(v, load_sidecar(data), cfg, texts, blocks, [0, 1])[2](rows)
                                      for v in ("deep", "exits", "heads", "exits2"))
    top = torch.from_numpy(blocks[rows] == 1)
    torch.testing.assert_close(heads, deep, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(exits2, deep, rtol=1e-4, atol=1e-5)  # block 0's rows read after block 1: the deepest
    torch.testing.assert_close(exits[top], deep[top], rtol=1e-4, atol=1e-5)
    assert (exits[~top] - deep[~top]).abs().max() > 0.1
    threads = torch.get_num_threads()
    try:  # the script sets the run's thread count, as its own process would; later tests keep theirs
        ar_exits.main([str(out), "--out", str(tmp_path / "arx"), "--steps", "2", "--eval-every", "1"])
    finally:
        torch.set_num_threads(threads)
    got = json.loads((tmp_path / "arx" / "ar_exits.json").read_text())
    assert [len(got["variants"][v]["curve"]) for v in ("deep", "exits")] == [2, 2] and got["exits_block_work"] == 0.75
    assert got["exits2_block_work"] == 1.0
    assert all(set(c["fve_by_block"]) == {"0", "1"} for v in got["variants"].values() for c in v["curve"])
