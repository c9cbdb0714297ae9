"""The memory an RL step holds, per role and phase, from the model's shape: before anything loads.

Notation: N = prompts x samples rollout rows, P prompt tokens, L = max_response_len, m the
micro-batch, V vocabulary, d width, I MLP width, b bytes per value of the run's dtype. One device
holds every role (the local backend; on Ray each worker holds its role's share).

What is counted, and how (exact where the count is; estimated where marked):
1. weights: the AV (every block, embedding, LM head), the reference (a second AV, or nothing with
   LoRA: the same module with its adapters off), the AR (blocks 0..K, embedding, a d x d head);
   the rollout shares the policy module;
2. training state: a gradient and AdamW's two moments per trained value (LoRA adapters are fp32,
   as peft builds them; full fine-tuning keeps the state in the weights' dtype);
3. generation: the KV cache, 2 x layers x kv_dim x b per token of N x (P + L), and the decode
   step's logits (N x V fp32, twice);
4. a log-prob pass and the policy update per micro-batch: the logits of m x L tokens in the model
   dtype and their gradient, plus ``token_logprobs``' fp32 chunk (three 2**25-value buffers);
   activations kept for backward, estimated as 10 d + 4 I values per token and block (d: block
   input, norms, q/k/v/o, residual; I: gate, up, activation, down input), or with gradient
   checkpointing d per token and block plus one block's 10 d + 4 I;
5. the AR's update per micro-batch: m x ``ar_len`` tokens through K + 1 blocks, the same estimate.
The peak is (1) + (2) + the largest of (3), (4), (5): the phases run one after another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nla.core.logprobs import LOGPROB_CHUNK_ELEMENTS
from nla.core.shapes import ModelShape

if TYPE_CHECKING:
    from nla.rl.config import RLConfig

__all__ = ["DTYPE_BYTES", "MemoryPlan", "PlanSettings", "device_memory", "plan_of_config", "plan_rl_step"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


@dataclass(frozen=True)
class PlanSettings:
    """An RL step's settings that set its memory (``nla plan`` flags; ``RLConfig`` fields)."""

    layer: int  # K: the AR keeps blocks 0..K
    dtype: str = "bfloat16"
    lora_r: int = 0  # the AV's adapters (0: full fine-tuning)
    ar_lora_r: int = 0
    prompts: int = 128
    samples: int = 8
    prompt_len: int = 24  # the canonical AV prompt (24 tokens with the default template on Qwen2.5)
    max_response_len: int = 150
    micro_batch: int = 8
    ar_len: int = 192  # AR text tokens: the explanation plus the template
    gradient_checkpointing: bool = False  # the AV's policy update
    ar_gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, found {self.dtype!r}")
        for name in ("prompts", "samples", "prompt_len", "max_response_len", "micro_batch", "ar_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an integer >= 1, found {v!r}")
        for name in ("layer", "lora_r", "ar_lora_r"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an integer >= 0, found {v!r}")


@dataclass
class MemoryPlan:
    """Bytes per role and term (``terms[role][term]``) and per phase; ``peak`` = persistent + the
    largest phase."""

    shape: str
    settings: PlanSettings
    terms: dict[str, dict[str, int]] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def persistent(self) -> int:
        return sum(sum(t.values()) for t in self.terms.values())

    @property
    def peak(self) -> int:
        return self.persistent + max(self.phases.values(), default=0)

    def fits(self, device_bytes: int) -> bool:
        return self.peak <= device_bytes

    def table(self, device_bytes: int | None = None) -> str:
        lines = [f"memory plan: {self.shape}, K={self.settings.layer}, {self.settings.dtype}, "
                 f"{self.settings.prompts} x {self.settings.samples} rollouts of <= {self.settings.max_response_len} "
                 f"tokens, micro-batch {self.settings.micro_batch}", "", "| held | GiB |", "|---|---|"]
        for role, terms in self.terms.items():
            for term, v in terms.items():
                if v:
                    lines.append(f"| {role}: {term} | {v / GIB:.2f} |")
        lines.append(f"| persistent | {self.persistent / GIB:.2f} |")
        for phase, v in self.phases.items():
            lines.append(f"| phase: {phase} | {v / GIB:.2f} |")
        lines.append(f"| **peak** | **{self.peak / GIB:.2f}** |")
        if device_bytes is not None:
            verdict = "fits" if self.fits(device_bytes) else "does NOT fit"
            lines += ["", f"{verdict} on a device of {device_bytes / GIB:.1f} GiB "
                      f"({100 * self.peak / device_bytes:.0f} % of it)"]
        return "\n".join(lines)


def _activations(shape: ModelShape, tokens: int, layers: int, b: int, checkpointed: bool) -> int:
    per_token_block = 10 * shape.hidden_size + 4 * shape.intermediate_size
    if checkpointed:
        return tokens * b * (layers * shape.hidden_size + per_token_block)
    return tokens * b * layers * per_token_block


def _trained(params: int, lora: int, b: int) -> dict[str, int]:
    if lora:
        return {"adapters": lora * 4, "gradients": lora * 4, "AdamW state": 2 * lora * 4}
    return {"gradients": params * b, "AdamW state": 2 * params * b}


def plan_rl_step(shape: ModelShape, s: PlanSettings) -> MemoryPlan:
    """The memory plan of one RL step of an AV and AR of ``shape`` (module docstring)."""
    if s.layer >= shape.num_hidden_layers:
        raise ValueError(f"layer: expected a block index below {shape.num_hidden_layers} ({shape.name}), "
                         f"found {s.layer}")
    b = DTYPE_BYTES[s.dtype]
    d, V = shape.hidden_size, shape.vocab_size
    n = s.prompts * s.samples
    plan = MemoryPlan(shape.name, s)
    av = shape.params()
    plan.terms["policy (AV)"] = {"weights": av * b, **_trained(av, shape.lora_params(s.lora_r) if s.lora_r else 0, b)}
    plan.terms["reference"] = {"weights": 0 if s.lora_r else av * b}
    ar = shape.params(s.layer + 1, lm_head=False) + d * d
    ar_lora = shape.lora_params(s.ar_lora_r, s.layer + 1) if s.ar_lora_r else 0
    plan.terms["reconstructor (AR)"] = {"weights": ar * b, **_trained(ar, ar_lora, b)}
    kv = 2 * shape.num_hidden_layers * shape.kv_dim * b * n * (s.prompt_len + s.max_response_len)
    plan.phases["generation (KV cache, decode logits)"] = kv + 2 * n * V * 4
    tokens = s.micro_batch * s.max_response_len
    logits = tokens * V * b
    chunk = 3 * min(LOGPROB_CHUNK_ELEMENTS, tokens * V) * 4
    acts = _activations(shape, s.micro_batch * (s.prompt_len + s.max_response_len), shape.num_hidden_layers, b,
                        s.gradient_checkpointing)
    plan.phases["policy update (per micro-batch)"] = 2 * logits + chunk + acts
    plan.phases["AR update (per micro-batch)"] = _activations(shape, s.micro_batch * s.ar_len, s.layer + 1, b,
                                                              s.ar_gradient_checkpointing)
    return plan


def plan_of_config(cfg: RLConfig) -> MemoryPlan:
    """The plan of an RL config: the AV's shape from its ``config.json``, the AR's layer from its
    sidecar, the settings from the config's sections."""
    from transformers import AutoConfig

    from nla.core.sidecar import load_sidecar

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(cfg.av), name=str(cfg.av))
    ar_side = load_sidecar(cfg.ar)
    layer = ar_side.layer_index if ar_side.layer_index is not None else shape.num_hidden_layers - 1
    return plan_rl_step(shape, PlanSettings(
        layer=layer, dtype=cfg.dtype, lora_r=cfg.lora.r, ar_lora_r=cfg.reconstructor.lora_r,
        prompts=cfg.rollout.rollout_batch_size, samples=cfg.rollout.n_samples_per_prompt,
        max_response_len=cfg.rollout.max_response_len, micro_batch=cfg.optimiser.micro_batch_size,
        ar_len=cfg.reconstructor.max_length, gradient_checkpointing=cfg.optimiser.gradient_checkpointing,
        ar_gradient_checkpointing=cfg.reconstructor.gradient_checkpointing))


def device_memory(device: str) -> int | None:
    """Total memory of a CUDA device (bytes); None for another device."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return None
