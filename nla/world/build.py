"""Build (or load from cache) the world: corpus -> tokenizer -> pretrained subject model.

A build lives in ``<base>/<name>-<hash>`` where ``<base>`` is ``out`` or
``$NLA_CACHE/world`` (``NLA_CACHE`` defaults to ``~/.cache/nla``) and ``<hash>`` covers
every config field plus ``WORLD_FORMAT_VERSION``. Building is atomic: everything is
written to a temporary sibling directory that is renamed into place at the end, so an
interrupted build never leaves a half-written world that a later call would trust.

Layout of a build::

    world_config.yaml   resolved WorldConfig
    summary.json        sizes, losses, timings, marker ids
    loss_curve.png      train loss per step, held-out loss, unigram entropy
    subject/            HF dir: LlamaForCausalLM + tokenizer (chat template, marker)

Documents ``0 .. n_docs-1`` of ``generate_documents(seed, ...)`` are the training
stories; ``n_docs .. n_docs+n_heldout_docs-1`` are held out (``WorldConfig.heldout_start``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nla.core.arch import save_tokenizer
from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE
from nla.util.configcheck import check_config_types
from nla.util.confighelp import option, with_help
from nla.util.numerics import cpu_kernels, cpu_paths, describe_cpu_paths
from nla.util.validation import load_json, load_yaml
from nla.world.explain import TextExplainer
from nla.world.facts import Document, all_facts, facts_at, text_end, token_facts, unit_ends
from nla.world.generator import generate_documents

logger = logging.getLogger(__name__)

# WorldConfig's bounds: a name is a directory under the cache; the smallest pretraining block; the
# largest vocabulary (issue 58).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MIN_SEQ_LEN = 16
MAX_VOCAB = 65536

WORLD_FORMAT_VERSION = 5  # bump when the build's output changes for the same config (5: explanations quote the text's end)


@dataclass(frozen=True)
class WorldConfig:
    """Everything that determines a world build (one YAML key per field).

    Every field's meaning, unit and range is its help (``nla config describe world``).
    """

    name: str = option("default", help="the build's name: its cache dir is <name>-<config hash>. Range: letters, "
                                       "digits, '.', '_' and '-', starting with a letter or digit, at most 64 "
                                       "characters (no path: the name is a directory under the cache).")
    seed: int = option(0, help="seeds the stories, the explanation samples, the pretraining order and the "
                              "subject's initialisation. Range: an integer in 0..2**32-1.")
    n_docs: int = option(20000, help="training stories (doc ids 0..n_docs-1). Range: an integer >= 1.")
    n_heldout_docs: int = option(1000, help="held-out stories after them (for the subject's held-out loss and "
                                            "the probe), never trained on. Range: an integer >= 1.")
    chat_fraction: float = option(0.3, help="explanation samples mixed into the subject's training stream, per "
                                            "training story (so the subject reads the explanation language). "
                                            "Range: [0, 2].")
    explainer_wrong_rate: float = option(0.1, help="probability that one of those explanation samples also "
                                                   "names a wrong fact. Range: [0, 1].")
    vocab_size: int = option(1024, help="the byte-level BPE tokenizer's vocabulary size. Range: an integer "
                                        f"in 300..{MAX_VOCAB} (256 bytes + specials; the stories hold far fewer "
                                        "merges than the cap).")
    d_model: int = option(128, help="the subject's width (hidden size): the vectors' dimension. Range: an "
                                    "integer >= 1, divisible by n_heads.")
    n_layers: int = option(4, help="the subject's decoder blocks. Range: an integer >= 3 (datagen extracts from "
                                   "a middle block).")
    n_heads: int = option(4, help="attention heads per block. Range: an integer >= 1 dividing d_model.")
    d_ff: int = option(344, help="the MLP's inner width. Range: an integer >= 1.")
    seq_len: int = option(128, help="tokens per pretraining block, and the subject's context length "
                                    f"(max_position_embeddings). Range: an integer >= {MIN_SEQ_LEN}.")
    train_steps: int = option(1200, help="the subject's pretraining steps. Range: an integer >= 1.")
    batch_size: int = option(16, help="blocks per pretraining step. Range: an integer >= 1.")
    lr: float = option(3e-3, help="peak learning rate of the subject's AdamW (linear warmup, then cosine decay "
                                  "to a tenth). Range: a number > 0.")
    warmup_steps: int = option(50, help="pretraining steps of linear LR warmup. Range: an integer >= 0.")
    weight_decay: float = option(0.1, help="AdamW's decoupled weight decay in pretraining. Range: a number >= 0.")
    default_layer: int | None = option(None, help="the recommended extraction layer K (output of block K), "
                                                  "where the state-tracking objective trains; null = n_layers "
                                                  "// 2. Range: 0..n_layers-2 (a block before the last), or "
                                                  "null.")
    state_weight: float = option(0.2, help="weight of the state-tracking objective at block default_layer "
                                           "(nla.world.subject), beside the next-token loss; 0 turns it off. "
                                           "Range: a number >= 0.")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            # the name is a directory under the cache: `../../evil` wrote outside it (issue 58)
            _bad("name", f"WorldConfig.name: expected letters, digits, '.', '_' or '-' (starting with a letter or "
                         f"digit, at most 64 characters), found {self.name!r}; the name becomes a cache directory, so "
                         "it cannot hold a path")
        if self.seq_len < MIN_SEQ_LEN:  # seq_len 1 was a ZeroDivisionError in pretraining (issue 58)
            _bad("seq_len", f"WorldConfig.seq_len: must be >= {MIN_SEQ_LEN} (a pretraining block holds at least a "
                            f"sentence of the stories and its next tokens), found {self.seq_len}")
        if self.vocab_size > MAX_VOCAB:  # 1e9 was a Rust backtrace of the BPE trainer (issue 58)
            _bad("vocab_size", f"WorldConfig.vocab_size: must be <= {MAX_VOCAB} (the stories hold far fewer merges; "
                               f"the subject's embedding is vocab_size x d_model), found {self.vocab_size}")
        positive = ("n_docs", "n_heldout_docs", "d_model", "n_heads", "d_ff", "seq_len", "train_steps", "batch_size")
        for f in positive:
            if getattr(self, f) < 1:
                _bad(f, f"WorldConfig.{f}: must be >= 1, found {getattr(self, f)}")
        if self.n_layers < 3:
            _bad("n_layers",
                 f"WorldConfig.n_layers: must be >= 3 so datagen can extract from a middle layer, found {self.n_layers}")
        if self.d_model % self.n_heads:
            _bad("d_model", f"WorldConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.vocab_size < 300:
            _bad("vocab_size", f"WorldConfig.vocab_size: must be >= 300 (256 bytes + specials), found {self.vocab_size}")
        if not 0.0 <= self.chat_fraction <= 2.0:
            _bad("chat_fraction", f"WorldConfig.chat_fraction: expected 0..2, found {self.chat_fraction}")
        if not 0.0 <= self.explainer_wrong_rate <= 1.0:
            _bad("explainer_wrong_rate",
                 f"WorldConfig.explainer_wrong_rate: expected 0..1, found {self.explainer_wrong_rate}")
        if not self.lr > 0:
            _bad("lr", f"WorldConfig.lr: must be > 0, found {self.lr}")
        if not self.state_weight >= 0:
            _bad("state_weight", f"WorldConfig.state_weight: must be >= 0 (0 turns the state objective off), "
                                 f"found {self.state_weight}")
        if self.default_layer is None:
            object.__setattr__(self, "default_layer", self.n_layers // 2)
        if not 0 <= self.default_layer < self.n_layers - 1:
            _bad("default_layer",
                 f"WorldConfig.default_layer: expected 0..{self.n_layers - 2} (a block before the last), "
                 f"found {self.default_layer}"
            )

    @property
    def heldout_start(self) -> int:
        return self.n_docs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        blob = json.dumps({"format": WORLD_FORMAT_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorldConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"WorldConfig: unknown keys {unknown}; valid keys are {sorted(known)}")
        return cls(**check_config_types(cls, data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> WorldConfig:
        return cls.from_dict(load_yaml(path, "world config") or {})


def _bad(name: str, message: str) -> None:
    raise ValueError(with_help(message, WorldConfig, name))


WORLD_PRESETS: dict[str, WorldConfig] = {
    # Seconds on a laptop CPU; for tests and smoke runs.
    "tiny": WorldConfig(
        name="tiny", n_docs=1000, n_heldout_docs=150, vocab_size=512, d_model=64, n_layers=3, n_heads=4,
        d_ff=172, seq_len=64, train_steps=100, batch_size=16, lr=4e-3, warmup_steps=10,
    ),
    # About three to four minutes on 2 CPU cores (192-231 s measured, 2026-12-05). 4 blocks, the state
    # objective at block 2: a linear probe there reads every fact kind at ~0.99 top-1 (chance 0.105); 6 blocks trained for
    # 600 steps without it read them at chance (BENCHMARKS.md, "What the world's vectors hold").
    # 1,200 steps, not 600: at 600 the held-out loss is near its end (0.861 nats/token against
    # 0.794) but the probe at block 2 reads activity, object and mood at chance (0.10 / 0.14 / 0.24
    # top-1, against 0.94 / 0.89 / 0.92 at 1,200; seed 0, issue 47, dev/LOG.md 2026-12-05).
    "default": WorldConfig(name="default", n_layers=4, train_steps=1200, lr=3e-3, warmup_steps=50, default_layer=2),
}
# A second world model on the same stories (same seed, corpus and tokenizer) at half the width: the
# base of a cross-model pair that explains the default subject's vectors (nla quickstart --pair-world).
WORLD_PRESETS["default-d64"] = dataclasses.replace(WORLD_PRESETS["default"], name="default-d64", d_model=64, d_ff=172)
# ... and at twice the width: a larger AV/AR than the subject, which separates what the cross-model
# machinery (adapter, head) costs from what a weaker model costs.
WORLD_PRESETS["default-d256"] = dataclasses.replace(WORLD_PRESETS["default"], name="default-d256", d_model=256,
                                                    d_ff=688)


@dataclass(frozen=True)
class WorldArtifacts:
    """A finished world build (see the module docstring for the layout)."""

    root: Path
    subject_dir: Path
    config: WorldConfig
    heldout_loss: float
    unigram_entropy: float
    train_seconds: float
    loss_curve_png: Path
    summary_json: Path
    summary: dict[str, Any]
    from_cache: bool = False


def resolve_config(preset_or_config: str | WorldConfig) -> WorldConfig:
    if isinstance(preset_or_config, WorldConfig):
        return preset_or_config
    if preset_or_config not in WORLD_PRESETS:
        raise ValueError(f"unknown world preset {preset_or_config!r}; choose one of {sorted(WORLD_PRESETS)}")
    return WORLD_PRESETS[preset_or_config]


def seeded_config(preset_or_config: str | WorldConfig, seed: int | None = None) -> WorldConfig:
    """The preset's config, with its stories' and subject's seed replaced when ``seed`` is given."""
    config = resolve_config(preset_or_config)
    return config if seed is None or seed == config.seed else dataclasses.replace(config, seed=seed)


