"""Read a Hugging Face safetensors checkpoint (one file or sharded) into fused engine weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from executor.model_config import HFModelConfig


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``: from the shard index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def read_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, on CPU, in their stored dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def fuse_weights(cfg: HFModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename to engine names and concatenate q/k/v and gate/up so each is one matmul.

    Result keys: ``embed``, ``norm``, ``lm_head``, and per layer ``layers.{i}.{qkv, qkv_bias?,
    o, gate_up, down, in_norm, post_norm, q_norm?, k_norm?}``.
    """

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        return sd[name]

    out: dict[str, torch.Tensor] = {"embed": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
        out["lm_head"] = out["embed"]
    else:
        out["lm_head"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        out[e + "qkv"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"])
        if a + "q_proj.bias" in sd:
            out[e + "qkv_bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
        out[e + "o"] = take(a + "o_proj.weight")
        if a + "o_proj.bias" in sd:
            out[e + "o_bias"] = sd[a + "o_proj.bias"]
        if cfg.qk_norm:
            out[e + "q_norm"] = take(a + "q_norm.weight")
            out[e + "k_norm"] = take(a + "k_norm.weight")
        out[e + "gate_up"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[e + "down"] = take(p + "mlp.down_proj.weight")
        out[e + "in_norm"] = take(p + "input_layernorm.weight")
        out[e + "post_norm"] = take(p + "post_attention_layernorm.weight")
    return out


def load_weights(
    model_dir: str | Path, cfg: HFModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Fused weights of ``model_dir`` as contiguous ``dtype`` tensors on ``device``.

    A tied output head stays the *same* tensor as the embedding (no second copy).
    """
    fused = fuse_weights(cfg, read_state_dict(model_dir))
    converted: dict[int, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        key = id(t)
        if key not in converted:
            converted[key] = t.to(device=device, dtype=dtype).contiguous()
        result[name] = converted[key]
    return result
