"""A reader of NLA checkpoints written from the published system's inference docs, not from nla.

It performs the steps the published inference guide (docs/inference.md of the published NLA
repository) and its single-file client describe, in the environment that client pins
(transformers 4.57), and imports nothing of nla: whatever nla writes must satisfy it as it is.

AV (verbalizer):
  1. ``AutoTokenizer.from_pretrained(dir)``; the sidecar ``nla_meta.yaml`` read with PyYAML;
     ``d_model`` from ``kind: nla_model``; ``float(extraction.injection_scale)``.
  2. The marker: ``encode(injection_char, add_special_tokens=False) == [injection_token_id]``, not
     UNK; the canonical prompt (the ``av`` template, else ``actor``, with the marker, as one user
     turn through the chat template, ``tokenize=True, add_generation_prompt=True``) holds it
     exactly once, between the recorded left and right neighbour ids.
  3. The input-embedding table read alone from the safetensors (the one key ending in
     ``embed_tokens.weight`` / ``wte.weight`` / ``word_embeddings.weight``), times sqrt(hidden)
     for the Gemma / T5 model types whose embedding scales in its forward.
  4. Each vector rescaled to L2 norm ``injection_scale`` (norm in fp32) and written at the marker.
  5. Decoding from those embeddings alone. The published client sends them to SGLang's
     ``/generate``; here either ``--server URL`` does exactly that (the wire format: embeds
     ``[T, d]``, ``sampling_params``; response ``{"text": ...}``) or the AV decodes them in this
     process (greedy, ``model.generate(inputs_embeds=...)``, the marker id suppressed as nla's
     decoding does). The text is the decode up to the first EOS, special tokens kept.
AR (reconstructor):
  1. ``role`` is ``ar`` or ``critic``; ``float(extraction.mse_scale)``; the ``ar`` (else ``critic``)
     template.
  2. The BOS invariant: a tokenizer with a ``bos_token_id`` must produce it first under
     ``add_special_tokens=True`` (the published ARs were trained with it).
  3. ``AutoModelForCausalLM.from_pretrained(dir)``: ``config.json`` holds K+1 blocks, K =
     ``ar.num_hidden_layers`` (or ``critic.*``); the LM head dropped, the final norm replaced by
     the identity, ``value_head.safetensors`` (key ``weight``) a bias-free Linear.
  4. The template's tokenised tail equals ``tokens.critic_suffix_ids``.
  5. Per text: ``tok(template.format(explanation=text), add_special_tokens=True)``, block K's output at
     the last token through the head; prediction and gold both rescaled to ``mse_scale``;
     ``mse = mean((p - g)^2)`` (= 2(1 - cos)).

Usage (under transformers 4.57): ``python published_reader.py --av DIR --ar DIR --vectors V.npy
--texts T.json --out OUT.json [--max-new-tokens N] [--server URL]``, or ``--load DIR`` (repeatable)
to only load checkpoints. Every check that fails raises
``ReaderRefused`` with the reason, which the output records (``{"refused": "..."}``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.request
from pathlib import Path

import numpy as np
import torch
import transformers
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

EMBED_KEY_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
SCALED_EMBED_TYPES = {"gemma", "gemma2", "gemma3", "gemma3_text", "t5"}
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f")


class ReaderRefused(Exception):
    """A check of the published reader failed: the checkpoint is not in the published format."""


def require(ok: bool, why: str) -> None:
    if not ok:
        raise ReaderRefused(why)


def sidecar(directory: Path) -> dict:
    path = directory / "nla_meta.yaml"
    require(path.is_file(), f"no nla_meta.yaml in {directory}")
    meta = yaml.safe_load(path.read_text())
    require(meta.get("kind") in ("nla_model", "nla_dataset"), f"unknown sidecar kind {meta.get('kind')!r}")
    return meta


def number(meta: dict, key: str) -> float:
    value = (meta.get("extraction") or {}).get(key)
    require(value is not None, f"extraction.{key} is missing or null")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ReaderRefused(f"extraction.{key} is {value!r}, which float() cannot read") from None


def chat_ids(tok, content: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class Verbalizer:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.tok = AutoTokenizer.from_pretrained(str(directory))
        meta = sidecar(directory)
        self.d_model = meta["d_model"] if meta["kind"] == "nla_model" else meta["extraction"]["d_model"]
        self.scale = number(meta, "injection_scale")
        t = meta["tokens"]
        self.char, self.marker = t["injection_char"], t["injection_token_id"]
        self.left, self.right = t["injection_left_neighbor_id"], t["injection_right_neighbor_id"]
        templates = meta["prompt_templates"]
        self.template = templates.get("av") or templates["actor"]
        live = self.tok.encode(self.char, add_special_tokens=False)
        require(live == [self.marker], f"{self.char!r} encodes to {live}, the sidecar says [{self.marker}]")
        require(live[0] != self.tok.unk_token_id, f"{self.char!r} is UNK")
        self.ids = chat_ids(self.tok, self.template.format(injection_char=self.char))
        sites = [i for i, x in enumerate(self.ids) if x == self.marker]
        require(len(sites) == 1, f"the marker appears {len(sites)} times in the canonical prompt")
        self.site = sites[0]
        require(0 < self.site < len(self.ids) - 1, "the marker is at an end of the prompt")
        require((self.ids[self.site - 1], self.ids[self.site + 1]) == (self.left, self.right),
                f"marker neighbours {(self.ids[self.site - 1], self.ids[self.site + 1])}, sidecar "
                f"{(self.left, self.right)}")
        self.embed = self._embedding_table() * self._embed_scale()
        require(self.embed.shape[1] == self.d_model, f"embedding width {self.embed.shape[1]} != d_model {self.d_model}")

    def _embedding_table(self) -> torch.Tensor:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            keys = [k for k in weight_map if k.endswith(EMBED_KEY_SUFFIXES)]
            require(len(keys) == 1, f"expected one embedding key, found {keys}")
            shard = self.dir / weight_map[keys[0]]
        else:
            shard = self.dir / "model.safetensors"
            require(shard.is_file(), f"no model.safetensors in {self.dir}")
            with safe_open(str(shard), framework="pt") as f:
                keys = [k for k in f.keys() if k.endswith(EMBED_KEY_SUFFIXES)]
            require(len(keys) == 1, f"expected one embedding key, found {keys}")
        with safe_open(str(shard), framework="pt") as f:
            return f.get_tensor(keys[0]).float()

    def _embed_scale(self) -> float:
        config = AutoConfig.from_pretrained(str(self.dir))
        text = getattr(config, "text_config", config)
        return math.sqrt(text.hidden_size) if getattr(text, "model_type", "") in SCALED_EMBED_TYPES else 1.0

    def embeds(self, vector: np.ndarray) -> torch.Tensor:
        """[T, d] fp32: the prompt's embeddings with the rescaled vector at the marker."""
        v = torch.as_tensor(vector, dtype=torch.float32)
        require(v.numel() == self.d_model and bool(torch.isfinite(v).all()), "bad vector")
        out = self.embed[torch.tensor(self.ids)].clone()
        out[self.site] = v * (self.scale / v.norm().clamp_min(1e-12))
        return out

    def decode_locally(self, vectors: np.ndarray, max_new_tokens: int) -> list[str]:
        model = AutoModelForCausalLM.from_pretrained(str(self.dir), dtype=torch.float32).eval()
        eos = self.tok.eos_token_id
        texts = []
        with torch.no_grad():
            for v in vectors:
                e = self.embeds(v)[None]
                out = model.generate(inputs_embeds=e, attention_mask=torch.ones(e.shape[:2], dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                     pad_token_id=self.tok.pad_token_id if self.tok.pad_token_id is not None else eos,
                                     suppress_tokens=[self.marker])
                ids = out[0].tolist()
                texts.append(self.tok.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=False))
        return texts

    def decode_on_server(self, vectors: np.ndarray, max_new_tokens: int, url: str) -> list[str]:
        texts = []
        for v in vectors:
            body = json.dumps({"input_embeds": self.embeds(v).tolist(),
                               "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                   "skip_special_tokens": False}}).encode()
            req = urllib.request.Request(url.rstrip("/") + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                out = json.loads(resp.read())
            texts.append((out[0] if isinstance(out, list) else out)["text"])
        return texts


class Reconstructor:
    def __init__(self, directory: Path) -> None:
        meta = sidecar(directory)
        require(meta.get("role") in ("ar", "critic"), f"role {meta.get('role')!r} is not an AR's")
        self.mse_scale = number(meta, "mse_scale")
        templates = meta["prompt_templates"]
        self.template = templates.get("ar") or templates["critic"]
        self.tok = AutoTokenizer.from_pretrained(str(directory))
        bos = self.tok.bos_token_id
        probe = self.tok("x", add_special_tokens=True)["input_ids"]
        require(bos is None or probe[0] == bos,
                f"the tokenizer declares bos_token_id={bos} but add_special_tokens=True starts with {probe[0]}")
        k = (meta.get("ar") or {}).get("num_hidden_layers")
        if k is None:
            critic = meta.get("critic") or {}
            k = critic.get("extraction_layer_index", critic.get("num_hidden_layers"))
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        require(model.config.num_hidden_layers == k + 1,
                f"config.json has {model.config.num_hidden_layers} blocks, the sidecar's K+1 is {k + 1}")
        inner = model.model
        names = [n for n in FINAL_NORM_NAMES if hasattr(inner, n)]
        require(bool(names), f"no final norm on {type(inner).__name__}")
        setattr(inner, names[0], torch.nn.Identity())
        self.inner = inner.eval()
        weight = load_file(str(directory / "value_head.safetensors"))["weight"].float()
        self.head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.head.load_state_dict({"weight": weight})
        suffix = (meta.get("tokens") or {}).get("critic_suffix_ids")
        if suffix:
            tail = self.tok(self.template.format(explanation="a probe explanation"), add_special_tokens=True)["input_ids"]
            require(tail[-len(suffix):] == list(suffix), f"template tail {tail[-len(suffix):]} != {suffix}")

    @torch.no_grad()
    def score(self, text: str, gold: np.ndarray) -> tuple[float, float]:
        ids = self.tok(self.template.format(explanation=text), return_tensors="pt", add_special_tokens=True)["input_ids"]
        pred = self.head(self.inner(ids, use_cache=False).last_hidden_state[0, -1])
        g = torch.as_tensor(gold, dtype=torch.float32)
        p_n = pred / pred.norm().clamp_min(1e-12) * self.mse_scale
        g_n = g / g.norm().clamp_min(1e-12) * self.mse_scale
        return float(((p_n - g_n) ** 2).mean()), float(p_n @ g_n / (p_n.norm() * g_n.norm()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--av")
    ap.add_argument("--ar")
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--texts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--server")
    ap.add_argument("--load", action="append", default=[],
                    help="only load this checkpoint (repeatable; AV or AR by its sidecar's role): "
                         "result['loads'] holds, per dir, null or why it was refused")
    args = ap.parse_args()
    vectors = np.load(args.vectors)
    result: dict = {"transformers": transformers.__version__}
    loads = []
    for directory in map(Path, args.load):
        try:
            role = sidecar(directory).get("role")
            (Reconstructor if role in ("ar", "critic") else Verbalizer)(directory)
            loads.append(None)
        except ReaderRefused as err:
            loads.append(str(err))
        except Exception as err:  # noqa: BLE001 - a crash of the reader is a refusal too
            loads.append(f"{type(err).__name__}: {err}")
    if args.load:
        result["loads"] = loads
    try:
        if args.av:
            av = Verbalizer(Path(args.av))
            result["av_texts"] = (av.decode_on_server(vectors, args.max_new_tokens, args.server) if args.server
                                  else av.decode_locally(vectors, args.max_new_tokens))
        if args.ar:
            ar = Reconstructor(Path(args.ar))
            texts = json.loads(Path(args.texts).read_text())
            scores = [ar.score(t, v) for t, v in zip(texts, vectors, strict=True)]
            result["ar_mse"], result["ar_cos"] = [s[0] for s in scores], [s[1] for s in scores]
    except ReaderRefused as err:
        result["refused"] = str(err)
    except Exception as err:  # noqa: BLE001 - a crash of the reader is what the test reports
        result["refused"] = f"{type(err).__name__}: {err}"
    Path(args.out).write_text(json.dumps(result))
    sys.exit(0)


if __name__ == "__main__":
    main()
