"""The world's dataset grader (``nla.graders`` name ``world``): facts, format checks, oracle.

What ``nla eval``, the RL loop and the format penalty read from a world dataset, through the
registry in ``nla.graders``: the core imports none of this module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nla.graders import DatasetGrader
from nla.world.explain import Grade, TextExplainer, degeneracy, grade, oracle_explanation
from nla.world.facts import KINDS, Fact

logger = logging.getLogger(__name__)

__all__ = ["WorldGrader"]


def _truth(facts: Sequence[str] | None) -> list[Fact]:
    try:
        return [Fact.parse(s) for s in (facts or [])]
    except ValueError as err:
        raise ValueError(f"{err}; the facts column must hold 'kind=value' strings of the world") from None


class WorldGrader(DatasetGrader):
    """Fact recall / precision against the row's facts (``nla.world.grade``: quotations are not
    claims), the world's degeneracy checks (``nla.world.explain.degeneracy``), its oracle and its
    ``TextExplainer``."""

    name = "world"
    kinds = KINDS
    degeneracy_checks = ("repeated", "broken_quote", "outside_language")

    def grade(self, explanation: str, truth: Sequence[str]) -> Grade:
        return grade(explanation, _truth(truth))

    def degeneracy(self, text: str | None) -> dict[str, bool]:
        d = degeneracy(text)
        return {"repeated": d.repeated_sentence, "broken_quote": d.broken_quote,
                "outside_language": d.outside_language}

    def oracle(self, truth: Sequence[str], current_word: str | None, key: int) -> str:
        return oracle_explanation(_truth(truth), current_word, key)

    def text_explainer(self, table: Any, dataset_path: Path) -> list[str] | None:
        """The world ``TextExplainer``'s output per row, with the datagen settings recorded in the
        dataset sidecar's provenance (defaults when they cannot be found); None when the table
        carries its own ``explanation`` column or lacks ``facts`` / ``doc_id`` / ``position``."""
        cols = table.column_names
        if "explanation" in cols or not {"facts", "doc_id", "position"} <= set(cols):
            return None
        from nla.datagen.explain import row_key

        seed, kw = 0, {}
        try:
            import yaml

            from nla.datagen.config import DatagenConfig
            from nla.sidecar import load_sidecar

            prov = load_sidecar(dataset_path).training.get("datagen_config")
            if prov and Path(prov).is_file():
                dc = DatagenConfig.from_dict(yaml.safe_load(Path(prov).read_text()) or {})
                w = dc.world_explainer
                seed, kw = dc.seed, dict(min_facts=w.min_facts, max_facts=w.max_facts, wrong_rate=w.wrong_rate,
                                         word_rate=w.word_rate, fact_rate=w.fact_rate)
        except (OSError, ValueError) as err:
            logger.warning("text explainer baseline: cannot read the datagen settings (%s); using defaults", err)
        explainer = TextExplainer(seed=seed, **kw)
        words = table.column("current_word").to_pylist() if "current_word" in cols else [None] * table.num_rows
        return [explainer.explain(frozenset(_truth(fs)), row_key(doc, pos), word)
                for fs, doc, pos, word in zip(table.column("facts").to_pylist(), table.column("doc_id").to_pylist(),
                                              table.column("position").to_pylist(), words, strict=True)]
