"""Read an HF `config.json` into a checked architecture description.

Only what Megatron can represent exactly is accepted: an unsupported architecture, rope scaling
type or feature (sliding window, biases on MLPs, ...) is an error that names the value, never a
silently different model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_agent.errors import InputError

# architectures value -> family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class UnsupportedModelError(InputError):
    """The HF config describes something the Megatron model cannot reproduce exactly."""


@dataclass(frozen=True)
class ModelArch:
    """The architecture of a decoder-only model, in Megatron's terms."""

    family: str
    """llama, qwen2 or qwen3."""
    architecture: str
    """The HF `architectures[0]` value."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    """Per-head size (kv_channels); may differ from hidden_size / num_attention_heads (Qwen3)."""
    vocab_size: int
    """Rows of the HF embedding (before Megatron's padding)."""
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    """HF rope_scaling with 'rope_type' normalised ({} when none)."""
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_query_groups


def load_hf_config(model_path: str | Path) -> dict:
    """The `config.json` of an HF model folder as a dict (clear error if missing)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be an HF folder with config.json")
    with open(path) as f:
        return json.load(f)


def arch_from_hf_config(cfg: dict) -> ModelArch:
    """Check an HF config dict and turn it into a `ModelArch`."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architectures={archs!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported (full attention only)")
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    num_kv = cfg.get("num_key_value_heads") or num_heads
    if num_heads % num_kv:
        raise UnsupportedModelError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
        )
    if family == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(cfg.get("attention_bias", False))
    return ModelArch(
        family=family,
        architecture=arch,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=num_heads,
        num_query_groups=num_kv,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(
            cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        ),
        rope_scaling=_rope_scaling(cfg),
        qkv_bias=qkv_bias,
        qk_norm=(family == "qwen3"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _rope_scaling(cfg: dict) -> dict:
    """HF rope scaling, normalised to a dict with 'rope_type'; {} for plain rope."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return {}
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    return scaling


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocabulary padding: the smallest multiple of divisible_by * tp >= vocab_size."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def model_arch(path: str | Path, flag: str = "--model") -> ModelArch:
    """The checked `ModelArch` of the HF model folder `path` (given as `flag`).

    Raises `InputError` naming the flag and the folder when it does not exist, has no
    config.json or no safetensors weights, or describes a model that is not supported.
    """
    folder = Path(path)
    what = "give an HF model folder (config.json + safetensors)"
    if not folder.exists():
        raise InputError(f"{flag} {path}: no such folder: {what}")
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: not a folder: {what}")
    if not (folder / "config.json").is_file():
        raise InputError(f"{flag} {path}: no config.json in this folder: {what}")
    if not (folder / SINGLE_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        raise InputError(f"{flag} {path}: neither {SINGLE_FILE} nor {INDEX_FILE} in this folder: {what}")
    try:
        cfg = load_hf_config(folder)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{flag} {path}: config.json is not valid JSON ({e})") from None
    try:
        return arch_from_hf_config(cfg)
    except InputError as e:
        raise type(e)(f"{flag} {path}: {e}") from None
    except (KeyError, TypeError) as e:
        raise InputError(f"{flag} {path}: config.json lacks or mistypes {e}") from None


def check_parallel_fit(
    arch: ModelArch, tp: int, pp: int, vpp: int = 1, *, keys: tuple[str, str, str] = ("--tp", "--pp", "--vpp")
) -> None:
    """Raise `InputError` when the model cannot be split at tp/pp/vpp (named by `keys`: the flags,
    or the config keys): tp must divide its attention heads and key/value heads, pp * vpp its layers."""
    heads, groups, layers = arch.num_attention_heads, arch.num_query_groups, arch.num_layers
    if heads % tp or groups % tp:
        raise InputError(
            f"{keys[0]}={tp} does not divide the model's {heads} attention heads and {groups} key/value "
            f"heads: choose a tp that divides both (e.g. {math.gcd(heads, groups)})"
        )
    if layers % (pp * vpp):
        what = f"{keys[1]}={pp} x {keys[2]}={vpp} = {pp * vpp}" if vpp > 1 else f"{keys[1]}={pp}"
        raise InputError(f"{what} does not divide the model's {layers} layers: choose a divisor of {layers}")
