"""`nla plan --shape qwen2.5-7b --layer 20 [...]`: the memory an RL step will hold, before anything loads.

The shape is a preset (``nla.core.shapes.SHAPES``: the config.json numbers of real models) or a
checkpoint's own ``config.json`` (``--model DIR``); the plan (``nla.rl.plan``) gives each role's
weights, training state and each phase's peak, and whether it fits a device.
"""

from __future__ import annotations

import argparse

from nla.util.flags import non_negative_int, positive_int

# Cards the plan is compared with when no --device-memory is given (GiB as their drivers report it).
CARDS = {"RTX 4090 (24 GB)": 23.6, "A100 40 GB": 39.4, "A100/H100 80 GB": 79.1, "H200 (141 GB)": 139.8}


def _gib(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB as a number > 0, found {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected GiB as a number > 0, found {text!r}")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    from nla.core.shapes import SHAPES

    p = sub.add_parser("plan", help="the memory an RL step will hold per role, and what fits on which card")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=sorted(SHAPES), help="a real model's shape (numbers, no weights)")
    src.add_argument("--model", help="a Hugging Face model dir: its config.json")
    p.add_argument("--layer", type=non_negative_int, required=True, help="K: the AR keeps blocks 0..K")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--lora-r", type=non_negative_int, default=0, help="the AV's LoRA rank (0: full fine-tuning)")
    p.add_argument("--ar-lora-r", type=non_negative_int, default=0)
    p.add_argument("--prompts", type=positive_int, default=128, help="rollout_batch_size")
    p.add_argument("--samples", type=positive_int, default=8, help="n_samples_per_prompt")
    p.add_argument("--max-response-len", type=positive_int, default=150)
    p.add_argument("--micro-batch", type=positive_int, default=8)
    p.add_argument("--ar-len", type=positive_int, default=192, help="AR text tokens (reconstructor.max_length)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="the AV's policy update")
    p.add_argument("--ar-gradient-checkpointing", action="store_true")
    p.add_argument("--device-memory", type=_gib, help="GiB of the card to check against (default: common cards)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nla.core.shapes import ModelShape, get_shape
    from nla.rl.plan import GIB, PlanSettings, plan_rl_step

    if args.model:
        from transformers import AutoConfig

        from nla.util.checkpoint_files import check_checkpoint

        check_checkpoint(args.model, "--model")
        shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(args.model), name=args.model)
    else:
        shape = get_shape(args.shape)
    plan = plan_rl_step(shape, PlanSettings(
        layer=args.layer, dtype=args.dtype, lora_r=args.lora_r, ar_lora_r=args.ar_lora_r, prompts=args.prompts,
        samples=args.samples, max_response_len=args.max_response_len, micro_batch=args.micro_batch,
        ar_len=args.ar_len, gradient_checkpointing=args.gradient_checkpointing,
        ar_gradient_checkpointing=args.ar_gradient_checkpointing))
    device = int(args.device_memory * GIB) if args.device_memory else None
    print(plan.table(device))
    if device is None:
        print("\n" + "\n".join(f"- {card}: {'fits' if plan.fits(int(g * GIB)) else 'does not fit'}"
                               for card, g in CARDS.items()))
    return 0 if device is None or plan.fits(device) else 3
