"""Mixed precision (``autocast: bfloat16``, nla.util.precision): the settings, the CPU check, the oneDNN
cap, the fp32 heads and the exact row selection under autocast."""

import pytest
import torch
from conftest import build_tiny_model, busy_process

from nla.core.prefix import take_rows
from nla.rl.config import RLConfig
from nla.train.config import ARTrainConfig, AVTrainConfig
from nla.util import precision
from nla.util.numerics import pins

CPU = torch.device("cpu")


def _kernels_not_asked(monkeypatch) -> None:
    """The pytest process ran matmuls under the pin's cap long before this test, so torch settled that
    oneDNN has no bf16 kernels here (``lift_onednn_cap``): this test's bf16 matmuls run on the reference
    kernel, slow but not wrong, and ``check_bf16_kernels`` (tested in a fresh process below) is told so."""
    monkeypatch.setattr(precision, "bf16_kernels_ready", lambda: None)


def test_the_setting_is_checked_and_names_the_field():
    assert ARTrainConfig(dataset="x").autocast is None
    assert AVTrainConfig(dataset="x", autocast="bfloat16").autocast == "bfloat16"
    with pytest.raises(ValueError, match=r"'autocast': expected null or one of \['bfloat16'\], found 'float16'"):
        ARTrainConfig(dataset="x", autocast="float16")
    with pytest.raises(ValueError, match=r"'autocast': expected null with dtype 'bfloat16' .*set dtype: float32"):
        AVTrainConfig(dataset="x", dtype="bfloat16", autocast="bfloat16")
    base = dict(av="a", ar="b", dataset="c", out_dir="o")
    assert RLConfig.from_dict({**base, "autocast": "bfloat16"}).autocast == "bfloat16"
    # the same check for the optimiser's setting (tests/test_train_common holds its math)
    assert ARTrainConfig(dataset="x").adamw == "default" and RLConfig.from_dict(base).adamw == "default"
    with pytest.raises(ValueError, match=r"'adamw': expected one of \['default', 'fused'\], found 'sgd'"):
        AVTrainConfig(dataset="x", adamw="sgd")
    with pytest.raises(ValueError, match=r"RLConfig.autocast: expected null or one of \['bfloat16'\], found 'fp8'"):
        RLConfig.from_dict({**base, "autocast": "fp8"})
    with pytest.raises(ValueError, match=r"RLConfig.autocast: expected null with backend.name 'ray'"):
        RLConfig.from_dict({**base, "autocast": "bfloat16", "backend": {"name": "ray"}})


def test_a_cpu_without_bf16_instructions_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"av.autocast: bfloat16 runs emulated on this CPU \(no avx512_bf16 or "
                                         r"amx_bf16 in its flags\), slower than float32: set av.autocast: null"):
        precision.prepare_autocast("bfloat16", CPU, "av.autocast", flags={"avx2", "avx512f"})
    precision.prepare_autocast(None, CPU, flags={"avx2"})  # off: nothing checked
    precision.prepare_autocast("bfloat16", torch.device("cuda"), flags={"avx2"})  # a GPU: not the CPU's business
    assert precision.bf16_native({"avx512_bf16"}) and precision.bf16_native({"amx_bf16", "avx2"})
    assert not precision.bf16_native({"avx512f", "avx512_vnni"})


def test_the_pins_onednn_cap_is_lifted_and_a_users_value_kept(monkeypatch):
    pinned = {p.var: p.value for p in pins()}.get("ONEDNN_MAX_CPU_ISA")
    if pinned is None:
        pytest.skip("the CPU pin does not apply on this machine")
    monkeypatch.setattr(precision, "_BEFORE_LIFT", None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", pinned)
    _kernels_not_asked(monkeypatch)
    precision.prepare_autocast("bfloat16", CPU, flags={"avx512_bf16"})
    import os

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "ALL"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # the user's own choice
    precision.prepare_autocast("bfloat16", CPU, flags={"avx512_bf16"})
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"


def test_heads_run_fp32_under_autocast_and_change_nothing_outside(tiny_tokenizer):
    plain = build_tiny_model("llama", tiny_tokenizer)
    hooked = build_tiny_model("llama", tiny_tokenizer)
    assert precision.keep_heads_fp32(hooked) == 1 and precision.keep_heads_fp32(hooked) == 0  # idempotent
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, hooked(input_ids=ids).logits)  # no autocast: the same bits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert plain(input_ids=ids).logits.dtype == torch.bfloat16
            logits = hooked(input_ids=ids).logits
            assert logits.dtype == torch.float32
            assert torch.is_autocast_enabled("cpu")  # the head's region closed again
            # the head's input is the bf16-matmul hidden state; the head itself is the fp32 one
            h = hooked.model(input_ids=ids).last_hidden_state
            with torch.autocast("cpu", enabled=False):
                assert torch.equal(logits, torch.nn.functional.linear(h.float(), hooked.lm_head.weight))
    head = hooked.get_output_embeddings()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError):
            head(torch.zeros(2, 3))  # a wrong width: the head raises
        assert torch.is_autocast_enabled("cpu")  # and autocast is on again after it


