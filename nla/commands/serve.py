"""`nla serve --av DIR [--ar DIR] [--host 127.0.0.1 --port 30000] [--allow-host NAME]`: an HTTP server over an AV.

It answers SGLang's ``POST /generate`` (what the published NLA client sends: ``input_embeds`` and
``sampling_params``), so that client can point at it, and nla's own ``/verbalize``, ``/score``
and ``/info``. Concurrent prompts are decoded together (one batcher thread). See docs/serve.md.
Unlike ``nla explore``, a checkpoint that cannot be loaded stops the command at once: without
the AV the server has nothing to answer.
"""

from __future__ import annotations

import argparse
import logging

from nla.util.flags import positive_int
from nla.util.http import LOOPBACK, allowed_hosts, check_bind_host, port_flag
from nla.util.threads import THREADS_HELP, threads_flag

log = logging.getLogger("nla.serve")

DEFAULT_PORT = 30000  # SGLang's default


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="HTTP server over an AV (SGLang's /generate for the published client) and "
                                     "nla's /verbalize, /score")
    p.add_argument("--av", required=True, help="verbalizer checkpoint dir (a LoRA adapter dir works too)")
    p.add_argument("--ar", help="reconstructor checkpoint dir (for /score)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=port_flag, default=DEFAULT_PORT, help=f"TCP port, 1-65535 (default {DEFAULT_PORT})")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests addressed to this host name (repeatable); the names of this "
                        "machine and the bound address are allowed already")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=threads_flag, help=f"torch CPU threads ({THREADS_HELP})")
    # Defaults live in nla.serve.ServeLimits; None here means "its default".
    p.add_argument("--max-batch", type=positive_int, help="prompts decoded together at most (default 64)")
    p.add_argument("--batch-wait-ms", type=float, help="how long the batcher waits for more prompts after the "
                                                      "first (default 2)")
    p.add_argument("--max-new-tokens", type=positive_int, help="cap on sampling_params.max_new_tokens (default 1024)")
    p.add_argument("--max-prompt-tokens", type=positive_int, help="tokens per prompt cap (default 2048)")
    p.add_argument("--max-prompts", type=positive_int, help="prompts per /generate request cap (default 64)")
    p.add_argument("--max-body-mb", type=positive_int, help="request body cap in MiB (default 32)")
    p.set_defaults(func=run)


def limits_of(args: argparse.Namespace):
    from nla.serve import ServeLimits

    given = {"max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms, "max_new_tokens": args.max_new_tokens,
             "max_prompt_tokens": args.max_prompt_tokens, "max_prompts": args.max_prompts,
             "max_body_bytes": args.max_body_mb * 2**20 if args.max_body_mb else None}
    if args.batch_wait_ms is not None and not 0 <= args.batch_wait_ms <= 1000:
        raise ValueError(f"--batch-wait-ms: expected 0..1000, found {args.batch_wait_ms}")
    return ServeLimits(**{k: v for k, v in given.items() if v is not None})


def build(args: argparse.Namespace):
    """The app for ``args`` (the checkpoints loaded); a checkpoint that cannot be used raises."""
    from nla.serve.app import NLAService, create_app
    from nla.util.threads import apply_threads
    from nla.util.validation import check_device

    check_device(args.device)
    check_bind_host(args.host)
    limits = limits_of(args)
    apply_threads(args.threads)
    service = NLAService.load(args.av, args.ar, device=args.device, dtype=args.dtype, limits=limits)
    return create_app(service, allowed_hosts=allowed_hosts(args.host, args.allow_host))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    app = build(args)
    names = allowed_hosts(args.host, args.allow_host)
    if args.host not in LOOPBACK:
        log.warning("binding to %s: anyone who can reach this address can use the server (it answers requests "
                    "addressed to %s; --allow-host adds names)", args.host, ", ".join(names))
    host = args.host if ":" not in args.host else f"[{args.host}]"
    log.info("nla serve: http://%s:%d/generate (published client: sglang_url='http://%s:%d')", host, args.port, host,
             args.port)
    from nla.serve.app import uvicorn_settings

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **uvicorn_settings(app.state.limits))
    return 0
