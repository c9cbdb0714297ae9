"""The published NLA inference client, unchanged, against ``nla serve`` and an nla checkpoint pair.

The published system ships a single-file client (``nla_inference.py``: ``NLAClient`` posts
``input_embeds`` to an SGLang server's ``/generate``; ``NLACritic`` scores with the AR). It is not
part of nla (its code stays out of this repository): give the path of your copy and a
``pip --target`` directory with the environment it pins (transformers 4.57.1, tokenizers 0.22,
huggingface_hub < 1, orjson; httpx, PyYAML, numpy, torch and safetensors come from this venv).

What runs:
1. nla's own client (this venv, transformers 5): greedy explanations and scores of N vectors.
2. ``nla serve --av AV --ar AR`` on a free loopback port (a real server process).
3. In a child process with the pinned environment first on ``PYTHONPATH``: the published
   ``NLAClient(AV, sglang_url=...)`` generates for the same vectors (``temperature=0``: greedy) and
   ``NLACritic(AR, dtype=torch.float32)`` scores nla's explanations.
4. Compared: explanations equal (count), and the largest score difference.

    python -m dev.experiments.published_client --client ~/nla_inference.py --env ~/published-env \\
        --run runs/quickstart [--rows 24] [--max-new-tokens 150] [--out report.json]

``--run`` takes a quickstart or ``nla rl`` output dir (its newest RL checkpoint) or use ``--av/--ar``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

CHILD = r"""
import importlib.util, json, sys
import numpy as np, torch
spec = importlib.util.spec_from_file_location("nla_inference", sys.argv[1])
pub = importlib.util.module_from_spec(spec); sys.modules["nla_inference"] = pub; spec.loader.exec_module(pub)
args = json.loads(open(sys.argv[2]).read())
vectors = np.load(args["vectors"])
client = pub.NLAClient(args["av"], sglang_url=args["url"])
texts = [client.generate(v, temperature=0.0, max_new_tokens=args["max_new_tokens"], extract_explanation=False)
         for v in vectors]
critic = pub.NLACritic(args["ar"], device="cpu", dtype=torch.float32)
scores = [critic.score(t, v) for t, v in zip(args["nla_explanations"], vectors)]
import transformers
json.dump({"transformers": transformers.__version__, "texts": texts, "mse": [s[0] for s in scores],
           "cos": [s[1] for s in scores]}, open(args["out"], "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"nla serve exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"nla serve did not answer {url}/health in {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", required=True, help="path of the published nla_inference.py")
    ap.add_argument("--env", required=True, help="pip --target dir with transformers 4.57.1 and orjson")
    ap.add_argument("--run", help="a quickstart or nla rl output dir (its newest RL checkpoint pair)")
    ap.add_argument("--av")
    ap.add_argument("--ar")
    ap.add_argument("--data", help="parquet of vectors (default: the run's datagen/rl.parquet)")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=150)
    ap.add_argument("--out", help="write the report JSON here")
    args = ap.parse_args()

    from nla.client import NLAClient, load_vectors

    if args.run:
        run = Path(args.run)
        rl = run / "rl" if (run / "rl" / "checkpoints").is_dir() else run
        step = sorted((rl / "checkpoints").glob("step_*"))[-1]
        av, ar = step / "av", step / "ar"
        data = Path(args.data) if args.data else run / "datagen" / "rl.parquet"
    else:
        if not (args.av and args.ar and args.data):
            raise SystemExit("give --run, or --av, --ar and --data")
        av, ar, data = Path(args.av), Path(args.ar), Path(args.data)
    vectors = load_vectors(data, rows=args.rows)
    print(f"[1/3] nla's client: {len(vectors)} vectors, greedy, max_new_tokens={args.max_new_tokens}", flush=True)
    client = NLAClient(av, ar, device="cpu")
    ours = client.verbalize(vectors, max_new_tokens=args.max_new_tokens, greedy=True)
    explanations = [v.explanation for v in ours]
    scored = client.score(explanations, vectors)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"[2/3] nla serve on {url}", flush=True)
    server = subprocess.Popen([sys.executable, "-m", "nla.cli", "serve", "--av", str(av), "--ar", str(ar),
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            np.save(Path(tmp) / "v.npy", vectors)
            spec = {"vectors": str(Path(tmp) / "v.npy"), "av": str(av), "ar": str(ar), "url": url,
                    "max_new_tokens": args.max_new_tokens, "out": str(Path(tmp) / "out.json"),
                    "nla_explanations": [e if e is not None else "" for e in explanations]}
            (Path(tmp) / "args.json").write_text(json.dumps(spec))
            print("[3/3] the published client (its own environment) against it", flush=True)
            env = {**os.environ, "PYTHONPATH": str(Path(args.env).resolve()), "TRANSFORMERS_VERBOSITY": "error"}
            proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(args.client).resolve()),
                                   str(Path(tmp) / "args.json")], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"the published client failed:\n{proc.stderr[-4000:]}")
            theirs = json.loads((Path(tmp) / "out.json").read_text())
    finally:
        server.terminate()
        server.wait(timeout=30)

    texts = [v.text for v in ours]
    same = [a == b for a, b in zip(theirs["texts"], texts, strict=True)]
    ok = ~np.isnan(scored.mse_nrm.numpy())
    diff = np.abs(np.array(theirs["mse"])[ok] - scored.mse_nrm.numpy()[ok])
    report = {"av": str(av), "ar": str(ar), "rows": len(vectors), "published_transformers": theirs["transformers"],
              "identical_explanations": int(sum(same)), "max_abs_mse_diff": float(diff.max()) if diff.size else None,
              "scored_rows": int(ok.sum()), "mismatches": [{"row": i, "nla": texts[i], "published": theirs["texts"][i]}
                                                          for i, s in enumerate(same) if not s]}
    print(f"identical greedy explanations: {report['identical_explanations']} / {len(vectors)}; "
          f"largest |mse_nrm difference| over {report['scored_rows']} scored rows: {report['max_abs_mse_diff']:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
