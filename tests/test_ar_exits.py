"""An AR reading each row at its own block (``Reconstructor.set_exits``, issue 59): the stepwise path and the
hooked path against a plain reference, what rows run, the checkpoint, and the errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from nla.core.arch import decoder_layers
from nla.core.reconstructor import EXIT_HEADS_FILE, Reconstructor, last_token_index, tokenize_ar_texts

TEXTS = ["Explanation : cat walks", "Explanation : the dog runs to the river in the morning with Bob", "x",
         "Explanation : Bob runs", "the cat"]
BLOCKS = [0, 3, 1, 2, 0]


def _reference(ar: Reconstructor, ids, mask, blocks) -> torch.Tensor:
    """A plain forward with HF's hidden states, row i read after block max(b_i, 1) at its last real token,
    through head b_i: the definition, written the slow way."""
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    hs = ar.base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                 output_hidden_states=True).hidden_states  # [emb, block 0, ..., block K] (K's: the skipped norm)
    last = last_token_index(mask)
    rows = []
    for i, b in enumerate(blocks):
        r = max(b, 1)
        rows.append(ar.exit_heads[str(b)](hs[r + 1][i, last[i]]))
    return torch.stack(rows)


def _heads_apart(ar: Reconstructor) -> None:
    torch.manual_seed(1)
    with torch.no_grad():  # heads that differ, so a row read through another block's head shows
        for h in ar.exit_heads.values():
            h.weight.add_(0.05 * torch.randn_like(h.weight))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_exits_read_each_row_after_its_block_through_its_head(tiny_model_dir, tiny_tokenizer, arch, side,
                                                               single_thread):
    torch.manual_seed(0)
    ar = Reconstructor.from_base(tiny_model_dir(arch), 3).train()
    assert ar.set_exits([0, 1, 2, 3]) == {0: 1, 1: 1, 2: 2, 3: 3}
    # the heads start as the value head (the identity): "the stream after the block is the prediction"
    assert all(torch.equal(h.weight, ar.value_head.weight) for h in ar.exit_heads.values())
    _heads_apart(ar)
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, side)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    gold = torch.randn(len(TEXTS), ar.config.hidden_size)
    results = []
    for read in ("predict", "reference"):
        ar.zero_grad(set_to_none=True)
        pred = ar.predict(ids, mask, blocks=BLOCKS) if read == "predict" else _reference(ar, ids, mask, BLOCKS)
        ((pred - gold) ** 2).sum().backward()
        results.append((pred.detach(), {k: p.grad.clone() for k, p in ar.named_parameters() if p.grad is not None}))
    (p_ex, g_ex), (p_ref, g_ref) = results
    torch.testing.assert_close(p_ex, p_ref, rtol=1e-5, atol=1e-5)
    assert g_ex.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g_ex[k], g_ref[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    # Llama/Qwen2 run the blocks one by one, Gemma-3 (a sliding window on some blocks) the whole forward
    assert ar._exits_stepwise == (arch in ("llama", "qwen2"))


def test_rows_read_early_do_not_run_the_later_blocks(tiny_model_dir, tiny_tokenizer, single_thread):
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    ar.set_exits([0, 1, 2, 3])
    seen = {}
    for r, block in enumerate(decoder_layers(ar.base)):
        block.register_forward_pre_hook(lambda m, a, kw, r=r: seen.setdefault(r, []).append(
            (a[0] if a else kw["hidden_states"]).shape[0]), with_kwargs=True)
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, "left")
    with torch.no_grad():
        ar.predict(enc["input_ids"], enc["attention_mask"], blocks=BLOCKS)
    # block 0 is called by the model (5 rows, stopped at its input), then by the loop on every row (none is read
    # after it); a row is read at its exit at its last token only, not through the block's call: the rows of
    # blocks 0 and 1 (3) are read at block 1, so it runs the 2 others; block 2 the one of block 3; block 3 none
    assert seen == {0: [5, 5], 1: [2], 2: [1]}


def test_one_exit_at_k_equals_the_deep_ar(tiny_model_dir, tiny_tokenizer, single_thread):
    """Every block read after K through copies of the value head: the AR without exits."""
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, "left")
    with torch.no_grad():
        deep = ar.predict(enc["input_ids"], enc["attention_mask"])
        ar.set_exits([0, 3], min_block=3)
        assert ar.exits == {0: 3, 3: 3}
        both = ar.predict(enc["input_ids"], enc["attention_mask"], blocks=[0, 3, 3, 0, 0])
    torch.testing.assert_close(both, deep, rtol=1e-5, atol=1e-6)


def test_exits_checkpoint_round_trip_and_errors(tiny_model_dir, tiny_tokenizer, tmp_path, single_thread):
    ar = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    ar.set_exits([0, 1, 2, 3])
    _heads_apart(ar)
    enc = tokenize_ar_texts(tiny_tokenizer, TEXTS, 64, "right")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        before = ar.predict(ids, mask, blocks=BLOCKS)
    ar.save_pretrained(tmp_path / "ar")
    with safe_open(str(tmp_path / "ar" / EXIT_HEADS_FILE), framework="pt") as f:
        assert sorted(f.keys()) == ["0", "1", "2", "3"]
        assert json.loads(f.metadata()["read_after"]) == {"0": 1, "1": 1, "2": 2, "3": 3}
    back = Reconstructor.from_pretrained(tmp_path / "ar").eval()
    assert back.exits == {0: 1, 1: 1, 2: 2, 3: 3}
    with torch.no_grad():
        torch.testing.assert_close(back.predict(ids, mask, blocks=BLOCKS), before, rtol=0, atol=0)
    # a fresh AR loading the heads (a LoRA run's resume)
    fresh = Reconstructor.from_base(tiny_model_dir("llama"), 3).eval()
    fresh.load_head(tmp_path / "ar")
    with torch.no_grad():
        torch.testing.assert_close(fresh.predict(ids, mask, blocks=BLOCKS), before, rtol=0, atol=0)

    with pytest.raises(ValueError, match=r"blocks: this AR reads each row at its own block .* pass blocks="):
        back.predict(ids, mask)
    with pytest.raises(ValueError, match=r"blocks: expected one block a row \(5 rows\), found 2"):
        back.predict(ids, mask, blocks=[0, 1])
    with pytest.raises(ValueError, match=r"block\(s\) \[7\] are not ones this AR reads \(its blocks: \[0, 1, 2, 3\]\)"):
        back.predict(ids, mask, blocks=[0, 1, 7, 2, 3])
    with pytest.raises(ValueError, match=r"exits: expected the pair's blocks in increasing order, the deepest this "
                                         r"AR's K = 3, found \[0, 2\]"):
        fresh.set_exits([0, 2])


def test_a_pair_whose_ar_reads_each_row_at_its_block_trains_runs_rl_and_is_read_by_the_client(tmp_path, tiny_model_dir):
    """ar.exits end to end on a tiny pair for blocks 0 and 2: the warm-start writes the heads (block 0 read after
    block 1, block 2 after 2), RL reads each row's block from its AR text (both paddings agree at step 0) and trains
    every head it has rows of, the client reads the RL'd AR as predict does, and resuming without exits is refused."""
    from test_layers import _cfg

    from nla.client import NLAClient
    from nla.core.sidecar import load_sidecar
    from nla.datagen.io import read_parquet, read_vectors
    from nla.datagen.pipeline import run
    from nla.rl.config import RLConfig
    from nla.rl.loop import run_rl
    from nla.train.ar import ARTrainError, train_ar
    from nla.train.config import ARTrainConfig

    run(_cfg(tmp_path, tiny_model_dir("llama"), layers=[0, 2]))
    dg = tmp_path / "out"
    common = dict(warmup_steps=0, eval_every=1, save_every=1, batch_size=4, threads=1, progress=False,
                  tensorboard=False, lr=1e-3, max_length=80)
    ar = train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar"), max_steps=1,
                                exits=True, **common))
    warm = Reconstructor.from_pretrained(ar.checkpoint_dir)
    assert warm.exits == {0: 1, 2: 2} and ar.metrics["eval_fve"] == ar.metrics["eval_fve"]  # evaluated, a number
    with pytest.raises(ARTrainError, match=r"exits: the checkpoint resumed from .* reads each row at its own block; "
                                           r"set exits: true to go on training it"):
        train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar"), max_steps=2, **common),
                 resume=True)
    # exit_min_block: block 0 read after block 2 (the deepest), through its own head; a resume must keep the map
    deep = train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar_deep"), max_steps=1,
                                  exits=True, exit_min_block=2, **common))
    assert Reconstructor.from_pretrained(deep.checkpoint_dir).exits == {0: 2, 2: 2}
    for m, where in ((None, r"1 reads the blocks after \{0: 1, 2: 2\}"), (1, r"1 reads the blocks after \{0: 1, 2: 2\}")):
        with pytest.raises(ARTrainError, match=rf"exit_min_block: {where}, but the checkpoint resumed from .* reads "
                                               r"them after \{0: 2, 2: 2\}; resume with the exit_min_block"):
            train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar_deep"), max_steps=2,
                                   exits=True, exit_min_block=m, **common), resume=True)
    resumed = train_ar(ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar_deep"), max_steps=2,
                                     exits=True, exit_min_block=2, **common), resume=True)
    assert Reconstructor.from_pretrained(resumed.checkpoint_dir).exits == {0: 2, 2: 2}
    for bad, why in ((dict(exit_min_block=-1, exits=True), "an integer >= 0, or null"),
                     (dict(exit_min_block=2), "null unless exits: true")):
        with pytest.raises(ValueError, match=rf"exit_min_block.*{why}"):
            ARTrainConfig(dataset=str(dg / "ar_sft.parquet"), out_dir=str(tmp_path / "ar_bad"), **bad, **common)
    one = tmp_path / "one"
    run(_cfg(one, tiny_model_dir("llama"), layer_index=2))
    with pytest.raises(ARTrainError, match=r"exits: dataset .* is for one block \(2\); an AR reads each row at its own "
                                           r"block only for a pair of several"):
        train_ar(ARTrainConfig(dataset=str(one / "out" / "ar_sft.parquet"), out_dir=str(tmp_path / "ar1"), max_steps=1,
                               exits=True, **common))
    from nla.train.av import train_av
    from nla.train.config import AVTrainConfig

    av = train_av(AVTrainConfig(dataset=str(dg / "av_sft.parquet"), out_dir=str(tmp_path / "av"), max_steps=1,
                                smoke_num=0, **{**common, "max_length": 128}))
    rl = run_rl(RLConfig.from_dict(dict(
        av=str(av.checkpoint_dir), ar=str(ar.checkpoint_dir), dataset=str(dg / "rl.parquet"), out_dir=str(tmp_path / "rl"),
        steps=1, eval_every=1, eval_max_rows=4, threads=1, progress=False,
        rollout=dict(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=8),
        optimiser=dict(lr=1e-5, micro_batch_size=4),
        reconstructor=dict(replay_dataset=str(dg / "ar_sft.parquet"), replay_fraction=0.5, lr=1e-2),
        checkpointing=dict(save_every=1, keep_last=1))))
    assert rl.metrics["step0_guard_diff"] < 1e-4  # the AR texts' blocks, read through both paddings
    after = Reconstructor.from_pretrained(rl.checkpoint_dir / "ar").eval()
    assert after.exits == {0: 1, 2: 2}
    tab = read_parquet(dg / "ar_sft.parquet")
    texts, blocks = tab.column("explanation").to_pylist()[:6], tab.column("activation_layer").to_pylist()[:6]
    assert sorted(set(blocks)) == [0, 2]
    client = NLAClient(str(rl.checkpoint_dir / "av"), str(rl.checkpoint_dir / "ar"))
    side = load_sidecar(rl.checkpoint_dir / "ar")
    enc = tokenize_ar_texts(after.tokenizer, [side.ar_text(t, layer=k) for t, k in zip(texts, blocks, strict=True)],
                            80)
    with torch.no_grad():
        want = after.predict(enc["input_ids"], enc["attention_mask"], blocks=blocks)
    torch.testing.assert_close(client.reconstruct(texts, layer=blocks), want, rtol=1e-5, atol=1e-5)
    vectors = torch.from_numpy(read_vectors(tab)[:6].copy())
    assert client.score(texts, vectors, layer=blocks).mse_nrm.shape == (6,)


