"""Model hyper-parameters for gpt-oss.

Field names follow OpenAI's original `config.json` (the format the reference loaders read with
`ModelConfig(**json)`), so `from_original_json` is a plain field copy and nobody has to remember a third
naming scheme. HF names are translated in `from_hf_json`. Everything the files provide is read from them;
the only constants here are the ones no checkpoint stores (RMSNorm eps and the SwiGLU alpha are hard-coded
in every reference implementation).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# config.json's names for a layer's attention (HF's `layer_types`); the KV page groups they map to are
# engine/kv_geometry.py's.
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# Decode batch sizes captured as CUDA graphs when neither the topology (decode.cuda_graph_batch_sizes) nor
# the caller says otherwise: the one default of the engine and the topology.
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


# What a model can be served as: every GEMM layer as `quant` says, the unembedding (LM head) bf16, except in
# fp8-block128-lmhead, where it is FP8 too (128x128 block scales): half the bytes of the largest single read
# of a decode step (1.16 GB at batch 1 for gpt-oss), at the cost of logits within FP8 rounding of the bf16
# head's (TensorRT-LLM's quantised lm_head; vLLM and the published FP8 recipes keep it bf16, as we do by
# default).
# mxfp4: the experts served from the MXFP4 blocks OpenAI ships (kernels/moe_mxfp4.py), the attention GEMMs FP8
# blocks; mxfp4-bf16: the same experts, the attention GEMMs bf16.
MODEL_QUANTS = ("bf16", "fp8-block128", "fp8-block128-lmhead", "mxfp4", "mxfp4-bf16")


def layer_quant(quant: str) -> str:
    """The quantisation of the transformer blocks' dense GEMM weights (attention) under a model quant
    (MODEL_QUANTS): one of engine/layers/linear.QUANTS."""
    return "fp8-block128" if quant.startswith("fp8") or quant == "mxfp4" else "bf16"


def expert_quant(quant: str) -> str:
    """The quantisation of the MoE experts under a model quant: layer_quant's, or mxfp4."""
    return "mxfp4" if quant.startswith("mxfp4") else layer_quant(quant)


def head_quant(quant: str) -> str:
    """The quantisation of the unembedding under a model quant (MODEL_QUANTS)."""
    return "fp8-block128" if quant == "fp8-block128-lmhead" else "bf16"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_hidden_layers: int
    num_experts: int
    experts_per_token: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    sliding_window: int
    initial_context_length: int
    rope_theta: float
    rope_scaling_factor: float
    rope_ntk_alpha: float
    rope_ntk_beta: float
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rms_norm_eps: float = 1e-5
    # 0 means "the YaRN-extended length" (initial_context_length * rope_scaling_factor), which is what
    # HF publishes as max_position_embeddings for both sizes.
    max_context: int = 0

    def __post_init__(self) -> None:
        if self.max_context == 0:
            object.__setattr__(
                self, "max_context", int(round(self.initial_context_length * self.rope_scaling_factor))
            )
        positive = (
            "num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
            "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
            "sliding_window", "initial_context_length",
        )
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA groups must be whole)"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} > num_experts={self.num_experts}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for half-split rotary")

    # ---- derived values -------------------------------------------------------------------------
    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def layer_is_sliding(self, layer: int) -> bool:
        # Even layers use the banded mask in every reference (and HF's layer_types start with sliding).
        return layer % 2 == 0

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(SLIDING_ATTENTION if self.layer_is_sliding(i) else FULL_ATTENTION
                     for i in range(self.num_hidden_layers))

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_is_sliding(i))

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.layer_is_sliding(i))

    def weight_bytes(self, quant: str = "bf16") -> int:
        """Device bytes of the served weights (estimate for sizing before loading): FP8 GEMM weights take
        one byte per parameter, embedding, unembedding (one under fp8-block128-lmhead) and the rest two."""
        h, d, e, i = self.hidden_size, self.head_dim, self.num_experts, self.intermediate_size
        attn = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d + self.num_attention_heads * d * h
        experts = self.num_hidden_layers * e * 3 * h * i
        other = self.vocab_size * h + self.num_hidden_layers * h * e  # embedding, routers (bf16)
        head = self.vocab_size * h * (1 if head_quant(quant) == "fp8-block128" else 2)
        per_param = {"fp8-block128": 1.0, "bf16": 2.0, "mxfp4": 17 / 32}  # MXFP4: 16 bytes + 1 scale a 32 weights
        return int(self.num_hidden_layers * attn * per_param[layer_quant(quant)]
                   + experts * per_param[expert_quant(quant)]) + 2 * other + head

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- readers -------------------------------------------------------------------------------
    @classmethod
    def from_original_json(cls, d: dict[str, Any], name: str = "custom") -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"name"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown keys in original-format config.json: {sorted(unknown)}")
        return cls(name=name, **d)

    @classmethod
    def from_hf_json(cls, d: dict[str, Any], name: str = "custom") -> "ModelConfig":
        # transformers < 5 writes `rope_scaling` (+ top-level rope_theta); 5.x writes `rope_parameters`
        # with rope_theta inside. Accept either.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "yarn"))
        if rope_type != "yarn":
            raise ValueError(f"gpt-oss uses YaRN rotary; config has rope_type={rope_type!r}")
        if rope.get("truncate", False):
            raise ValueError("gpt-oss YaRN uses un-rounded correction bounds (truncate=false)")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if theta is None:
            raise ValueError("HF config has no rope_theta (neither top level nor in rope_parameters)")
        n_layers = int(d["num_hidden_layers"])
        cfg = cls(
            name=name,
            num_hidden_layers=n_layers,
            num_experts=int(d["num_local_experts"]),
            experts_per_token=int(d.get("num_experts_per_tok", d.get("experts_per_token"))),
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            sliding_window=int(d["sliding_window"]),
            initial_context_length=int(rope["original_max_position_embeddings"]),
            rope_theta=float(theta),
            rope_scaling_factor=float(rope["factor"]),
            rope_ntk_alpha=float(rope.get("beta_slow") or 1.0),
            rope_ntk_beta=float(rope.get("beta_fast") or 32.0),
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_context=int(d.get("max_position_embeddings", 0)),
        )
        layer_types = d.get("layer_types")
        if layer_types is not None and tuple(layer_types) != cfg.layer_types:
            # The model code hard-wires even=sliding (as the references do); refuse anything else loudly
            # rather than silently run a different mask pattern.
            raise ValueError(f"unsupported layer_types {layer_types}; expected alternating sliding/full")
        return cfg


