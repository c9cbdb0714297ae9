"""``nla serve`` throughput: 32 concurrent clients vs the same requests one at a time.

The AV is a world-sized Llama with random weights (the default world preset's shape: d=128, 4
layers, a 1,024-token BPE tokenizer trained on world stories, the world's AV prompt), written as
an nla checkpoint, or ``--av DIR`` (e.g. a quickstart AV). The server is the real app under
uvicorn on a loopback port. Each request is what the published client sends: the AV prompt's
embeddings with the vector at the marker, ``POST /generate``, greedy, ``--max-new-tokens`` (a random
AV rarely writes EOS, so most rows run to the cap). The same requests run first one at a time,
then from ``--clients`` threads at once, in the same run; the script checks that every text is
the same both ways, then prints requests/s of each, their ratio and the batch sizes the server
used.

    .venv/bin/python -m bench.bench_serve [--requests 128] [--clients 32] [--max-new-tokens 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path


def build_world_sized_av(root: Path, seed: int = 0) -> Path:
    """A random-weight AV at the default world preset's shape, saved with nla's writers."""
    from nla.core.sidecar import NLAConfig, write_sidecar
    from nla.core.templates import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, DEFAULT_INJECTION_CHAR
    from nla.world import WORLD_PRESETS, generate_documents
    from nla.world.subject import ModelShape, build_model
    from nla.world.tokenizer import train_tokenizer

    cfg = WORLD_PRESETS["default"]
    texts = [d.text for d in generate_documents(seed, 400)] + [DEFAULT_AV_TEMPLATE.format(injection_char="")] * 10
    tok = train_tokenizer(texts, cfg.vocab_size)
    shape = ModelShape(len(tok), cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.seq_len)
    model = build_model(shape, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed)
    side = NLAConfig.from_tokenizer(tok, kind="nla_model", role="av", d_model=cfg.d_model,
                                    layer_index=cfg.default_layer, av_template=DEFAULT_AV_TEMPLATE,
                                    ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR,
                                    injection_scale="sqrt_d_model")
    av = root / "av"
    model.save_pretrained(av)
    tok.save_pretrained(av)
    write_sidecar(av / "nla_meta.yaml", side)
    return av


def main() -> None:
    import httpx
    import torch

    from nla.core.arch import build_input_embeds
    from nla.core.token_ids import canonical_av_prompt_ids
    from nla.serve import ServeLimits
    from nla.serve.app import NLAService, create_app
    from nla.util.http import BackgroundServer
    from nla.util.threads import apply_threads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--av", help="an AV checkpoint dir (default: a random world-sized one built here)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--threads", default="2", help="torch CPU threads (as --threads of nla commands)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    n_threads = apply_threads(int(args.threads) if args.threads.isdigit() else args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="bench_serve_")
    t0 = time.perf_counter()
    av = Path(args.av) if args.av else build_world_sized_av(Path(tmp.name), args.seed)
    print(f"AV: {av} ({'given' if args.av else 'random, default world shape'}; {time.perf_counter() - t0:.1f} s)")
    service = NLAService.load(str(av), None, device="cpu", limits=ServeLimits(max_new_tokens=args.max_new_tokens))
    side, tok, model = service.sidecar, service.tokenizer, service.model
    ids = canonical_av_prompt_ids(tok, side.av_messages())
    pos = next(i for i in range(1, len(ids) - 1) if ids[i] == side.injection_token_id
               and ids[i - 1] == side.injection_left_neighbor_id and ids[i + 1] == side.injection_right_neighbor_id)
    with torch.no_grad():
        base = build_input_embeds(model, torch.tensor(ids)).float()
    vectors = torch.randn(args.requests, side.d_model, generator=torch.Generator().manual_seed(args.seed))
    scale = side.injection_scale_value()
    bodies = []
    for v in vectors:
        e = base.clone()
        e[pos] = v * (scale / v.norm())
        bodies.append({"input_embeds": e.tolist(), "sampling_params": {
            "temperature": 0, "max_new_tokens": args.max_new_tokens, "skip_special_tokens": False}})
    print(f"{args.requests} requests of {len(ids)} x {base.shape[1]} embeddings, greedy, max_new_tokens "
          f"{args.max_new_tokens}; torch threads {n_threads}")

    with BackgroundServer(create_app(service)) as srv, httpx.Client(timeout=600) as http:
        http.post(f"{srv.url}/generate", json=bodies[0]).raise_for_status()  # warm-up
        t = time.perf_counter()
        sequential = []
        for i, b in enumerate(bodies):
            sequential.append(http.post(f"{srv.url}/generate", json=b).json())
            if (i + 1) % 32 == 0:
                print(f"  one at a time: {i + 1}/{len(bodies)} ({time.perf_counter() - t:.1f} s)", flush=True)
        t_seq = time.perf_counter() - t
        before = service.batcher.stats()
        answers: list = [None] * len(bodies)
        nxt = iter(range(len(bodies)))
        lock = threading.Lock()

        def client() -> None:
            with httpx.Client(timeout=600) as c:
                while True:
                    with lock:
                        i = next(nxt, None)
                    if i is None:
                        return
                    answers[i] = c.post(f"{srv.url}/generate", json=bodies[i]).json()

        t = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        t_conc = time.perf_counter() - t
        after = service.batcher.stats()
    service.close()
    same = sum(a["text"] == s["text"] for a, s in zip(answers, sequential, strict=True))
    tokens = sum(s["meta_info"]["completion_tokens"] for s in sequential)
    batches = after["batches"] - before["batches"]
    print(f"same text one at a time and concurrent: {same}/{len(bodies)}")
    print(f"one at a time: {t_seq:.2f} s, {len(bodies) / t_seq:.2f} req/s, {tokens / t_seq:.0f} tokens/s")
    print(f"{args.clients} clients:    {t_conc:.2f} s, {len(bodies) / t_conc:.2f} req/s, {tokens / t_conc:.0f} tokens/s "
          f"({batches} batches, mean {len(bodies) / max(batches, 1):.1f} prompts, largest {after['largest_batch']})")
    print(f"throughput ratio: {t_seq / t_conc:.2f}x")
    if same != len(bodies):
        raise SystemExit("the concurrent answers differ from the one-at-a-time ones")


if __name__ == "__main__":
    main()
