"""What nla writes, read the published way: under transformers 4.57, by tests/published_reader.py.

The published NLA system's inference client pins transformers 4.57.1; every other test here runs
under transformers 5 and reads sidecars with nla's own reader, so none of them could see that a
checkpoint of nla was unreadable there (issue 46: the tokenizer config, symbolic scales, a BOS
declared but never added). Here the reader written from the published inference guide (it imports
nothing of nla) runs in a subprocess with transformers 4.57 first on its path (``make test``
installs it in ``.venv/published-reader``, beside the venv's newer one) and must agree with
``NLAClient``: the same greedy explanation for every vector, the same ``mse_nrm`` within 1e-5.

The pairs: a tiny Llama with a tokenizer that declares a BOS it never adds (the world's case), a
Qwen2 at test width with Qwen2.5's real tokenizer and chat template (random weights, both written
by nla's checkpoint writers), and (slow) the AV/AR pair of a real ``nla quickstart`` run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import QWEN_VOCAB_ROWS, build_tiny_model, qwen_tokenizer_dir

from nla.client import NLAClient
from nla.core.arch import PORTABLE_TOKENIZER_CLASS, load_tokenizer, save_tokenizer
from nla.core.injection import save_av_checkpoint
from nla.core.reconstructor import Reconstructor
from nla.core.sidecar import NLAConfig
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR

ROOT = Path(__file__).resolve().parent.parent
READER = Path(__file__).resolve().parent / "published_reader.py"
READER_ENV = Path(os.environ.get("NLA_PUBLISHED_READER_PATH", ROOT / ".venv" / "published-reader"))
MAX_NEW = 24
N_VECTORS = 12


def _reader_env() -> Path:
    if not (READER_ENV / "transformers").is_dir():
        pytest.skip(f"transformers 4.57 is not installed in {READER_ENV}: `make test` installs it "
                    "(or set NLA_PUBLISHED_READER_PATH to a pip --target dir holding transformers==4.57.1)")
    return READER_ENV


def run_reader(tmp: Path, vectors: np.ndarray, *, av: Path | None = None, ar: Path | None = None,
               texts: list[str] | None = None, server: str | None = None, load: list[Path] = ()) -> dict:
    """Run the published-way reader under transformers 4.57; its JSON result."""
    env_dir = _reader_env()
    np.save(tmp / "vectors.npy", vectors.astype(np.float32))
    (tmp / "texts.json").write_text(json.dumps(texts or []))
    cmd = [sys.executable, str(READER), "--vectors", str(tmp / "vectors.npy"), "--texts", str(tmp / "texts.json"),
           "--out", str(tmp / "reader.json"), "--max-new-tokens", str(MAX_NEW)]
    for flag, value in (("--av", av), ("--ar", ar), ("--server", server), *(("--load", d) for d in load)):
        if value is not None:
            cmd += [flag, str(value)]
    env = {**os.environ, "PYTHONPATH": str(env_dir), "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp / "reader.json").read_text())
    assert out["transformers"].startswith("4.57"), out
    return out


def assert_reader_agrees(tmp: Path, av_dir: Path, ar_dir: Path, vectors: np.ndarray) -> dict:
    """The reader under 4.57 loads both checkpoints and matches NLAClient's greedy texts and scores."""
    client = NLAClient(av_dir, ar_dir, device="cpu")
    ours = client.verbalize(vectors, max_new_tokens=MAX_NEW, greedy=True)
    texts = [v.text for v in ours]
    scored = client.score(texts, vectors)
    out = run_reader(tmp, vectors, av=av_dir, ar=ar_dir, texts=texts)
    assert "refused" not in out, out["refused"]
    assert out["av_texts"] == texts
    ours_mse = scored.mse_nrm.numpy()
    theirs = np.array(out["ar_mse"])
    assert np.abs(theirs - ours_mse).max() <= 1e-5, (theirs, ours_mse)
    # the published definition, by hand: mse = 2 (1 - cos)
    assert np.allclose(theirs, 2 * (1 - np.array(out["ar_cos"])), atol=1e-5)
    return out


