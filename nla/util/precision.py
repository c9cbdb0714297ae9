"""Mixed precision: matmuls in bf16 under ``torch.autocast``, weights, optimiser state and losses in fp32.

A training stage or RL run with ``autocast: bfloat16`` runs its forwards under ``torch.autocast``
(PyTorch's own mixed precision: linear layers and attention in bf16, norms, softmaxes and the
residual stream in fp32; the backward follows the forward's dtypes). nla adds the NLA-specific
parts torch cannot know:

- **the heads stay fp32** (``keep_heads_fp32``): the AV's LM head (its logits feed log-probs, the
  KL to the reference and the SFT loss; bf16 logits of 10 are off by 0.04) and the AR's value head
  (its prediction is the reward);
- **the CPU's bf16 kernels**: on a CPU torch's bf16 matmuls are oneDNN's, which nla's CPU pin caps
  at AVX2 (``nla.util.numerics``), where bf16 is emulated: its matmuls ran at 0.01-0.03x fp32's rate on an
  AMD EPYC. ``prepare_autocast`` lifts that cap (the pin's own value only; a value the user set stays),
  refuses a CPU without bf16 instructions (AVX512_BF16 or AMX), where bf16 is slower than fp32
  whatever the cap, and refuses a process whose first matmul ran under the cap (``lift_onednn_cap``:
  torch settles its bf16 kernels then); the runs that use autocast lift the cap at their start.

What it buys depends on the model: SmolLM2-135M's SFT steps ran 1.9-2.2x faster on an AMD EPYC
(Zen 5, AVX512_BF16), the default world's 1M-parameter RL step not at all (its step is bound by
small ops, not matmuls; BENCHMARKS.md, "Mixed precision on the CPU"). The numbers it gives are that
CPU kind's own: bf16 kernels differ by instruction set, so the pin's promise (the same numbers on
every x86 machine) does not hold under it, and the same seed may differ from the fp32 run's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["AUTOCAST_DTYPES", "autocast", "bf16_kernels_ready", "bf16_native", "check_bf16_kernels",
           "keep_heads_fp32", "lift_onednn_cap", "onednn_setting", "prepare_autocast"]

logger = logging.getLogger(__name__)

AUTOCAST_DTYPES = ("bfloat16",)
# CPU flags of native bf16 arithmetic (/proc/cpuinfo): AVX-512's dot product, or AMX's tiles
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ONEDNN_VAR = "ONEDNN_MAX_CPU_ISA"


def bf16_native(flags: set[str] | None = None) -> bool:
    """Whether this CPU has bf16 instructions (``BF16_FLAGS``); ``flags``: the CPU's (default: read)."""
    from nla.util.numerics import cpu_flags

    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_FLAGS)


def prepare_autocast(name: str | None, device: torch.device, field: str = "autocast",
                     flags: set[str] | None = None) -> None:
    """Before a stage's first bf16 op: on a CPU, refuse one without bf16 instructions, and lift the CPU
    pin's cap on oneDNN (module docstring). Nothing for ``None`` or a GPU."""
    if name is None or device.type != "cpu":
        return
    if not bf16_native(flags):
        raise ValueError(
            f"{field}: {name} runs emulated on this CPU (no {' or '.join(BF16_FLAGS)} in its flags), slower than "
            f"float32: set {field}: null, or run on a CPU with AVX512_BF16 or AMX, or a GPU")
    lift_onednn_cap(field)
    check_bf16_kernels(field, flags)


def lift_onednn_cap(field: str = "autocast") -> None:
    """Lift the CPU pin's ``ONEDNN_MAX_CPU_ISA=AVX2`` to ``ALL`` (a value the user set stays), so that bf16
    matmuls get oneDNN's bf16 kernels. Idempotent.

    It must come before the process's first matmul of any dtype: torch decides once per process, at
    its first matmul (fp32 included) or bf16 check, whether oneDNN has bf16 kernels, reading the cap as
    it is then; decided under the pin's AVX2 cap, every bf16 matmul after it runs on torch's reference
    kernel, about 300x slower (measured: 3 against 937 GFLOP/s on an AMD EPYC). So a run that will use
    autocast lifts the cap at its start (``nla.quickstart.run_quickstart`` before its first stage,
    ``nla.rl.loop.run_rl`` before building its roles), and ``check_bf16_kernels`` refuses a process
    where it came too late. fp32 work does not read the cap (measured: SmolLM2-135M's fp32 forward and
    backward gave the same bits under either; the world's tiny subject is held to it by
    tests/test_precision.py), so the stages before an autocast one keep their numbers and their
    cache keys (``onednn_setting``)."""
    global _BEFORE_LIFT
    if os.environ.get(ONEDNN_VAR) == _pinned_onednn():  # the pin's cap, not the user's: bf16 needs oneDNN's widest
        _BEFORE_LIFT = os.environ[ONEDNN_VAR]
        os.environ[ONEDNN_VAR] = "ALL"
        logger.info("%s: %s lifted to ALL for bf16 matmuls (torch reads it at the process's first matmul)", field,
                    ONEDNN_VAR)


