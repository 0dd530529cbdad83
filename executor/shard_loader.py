"""Load one tensor-parallel rank's shard of a safetensors checkpoint, reading only its slices.

Each tensor is sliced on load (safetensors' ``get_slice``, the ranges its family's
`executor.models.base.ModelFamily.shard_spec` names), so a rank reads and holds ``1/world`` of the
sharded weights. The checkpoint is checked whole first, from its headers (names and full
shapes, `executor.loader.check_checkpoint`), then the rank's slices are fused as a single device's
weights are (`executor.loader.fuse_weights`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from executor.loader import check_checkpoint, checkpoint_files, fuse_weights, to_device
from executor.model_config import HFModelConfig
from executor.models.base import ModelFamily
from executor.models.registry import family_of
from executor.parallel import ShardLayout


def _read_slice(f: object, name: str, layout: ShardLayout, family: ModelFamily) -> torch.Tensor:
    spec = family.shard_spec(name, layout)
    if spec is None:
        t: torch.Tensor = f.get_tensor(name)  # type: ignore[attr-defined]
        if name.endswith(family.row_parallel_biases) and layout.rank != 0:
            t = torch.zeros_like(t)  # the sum over ranks adds the bias exactly once
        return t
    s = f.get_slice(name)  # type: ignore[attr-defined]
    # Any dimension: gpt-oss's stacked experts are cut along their last.
    lead = (slice(None),) * spec.dim
    parts = [s[lead + (slice(start, end),)] for start, end in spec.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def read_shard(model_dir: str | Path, cfg: HFModelConfig, layout: ShardLayout) -> dict[str, torch.Tensor]:
    """This rank's slices of every checkpoint tensor, after checking the names and full shapes."""
    family = family_of(cfg)
    full: dict[str, torch.Tensor] = {}
    shards: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                # Shape-only stand-ins: enough for the check, no data read.
                full[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
    if cfg.tie_word_embeddings and "lm_head.weight" in full:
        # The one check that compares values (a stored head must equal the tied embedding).
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in ("lm_head.weight", "model.embed_tokens.weight"):
                    if name in f.keys():
                        full[name] = f.get_tensor(name)
    check_checkpoint(cfg, full)
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in full and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    shards[name] = _read_slice(f, name, layout, family)
    return shards


def load_shard(
    model_dir: str | Path, cfg: HFModelConfig, layout: ShardLayout, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Fused weights of this rank (see `executor.loader.load_weights`): its slices, on ``device``.

    The output head's rows are padded with zeros to ``layout.vocab_per_rank`` so that every rank's
    logit block has one shape (the all-gather needs it); the padding columns are cut after it.
    """
    sd = read_shard(model_dir, cfg, layout)
    fused = fuse_weights(layout.local_config(cfg), sd, check=False)
    head = fused["lm_head"]
    pad = layout.vocab_per_rank - head.shape[0]
    if pad:
        fused["lm_head"] = torch.cat([head, head.new_zeros(pad, head.shape[1])])
    return to_device(fused, dtype, device)