def test_the_ars_value_head_runs_fp32(tiny_tokenizer):
    from nla.core.reconstructor import Reconstructor

    base = build_tiny_model("llama", tiny_tokenizer)
    ar = Reconstructor(base.model, tokenizer=tiny_tokenizer)
    assert precision.keep_heads_fp32(ar) == 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = ar.value_head(torch.randn(2, base.config.hidden_size).bfloat16())
    assert out.dtype == torch.float32


def test_take_rows_is_an_exact_selection_under_autocast():
    x = torch.randn(3, 5, 7)
    rows = torch.tensor([0, 0, 2, 1, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = take_rows(x, rows)
    assert got.dtype == torch.float32 and torch.equal(got, x[rows])  # a bf16 matmul would round x


@pytest.mark.parametrize("role", ["ar", "av"])
def test_a_warm_start_trains_under_autocast_near_its_fp32_run(tmp_path, monkeypatch, role):
    """A warm-start with ``autocast: bfloat16``: the first step's loss (the same weights, bf16 matmuls) is
    within 2 % of the fp32 run's and not the same bits; every step's loss is finite; the saved weights are
    fp32."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from train_helpers import dataset_sidecar, write_av_dataset

    from nla.core.arch import load_tokenizer
    from nla.core.sidecar import write_sidecar
    from nla.datagen.io import vectors_to_arrow
    from nla.train.ar import train_ar
    from nla.train.av import train_av
    from nla.util.metrics import read_metrics
    from nla.world import build_world

    monkeypatch.setattr(precision, "bf16_native", lambda flags=None: True)  # emulated where absent: slow, not wrong
    _kernels_not_asked(monkeypatch)
    import os

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"))
    monkeypatch.setattr(precision, "_BEFORE_LIFT", precision._BEFORE_LIFT)
    base = build_world("tiny", progress=False).subject_dir
    side = dataset_sidecar(load_tokenizer(base), base, 64, 1, injection_scale=8.0)
    rng = np.random.default_rng(0)
    vec = rng.normal(size=(32, 64)).astype(np.float32)
    texts = [f"the {w} is happy" for w in ["cat", "dog", "bird", "fish"] * 8]
    if role == "av":
        ds = write_av_dataset(tmp_path / "av.parquet", side, vec, texts)
    else:
        ds = tmp_path / "ar.parquet"
        pq.write_table(pa.table({"activation_vector": vectors_to_arrow(vec), "doc_id": pa.array(range(32), pa.int64()),
                                 "prompt": pa.array([side.ar_text(t) for t in texts]),
                                 "explanation": pa.array(texts)}), ds)
        write_sidecar(ds, side)
    kw = dict(dataset=str(ds), max_steps=3, batch_size=8, lr=1e-3, warmup_steps=1, log_every=1, eval_every=3,
              save_every=3, eval_fraction=0.25, tensorboard=False, progress=False, threads=1)
    runs = {}
    for amp in (None, "bfloat16"):
        out = tmp_path / f"{role}_{amp}"
        if role == "av":
            res = train_av(AVTrainConfig(out_dir=str(out), smoke_num=1, smoke_max_new_tokens=4, autocast=amp, **kw))
        else:
            res = train_ar(ARTrainConfig(out_dir=str(out), autocast=amp, **kw))
        runs[amp] = [r["loss"] for r in read_metrics(out / f"{role}.jsonl") if "loss" in r]
        from safetensors import safe_open

        with safe_open(str(next(res.checkpoint_dir.glob("*.safetensors"))), "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())
    fp, bf = runs[None], runs["bfloat16"]
    assert len(bf) == 3 and all(np.isfinite(bf))
    assert bf[0] != fp[0] and abs(bf[0] - fp[0]) < 0.02 * abs(fp[0])


def test_a_stages_cache_key_does_not_move_when_an_earlier_stage_lifted_the_cap(monkeypatch):
    """The quickstart keys each stage on the CPU paths it runs (``nla.quickstart._hash``). A stage with
    autocast lifts oneDNN's cap for the rest of the process, so a resumed run (the bf16 stage cached, not
    run) would see another cap than the first run did: each stage's key reads the cap it runs with."""
    from nla import quickstart as qs

    pinned = {p.var: p.value for p in pins()}.get("ONEDNN_MAX_CPU_ISA")
    if pinned is None:
        pytest.skip("the CPU pin does not apply on this machine")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", pinned)
    monkeypatch.setattr(precision, "_BEFORE_LIFT", None)
    fp32, bf16 = {"max_steps": 5}, {"max_steps": 5, "autocast": "bfloat16"}
    assert precision.onednn_setting(None) == pinned and precision.onednn_setting("bfloat16") == "ALL"
    before = qs._hash(fp32), qs._hash(bf16)
    _kernels_not_asked(monkeypatch)
    precision.prepare_autocast("bfloat16", CPU, flags={"avx512_bf16"})
    import os

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "ALL"
    assert (qs._hash(fp32), qs._hash(bf16)) == before and before[0] != before[1]
    assert precision.onednn_setting(None) == pinned


_FRESH = """
import os, sys, torch
import nla  # the CPU pin: ONEDNN_MAX_CPU_ISA=AVX2
from nla.util import precision
if sys.argv[1] == "late":  # a matmul before the lift settles torch's bf16 kernels under the cap
    torch.nn.Linear(8, 8)(torch.randn(2, 8)).sum()
try:
    precision.prepare_autocast("bfloat16", torch.device("cpu"), "ar.autocast")
except RuntimeError as err:
    print("REFUSED", err)
    raise SystemExit(0)
print("READY", precision.bf16_kernels_ready(), os.environ["ONEDNN_MAX_CPU_ISA"])
"""


@pytest.mark.parametrize("when", ["first", "late"])
def test_a_process_whose_first_matmul_ran_under_the_cap_is_refused(when):
    """On a CPU with bf16 instructions torch settles at a process's first matmul whether oneDNN has bf16
    kernels, under the cap as it is then: lifted first, they are there; lifted after a matmul, bf16 would
    run on the reference kernel (~300x slower, BENCHMARKS "Mixed precision on the CPU") and the stage is
    refused with what to do. Each case in a fresh process (this one settled long ago)."""
    import subprocess
    import sys

    if not precision.bf16_native():
        pytest.skip("this CPU has no bf16 instructions (autocast is refused before the kernels matter)")
    if {p.var: p.value for p in pins()}.get("ONEDNN_MAX_CPU_ISA") is None:
        pytest.skip("the CPU pin does not cap oneDNN on this machine")
    env = {k: v for k, v in __import__("os").environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", _FRESH, when], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if when == "first":
        assert "READY True ALL" in out.stdout
    else:
        assert "REFUSED ar.autocast: this process ran a matmul before ONEDNN_MAX_CPU_ISA was lifted" in out.stdout
        assert "run the autocast stage in a fresh process" in out.stdout


_FP32 = """
import os, sys, torch
import nla  # the CPU pin: ONEDNN_MAX_CPU_ISA=AVX2
if sys.argv[1] == "ALL":
    os.environ["ONEDNN_MAX_CPU_ISA"] = "ALL"  # as lift_onednn_cap leaves it, before the first matmul
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from nla.world import build_world
model = AutoModelForCausalLM.from_pretrained(build_world("tiny", progress=False).subject_dir, dtype=torch.float32)
ids = torch.arange(2 * 24).reshape(2, 24) % model.config.vocab_size
out = model(ids, output_hidden_states=True)
out.logits.logsumexp(-1).mean().backward()
torch.save([out.hidden_states[1], out.logits, *(p.grad for p in model.parameters())], sys.argv[2])
"""


def test_fp32_work_gives_the_same_bits_with_the_cap_lifted(tmp_path):
    """Why the stages before an autocast one keep their numbers and cache keys when the quickstart lifts the
    cap at its start: an fp32 forward and backward of the world's tiny subject, each in a fresh process,
    under the pin's cap and lifted, give the same hidden states, logits and gradients bit for bit."""
    import subprocess
    import sys

    if {p.var: p.value for p in pins()}.get("ONEDNN_MAX_CPU_ISA") is None:
        pytest.skip("the CPU pin does not cap oneDNN on this machine")
    env = {k: v for k, v in __import__("os").environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    got = []
    for cap in ("pinned", "ALL"):
        path = tmp_path / f"{cap}.pt"
        out = subprocess.run([sys.executable, "-c", _FP32, cap, str(path)], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got.append(torch.load(path))
    assert len(got[0]) > 3 and all(torch.equal(a, b) for a, b in zip(*got, strict=True))


_BF16_AV = """
import sys
sys.path.insert(0, sys.argv[2])  # the tests' helpers
import numpy as np
import torch
from nla.core.arch import load_tokenizer
from nla.train.av import train_av
from nla.train.config import AVTrainConfig
from nla.util import precision
from nla.world import build_world
from train_helpers import dataset_sidecar, explanations, write_av_dataset
# before any matmul: a cached world built at another thread count is built again here (nla.world.build),
# and a matmul before the lift would leave bf16 on torch's reference kernel (train_av would refuse)
precision.prepare_autocast("bfloat16", torch.device("cpu"), "av.autocast")
torch.set_num_threads(2)
base = build_world("tiny", progress=False).subject_dir
side = dataset_sidecar(load_tokenizer(base), base, 64, 1, injection_scale=8.0)
vec = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
ds = write_av_dataset(sys.argv[1] + "/av.parquet", side, vec, explanations(32))
res = train_av(AVTrainConfig(dataset=str(ds), out_dir=sys.argv[1] + "/av", max_steps=4, batch_size=8, lr=1e-3,
                             warmup_steps=1, log_every=1, eval_every=4, save_every=4, eval_fraction=0.25,
                             tensorboard=False, progress=False, threads=2, smoke_num=1, smoke_max_new_tokens=4,
                             autocast="bfloat16"))
print("CKPT", next(res.checkpoint_dir.glob("*.safetensors")))
"""


@pytest.mark.slow
def test_a_bf16_warm_start_gives_the_same_bits_beside_a_busy_process(tmp_path):
    """The same seed gives the same numbers whatever else the machine runs, under ``autocast: bfloat16`` too:
    an AV warm-start (4 steps, 2 threads, bf16 matmuls on oneDNN's bf16 kernels) in a fresh process alone,
    and again beside a process that takes every cycle it leaves (nice 19, as tests/test_determinism.py's),
    saves the same weights bit for bit. Where the CPU has no bf16 instructions autocast is refused
    (above), so there is nothing to compare."""
    import contextlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from nla.world import build_world

    if not precision.bf16_native():
        pytest.skip("this CPU has no bf16 instructions: autocast is refused there")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    helpers = str(Path(__file__).resolve().parent)
    weights = []
    for name in ("alone", "beside"):
        out_dir = tmp_path / name
        out_dir.mkdir()
        with busy_process() if name == "beside" else contextlib.nullcontext():
            out = subprocess.run([sys.executable, "-c", _BF16_AV, str(out_dir), helpers], capture_output=True,
                                 text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        weights.append(load_file(out.stdout.split("CKPT ")[-1].strip()))
    alone, beside = weights
    assert alone.keys() == beside.keys() and len(alone) > 3
    start = load_file(str(next(Path(build_world("tiny", progress=False).subject_dir).glob("*.safetensors"))))
    moved = [k for k in alone if k in start and not torch.equal(alone[k], start[k])]
    assert moved  # the warm-start trained: the comparison is of weights bf16 steps changed
    differ = [k for k in alone if not torch.equal(alone[k], beside[k])]
    assert not differ, f"{len(differ)} of {len(alone)} tensors differ beside a busy process, e.g. {differ[:3]}"