def write_pair(root: Path, model: torch.nn.Module, tok, layer: int) -> tuple[Path, Path]:
    """An AV and an AR (K = ``layer``) from ``model``, written by nla's checkpoint writers."""
    side = NLAConfig.from_tokenizer(
        tok, kind="nla_model", role="av", d_model=model.config.hidden_size, layer_index=layer,
        av_template=DEFAULT_AV_TEMPLATE, ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR,
        injection_scale="sqrt_d_model", base_model="test-subject")
    av_dir = save_av_checkpoint(model, tok, side, root / "av", stage="test")
    ar = Reconstructor.from_base(model, layer, tokenizer=tok, sidecar=side)
    with torch.no_grad():  # a head that is not the identity, so that using it is visible
        ar.value_head.weight.add_(0.05 * torch.randn(ar.value_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    ar_dir = ar.save_pretrained(root / "ar")
    return av_dir, ar_dir


def _vectors(d: int, n: int = N_VECTORS, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32) * 3.0


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tiny_tokenizer) -> tuple[Path, Path]:
    model = build_tiny_model("llama", tiny_tokenizer, seed=5)
    return write_pair(tmp_path_factory.mktemp("tiny_pair"), model, tiny_tokenizer, layer=1)


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Qwen2 at test width with Qwen2.5's real tokenizer; weights drawn at std 0.1 (not HF's 0.02, at
    which every vector decodes to newlines) so that greedy texts differ by vector and run over the
    whole byte-level vocabulary: the decoding of both transformers versions is compared too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(qwen_tokenizer_dir())
    config = Qwen2Config(vocab_size=QWEN_VOCAB_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, initializer_range=0.1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    return write_pair(tmp_path_factory.mktemp("qwen_pair"), model, tok, layer=2)


# ---------------------------------------------------------------- what is written (transformers 5)
def test_written_sidecars_hold_numbers_the_published_reader_converts(tiny_pair):
    av_dir, ar_dir = tiny_pair
    for d in (av_dir, ar_dir):
        doc = yaml.safe_load((d / "nla_meta.yaml").read_text())
        assert doc["extraction"]["injection_scale"] == math.sqrt(32)  # sqrt_d_model at d = 32, as a number
        assert doc["extraction"]["mse_scale"] == math.sqrt(32)
        assert "sqrt_d_model" not in (d / "nla_meta.yaml").read_text()
    assert yaml.safe_load((ar_dir / "nla_meta.yaml").read_text())["ar"] == {"num_hidden_layers": 1}


def test_written_tokenizer_config_is_portable(tiny_pair, tiny_tokenizer):
    av_dir, _ = tiny_pair
    config = json.loads((av_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS
    assert "extra_special_tokens" not in config  # transformers 5 wrote a list there; 4.57 wants a mapping
    assert config["additional_special_tokens"] == ["<|user|>", "<|assistant|>", "<|end|>"]
    # "<bos>" is declared by the tokenizer but never added by it: not declared in the saved config
    assert tiny_tokenizer.bos_token == "<bos>" and tiny_tokenizer("x")["input_ids"][0] != tiny_tokenizer.bos_token_id
    assert config["bos_token"] is None
    # and the saved tokenizer still tokenises as the original (nla reads it back unchanged)
    back = load_tokenizer(av_dir)
    text = "the cat walks to the garden"
    assert back(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert back.apply_chat_template([{"role": "user", "content": text}], tokenize=False) == \
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    assert (back.eos_token_id, back.pad_token_id, back.bos_token_id) == \
        (tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id, None)


def test_a_bos_the_tokenizer_adds_stays_declared(tmp_path, tiny_tokenizer):
    import copy

    from tokenizers import processors

    tok = copy.deepcopy(tiny_tokenizer)
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                                         special_tokens=[("<bos>", bos)])
    assert tok("x")["input_ids"][0] == bos  # as Llama's and Gemma's tokenizers do
    save_tokenizer(tok, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["bos_token"] == "<bos>"


def test_a_bos_the_chat_template_uses_stays_declared_with_a_warning(tmp_path, tiny_tokenizer, caplog):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    with caplog.at_level("WARNING", logger="nla.core.arch"):
        save_tokenizer(tok, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["bos_token"] == "<bos>"
    assert "published reconstructor reader will refuse" in caplog.text


# ---------------------------------------------------------------- read under transformers 4.57
def test_tiny_pair_reads_under_4_57_and_agrees_with_nla(tiny_pair, tmp_path):
    av_dir, ar_dir = tiny_pair
    out = assert_reader_agrees(tmp_path, av_dir, ar_dir, _vectors(32))
    assert len(set(out["av_texts"])) > 1  # random weights: the vector changes the greedy text


def test_qwen_pair_reads_under_4_57_and_agrees_with_nla(qwen_pair, tmp_path):
    av_dir, ar_dir = qwen_pair
    assert json.loads((av_dir / "tokenizer_config.json").read_text())["bos_token"] is None  # Qwen has none
    out = assert_reader_agrees(tmp_path, av_dir, ar_dir, _vectors(64, n=6))
    assert len(set(out["av_texts"])) == 6


def test_reader_refuses_what_nla_wrote_before(tiny_pair, tmp_path):
    """The three faults of issue 46, put back one at a time into a copy: the reader refuses each
    (so the agreement above is not a reader that accepts anything)."""
    import shutil

    av_dir, ar_dir = tiny_pair
    # 1. transformers 5's tokenizer class
    bad_class = tmp_path / "class"
    shutil.copytree(av_dir, bad_class)
    config = json.loads((bad_class / "tokenizer_config.json").read_text())
    (bad_class / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "TokenizersBackend"}))
    # 2. a symbolic scale
    bad_scale = tmp_path / "scale"
    shutil.copytree(av_dir, bad_scale)
    doc = yaml.safe_load((bad_scale / "nla_meta.yaml").read_text())
    doc["extraction"]["injection_scale"] = "sqrt_d_model"
    (bad_scale / "nla_meta.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    # 3. a BOS declared but not added, in the AR
    bad_bos = tmp_path / "bos"
    shutil.copytree(ar_dir, bad_bos)
    config = json.loads((bad_bos / "tokenizer_config.json").read_text())
    (bad_bos / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<bos>"}))
    loads = run_reader(tmp_path, _vectors(32, n=1), load=[av_dir, ar_dir, bad_class, bad_scale, bad_bos])["loads"]
    assert loads[:2] == [None, None]  # the pair as nla wrote it loads
    assert "TokenizersBackend does not exist" in loads[2]
    assert "float() cannot read" in loads[3]
    assert "declares bos_token_id" in loads[4]


@pytest.mark.slow
def test_quickstart_pair_reads_under_4_57_and_agrees_with_nla(tiny_quickstart_run, tmp_path):
    """The RL pair of a real quickstart run (the world's own tokenizer, subject and writers)."""
    import pyarrow.parquet as pq

    from nla.client import load_vectors

    steps = sorted((tiny_quickstart_run / "rl" / "checkpoints").glob("step_*"))
    av_dir, ar_dir = steps[-1] / "av", steps[-1] / "ar"
    rl = tiny_quickstart_run / "datagen" / "rl.parquet"
    assert pq.ParquetFile(rl).metadata.num_rows >= N_VECTORS
    vectors = load_vectors(rl, rows=N_VECTORS)
    out = assert_reader_agrees(tmp_path, av_dir, ar_dir, vectors)
    assert all("<explanation>" in t for t in out["av_texts"])
