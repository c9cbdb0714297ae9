"""The package's layers hold (docs/design.md §8): one order, each layer importing only the layers
below it; no import cycle between modules; no private name imported from another module.

Every ``import`` / ``from … import`` statement counts, the ones inside functions too: a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nla"

# The layers, bottom first: each may import the layers before it, never one after it. "root" is
# nla/__init__.py (its public names load on first use, by module name). docs/design.md §8 and
# docs/index.md draw this order (test_the_docs_draw_the_order).
LAYERS = ("util", "core", "world", "datagen", "train", "rl", "client", "eval",
          "quickstart", "explore", "serve", "commands", "root", "cli")
BELOW = {layer: set(LAYERS[:i]) for i, layer in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1]


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every nla import in the file, resolved to a module
    where the name is a submodule."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nla":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub, None) if sub in MODULES else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "nla"]
    return out


def _deps() -> dict[str, set[str]]:
    return {m: {d for d, _ in _imports(p) if d in MODULES and d != m} for m, p in MODULES.items()}


def test_the_map_sees_every_layer():
    # a renamed or new top-level module must be given its place in LAYERS
    assert {_layer(m) for m in MODULES} == set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_the_layers_below_it(layer):
    bad = sorted(
        f"{m} imports {d} ({_layer(d)} is not below {layer})"
        for m, deps in _deps().items() if _layer(m) == layer
        for d in deps if _layer(d) not in BELOW[layer] | {layer}
    )
    assert not bad, "\n".join(bad)


def _dotted(layer: str) -> str:
    return "nla" if layer == "root" else f"nla.{layer}"


def test_the_docs_draw_the_order():
    root = PKG.parent
    design = (root / "docs" / "design.md").read_text(encoding="utf-8")
    table = design[design.index("**Layering rules**"):]
    drawn = re.findall(r"^\| (\d+) \| `(nla(?:\.\w+)?)`", table, flags=re.M)
    assert [int(n) for n, _ in drawn] == list(range(1, len(LAYERS) + 1))
    assert [name for _, name in drawn] == [_dotted(layer) for layer in LAYERS]
    index = (root / "docs" / "index.md").read_text(encoding="utf-8")
    chain = " ".join(index[index.index("## Where things live"):].split("\n\n")[1].split())
    assert re.findall(r"`(nla(?:\.\w+)?)`", chain) == [_dotted(layer) for layer in LAYERS], chain


def test_no_import_cycle():
    deps = _deps()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(deps[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(deps):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_no_private_name_is_imported_from_another_module():
    bad = sorted(
        f"{m} imports {name} from {d}"
        for m, p in MODULES.items()
        for d, name in _imports(p)
        if name and name.startswith("_") and not name.startswith("__") and d != m
    )
    assert not bad, "\n".join(bad)


def test_the_checker_finds_what_it_looks_for(tmp_path):
    # the helpers see lazy imports, submodules and private names
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from nla.core import vectors\n    from nla.train.ar import _x\nimport nla.util.threads\n")
    assert sorted(_imports(src), key=str) == [("nla.core.vectors", None), ("nla.train.ar", "_x"),
                                              ("nla.util.threads", None)]
    assert _layer("nla.core.vectors") == "core" and _layer("nla") == "root"
