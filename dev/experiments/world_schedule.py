"""Can the world pretrain in less compute? Build variants of the default world, probe block 2.

    python -m dev.experiments.world_schedule --out DIR --seeds 0 1 2 --set batch_size=8 [--set lr=0.006 ...]

Builds the ``default`` world preset with the given fields replaced (``WorldConfig`` keys: e.g.
``train_steps``, ``batch_size``, ``lr``, ``state_weight``) for each seed into ``DIR`` (not the
shared cache), then fits the world's linear probe (``nla.world.probe``, the quickstart's probe
settings: 800 training and 150 held-out stories) at the extraction layer only. Prints one JSON
line per seed: the held-out loss, the pretraining seconds, and each kind's probe top-1. The
default's own figures (1,200 steps x 16 blocks, lr 3e-3) are in every quickstart run's
``probe.json``. Issue 47 asked whether the world's pretraining can be cut; dev/LOG.md 2026-12-05
("Cuts that did not hold") has what this measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def _parse_set(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set: expected KEY=VALUE, found {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    from nla.util.threads import apply_threads
    from nla.world.build import WORLD_PRESETS, build_world
    from nla.world.probe import probe_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where the variant worlds are built")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--set", dest="fields", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    base = WORLD_PRESETS["default"]
    names = {f.name for f in dataclasses.fields(base)}
    changes = {}
    for key, value in _parse_set(args.fields).items():
        if key not in names or key in ("name", "seed"):
            raise SystemExit(f"--set {key}: not a WorldConfig field to vary; choose from "
                             f"{sorted(set(names) - {'name', 'seed'})}")
        changes[key] = type(getattr(base, key))(value)
    for seed in args.seeds:
        config = dataclasses.replace(base, seed=seed, **changes)
        apply_threads(args.threads)
        start = time.perf_counter()
        world = build_world(config, out=args.out, progress=False)
        (layer,) = probe_world(world, layers=[config.default_layer], n_train_docs=800, n_test_docs=150)
        print(json.dumps({
            "seed": seed, "changes": changes, "heldout_loss": round(world.heldout_loss, 4),
            "train_seconds": round(world.train_seconds, 1), "wall_seconds": round(time.perf_counter() - start, 1),
            "probe_top1": {k.kind: round(k.top1, 3) for k in layer.kinds},
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
