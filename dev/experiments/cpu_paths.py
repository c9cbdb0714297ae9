"""Which library decides each op's bits: replay every op a tiny quickstart runs under several CPU settings.

Issue 61. Step 1 runs `nla quickstart --preset tiny` in this process under a TorchDispatchMode that
keeps, per ATen op, the inputs of its first few calls of distinct shapes. Step 2 replays each kept
call in a fresh process per setting (seeded, inputs cloned, fixed threads) and hashes its outputs.
Step 3 prints, for pairs of settings, the ops whose bits differ: an op that differs between two
settings depends on what they change.

    python -m dev.experiments.cpu_paths --out DIR            # capture, replay, compare
    python -m dev.experiments.cpu_paths --out DIR --replay   # replay and compare an earlier capture

Across machines (where two CPUs give a stage other numbers under the same pin), the first op that
differs names the culprit: every op before it saw the same inputs on both machines.

    python -m dev.experiments.cpu_paths trace --out A.json -- train av --config RUN/av/checkpoints/step_*/train_config.yaml --max-steps 1 --out /tmp/t --overwrite
    python -m dev.experiments.cpu_paths diff A.json B.json   # the first op whose output differs

`cpu_paths_av_trace_xeon.json` beside this file is the reference: the first 8,000 op calls of the
default quickstart's AV warm-start (seed 0, 2 threads, `NLA_CACHE=<empty> nla quickstart`, then the
trace command above on its `av/checkpoints/step_00001500/train_config.yaml`), on an Intel Xeon
with AVX-512 and AMX under nla's pin (2026-12-05). Traced the same way on another CPU, `diff`
names the first op that machine computes otherwise. With NLA_CPU_PIN=off on that Xeon it is call
1134, `aten.mm` on [2368, 128] x [128, 128] (MKL's AVX-512 branch).

Settings (names used in the comparison):
- free: nothing pinned (each library chooses by CPU)
- aten: ATEN_CPU_CAPABILITY=avx2 only (nla's pin before issue 61)
- mkl: aten + MKL_CBWR=AVX2
- mkl_strict: aten + MKL_CBWR=AVX2,STRICT
- mkl_isa: aten + MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's instruction cap, not its CNR branch)
- mkl_dyn: mkl + MKL_DYNAMIC=FALSE
- onednn: mkl + ONEDNN_MAX_CPU_ISA=AVX2
- nla: nla's pin (import nla in a clean environment)

Measured on an Intel Xeon (AVX-512, AMX), torch 2.13, 2 threads (2026-12-05; dev/LOG.md):
aten vs free: softmax, log-softmax and attention; mkl vs aten: mm, bmm, dot, linear, the CPU flash
attention forward and backward, exp, log, sqrt; mkl_isa = mkl; mkl_dyn = mkl; onednn = mkl (no op
reaches oneDNN); mkl_strict vs mkl: mm, linear and attention (a different mode, not a CPU path).
NumPy and OpenBLAS are outside ATen's dispatch; tests/cpu_paths_workload.py covers them.
"""

from __future__ import annotations

# isort: off
import nla  # noqa: F401  (first: the CPU pin, before torch or NumPy load; NLA_CPU_PIN=off for the libraries' own choice)
# isort: on

import argparse
import collections
import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from nla.util.numerics import pins  # noqa: E402

