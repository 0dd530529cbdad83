"""Read a Hugging Face safetensors checkpoint (one file or sharded) into a family's fused engine weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from executor.model_config import HFModelConfig
from executor.models.registry import family_of


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
# the config (`executor.layers.rotary`), as transformers itself does on load.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
    want = family_of(cfg).checkpoint_shapes(cfg)
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
    """``sd`` under engine names, fused by its family (`executor.models.base.ModelFamily.fuse`).

    ``sd`` is checked first (`check_checkpoint`) unless ``check`` is False (a tensor-parallel shard,
    checked whole before it was sliced: `executor.shard_loader`).
    """
    if check:
        check_checkpoint(cfg, sd)
    return family_of(cfg).fuse(cfg, sd)


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
