"""The `nla` command line.

Each subcommand lives in `nla/commands/<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func` on it. The CLI
only wires them together, so a stage can be found from docs/design.md in one step.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from nla import __version__

# Subcommand modules, in the order `nla --help` lists them.
COMMANDS = ("world", "datagen", "train", "rl", "plan", "eval", "verbalize", "score", "quickstart", "explore", "serve", "sidecar",
            "config")


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line ``nla CMD: error: ...`` and exit code 2, like every other input error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="nla", description="Natural Language Autoencoders: train and use verbalizer/reconstructor pairs."
    )
    parser.add_argument("--version", action="version", version=f"nla {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"nla.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"nla.commands.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as exc:
        # Our errors name the field, the expected and found values and the fix: show that,
        # not a traceback (-v shows the traceback too).
        if args.verbose:
            raise
        # One line: multi-line messages (HF, OS) are joined so the culprit stays on the error line.
        message = " ".join(str(exc).split("\n")) if str(exc) else type(exc).__name__
        if isinstance(exc, OSError):
            message = os_error_message(exc, getattr(args, "out", None))
        print(f"nla {args.command}: error: {message}", file=sys.stderr)
        return 2


def os_error_message(exc: OSError, out: str | None) -> str:
    """One line for an OS error: what failed, on which file, and what to do. A full disk said only
    "[Errno 28] No space left on device", with no path (issue 58)."""
    import errno

    files = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
    what = exc.strerror or " ".join(str(exc).split())
    where = f" ({' -> '.join(files)})" if files else (f" (writing under --out {out})" if out else "")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk is full{where}: {what}; free space on that filesystem (or a quota), or write to another "
                "--out, then rerun (finished stages and checkpoints are kept)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}: {what}; fix the permissions or choose another path"
    return " ".join(str(exc).split()) or type(exc).__name__  # names its file where the OS gave one


if __name__ == "__main__":
    sys.exit(main())
