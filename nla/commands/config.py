"""`nla config describe {rl,ar,av,datagen,world} [SECTION]`: every field of a stage config, explained.

Each field's name (dotted into its section, as ``--set`` takes it), type, default and help
(meaning, unit, valid range), read from the config dataclass itself (``nla.util.confighelp``),
so what it prints is what the stage reads.
"""

from __future__ import annotations

import argparse
import importlib

# config name -> (module, class, how the stage reads it)
CONFIGS = {
    "rl": ("nla.rl.config", "RLConfig", "nla rl --config FILE --set SECTION.KEY=VALUE"),
    "ar": ("nla.train.config", "ARTrainConfig", "nla train ar --config FILE --set KEY=VALUE"),
    "av": ("nla.train.config", "AVTrainConfig", "nla train av --config FILE --set KEY=VALUE"),
    "datagen": ("nla.datagen.config", "DatagenConfig", "nla datagen run --config FILE --set KEY=VALUE"),
    "world": ("nla.world.build", "WorldConfig", "nla world build --config FILE"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="explain a stage config's fields: type, default, meaning, range")
    steps = p.add_subparsers(dest="config_step", metavar="STEP")
    d = steps.add_parser("describe", help="every field of a config (or of one section), with its help")
    d.add_argument("config", choices=sorted(CONFIGS), help="which stage's config")
    d.add_argument("section", nargs="?", help="only this section or field (e.g. loss, reward.overlong_buffer_len)")
    d.set_defaults(func=describe)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def config_class(name: str) -> type:
    module, cls, _ = CONFIGS[name]
    return getattr(importlib.import_module(module), cls)


def describe(args: argparse.Namespace) -> int:
    from nla.util.confighelp import describe as describe_fields

    _, cls, usage = CONFIGS[args.config]
    print(describe_fields(config_class(args.config), args.section, title=f"{cls} ({usage})"), end="")
    return 0
