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


# Tensors a Hugging Face checkpoint may carry that the model deliberately does not read: older
# transformers saved each layer's rotary ``inv_freq`` buffer, which the engine recomputes from
# the config (`executor.model.rope_inv_freq`), as transformers itself does on load.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def expected_shapes(cfg: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model reads, by Hugging Face name, with its shape.

    Biases appear exactly when the config asks for them (see `HFModelConfig`); ``lm_head.weight``
    only when the embeddings are not tied.
    """
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes.update(
            {
                a + "q_proj.weight": (q, h),
                a + "k_proj.weight": (kv, h),
                a + "v_proj.weight": (kv, h),
                a + "o_proj.weight": (h, q),
                m + "gate_proj.weight": (inter, h),
                m + "up_proj.weight": (inter, h),
                m + "down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if cfg.attention_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        if cfg.mlp_bias:
            shapes.update({m + "gate_proj.bias": (inter,), m + "up_proj.bias": (inter,), m + "down_proj.bias": (h,)})
    return shapes


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_checkpoint(cfg: HFModelConfig, sd: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``sd`` holds exactly the tensors the model reads, in their shapes.

    A tensor the model would not use is an error, not ignored: it means the model code does not
    match the checkpoint (a bias the architecture's config did not announce, an unknown module),
    and silently dropping it gives wrong outputs. Two kinds are accepted on purpose: rotary
    ``inv_freq`` buffers (`IGNORED_SUFFIXES`), and with tied embeddings an ``lm_head.weight`` that
    is an exact copy of the embedding (a different one contradicts ``tie_word_embeddings``).
    """
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in sd]
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s) the {cfg.architecture} config needs: {_names(missing)}")
    unused = [n for n in sd if n not in want and not n.endswith(IGNORED_SUFFIXES)]
    if cfg.tie_word_embeddings and "lm_head.weight" in unused:
        head, embed = sd["lm_head.weight"], sd["model.embed_tokens.weight"]
        if head.shape != embed.shape or not torch.equal(head, embed.to(head.dtype)):
            raise ValueError(
                "checkpoint has an lm_head.weight that differs from model.embed_tokens.weight, but its "
                "config sets tie_word_embeddings=true (the output head is the embedding)"
            )
        unused.remove("lm_head.weight")
    if unused:
        raise ValueError(
            f"checkpoint has tensor(s) the {cfg.architecture} model does not use: {_names(unused)} "
            "(a config flag such as attention_bias/mlp_bias that does not match the weights, or an "
            "unsupported module); refusing to load rather than silently dropping them"
        )
    wrong = [f"{n}: {tuple(sd[n].shape)}, expected {shape}" for n, shape in want.items() if tuple(sd[n].shape) != shape]
    if wrong:
        raise ValueError(f"checkpoint tensor(s) with the wrong shape for the config: {'; '.join(wrong[:8])}")


def fuse_weights(cfg: HFModelConfig, sd: dict[str, torch.Tensor], check: bool = True) -> dict[str, torch.Tensor]:
    """Rename to engine names and concatenate q/k/v and gate/up so each is one matmul.

    ``sd`` is checked first (`check_checkpoint`) unless ``check`` is False (a tensor-parallel shard,
    checked whole before it was sliced: `executor.shard_loader`). Result keys: ``embed``, ``norm``, ``lm_head``,
    and per layer ``layers.{i}.{qkv, qkv_bias?, o, o_bias?, gate_up, gate_up_bias?, down,
    down_bias?, in_norm, post_norm, q_norm?, k_norm?}``.
    """
    if check:
        check_checkpoint(cfg, sd)
    out: dict[str, torch.Tensor] = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
    out["lm_head"] = out["embed"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, e = f"model.layers.{i}.", f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[e + "qkv"] = torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        if cfg.attention_bias:
            out[e + "qkv_bias"] = torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        out[e + "o"] = sd[a + "o_proj.weight"]
        if cfg.o_bias:
            out[e + "o_bias"] = sd[a + "o_proj.bias"]
        if cfg.qk_norm:
            out[e + "q_norm"] = sd[a + "q_norm.weight"]
            out[e + "k_norm"] = sd[a + "k_norm.weight"]
        out[e + "gate_up"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        out[e + "down"] = sd[m + "down_proj.weight"]
        if cfg.mlp_bias:
            out[e + "gate_up_bias"] = torch.cat([sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"]])
            out[e + "down_bias"] = sd[m + "down_proj.bias"]
        out[e + "in_norm"] = sd[p + "input_layernorm.weight"]
        out[e + "post_norm"] = sd[p + "post_attention_layernorm.weight"]
    return out


def load_weights(model_dir: str | Path, cfg: HFModelConfig, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Fused weights of ``model_dir`` as contiguous ``dtype`` tensors on ``device``.

    A tied output head stays the *same* tensor as the embedding (no second copy).
    """
    return to_device(fuse_weights(cfg, read_state_dict(model_dir)), dtype, device)


def to_device(fused: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """``fused`` as contiguous ``dtype`` tensors on ``device``; names sharing a tensor (a tied head)
    still share one."""
    converted: dict[int, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        key = id(t)
        if key not in converted:
            converted[key] = t.to(device=device, dtype=dtype).contiguous()
        result[name] = converted[key]
    return result
