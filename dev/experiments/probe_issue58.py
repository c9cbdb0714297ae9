"""Issue 58's hostile-user and hostile-client findings, probed again through the CLI and over HTTP.

Each probe builds its input in a scratch dir, runs ``nla ...`` as a user would (a real process; the
server probes start ``nla serve`` and talk to it with raw sockets and httpx), and checks the outcome
the issue asks for: a clear error (exit 2, one ``nla CMD: error:`` line, no traceback), a clean 4xx,
or the correct result, and that nothing outside the run was read, changed or deleted.

    python -m dev.experiments.probe_issue58 --run runs/quickstart-tiny [--scratch /tmp/probe58] [--only TEXT]

``--run``: a finished ``nla quickstart`` dir, or one whose world, datagen, ar and av stages are done
(its warm-start pair, datagen and world are used; the run itself is only read). Prints one line per
probe with the issue's class, a count per class, and exits 1 if any probe fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

NLA = [sys.executable, "-m", "nla.cli"]
SECRET = "root:x:0:0:the secret nla must not serve or touch\n"


def run(*args: str, timeout: float = 600) -> tuple[int, str]:
    proc = subprocess.run([*NLA, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr + proc.stdout


def clear_error(code: int, out: str, command: str, *parts: str) -> str | None:
    """None when the output is one clear error line with ``parts``; else what is wrong."""
    if code != 2:
        return f"exit {code}, expected 2: {out[-300:]!r}"
    if "Traceback" in out:
        return "a traceback"
    errors = [ln for ln in out.splitlines() if ln.startswith(f"nla {command}: error: ")
              or (ln.startswith("nla ") and ": error: " in ln)]
    if len(errors) != 1:
        return f"{len(errors)} error lines: {out[-300:]!r}"
    if len(errors[0]) > 2000:
        return f"an error line of {len(errors[0])} characters"
    missing = [p for p in parts if p not in errors[0]]
    return f"the error does not say {missing}: {errors[0][:300]!r}" if missing else None


def latest(ckpts: Path) -> Path:
    return sorted(p for p in ckpts.glob("step_*") if p.is_dir())[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--scratch", default="/tmp/probe58")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run only the probes whose name contains TEXT (repeatable)")
    args = ap.parse_args()
    run_dir = Path(args.run).resolve()
    scratch = Path(args.scratch).resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    data = run_dir / "datagen"
    av, ar = latest(run_dir / "av" / "checkpoints"), latest(run_dir / "ar" / "checkpoints")
    from nla.core.sidecar import load_sidecar

    d_model = load_sidecar(av).d_model
    secret = scratch / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(SECRET)
    results: list[tuple[str, str, str | None]] = []

    def probe(cls: str, name: str, fn: Callable[[], str | None]) -> None:
        t0 = time.perf_counter()
        try:
            why = fn()
        except Exception as err:  # noqa: BLE001 - a probe that crashes is a failed probe
            why = f"the probe crashed: {type(err).__name__}: {err}"
        results.append((cls, name, why))
        print(f"{'ok  ' if why is None else 'FAIL'} [{cls}] {name} ({time.perf_counter() - t0:.1f} s)"
              + (f": {why}" if why else ""), flush=True)

    def secret_kept() -> str | None:
        return None if secret.read_text() == SECRET else "the file outside the run was changed"

    ar_train = ["train", "ar", "--dataset", data / "ar_sft.parquet", "--max-steps", "1", "--threads", "1",
                "--set", "progress=false", "--set", "tensorboard=false", "--set", "eval_every=1000", "--set", "warmup_steps=0"]

    # ---- 1. security: a file outside the run is served / written
    def explore_plot_link() -> str | None:
        x = scratch / "qs_link"
        x.mkdir()
        (x / "report.json").write_text(json.dumps({"headline": {}, "plots": {"ar_curves": "ar_curves.png"}}))
        os.symlink(secret, x / "ar_curves.png")
        code, out = run("explore", "--av", av, "--ar", ar, "--run", x, "--port", str(free_port()))
        return clear_error(code, out, "explore", "leads out of the run directory", "Remove the link")

    def world_name_out() -> str | None:
        cfg = scratch / "evil.yaml"
        cfg.write_text("name: ../../evil\n")
        code, out = run("world", "build", "--config", cfg, "--out", scratch / "wcache")
        return clear_error(code, out, "world", "WorldConfig.name") or (
            "something was written" if (scratch / "evil").exists() else None)

    # ---- 2. data loss
    def overwrite_user_checkpoints() -> str | None:
        x = scratch / "user_ckpt"
        (x / "checkpoints" / "my_model").mkdir(parents=True)
        (x / "checkpoints" / "my_model" / "model.safetensors").write_bytes(b"weights")
        (x / "ar.jsonl").write_text('{"step": 1}\n')
        code, out = run(*ar_train, "--out", x, "--overwrite")
        why = clear_error(code, out, "train", "--overwrite would delete what nla did not write", "my_model")
        return why or (None if (x / "checkpoints" / "my_model" / "model.safetensors").is_file() else "deleted")

    def overwrite_quickstart_plots() -> str | None:
        x = scratch / "qs_plots"
        x.mkdir()
        (x / "report.json").write_text("{}")
        (x / "av_curves.png").write_bytes(b"\x89PNG report plot")
        (x / "ar.jsonl").write_text('{"step": 1}\n')
        code, out = run(*ar_train, "--out", x, "--overwrite")
        if code != 0:
            return f"exit {code}: {out[-300:]!r}"
        kept = (x / "av_curves.png").is_file() and (x / "av_curves.png").read_bytes() == b"\x89PNG report plot"
        return None if kept else "the report's plot was deleted"

    def lock_link() -> str | None:
        x = scratch / "lock_link"
        x.mkdir()
        os.symlink(secret, x / ".nla.lock")
        code, out = run(*ar_train, "--out", x)
        return clear_error(code, out, "train", ".nla.lock is a symbolic link") or secret_kept()

    def log_link() -> str | None:
        x = scratch / "log_link"
        x.mkdir()
        os.symlink(secret, x / "ar.jsonl")
        code, out = run(*ar_train, "--out", x)
        return clear_error(code, out, "train", "ar.jsonl: the metrics log leads out of the run directory") or \
            secret_kept()

    # ---- 3. silently wrong
    def tiny_temperatures() -> str | None:
        for cmd, name in ((["verbalize", "--av", av, "--vectors", data / "rl.parquet", "--rows", "2", "--sample",
                            "--temperature", "1e-40"], "verbalize"),
                          (["eval", "--av", av, "--ar", ar, "--dataset", data / "rl.parquet", "--suite", "best_of",
                            "--temperature", "inf"], "eval")):
            code, out = run(*cmd)
            if code != 2 or "expected a finite number in [0.0001, 100]" not in out or "Traceback" in out:
                return f"nla {name}: exit {code}: {out[-300:]!r}"
        code, out = run("rl", "--av", av, "--ar", ar, "--dataset", data / "rl.parquet", "--out", scratch / "rl_t",
                        "--set", "rollout.temperature=1e-45")
        return clear_error(code, out, "rl", "rollout.temperature", "[0.0001, 100]")

    def score_rows_and_bom() -> str | None:
        import numpy as np
        import pyarrow.parquet as pq

        vec = np.stack(pq.read_table(data / "ar_sft.parquet").column("activation_vector").to_numpy(
            zero_copy_only=False)[:6]).astype(np.float32)
        texts = pq.read_table(data / "ar_sft.parquet").column("explanation").to_pylist()[:6]
        np.save(scratch / "v.npy", vec)
        (scratch / "ordered.jsonl").write_text("".join(json.dumps({"row": i, "explanation": t}) + "\n"
                                                       for i, t in enumerate(texts)))
        order = [3, 0, 5, 1, 4, 2]
        (scratch / "shuffled.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(
            json.dumps({"row": i, "explanation": texts[i]}) + "\n" for i in order).encode())
        scores = []
        for name in ("ordered", "shuffled"):
            code, out = run("score", "--ar", ar, "--texts", scratch / f"{name}.jsonl", "--vectors", scratch / "v.npy",
                            "--out", scratch / f"{name}.scores.jsonl", "--threads", "1")
            if code != 0:
                return f"exit {code}: {out[-300:]!r}"
            scores.append({r["row"]: r["mse_nrm"] for r in map(json.loads, (scratch / f"{name}.scores.jsonl")
                                                                 .read_text().splitlines())})
        return None if all(abs(scores[0][k] - scores[1][k]) < 1e-5 for k in scores[0]) else f"{scores}"

    def datagen_max_len() -> str | None:
        cfg = scratch / "dg.yaml"
        cfg.write_text((data / "datagen_config.yaml").read_text())
        code, out = run("datagen", "run", "--config", cfg, "--out", scratch / "dg", "--set", "max_len=1000")
        why = clear_error(code, out, "datagen", "max_len: 1000 tokens per document", "max_position_embeddings")
        return why or (None if not (scratch / "dg" / "activations.parquet").exists() else "extracted anyway")

    def suite_subject_av() -> str | None:
        code, out = run("eval", "--av", av, "--ar", ar, "--dataset", data / "rl.parquet", "--suite", "causal",
                        "--subject", av, "--max-rows", "8")
        return clear_error(code, out, "eval", "--subject", "is a verbalizer (AV) checkpoint")

    def av_cut_responses() -> str | None:
        code, out = run("train", "av", "--dataset", data / "av_sft.parquet", "--out", scratch / "av_cut",
                        "--max-steps", "1", "--threads", "1", "--set", "max_length=40", "--set", "progress=false",
                        "--set", "tensorboard=false", "--set", "eval_every=1000", "--set", "smoke_num=0",
                        "--set", "warmup_steps=0")
        if "Traceback" in out:
            return "a traceback"
        return None if "are longer than max_length 40" in out and "raise max_length to" in out else \
            f"no word of the cut responses (exit {code}): {out[-300:]!r}"

    def facts_empty() -> str | None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        t = pq.read_table(data / "rl.parquet").slice(0, 12)
        t = t.set_column(t.schema.get_field_index("facts"), "facts",
                         pa.array([[]] * len(t), t.schema.field("facts").type))
        ds = scratch / "empty_facts.parquet"
        pq.write_table(t, ds)
        shutil.copy(str(data / "rl.parquet") + ".nla_meta.yaml", str(ds) + ".nla_meta.yaml")
        code, out = run("eval", "--av", av, "--ar", ar, "--dataset", ds, "--out", scratch / "empty_eval",
                        "--max-new-tokens", "24", "--threads", "1")
        if code != 0:
            return f"exit {code}: {out[-400:]!r}"
        report = json.loads(next((scratch / "empty_eval").glob("*.json")).read_text())
        return None if '"recall": 1.0' not in json.dumps(report) else "recall 1.0 on rows where nothing holds"

    # ---- 4, 5 and 7: the server
    def serve_probes() -> str | None:
        import httpx

        port = free_port()
        proc = subprocess.Popen([*NLA, "serve", "--av", av, "--port", str(port), "--threads", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        problems = []
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            hd = {"content-type": "application/json"}

            def expect(what: str, status: int, said: str, body: bytes | None = None, j=None, path="/generate",
                       within: float = 30.0) -> None:
                t0 = time.perf_counter()
                r = httpx.post(f"{url}{path}", content=body if body is not None else json.dumps(j).encode(),
                               headers=hd, timeout=120)
                took = time.perf_counter() - t0
                if r.status_code != status or said not in r.text or took > within:
                    problems.append(f"{what}: {r.status_code} in {took:.1f} s, {r.text[:200]!r}")

            expect("a 28 MB text", 413, "bytes, more than", j={"text": "ab" * 14_000_000}, within=20)
            expect("an empty text", 400, "is empty", j={"text": ""})
            expect("a 2,000-token prompt", 400, "positions", j={"input_ids": [5] * 2000})
            expect("temperature 1e-40", 400, "[0.0001, 100]",
                   j={"input_ids": [5, 6], "sampling_params": {"temperature": 1e-40}})
            expect("/verbalize work", 413, "tokens to decode",
                   j={"vectors": [[0.5] * d_model] * 256, "n_samples": 16, "max_new_tokens": 1024, "greedy": False},
                   path="/verbalize")
            expect("string numbers", 400, "expected", j={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "8"}})
            expect("duplicate keys", 400, "given twice", body=b'{"input_ids": [5], "input_ids": [6]}')
            # a slow body is cut off (the default 30 s), an idle connection closed (5 s)
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                t0 = time.perf_counter()
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")
                got = s.recv(4096)
                if not got.startswith(b"HTTP/1.1 408") or time.perf_counter() - t0 > 45:
                    problems.append(f"a slow body: {got[:80]!r} after {time.perf_counter() - t0:.0f} s")
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                t0 = time.perf_counter()
                try:
                    while s.recv(4096):  # the answer, then the server's close
                        pass
                except TimeoutError:
                    pass
                if time.perf_counter() - t0 > 15:
                    problems.append(f"an idle connection stayed open {time.perf_counter() - t0:.0f} s")
            # a request head sent a byte a second: a 408 and the close after the default 10 s
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                t0 = time.perf_counter()
                got = b""
                try:
                    for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 60:
                        s.sendall(bytes([byte]))
                        s.settimeout(1.0)
                        try:
                            got = s.recv(4096)
                        except TimeoutError:
                            continue
                        break
                except OSError:
                    pass
                if not got.startswith(b"HTTP/1.1 408") or time.perf_counter() - t0 > 20:
                    problems.append(f"a slow request head: {got[:80]!r} after {time.perf_counter() - t0:.0f} s")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # gone mid-body
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"input")
            time.sleep(1)
            if httpx.get(f"{url}/health", timeout=5).status_code != 200:
                problems.append("the server stopped answering")
        finally:
            proc.terminate()
            log = proc.communicate(timeout=30)[0]
        if "Traceback" in log:
            problems.append(f"a traceback in the server's log: {log[log.index('Traceback'):][:300]!r}")
        return "; ".join(problems) or None

    # ---- 7. lower severity (round 5's left-overs)
    def checksum_flip() -> str | None:
        x = scratch / "ckflip"
        shutil.copytree(ar, x)
        f = x / "model.safetensors"
        code, out = run("score", "--ar", x, "--dataset", data / "ar_sft.parquet", "--rows", "4")
        if code != 0:
            return f"the first load failed: {out[-300:]!r}"
        st = f.stat()
        time.sleep(0.05)
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0x01
        f.write_bytes(bytes(raw))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the size and mtime as they were
        code, out = run("score", "--ar", x, "--dataset", data / "ar_sft.parquet", "--rows", "4")
        return clear_error(code, out, "score", "SHA-256 differs")

    def resume_replaced_dataset() -> str | None:
        x = scratch / "resume_ds"
        ds = scratch / "resume_ds.parquet"
        shutil.copy(data / "ar_sft.parquet", ds)
        shutil.copy(data / "ar_sft.parquet.nla_meta.yaml", str(ds) + ".nla_meta.yaml")
        args = [a if a != data / "ar_sft.parquet" else ds for a in ar_train]
        args[args.index("--max-steps") + 1] = "2"
        code, out = run(*args, "--out", x, "--set", "stop_after_steps=1", "--set", "save_every=1")
        if code != 0:
            return f"the first step failed: {out[-300:]!r}"
        shutil.copy(data / "av_sft.parquet", ds)  # another file at the same path
        code, out = run(*args, "--out", x, "--resume", "--set", "save_every=1")
        return clear_error(code, out, "train", "is not the file this run trained on")

    def malformed_manifest() -> str | None:
        x = scratch / "manifest"
        shutil.copytree(data, x, ignore=shutil.ignore_patterns("*.parquet"))
        summary = x / "datagen_summary.json"
        summary.write_text('{"extract": ')
        code, out = run("datagen", "run", "--config", x / "datagen_config.yaml", "--out", x, timeout=120)
        return clear_error(code, out, "datagen", "datagen_summary.json:1:13", "not valid JSON")

    # ---- 5. tracebacks
    def quickstart_sets() -> str | None:
        for setting in ("datagen.seed=5", "datagen.threads=1", "datagen.shuffled_baseline=false"):
            code, out = run("quickstart", "--preset", "tiny", "--out", scratch / "qs_set", "--set", setting)
            why = clear_error(code, out, "quickstart", "is set by the quickstart itself")
            if why or (scratch / "qs_set").exists():  # no out dir: refused before the world stage
                return f"{setting}: {why or 'ran stages first'}"
        return None

    def suite_all_null() -> str | None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        t = pq.read_table(data / "rl.parquet").slice(0, 8)
        t = t.set_column(t.schema.get_field_index("facts"), "facts", pa.nulls(len(t), t.schema.field("facts").type))
        ds = scratch / "null_facts.parquet"
        pq.write_table(t, ds)
        shutil.copy(str(data / "rl.parquet") + ".nla_meta.yaml", str(ds) + ".nla_meta.yaml")
        code, out = run("eval", "--av", av, "--ar", ar, "--dataset", ds, "--suite", "claims,confabulation",
                        "--max-new-tokens", "16", "--out", scratch / "null_suite", "--threads", "1")
        if code != 0 or "Traceback" in out:
            return f"exit {code}: {out[-300:]!r}"
        return None if "no ground truth" in (scratch / "null_suite" / "suite.md").read_text() else "not said"

    def explore_malformed() -> str | None:
        for name, text, said in (("report.json", "{not json", "report.json is not valid JSON"),
                                 ("rl.jsonl", '{"step": 1}\n{"step"\n{"step": 3}\n', "rl.jsonl: line 2")):
            x = scratch / f"bad_{name}"
            x.mkdir()
            (x / name).write_text(text)
            if name == "rl.jsonl":
                (x / "rl_summary.json").write_text("{}")
            code, out = run("explore", "--av", av, "--ar", ar, "--run", x, "--port", str(free_port()))
            why = clear_error(code, out, "explore", said)
            if why:
                return f"{name}: {why}"
        return None

    def world_bounds() -> str | None:
        for field, value in (("seq_len", "1"), ("vocab_size", "1000000000")):
            cfg = scratch / f"w_{field}.yaml"
            cfg.write_text(f"name: w\n{field}: {value}\n")
            code, out = run("world", "build", "--config", cfg, "--out", scratch / "wcache")
            why = clear_error(code, out, "world", f"WorldConfig.{field}")
            if why:
                return f"{field}: {why}"
        return None

    # ---- 6. hangs
    def trickling_explainer() -> str | None:
        code = (
            "import os, time\n"
            "from nla.datagen.config import ProviderConfig\n"
            "from nla.datagen.providers import OpenAIExplainer\n"
            "os.environ['NLA_PROBE_KEY'] = 'k'\n"
            "cfg = ProviderConfig(model='m', base_url='http://127.0.0.1:{}', api_key_env='NLA_PROBE_KEY', "
            "max_retries=0, timeout_s=2.0, max_concurrency=1)\n"
        )
        stop = threading.Event()

        class Trickle(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                try:
                    self.send_response(200)
                    self.send_header("content-length", "1000000")
                    self.end_headers()
                    while not stop.is_set():
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            script = code.format(srv.server_address[1]) + (
                "t0 = time.time(); out = OpenAIExplainer(cfg).explain_batch([{'doc_id': 0, 'position': 1, "
                "'context': 'a', 'token': 'a'}]); print('RESULT', out, round(time.time() - t0, 1))\n")
            proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        finally:
            stop.set()
            srv.shutdown()
        return None if "RESULT [None]" in proc.stdout else f"{proc.stdout[-200:]!r} {proc.stderr[-300:]!r}"

    def alias_bomb() -> str | None:
        # the anchors inside the list field itself: 10**8 strings once expanded
        items = ['&a0 ["q_proj"]'] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
        cfg = scratch / "bomb.yaml"
        cfg.write_text(f"av: {av}\nar: {ar}\ndataset: {data / 'rl.parquet'}\n"
                       f"lora:\n  target_modules: [{', '.join(items)}]\n")
        t0 = time.perf_counter()
        code, out = run("rl", "--config", cfg, "--out", scratch / "bomb", timeout=120)
        why = clear_error(code, out, "rl", "expands to more than 100,000 values")
        return why or (None if time.perf_counter() - t0 < 60 else "over a minute")

    for cls, name, fn in (
            ("security", "explore --run serving a plot linked to a file outside", explore_plot_link),
            ("security", "world name ../../evil", world_name_out),
            ("data loss", "--overwrite beside a checkpoints/ folder nla never wrote", overwrite_user_checkpoints),
            ("data loss", "--overwrite on a quickstart dir keeps the report's plots", overwrite_quickstart_plots),
            ("data loss", "a .nla.lock symlink", lock_link),
            ("data loss", "an ar.jsonl symlink", log_link),
            ("silent", "temperatures 1e-40 / inf / 1e-45 in verbalize, eval --suite, rl", tiny_temperatures),
            ("silent", "score --texts pairs by row and drops a BOM", score_rows_and_bom),
            ("silent", "datagen --set max_len=1000 on a 64-position subject", datagen_max_len),
            ("silent", "eval --suite --subject <the AV>", suite_subject_av),
            ("silent", "train av cutting responses", av_cut_responses),
            ("silent", "facts [] on every row", facts_empty),
            ("server", "nla serve: bounds, 4xx, timeouts, disconnects", serve_probes),
            ("traceback", "quickstart --set datagen.seed / threads / shuffled_baseline", quickstart_sets),
            ("traceback", "eval --suite on all-null facts", suite_all_null),
            ("traceback", "explore --run with a malformed report.json / rl.jsonl", explore_malformed),
            ("traceback", "world build seq_len 1 / vocab_size 1e9", world_bounds),
            ("hang", "an API explainer trickling a byte at a time", trickling_explainer),
            ("hang", "a YAML alias bomb in lora.target_modules", alias_bomb),
            ("lower", "a checksum verified once, then a bit flipped with size and mtime kept", checksum_flip),
            ("lower", "--resume after the dataset was replaced at the same path", resume_replaced_dataset),
            ("lower", "a malformed datagen_summary.json names the file", malformed_manifest)):
        if not args.only or any(t in name for t in args.only):
            probe(cls, name, fn)
    failed = Counter(cls for cls, _, why in results if why is not None)
    total = Counter(cls for cls, _, _ in results)
    print("\nby class (probes as the issue asks / probes): " +
          ", ".join(f"{c} {total[c] - failed[c]}/{total[c]}" for c in total))
    print(f"{sum(total.values()) - sum(failed.values())} of {sum(total.values())} probes as the issue asks")
    return 1 if failed else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