# nla's pin variables, and MKL's instruction cap, which the settings below compare with its CNR branch
PIN_VARS = (*(p.var for p in pins()), "MKL_ENABLE_INSTRUCTIONS")
_ATEN = {"ATEN_CPU_CAPABILITY": "avx2"}
SETTINGS: dict[str, dict[str, str] | None] = {
    "free": {"NLA_CPU_PIN": "off"},
    "aten": dict(_ATEN),
    "mkl": {**_ATEN, "MKL_CBWR": "AVX2"},
    "mkl_strict": {**_ATEN, "MKL_CBWR": "AVX2,STRICT"},
    "mkl_isa": {**_ATEN, "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl_dyn": {**_ATEN, "MKL_CBWR": "AVX2", "MKL_DYNAMIC": "FALSE"},
    "onednn": {**_ATEN, "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "nla": None,  # nla's own pin
}
PAIRS = [("aten", "free"), ("mkl", "aten"), ("mkl_isa", "mkl"), ("mkl_dyn", "mkl"), ("onednn", "mkl"),
         ("mkl_strict", "mkl"), ("nla", "onednn")]


def capture(out: Path, per_op: int) -> Path:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    from nla.cli import main

    seen: dict[str, set] = collections.defaultdict(set)
    samples: list = []

    def signature(args) -> tuple:
        return tuple((tuple(a.shape), str(a.dtype), a.is_contiguous()) for a in args if isinstance(a, torch.Tensor))

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name, key = str(func), signature(args)
            small = all(not isinstance(a, torch.Tensor) or (a.device.type == "cpu" and a.numel() < 5_000_000
                                                            and a.layout == torch.strided)
                        for a in (*args, *kwargs.values()))
            if small and len(seen[name]) < per_op and key not in seen[name]:
                seen[name].add(key)
                item = (name, tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                       (args, kwargs)))
                try:
                    torch.save(item, io.BytesIO())  # some arguments (modules, generators) cannot be kept
                    samples.append(item)
                except Exception:  # noqa: BLE001
                    pass
            return func(*args, **kwargs)

    with Keep():
        code = main(["quickstart", "--preset", "tiny", "--out", str(out / "run"), "--no-progress", "--overwrite"])
    if code != 0:
        raise SystemExit(f"the tiny quickstart failed ({code})")
    path = out / "ops.pt"
    torch.save(samples, path)
    print(f"kept {len(samples)} calls of {len(seen)} ops -> {path}")
    return path


def replay(ops: Path, result: Path, threads: int) -> None:
    """In this process (started with the setting's environment): each kept call's output digest."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    torch.set_num_threads(threads)
    digests = {}
    for i, (name, (args, kwargs)) in enumerate(torch.load(ops, weights_only=False)):
        torch.manual_seed(0)
        args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        ns, op, overload = name.split(".")
        try:
            out = getattr(getattr(getattr(torch.ops, ns), op), overload)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            digests[f"{i}:{name}"] = f"error {type(exc).__name__}"
            continue
        h = hashlib.sha256()
        for leaf in tree_leaves((out, args)):  # in-place ops write their inputs
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.numel():
                h.update(leaf.detach().clone(memory_format=torch.contiguous_format).reshape(-1)
                         .view(torch.uint8).numpy().tobytes())
        digests[f"{i}:{name}"] = h.hexdigest()[:16]
    result.write_text(json.dumps(digests))


def run_setting(name: str, ops: Path, out: Path, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS}
    setting = SETTINGS[name]
    first = "import nla; " if setting is None else ""
    env.update(setting or {})
    result = out / f"replay_{name}.json"
    code = (f"{first}from dev.experiments.cpu_paths import replay; from pathlib import Path; "
            f"replay(Path({str(ops)!r}), Path({str(result)!r}), {threads})")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(result.read_text())


def trace(out: Path, command: list[str], limit: int) -> int:
    """Run an `nla` command with every ATen op's output digested, in call order (the first ``limit``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from nla.cli import main as nla_main
    from nla.util.numerics import cpu_paths

    calls: list[list] = []

    class Enough(BaseException):  # not an Exception: the CLI reports those as errors and goes on
        pass

    class Digest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if len(calls) >= limit:
                raise Enough
            if "empty" not in str(func):  # empty: uninitialised memory
                h = hashlib.sha256()
                for leaf in tree_leaves(result):
                    if (isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.numel()
                            and leaf.device.type != "meta"):  # meta: a model built before its weights load
                        h.update(leaf.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
                                 .view(torch.uint8).numpy().tobytes())
                shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
                calls.append([str(func), shapes, h.hexdigest()[:16]])
            return result

    code = 0
    try:
        with Digest():
            code = nla_main(command)
    except Enough:
        pass  # the command stops at the limit: a trace of its first op calls
    out.write_text(json.dumps({"command": command, "cpu_paths": cpu_paths(), "calls": calls}))
    print(f"{len(calls)} op calls digested -> {out} (exit {code})")
    return code


def diff(a: Path, b: Path) -> int:
    """The first op call whose output differs between two traces of the same command."""
    ta, tb = json.loads(a.read_text()), json.loads(b.read_text())
    print(f"A: {ta['cpu_paths']}\nB: {tb['cpu_paths']}")
    for i, (x, y) in enumerate(zip(ta["calls"], tb["calls"], strict=False)):
        if x[:2] != y[:2]:
            print(f"call {i}: the two runs called different ops ({x[:2]} vs {y[:2]}): an earlier difference "
                  "outside ATen's ops (data, Python) or a control-flow change")
            return 1
        if x[2] != y[2]:
            print(f"call {i}: {x[0]} on inputs of shapes {x[1]} is the first op whose output differs")
            return 1
    print(f"the first {min(len(ta['calls']), len(tb['calls']))} op calls agree")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trace"]:
        sep = argv.index("--")
        tp = argparse.ArgumentParser(prog="cpu_paths trace")
        tp.add_argument("--out", type=Path, required=True)
        tp.add_argument("--limit", type=int, default=20_000,
                        help="op calls digested, from the first; the command is stopped there")
        targs = tp.parse_args(argv[1:sep])
        return trace(targs.out, argv[sep + 1:], targs.limit)
    if argv[:1] == ["diff"]:
        return diff(Path(argv[1]), Path(argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--per-op", type=int, default=4, help="calls kept per op (distinct input shapes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replay", action="store_true", help="replay an earlier capture in --out")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ops = args.out / "ops.pt" if args.replay else capture(args.out, args.per_op)
    results = {}
    for name in SETTINGS:
        print(f"replaying under {name} ...", flush=True)
        results[name] = run_setting(name, ops, args.out, args.threads)
    report = {}
    for a, b in PAIRS:
        differ = sorted({k.split(":", 1)[1] for k in results[a]
                         if results[a][k] != results[b].get(k) and "empty" not in k})  # empty: uninitialised
        report[f"{a} vs {b}"] = differ
        print(f"{a} vs {b}: {len(differ)} ops differ{': ' + ', '.join(differ) if differ else ''}")
    (args.out / "cpu_paths.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