def default_cache_dir() -> Path:
    return Path(os.environ.get("NLA_CACHE", "~/.cache/nla")).expanduser() / "world"


def world_dir(config: WorldConfig, out: str | Path | None = None) -> Path:
    base = Path(out) if out is not None else default_cache_dir()
    return base / f"{config.name}-{config.config_hash()}"


def load_world(root: str | Path) -> WorldArtifacts:
    """Open a finished build directory."""
    root = Path(root)
    summary_json = root / "summary.json"
    if not summary_json.exists():
        raise FileNotFoundError(f"{root} is not a finished world build (no summary.json); run `nla world build`")
    summary = load_json(summary_json, "world build's summary", f"rebuild it: nla world build --out {root} --overwrite")
    return WorldArtifacts(
        root=root,
        subject_dir=root / "subject",
        config=WorldConfig.from_yaml(root / "world_config.yaml"),
        heldout_loss=summary["heldout_loss"],
        unigram_entropy=summary["unigram_entropy"],
        train_seconds=summary["train_seconds"],
        loss_curve_png=root / "loss_curve.png",
        summary_json=summary_json,
        summary=summary,
        from_cache=True,
    )


def _bits_key(paths: dict[str, str] | None) -> dict[str, str] | None:
    """The recorded CPU paths a world's bits depend on: all but oneDNN's cap. A world is fp32 work, which
    does not read the cap (tests/test_world_build.py builds one under the pin's cap and lifted, in fresh
    processes, byte for byte the same), and a run with autocast lifts it before its first stage
    (``nla.util.precision.lift_onednn_cap``): keyed on it, such a run would build its cached world again."""
    return None if paths is None else {k: v for k, v in paths.items() if k != "onednn"}


