"""Every config field explains itself: its help is declared with the field, and the CLI shows it.

A stage config (train, datagen, RL, world) is a frozen dataclass; each field is declared with
:func:`option`, which puts its help (meaning, unit, valid range) in the field's metadata. The
type and the default come from the declaration itself, so they cannot drift from the help:

1. :func:`describe` lists every field of a config, nested sections included (``loss.eps_high``),
   as ``nla config describe`` prints it: the top-level fields, then each section's.
2. :func:`field_help` gives one field's help by its dotted name, for the errors that name a field
   (:func:`with_help`).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import MISSING, dataclass
from typing import Any

__all__ = ["HELP", "FieldDoc", "describe", "field_help", "option", "sections", "with_help"]

HELP = "help"  # the metadata key


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING) -> Any:
    """A dataclass field whose help is declared with it: ``lr: float = option(1e-4, help="...")``.

    ``help`` says what the field means, its unit and its valid range; the type and the default
    are the declaration's.
    """
    if not help.strip():
        raise ValueError("option: every config field needs its help (meaning, unit, valid range)")
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={HELP: help})
    return dataclasses.field(default=default, metadata={HELP: help})


@dataclass(frozen=True)
class FieldDoc:
    """One field as ``describe`` shows it: dotted name, declared type, default, help."""

    name: str
    type: str
    default: str
    help: str


def _section_type(hint: Any) -> type | None:
    """The dataclass a field holds when it is a nested section, else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _shown(value: Any) -> str:
    """A default as it is written in YAML (``null``, ``true``, ``"grpo"``, ``[0.9, 0.999]``)."""
    if value is MISSING:
        return "(required)"
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value, ensure_ascii=False)
    except TypeError:
        return repr(value)


def sections(cls: type) -> list[str]:
    """The names of ``cls``'s nested sections (``rollout``, ``loss``, ...)."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if _section_type(hints.get(f.name)) is not None]


def field_help(cls: type, name: str) -> str | None:
    """The help of field ``name`` of ``cls`` (dotted into sections: ``loss.eps_high``); None when
    ``name`` is no field."""
    head, _, rest = name.partition(".")
    for f in dataclasses.fields(cls):
        if f.name == head:
            if not rest:
                return f.metadata.get(HELP)
            section = _section_type(typing.get_type_hints(cls).get(head))
            return field_help(section, rest) if section is not None else None
    return None


def with_help(message: str, cls: type, name: str, *, label: str | None = None) -> str:
    """``message`` followed by the help of field ``name`` of ``cls`` (an error that names a field says
    what the field is), shown as ``label`` (default ``name``). ``loss.gamma/lam`` names two fields,
    each with its help; ``message`` comes back unchanged when ``name`` names no field."""
    prefix, dot, leaves = name.rpartition(".")
    names = [f"{prefix}{dot}{leaf}" for leaf in leaves.split("/")]
    helps = [(label if label and len(names) == 1 else n, field_help(cls, n)) for n in names]
    shown = "; ".join(f"{n}: {text.rstrip('.')}" for n, text in helps if text)
    return f"{message} ({shown})" if shown else message


def _rows(cls: type, prefix: str = "") -> Iterator[tuple[str, FieldDoc]]:
    """("field", doc) for each field of ``cls`` in declaration order, then per nested section
    ("section", doc with the section's help) and its own rows, as YAML lays them out."""
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        section = _section_type(hints.get(f.name))
        if section is not None:
            nested.append((f, section))
        else:
            yield "field", FieldDoc(f"{prefix}{f.name}", str(f.type), _shown(_default(f)), f.metadata.get(HELP, ""))
    for f, section in nested:
        yield "section", FieldDoc(f"{prefix}{f.name}", section.__name__, "", f.metadata.get(HELP, ""))
        yield from _rows(section, f"{prefix}{f.name}.")


def describe(cls: type, section: str | None = None, *, title: str | None = None, width: int = 100) -> str:
    """What ``nla config describe`` prints: per field ``name (type, default ...)`` with its help below;
    the top-level fields first, then each section under a ``[name]`` line with the section's help.
    ``section``: only the fields under that section or name (``loss``, ``steps``, ``loss.eps_high``);
    a name that matches no field is a ``ValueError`` listing the sections and fields."""
    rows = list(_rows(cls))
    if section:
        rows = [(kind, d) for kind, d in rows if d.name == section or d.name.startswith(section + ".")]
        if not rows:
            top = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"{cls.__name__}: no section or field {section!r}; sections: {sections(cls)}, "
                             f"fields: {[n for n in top if n not in sections(cls)]}")
    lines = [title or cls.__name__, ""]
    for kind, d in rows:
        if kind == "section":
            lines += ([""] if lines[-1] else []) + textwrap.wrap(f"[{d.name}] {d.help}", width=width,
                                                                 subsequent_indent="    ", break_on_hyphens=False)
            continue
        lines.append(f"{d.name} ({d.type}, default {d.default})")
        lines += textwrap.wrap(d.help, width=width, initial_indent="    ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"