PRESETS: dict[str, ModelConfig] = {
    "gpt-oss-20b": ModelConfig(
        name="gpt-oss-20b", num_hidden_layers=24, num_experts=32, experts_per_token=4, vocab_size=201088,
        hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
        num_key_value_heads=8, sliding_window=128, initial_context_length=4096, rope_theta=150000.0,
        rope_scaling_factor=32.0, rope_ntk_alpha=1.0, rope_ntk_beta=32.0, swiglu_limit=7.0,
    ),
    "gpt-oss-120b": ModelConfig(
        name="gpt-oss-120b", num_hidden_layers=36, num_experts=128, experts_per_token=4, vocab_size=201088,
        hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
        num_key_value_heads=8, sliding_window=128, initial_context_length=4096, rope_theta=150000.0,
        rope_scaling_factor=32.0, rope_ntk_alpha=1.0, rope_ntk_beta=32.0, swiglu_limit=7.0,
    ),
    # The shape of tests/data/gpt-oss-tiny-original (3 layers, 8 experts, vocab 1024).
    "tiny": ModelConfig(
        name="tiny", num_hidden_layers=3, num_experts=8, experts_per_token=4, vocab_size=1024,
        hidden_size=128, intermediate_size=96, head_dim=32, num_attention_heads=8,
        num_key_value_heads=2, sliding_window=8, initial_context_length=256, rope_theta=150000.0,
        rope_scaling_factor=32.0, rope_ntk_alpha=1.0, rope_ntk_beta=32.0, swiglu_limit=7.0,
    ),
    # gpt-oss layers at toy width with the real 201088-token vocabulary, so harmony-rendered prompts (ids
    # up to 200012) are valid input for CPU serving tests with dummy weights.
    "gpt-oss-tiny": ModelConfig(
        name="gpt-oss-tiny", num_hidden_layers=4, num_experts=8, experts_per_token=4, vocab_size=201088,
        hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=8,
        num_key_value_heads=2, sliding_window=128, initial_context_length=4096, rope_theta=150000.0,
        rope_scaling_factor=32.0, rope_ntk_alpha=1.0, rope_ntk_beta=32.0, swiglu_limit=7.0,
        max_context=8192,
    ),
    # gpt-oss's attention shape (64 q / 8 KV heads of 64 dims, window 128) in 4 narrow layers: on a GPU
    # it runs the FlashInfer paths the real models use, at test speed (tests/gpu serve tests).
    "tiny-attn64": ModelConfig(
        name="tiny-attn64", num_hidden_layers=4, num_experts=8, experts_per_token=4, vocab_size=1024,
        hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=64,
        num_key_value_heads=8, sliding_window=128, initial_context_length=4096, rope_theta=150000.0,
        rope_scaling_factor=32.0, rope_ntk_alpha=1.0, rope_ntk_beta=32.0, swiglu_limit=7.0,
        max_context=4096,
    ),
}


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _config_from_dir(path: Path) -> ModelConfig:
    """An original-format dir (config.json with `num_experts`), an HF dir (`num_local_experts`), or an
    HF repo dir whose `original/` holds the original files (the HF config wins: it is the repo's own)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if (path / "original" / "config.json").is_file():
            cfg_file = path / "original" / "config.json"
        else:
            raise FileNotFoundError(f"no config.json in {path} (nor in {path / 'original'})")
    d = _read_json(cfg_file)
    name = path.name
    if "num_local_experts" in d or d.get("model_type") == "gpt_oss":
        return ModelConfig.from_hf_json(d, name=name)
    return ModelConfig.from_original_json(d, name=name)


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        return _config_from_dir(path)
    if path.is_file() and path.suffix == ".json":
        d = _read_json(path)
        if "num_local_experts" in d:
            return ModelConfig.from_hf_json(d, name=path.parent.name)
        return ModelConfig.from_original_json(d, name=path.parent.name)
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory"
    )
