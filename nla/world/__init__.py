"""The world: a synthetic corpus with exact ground truth, its tokenizer and subject model.

Light imports only here (generator, facts, grader); the tokenizer and subject model
pull in ``transformers`` and are imported from their modules (docs/design.md §5).
"""

from nla.world.build import WORLD_PRESETS, WorldArtifacts, WorldConfig, build_world, load_world, world_dir
from nla.world.explain import Grade, TextExplainer, grade, parse_facts, render_facts
from nla.world.facts import KINDS, Document, Fact, all_facts, current_word, facts_at, text_end, token_facts
from nla.world.generator import generate_documents

__all__ = [
    "KINDS",
    "WORLD_PRESETS",
    "Document",
    "Fact",
    "Grade",
    "TextExplainer",
    "WorldArtifacts",
    "WorldConfig",
    "all_facts",
    "build_world",
    "current_word",
    "text_end",
    "facts_at",
    "generate_documents",
    "grade",
    "load_world",
    "parse_facts",
    "render_facts",
    "token_facts",
    "world_dir",
]
