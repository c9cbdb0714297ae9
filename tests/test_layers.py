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
    with pytest.raises(ValueError, match="DatagenConfig.center: expected false when layers is set"):
        _cfg(tmp_path, model, layers=[0, 1], center=True)
    assert _cfg(tmp_path, model, layers=[0, 1], layer_index=1).layers == (0, 1)
    # a block the model has not: refused before any document is read
    from nla.datagen.io import DatagenError

    with pytest.raises(DatagenError, match=r"layer_index 7 is out of range: the model has 4 decoder blocks, valid range 0..3"):
        run(_cfg(tmp_path / "bad", model, layers=[0, 7]))


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
    side = _layered_sidecar(layer_norms={0: 1.5, 2: 30.25})
    write_sidecar(tmp_path, side)
    assert load_sidecar(tmp_path) == side.replace(mse_scale=2.0)  # written as the number: sqrt(d_model 4)
    assert load_sidecar(tmp_path).layer_norms == {0: 1.5, 2: 30.25}


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


def test_both_warm_starts_train_on_rows_of_several_blocks(tmp_path, tiny_model_dir):
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.train.config import ARTrainConfig, AVTrainConfig

    run(_cfg(tmp_path, tiny_model_dir("llama"), layers=[0, 1]))
    dg = tmp_path / "out"
    common = dict(warmup_steps=0, max_steps=1, eval_every=1, save_every=1, batch_size=4, threads=1, progress=False,
                  tensorboard=False)
    ar = train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar"), lr=1e-4,
                                max_length=80, shuffle_sentences=True, **common))
    av = train_av(AVTrainConfig(dataset=str(dg / "av_sft.parquet"), out_dir=str(tmp_path / "av"), lr=1e-4,
                                max_length=128, smoke_num=1, **common))
    for ckpt, role in ((ar.checkpoint_dir, "ar"), (av.checkpoint_dir, "av")):
        side = load_sidecar(ckpt)
        assert (side.role, side.layers, side.layer_index) == (role, (0, 1), 1)
    from nla.core import arch
    from nla.core.reconstructor import Reconstructor

    assert len(arch.decoder_layers(Reconstructor.from_pretrained(ar.checkpoint_dir).base)) == 2  # blocks 0..1
    # what does not read several blocks yet refuses the pair by name, never reads it as one block
    from nla.client import NLAClient, NLAClientError
    from nla.rl.setup import RLSetupError, load_pair_sidecars

    with pytest.raises(RLSetupError, match=r"av: a pair of several blocks \(\[0, 1\], extraction.layers\); RL does not "
                                           r"train one yet"):
        load_pair_sidecars(av.checkpoint_dir, ar.checkpoint_dir)
    with pytest.raises(NLAClientError, match=r"the AV reads several blocks \(\[0, 1\], extraction.layers\); NLAClient "
                                             r"does not take a block per vector yet"):
        NLAClient(str(av.checkpoint_dir), None)
    with pytest.raises(NLAClientError, match=r"the AR reads several blocks"):
        NLAClient(None, str(ar.checkpoint_dir))
