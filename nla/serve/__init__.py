"""``nla serve``: an HTTP server over an AV (and optionally an AR) checkpoint (docs/serve.md).

It stands in for the SGLang server the published NLA client talks to (``POST /generate`` with
``input_embeds``; ``GET /health``, ``GET /get_model_info``) and adds nla's own ``/verbalize``,
``/score`` and ``/info``.

- ``engine``: sampling parameters, the batcher thread that owns the models, the batched decode.
- ``app``: the Starlette app (``create_app``) and ``NLAService`` (the loaded checkpoints).

``app`` needs the ``explore`` extra (starlette, uvicorn); import it from here lazily.
"""

from __future__ import annotations

from typing import Any

from nla.serve.engine import SAMPLING_KEYS, Batcher, GenerateJob, SamplingParams, ServeLimits

__all__ = ["SAMPLING_KEYS", "Batcher", "GenerateJob", "NLAService", "SamplingParams", "ServeLimits",
           "create_app"]


def create_app(*args: Any, **kwargs: Any):
    """``nla.serve.app.create_app`` (imported on use: starlette is an optional dependency)."""
    from nla.serve.app import create_app as _create_app

    return _create_app(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "NLAService":
        from nla.serve.app import NLAService

        return NLAService
    raise AttributeError(f"module 'nla.serve' has no attribute {name!r}")
