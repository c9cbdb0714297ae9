"""`nla explore --av DIR --ar DIR [--subject DIR] [--run DIR] [--host 127.0.0.1 --port 8765] [--allow-host NAME]`: local web explorer.

A problem with the models (a missing checkpoint, an AV/AR pair of different ``d_model``, a
subject without the pair's layer) is logged and shown in the page, and every model request
answers it as a JSON 409; the run view still works. See docs/explore.md.
"""

from __future__ import annotations

import argparse
import logging

from nla.util.http import LOOPBACK, allowed_hosts, header_timeout_protocol, port_flag
from nla.util.threads import THREADS_HELP, threads_flag

log = logging.getLogger("nla.explore")

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explore", help="local web explorer: explanations and round-trip scores per token, and runs")
    p.add_argument("--av", required=True, help="verbalizer checkpoint dir")
    p.add_argument("--ar", required=True, help="reconstructor checkpoint dir")
    p.add_argument("--subject", help="subject model dir (default: the base_model recorded in the pair's sidecars)")
    p.add_argument("--run", help="a quickstart or nla rl output dir to show in the run view")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=port_flag, default=8765, help="TCP port, 1-65535 (default 8765)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests addressed to this host name (repeatable); the names of this "
                        "machine and the bound address are allowed already")
    # Defaults live in nla.explore.ExploreLimits (96, 128 and 8 today); None here means "its default".
    p.add_argument("--max-new-tokens", type=int, help="explanation length cap (default 96)")
    p.add_argument("--max-tokens", type=int, help="tokens per text cap, also capped by the subject's context "
                   "(default 128)")
    p.add_argument("--max-samples", type=int, help="sampled explanations per token cap (default 8)")
    p.add_argument("--allow-mixed-provenance", action="store_true",
                   help="serve even when the pair and --subject record different subjects, layers or tokenizers")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=threads_flag, help=f"torch CPU threads ({THREADS_HELP})")
    p.set_defaults(func=run)


def build(args: argparse.Namespace):
    """The app for ``args``: models that fail to load become the page's setup error, a bad --run raises."""
    from nla.commands.eval import apply_threads_flag
    from nla.explore import ExploreLimits, Explorer, create_app, load_run

    given = {"max_new_tokens": args.max_new_tokens, "max_tokens": args.max_tokens, "max_samples": args.max_samples}
    limits = ExploreLimits(**{k: v for k, v in given.items() if v is not None})
    run_summary = load_run(args.run) if args.run else None
    apply_threads_flag(args)
    explorer, setup_error = None, None
    try:
        explorer = Explorer.load(args.av, args.ar, args.subject, device=args.device, dtype=args.dtype, limits=limits,
                                 allow_mixed_provenance=args.allow_mixed_provenance)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        setup_error = " ".join(str(exc).split())
        log.error("the models could not be loaded; the page will say why: %s", setup_error)
    return create_app(explorer, run=run_summary, limits=limits, setup_error=setup_error,
                      allowed_hosts=allowed_hosts(args.host, args.allow_host))




def check_port_free(host: str, port: int) -> None:
    """Bind ``host``:``port`` once and let it go, before the models load and before "open http://..."
    is printed: a port in use used to print the link and then exit 3. A ValueError names the port."""
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as err:
        raise ValueError(f"--host: cannot resolve {host!r} to an address to bind ({err}); give an address of this "
                         "machine such as 127.0.0.1 (the default) or 0.0.0.0") from None
    family, socktype, proto, _, address = infos[0]
    with socket.socket(family, socktype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as err:
            raise ValueError(f"--port: cannot listen on {host}:{port} ({err.strerror or err}); another program "
                             "uses the port: stop it or pass another --port") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    check_port_free(args.host, args.port)
    app = build(args)
    check_port_free(args.host, args.port)  # again: the models took a while to load
    if args.host not in LOOPBACK:
        log.warning("binding to %s: anyone who can reach this address can use the explorer (it answers requests "
                    "addressed to %s; --allow-host adds names)", args.host, ", ".join(allowed_hosts(args.host,
                                                                                                      args.allow_host)))
    log.info("nla explore: open http://%s:%d/", args.host if ":" not in args.host else f"[{args.host}]", args.port)
    # a request's head within 10 s (uvicorn bounds neither it nor, in the app, the body: nla.util.http)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=header_timeout_protocol(10.0))
    return 0
