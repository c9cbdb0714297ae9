"""Screenshot of `nla explore` (docs/explore.png), made by headless Chromium on a real server.

Starts the explorer on a quickstart run's RL pair, opens a held-out world document, explains
every token, clicks a token whose greedy explanation makes a false claim, samples k
explanations, and saves the page. With ``--run-out`` it also saves the run view.

    python -m dev.experiments.explore_screenshot --run runs/quickstart-tiny --out docs/explore.png
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from nla.explore import Explorer, create_app, load_run
from nla.util.http import BackgroundServer
from tests.chromium import HeadlessChromium  # the test helper drives the browser

# The selected token: one true and one false claim, else any false claim, nearest a mid-range cosine.
PICK = """(() => {
  const rs = [...state.results.values()].filter((r) => r.greedy.cosine !== null && r.position > 4);
  const has = (r, ok) => (r.greedy.claims || []).some((c) => c.correct === ok);
  const mixed = rs.filter((r) => has(r, true) && has(r, false));
  const wrong = rs.filter((r) => has(r, false));
  const pool = mixed.length ? mixed : wrong.length ? wrong : rs;
  pool.sort((a, b) => Math.abs(a.greedy.cosine - 0.45) - Math.abs(b.greedy.cosine - 0.45));
  return pool[0].position;
})()"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="quickstart run dir (its rl.stage_done.json names the pair)")
    ap.add_argument("--out", default="docs/explore.png")
    ap.add_argument("--run-out", help="also save the run view here")
    ap.add_argument("--doc", type=int, default=4, help="index of the held-out document in the page's list")
    ap.add_argument("--samples", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rl = json.loads((Path(args.run) / "rl.stage_done.json").read_text())
    explorer = Explorer.load(rl["av"], rl["ar"], device="cpu")
    app = create_app(explorer, run=load_run(args.run))
    with BackgroundServer(app) as server, HeadlessChromium(width=1200, height=900) as page:
        page.goto(server.url + "/")
        page.wait_for(f"document.querySelectorAll('#doc-select option').length > {args.doc + 1}")
        page.evaluate(f"(() => {{ const s = document.getElementById('doc-select'); s.selectedIndex = {args.doc + 1};"
                      " s.dispatchEvent(new Event('change')); })()")
        page.click("#explore-btn")
        page.wait_for("state.results.size > 0 && state.results.size === state.tokens.length", timeout=300)
        position = page.evaluate(PICK)
        page.click(f'.tok[data-position="{position}"]')
        page.wait_for("!document.getElementById('detail').hidden")
        page.evaluate(f"document.getElementById('k-input').value = {args.samples}")
        page.click("#sample-btn")
        page.wait_for(f"document.querySelectorAll('#d-samples .explanation-card').length === {args.samples}",
                      timeout=300)
        page.evaluate("document.getElementById('own').open = true")
        page.screenshot(args.out)
        logging.info("wrote %s (token %d)", args.out, position)
        if args.run_out:
            page.click("#tab-run")
            page.wait_for("[...document.querySelectorAll('#run-plots img')].every((i) => i.complete)"
                          " && document.querySelectorAll('#run-plots img').length > 0")
            page.screenshot(args.run_out)
            logging.info("wrote %s", args.run_out)


if __name__ == "__main__":
    main()
