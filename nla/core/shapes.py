"""The shapes of real models, as numbers: a random-weight model of any of them on any device.

Throughput and memory do not depend on the weights' values, so a shape preset stands in for a
checkpoint wherever only its size matters (``nla plan``, ``bench/gpu_scale.sh``). The numbers are
those of each model's ``config.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["SHAPES", "ModelShape", "get_shape"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape. ``params()`` counts weights as transformers builds them (Qwen2: q/k/v
    projections with a bias, o/MLP without, RMSNorm weights, an untied LM head unless tied)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def block_params(self) -> int:
        d, i, kv = self.hidden_size, self.intermediate_size, self.kv_dim
        attn = d * d + d + 2 * (d * kv + kv) + d * d  # q (+bias), k and v (+bias), o
        return attn + 3 * d * i + 2 * d  # gate, up, down; two norms

    def params(self, layers: int | None = None, *, lm_head: bool = True) -> int:
        """Weights of the first ``layers`` blocks (all when None) with the embedding and final norm,
        and the LM head when ``lm_head`` and untied."""
        n = self.num_hidden_layers if layers is None else layers
        head = self.vocab_size * self.hidden_size if lm_head and not self.tie_word_embeddings else 0
        return self.vocab_size * self.hidden_size + n * self.block_params() + self.hidden_size + head

    def lora_params(self, r: int, layers: int | None = None) -> int:
        """Adapter weights at rank ``r`` on every attention and MLP projection (nla's default targets)."""
        d, i, kv = self.hidden_size, self.intermediate_size, self.kv_dim
        per_block = r * ((d + d) + 2 * (d + kv) + (d + d) + 2 * (d + i) + (i + d))
        return per_block * (self.num_hidden_layers if layers is None else layers)

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "") -> ModelShape:
        """The shape of a transformers config (a checkpoint's ``config.json``; its text config for a
        multimodal model)."""
        from nla.core.arch import text_config

        c = text_config(config)
        try:
            return cls(name=name or getattr(c, "_name_or_path", "") or c.model_type, model_type=c.model_type,
                       vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                       tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                       max_position_embeddings=getattr(c, "max_position_embeddings", 32768),
                       rope_theta=float(getattr(c, "rope_theta", None)
                                        or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 1e6)),
                       rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)))
        except AttributeError as err:
            raise ValueError(f"shape: the {c.model_type} config lacks a field a plan needs ({err})") from None

    def hf_config(self, **overrides: Any) -> Any:
        from transformers import AutoConfig

        kw = {k: v for k, v in asdict(self).items() if k not in ("name", "model_type")}
        kw.update(overrides)
        return AutoConfig.for_model(self.model_type, **kw)

    def build(self, dtype: Any = None, device: Any = None, **overrides: Any) -> Any:
        """A causal LM of this shape with random weights (``overrides``: config fields, e.g. a test
        width), built directly on ``device``."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device(device or "cpu"):
            return AutoModelForCausalLM.from_config(self.hf_config(**overrides), dtype=dtype or torch.float32)


SHAPES: dict[str, ModelShape] = {
    s.name: s for s in (
        ModelShape("qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, True),
        ModelShape("qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, True),
        ModelShape("qwen2.5-7b", "qwen2", 152064, 3584, 18944, 28, 28, 4, False, 131072),
    )
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"shape: expected one of {sorted(SHAPES)}, found {name!r}") from None