def bf16_kernels_ready() -> bool | None:
    """Whether torch will run bf16 matmuls on oneDNN's bf16 kernels in this process (None: this torch has
    no way to ask). Asking fixes the answer for the process, as a matmul does (``lift_onednn_cap``)."""
    ask = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    return None if ask is None else bool(ask())


def check_bf16_kernels(field: str = "autocast", flags: set[str] | None = None) -> None:
    """Refuse to go on where this CPU has bf16 instructions but torch has already settled, under the pin's
    cap, that oneDNN has no bf16 kernels (``lift_onednn_cap``): every bf16 matmul would run ~300x slower.
    ``flags``: the CPU's (default: read); a CPU without bf16 instructions is ``prepare_autocast``'s to refuse."""
    if not bf16_native(flags):
        return
    if bf16_kernels_ready() is False:
        raise RuntimeError(
            f"{field}: this process ran a matmul before {ONEDNN_VAR} was lifted from the CPU pin's "
            f"{_BEFORE_LIFT or _pinned_onednn()}, so torch runs bf16 matmuls on its reference kernel (about 300x "
            "slower than oneDNN's bf16 kernels): run the autocast stage in a fresh process (nla train, nla rl "
            f"and nla quickstart --autocast lift the cap first), or start it with {ONEDNN_VAR}=ALL, or set "
            f"{field}: null")


def _pinned_onednn() -> str | None:
    from nla.util.numerics import pins

    return {p.var: p.value for p in pins()}.get(ONEDNN_VAR)


# ONEDNN_MAX_CPU_ISA as it was before prepare_autocast lifted it in this process (None: never lifted)
_BEFORE_LIFT: str | None = None


def onednn_setting(name: str | None) -> str:
    """The ``ONEDNN_MAX_CPU_ISA`` a stage runs with, whatever ran before it in this process (a cache key:
    ``nla.quickstart``): with autocast ``name``, the value ``prepare_autocast`` gives it; without, the value
    before any lift. "" where it is unset."""
    before = os.environ.get(ONEDNN_VAR, "") if _BEFORE_LIFT is None else _BEFORE_LIFT
    return "ALL" if name is not None and before == _pinned_onednn() else before


@contextlib.contextmanager
def autocast(device: torch.device, name: str | None) -> Iterator[None]:
    """``torch.autocast`` to ``name`` on ``device``'s type; nothing for None."""
    if name is None:
        yield
        return
    with torch.autocast(device.type, dtype=getattr(torch, name)):
        yield


def _heads(model: nn.Module) -> list[nn.Module]:
    heads = []
    value_head = getattr(model, "value_head", None)
    if isinstance(value_head, nn.Module):
        heads.append(value_head)
    exit_heads = getattr(model, "exit_heads", None)  # an AR reading each row at its own block: a head a block
    if isinstance(exit_heads, nn.ModuleDict):
        heads.extend(exit_heads.values())
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if isinstance(out, nn.Module):
        heads.append(out)
    return heads


def keep_heads_fp32(model: nn.Module) -> int:
    """Make ``model``'s heads (an AR's ``value_head``, a causal LM's output embeddings) run in fp32 inside
    an autocast region: hooks that switch autocast off for the head and feed it fp32 input. Outside
    autocast they do nothing. Idempotent; returns the number of heads hooked now."""
    n = 0
    for head in _heads(model):
        if getattr(head, "_nla_fp32_head", False):
            continue
        states: list[torch.autocast | None] = []  # a stack: the region each call of the head opened

        def before(_m: nn.Module, args: tuple, _states=states) -> tuple | None:
            x = args[0] if args else None
            dev = x.device.type if torch.is_tensor(x) else "cpu"
            if not torch.is_autocast_enabled(dev):
                _states.append(None)
                return None
            ctx = torch.autocast(dev, enabled=False)
            ctx.__enter__()
            _states.append(ctx)
            return (x.float(), *args[1:]) if torch.is_tensor(x) and x.is_floating_point() else None

        def after(_m: nn.Module, _args: tuple, _out: object, _states=states) -> None:
            ctx = _states.pop() if _states else None
            if ctx is not None:
                ctx.__exit__(None, None, None)

        head.register_forward_pre_hook(before)
        head.register_forward_hook(after, always_call=True)
        head._nla_fp32_head = True
        n += 1
    return n
