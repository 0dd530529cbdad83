"""Rotary position embeddings: inverse frequencies of every scaling type, and the cos/sin tables.

The tables are ``[max_pos, rot_dim]`` fp32 = cat(cos, sin) (`Ops.rotary`), with a scaling type's
attention factor (YaRN, LongRoPE) folded in as transformers multiplies it into cos and sin.
``rot_dim`` is below the head size with a partial rotary factor: only the first ``rot_dim``
channels of each head rotate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from executor.model_config import HFModelConfig, RopeParams


def _default(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, sc: dict[str, Any]) -> torch.Tensor:
    factor = float(sc["factor"])
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings") or 8192)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, sc: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = int(sc.get("original_max_position_embeddings") or max_pos)
    factor = float(sc.get("factor") or max_pos / orig)
    attention_factor = sc.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # high frequencies keep their value, low ones are interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def inv_freq_and_factor(rope: RopeParams, rot_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, ``rot_dim // 2``) and the attention factor of ``rope``.

    ``dynamic`` (NTK) is plain RoPE: transformers rescales only once a sequence outgrows
    ``max_position_embeddings``, which the engine never serves (``max_model_len`` is capped there).
    ``longrope`` uses its short factors: transformers switches a whole sequence to the long ones
    once it grows past ``original_max_position_embeddings`` (re-rotating nothing already cached),
    which no per-position table can follow; the engine is exact up to that length.
    """
    theta, sc = rope.theta, rope.scaling
    if sc is None:
        return _default(theta, rot_dim), 1.0
    kind = sc["rope_type"]
    if kind == "llama3":
        return _llama3(_default(theta, rot_dim), sc), 1.0
    if kind == "linear":
        return _default(theta, rot_dim) / float(sc["factor"]), 1.0
    if kind == "dynamic":
        return _default(theta, rot_dim), 1.0
    if kind == "yarn":
        return _yarn(theta, rot_dim, sc, max_pos)
    if kind == "longrope":
        orig = int(sc.get("original_max_position_embeddings") or max_pos)
        factor = float(sc.get("factor") or max_pos / orig)
        attention_factor = sc.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = torch.tensor(sc["short_factor"], dtype=torch.float32)
        shape = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        return 1.0 / (ext * theta**shape), float(attention_factor)
    raise ValueError(f"unsupported rope type {kind!r}")


def rotary_dim(cfg: HFModelConfig) -> int:
    """Channels of each head that rotate (all but with a partial rotary factor)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_cache(rope: RopeParams, rot_dim: int, max_pos: int, device: torch.device) -> torch.Tensor:
    """``[max_pos, rot_dim]`` fp32 table: cat(cos, sin) of position x inverse frequency."""
    inv_freq, factor = inv_freq_and_factor(rope, rot_dim, max_pos)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor).to(device)


class RopeTables:
    """One cos/sin table per distinct `RopeParams` of a model (layers of a type share theirs)."""

    __slots__ = ("rot_dim", "max_pos", "device", "_tables")

    def __init__(self, cfg: HFModelConfig, max_pos: int, device: torch.device) -> None:
        self.rot_dim = rotary_dim(cfg)
        self.max_pos = max_pos
        self.device = device
        self._tables: dict[str, torch.Tensor] = {}

    def table(self, rope: RopeParams) -> torch.Tensor:
        """The table of ``rope`` (built on first use)."""
        key = repr((rope.theta, sorted((rope.scaling or {}).items())))
        if key not in self._tables:
            self._tables[key] = rope_cache(rope, self.rot_dim, self.max_pos, self.device)
        return self._tables[key]