def test_the_rl_worker_reads_each_rows_block_from_its_ar_text_fused_or_plain(tiny_model_dir):
    """The AR role of a pair whose AR has exits: rewards are ``predict`` with each AR text's block, the fused
    window's update equals the plain one, and each head is trained on its block's rows only."""
    import copy

    from train_helpers import dataset_sidecar

    from nla.core.arch import load_tokenizer
    from nla.core.templates import LAYERED_AR_TEMPLATE, LAYERED_AV_TEMPLATE
    from nla.core.vectors import mse_nrm
    from nla.rl.roles import OptimSettings, ReconstructorWorker

    base = tiny_model_dir("llama")
    tok = load_tokenizer(base)
    ar = Reconstructor.from_base(base, 3, tokenizer=tok)
    ar.set_exits([0, 1, 2, 3])
    side = dataset_sidecar(tok, base, d_model=ar.config.hidden_size, layer_index=3).replace(
        layers=(0, 1, 2, 3), av_template=LAYERED_AV_TEMPLATE, ar_template=LAYERED_AR_TEMPLATE)
    optim = OptimSettings(lr=1e-2, weight_decay=0.0, warmup_steps=0, total_steps=10, max_grad_norm=1e9)
    plain = ReconstructorWorker(ar, tok, side, optim, max_length=64, micro_batch_size=3, device=torch.device("cpu"))
    fused = copy.deepcopy(plain)
    fused.fuse_reward = True
    blocks = [0, 1, 0, 2, 1, 0]  # none of block 3
    texts = [side.ar_text(t, layer=k) for t, k in zip(TEXTS + ["cat"], blocks, strict=True)]
    golds = torch.randn(6, ar.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        enc = tokenize_ar_texts(tok, texts, 64, "left")
        want = mse_nrm(ar.eval().predict(enc["input_ids"], enc["attention_mask"], blocks=blocks), golds,
                       plain.scale)
    items = list(zip(texts, golds, strict=True))
    r_plain = plain.mse_batch(items)
    fused.begin_rollout()
    r_fused = fused.mse_batch(items)
    torch.testing.assert_close(r_plain, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(r_fused, r_plain)
    before = {k: h.weight.detach().clone() for k, h in plain.ar.exit_heads.items()}
    m_plain, m_fused = plain.update(texts, golds), fused.update(texts, golds)
    assert m_fused["ar_loss"] == pytest.approx(m_plain["ar_loss"], rel=1e-5)
    for k in ("0", "1", "2"):
        assert not torch.equal(plain.ar.exit_heads[k].weight, before[k])
        torch.testing.assert_close(fused.ar.exit_heads[k].weight, plain.ar.exit_heads[k].weight, rtol=1e-4, atol=1e-6)
    assert torch.equal(plain.ar.exit_heads["3"].weight, before["3"])  # no row of block 3
    with pytest.raises(ValueError, match=r"ar_text_layer: 'Explanation: cat' is no block's AR text of this pair"):
        plain.mse_batch([("Explanation: cat", golds[0])])


def test_the_exits_step_benchmark_runs_both_readings_on_one_batch(tiny_model_dir, single_thread):
    """bench/bench_ar_exits.py's measure on a tiny Llama (its timing is the benchmark's, not asserted)."""
    from bench.bench_ar_exits import measure

    r = measure(str(tiny_model_dir("llama")), [0, 1, 2, 3], batch=8, lengths=(5, 12), repeat=2)
    assert r["exits"] == {0: 1, 1: 1, 2: 2, 3: 3} and r["blocks_kept"] == 4 and r["batch"] == 8
    assert 5 <= r["padded_length"] <= 12 and set(r["seconds"]) == {"deep", "exits"}
    assert r["exits_over_deep"] == r["seconds"]["exits"] / r["seconds"]["deep"] > 0