def build_world(
    preset_or_config: str | WorldConfig,
    out: str | Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> WorldArtifacts:
    """Build the world (or return the cached build of the same config unless ``force``)."""
    config = resolve_config(preset_or_config)
    root = world_dir(config, out)
    if (root / "summary.json").exists() and not force:
        cached = load_world(root)
        import torch

        built_with, here = cached.summary.get("cpu_paths"), cpu_paths()
        threads_then, threads = cached.summary.get("torch_threads"), torch.get_num_threads()
        if _bits_key(built_with) == _bits_key(here) and threads_then == threads:
            logger.info("world %s: using cached build %s", config.name, root)
            return cached
        # Other CPU code paths, or another thread count, give other bits (nla.util.numerics,
        # nla.util.threads); a build from before the paths were all recorded may have run any, so it
        # is built again too.
        if _bits_key(built_with) != _bits_key(here):
            logger.warning("world %s: the cached build %s ran %s CPU paths, this process runs %s; building it again",
                           config.name, root, describe_cpu_paths(built_with) if built_with else "unrecorded",
                           describe_cpu_paths(here))
        else:
            logger.warning("world %s: the cached build %s ran %s torch threads, this process runs %d; building it "
                           "again", config.name, root, threads_then, threads)
        force = True
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".tmp-{root.name}-{uuid.uuid4().hex[:8]}"
    try:
        _build_into(config, tmp, progress)
        if root.exists() and (root / "summary.json").exists() and not force:
            # Another process built the same config meanwhile (same seed, same result): use it.
            logger.info("world %s: another process finished %s first; using it", config.name, root)
            return load_world(root)
        if root.exists():  # force: swap the old build out only once the new one is complete
            trash = root.parent / f".old-{root.name}-{uuid.uuid4().hex[:8]}"
            root.rename(trash)
            tmp.rename(root)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    artifacts = load_world(root)
    return dataclasses.replace(artifacts, from_cache=False)


def explanation_samples(config: WorldConfig, docs: list[Document]) -> list[str]:
    """Text-explainer outputs for random (document, word end) positions of the training docs."""
    rng = random.Random(f"nla-world-explanations:{config.seed}")
    explainer = TextExplainer(seed=config.seed, wrong_rate=config.explainer_wrong_rate)
    out = []
    for key in range(int(config.chat_fraction * len(docs))):
        doc = rng.choice(docs)
        end = rng.choice(unit_ends(doc.text))  # after a word or a mark: the quotation ends in either
        out.append(explainer.explain(facts_at(doc, end), key, text_end(doc, end)))
    return out


def _build_into(config: WorldConfig, tmp: Path, progress: bool) -> None:
    # Heavy imports here so `import nla.world` stays light for the generator and grader.
    import torch

    from nla.world.subject import (
        ModelShape,
        PretrainSettings,
        build_model,
        count_params,
        evaluate_loss,
        pack_blocks,
        pack_state_blocks,
        pretrain,
        unigram_entropy,
    )
    from nla.world.tokenizer import canonical_av_messages, marker_ids, train_tokenizer

    t_start = time.perf_counter()
    tmp.mkdir(parents=True)
    docs = generate_documents(config.seed, config.n_docs)
    heldout = generate_documents(config.seed, config.n_heldout_docs, start_id=config.heldout_start)
    explanations = explanation_samples(config, docs)
    tagged = [f"<explanation>\n{e}\n</explanation>" for e in explanations]
    av_prompt_text = DEFAULT_AV_TEMPLATE.format(injection_char="")
    tok_texts = [d.text for d in docs] + tagged + [DEFAULT_AR_TEMPLATE.format(explanation=e) for e in explanations]
    tok_texts += [av_prompt_text] * max(1, len(explanations))
    logger.info("world %s: training tokenizer (vocab %d) on %d texts", config.name, config.vocab_size, len(tok_texts))
    tok = train_tokenizer(tok_texts, config.vocab_size)

    # Half the explanations as AV chat samples, half in the AR template.
    # Stories carry their per-token state (fact indices) for the state objective; explanations none.
    fact_index = {f: i for i, f in enumerate(all_facts())}
    samples: list[tuple[list[int], list[list[int]] | None]] = []
    for d in docs:
        enc = tok(d.text, add_special_tokens=False, return_offsets_mapping=True)
        states = [[fact_index[f] for f in fs] for fs in token_facts(d, enc["offset_mapping"])]
        samples.append((enc["input_ids"], states))
    for i, (e, t) in enumerate(zip(explanations, tagged, strict=True)):
        if i % 2 == 0:
            messages = canonical_av_messages() + [{"role": "assistant", "content": t}]
            text = tok.apply_chat_template(messages, tokenize=False)
        else:
            text = DEFAULT_AR_TEMPLATE.format(explanation=e)
        samples.append((tok.encode(text, add_special_tokens=False), None))
    random.Random(f"nla-world-order:{config.seed}").shuffle(samples)
    blocks = pack_blocks([ids for ids, _ in samples], config.seq_len, tok.eos_token_id)
    state = None
    if config.state_weight > 0:
        state = pack_state_blocks([st for _, st in samples], [len(ids) for ids, _ in samples], config.seq_len,
                                  len(fact_index))
    heldout_blocks = pack_blocks(
        [tok.encode(d.text, add_special_tokens=False) for d in heldout], config.seq_len, tok.eos_token_id
    )

    shape = ModelShape(len(tok), config.d_model, config.n_layers, config.n_heads, config.d_ff, config.seq_len)
    model = build_model(shape, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=config.seed)
    n_params = count_params(model)
    logger.info(
        "world %s: pretraining %.2fM params on %d blocks x %d tokens for %d steps",
        config.name, n_params / 1e6, blocks.shape[0], config.seq_len, config.train_steps,
    )
    settings = PretrainSettings(
        steps=config.train_steps, batch_size=config.batch_size, lr=config.lr,
        warmup_steps=config.warmup_steps, weight_decay=config.weight_decay, seed=config.seed,
        state_layer=config.default_layer if config.state_weight > 0 else None, state_weight=config.state_weight,
    )
    result = pretrain(model, blocks, settings, progress=progress, state=state)
    heldout_loss = evaluate_loss(model, heldout_blocks)
    entropy = unigram_entropy(heldout_blocks)

    subject_dir = tmp / "subject"
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(subject_dir, safe_serialization=True)
    save_tokenizer(tok, subject_dir)
    (tmp / "world_config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    _plot_losses(result.losses, heldout_loss, entropy, tmp / "loss_curve.png", config.name)

    inj, left, right = marker_ids(tok)
    summary = {
        "name": config.name,
        "config_hash": config.config_hash(),
        "format_version": WORLD_FORMAT_VERSION,
        "n_docs": config.n_docs,
        "n_heldout_docs": config.n_heldout_docs,
        "n_explanation_samples": len(explanations),
        "train_tokens": int(blocks.numel()),
        "heldout_tokens": int(heldout_blocks.numel()),
        "vocab_size": len(tok),
        "n_params": n_params,
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "default_layer": config.default_layer,
        "heldout_loss": heldout_loss,
        "unigram_entropy": entropy,
        "final_train_loss": result.losses[-1],
        "final_state_loss": result.state_losses[-1] if result.state_losses else None,
        "train_seconds": result.seconds,
        "train_tokens_seen": result.tokens,
        "tokens_per_second": result.tokens / max(result.seconds, 1e-9),
        "build_seconds": time.perf_counter() - t_start,
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": cpu_kernels(),  # nla.util.numerics: which CPU kernels ATen ran (AVX2 unless overridden)
        "cpu_paths": cpu_paths(),  # and every numeric library's code path, read back
        "injection_token_id": inj,
        "injection_left_neighbor_id": left,
        "injection_right_neighbor_id": right,
        "train_losses": result.losses,
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1))


def _plot_losses(losses: list[float], heldout: float, entropy: float, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless; never open a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label="train loss", lw=1)
    ax.axhline(heldout, color="C1", ls="--", label=f"held-out loss {heldout:.3f}")
    ax.axhline(entropy, color="C2", ls=":", label=f"unigram entropy {entropy:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(f"world '{name}' subject pretraining")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
