"""``nla explore``: a local web explorer for activations, explanations and runs (docs/explore.md).

- ``engine``: text -> tokens -> activations at the pair's layer -> explanations and scores.
- ``run``: what a quickstart or RL output dir says, for the run view.
- ``app``: the Starlette app, its JSON API and the static page (``static/``, no build step).
(The headless-Chromium driver of the browser test and the docs screenshot is a test helper:
``tests/chromium.py``.)

``app`` needs the ``explore`` extra (starlette, uvicorn); import it from here lazily.
"""

from __future__ import annotations

from typing import Any

from nla.explore.engine import ExploreLimits, Explorer, grade_claims
from nla.explore.run import RunSummary, load_run

__all__ = ["ExploreLimits", "Explorer", "RunSummary", "create_app", "grade_claims", "load_run"]


def create_app(*args: Any, **kwargs: Any):
    """``nla.explore.app.create_app`` (imported on use: starlette is an optional dependency)."""
    from nla.explore.app import create_app as _create_app

    return _create_app(*args, **kwargs)
