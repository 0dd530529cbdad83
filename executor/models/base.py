"""`ModelFamily`: what one model family declares, and the Llama-style defaults most families keep.

A family names the Hugging Face ``architectures`` it serves and answers four questions, each a
method a family overrides where it differs:

- its config (`parse`: `executor.model_config.base_config`, then `configure` sets the family's
  biases, windows, norms, scales);
- its checkpoint (`checkpoint_shapes`: every tensor the model reads, by Hugging Face name, with its
  shape; `fuse`: those tensors under engine names, with q/k/v and gate/up concatenated);
- its tensor-parallel shards (`shard_spec`: the rows or columns of a checkpoint tensor a rank
  reads; `row_parallel_biases`: biases added once after an all-reduce);
- its layers (`make_mlp`; `build` composes the shared `executor.models.decoder.CausalLM`).

Engine names of a layer ``i`` (prefix ``layers.{i}.``): ``qkv``, ``qkv_bias``?, ``o``, ``o_bias``?,
``q_norm``?, ``k_norm``?, ``sinks``?, ``gate_up``, ``gate_up_bias``?, ``down``, ``down_bias``?,
``in_norm``, ``post_norm`` (before the MLP), ``attn_out_norm``?/``mlp_out_norm``? (sandwich norms);
model-wide ``embed``, ``norm``, ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from executor.layers.linear import Linear
from executor.layers.mlp import DenseMLP
from executor.layers.weights import Weights
from executor.model_config import FULL, SLIDING, HFModelConfig, base_config
from executor.ops import Ops

if TYPE_CHECKING:
    from executor.models.decoder import CausalLM
    from executor.parallel import ShardLayout, TensorParallel

Shapes = dict[str, tuple[int, ...]]
StateDict = dict[str, torch.Tensor]


@dataclass(slots=True, frozen=True)
class ShardSpec:
    """The part of a checkpoint tensor a rank reads: ``ranges`` along ``dim``, concatenated (a
    fused checkpoint projection such as Phi-3's ``qkv_proj`` gives a rank three ranges)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]


def rows(dim: int, *ranges: tuple[int, int]) -> ShardSpec:
    """A `ShardSpec` of ``ranges`` along ``dim``."""
    return ShardSpec(dim, tuple(ranges))


class ModelFamily:
    """A model family (see the module docstring). Stateless: one instance serves every model."""

    architectures: ClassVar[tuple[str, ...]] = ()
    # The checkpoint module of a layer's feed-forward block (Mixtral's is "block_sparse_moe").
    mlp_module: ClassVar[str] = "mlp"
    # Row-parallel biases (by checkpoint name suffix): added once, after the all-reduce.
    row_parallel_biases: ClassVar[tuple[str, ...]] = ("self_attn.o_proj.bias", "mlp.down_proj.bias")

    # -- config --
    def parse(self, arch: str, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> HFModelConfig:
        """The `HFModelConfig` of a ``config.json`` (``raw``) whose architecture is ``arch``."""
        cfg = base_config(arch, raw, generation_config)
        self.configure(cfg, raw)
        return cfg

    def configure(self, cfg: HFModelConfig, raw: dict[str, Any]) -> None:
        """Set the family's fields of ``cfg`` from ``raw`` (biases, windows, norms, ...)."""

    # -- checkpoint names and shapes --
    def checkpoint_shapes(self, cfg: HFModelConfig) -> Shapes:
        """Every checkpoint tensor the model reads, by Hugging Face name, with its shape;
        ``lm_head.weight`` only when the embeddings are not tied."""
        h = cfg.hidden_size
        shapes: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            shapes.update(self.attention_shapes(cfg, i, p + "self_attn."))
            shapes.update(self.mlp_shapes(cfg, i, f"{p}{self.mlp_module}."))
            shapes.update({p + name + ".weight": (h,) for name in self.norm_names(cfg).values()})
        return shapes

    def norm_names(self, cfg: HFModelConfig) -> dict[str, str]:
        """Engine name -> checkpoint module name of a layer's norms."""
        names = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
        if cfg.sandwich_norm:  # post_attention_layernorm norms attention's output there
            names = {
                "in_norm": "input_layernorm",
                "attn_out_norm": "post_attention_layernorm",
                "post_norm": "pre_feedforward_layernorm",
                "mlp_out_norm": "post_feedforward_layernorm",
            }
        return names

    def attention_shapes(self, cfg: HFModelConfig, layer: int, a: str) -> Shapes:
        """Attention tensors of ``layer`` under prefix ``a`` (separate q/k/v projections)."""
        h, q, kv, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
        shapes: Shapes = {
            a + "q_proj.weight": (q, h),
            a + "k_proj.weight": (kv, h),
            a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q),
        }
        if cfg.attention_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        if cfg.attn_sinks:
            shapes[a + "sinks"] = (cfg.num_heads,)
        return shapes

    def mlp_shapes(self, cfg: HFModelConfig, layer: int, m: str) -> Shapes:
        """MLP tensors of ``layer`` under prefix ``m`` (separate gate/up/down projections)."""
        h, inter = cfg.hidden_size, cfg.intermediate_size
        shapes: Shapes = {
            m + "gate_proj.weight": (inter, h),
            m + "up_proj.weight": (inter, h),
            m + "down_proj.weight": (h, inter),
        }
        if cfg.mlp_bias:
            shapes.update({m + "gate_proj.bias": (inter,), m + "up_proj.bias": (inter,), m + "down_proj.bias": (h,)})
        return shapes

    # -- fusing into engine names --
    def fuse(self, cfg: HFModelConfig, sd: StateDict) -> StateDict:
        """``sd`` (checked, or a rank's slices of it) under engine names (module docstring)."""
        out: StateDict = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
        out["lm_head"] = out["embed"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
        for i in range(cfg.num_layers):
            p, e = f"model.layers.{i}.", f"layers.{i}."
            out.update(self.fuse_attention(cfg, i, sd, p + "self_attn.", e))
            out.update(self.fuse_mlp(cfg, i, sd, f"{p}{self.mlp_module}.", e))
            for engine, name in self.norm_names(cfg).items():
                out[e + engine] = sd[p + name + ".weight"]
        return out

    def fuse_attention(self, cfg: HFModelConfig, layer: int, sd: StateDict, a: str, e: str) -> StateDict:
        """Engine attention tensors of ``layer`` (prefix ``e``) from checkpoint prefix ``a``."""
        out = {e + "qkv": torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"]), e + "o": sd[a + "o_proj.weight"]}
        if cfg.attention_bias:
            out[e + "qkv_bias"] = torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        if cfg.o_bias:
            out[e + "o_bias"] = sd[a + "o_proj.bias"]
        if cfg.qk_norm:
            out[e + "q_norm"], out[e + "k_norm"] = sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]
        if cfg.attn_sinks:
            out[e + "sinks"] = sd[a + "sinks"]
        return out

    def fuse_mlp(self, cfg: HFModelConfig, layer: int, sd: StateDict, m: str, e: str) -> StateDict:
        """Engine MLP tensors of ``layer`` (prefix ``e``) from checkpoint prefix ``m``."""
        out = {
            e + "gate_up": torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]),
            e + "down": sd[m + "down_proj.weight"],
        }
        if cfg.mlp_bias:
            out[e + "gate_up_bias"] = torch.cat([sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"]])
            out[e + "down_bias"] = sd[m + "down_proj.bias"]
        return out

    # -- tensor parallelism --
    def shard_spec(self, name: str, layout: ShardLayout) -> ShardSpec | None:
        """The part of checkpoint tensor ``name`` that ``layout``'s rank reads; None: all of it."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return rows(0, layout.vocab)
        if name.endswith("self_attn.sinks"):
            return rows(0, layout.q_heads)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return rows(0, layout.q_rows())
        if name.endswith(
            ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")
        ):
            return rows(0, layout.kv_rows())
        if name.endswith("self_attn.o_proj.weight"):
            return rows(1, layout.q_rows())
        if name.endswith(("mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias")):
            return rows(0, layout.inter)
        if name.endswith("mlp.down_proj.weight"):
            return rows(1, layout.inter)
        return None  # norms, row-parallel biases: whole

    # -- layers --
    def make_mlp(
        self, cfg: HFModelConfig, layer: int, w: Weights, ops: Ops, tp: TensorParallel | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The feed-forward block of ``layer`` (a dense gated MLP; a mixture of experts overrides)."""
        e = f"layers.{layer}."
        gate_up = Linear(w.take(e + "gate_up"), w.opt(e + "gate_up_bias"))
        return DenseMLP(gate_up, Linear(w.take(e + "down"), w.opt(e + "down_bias")), ops, cfg.hidden_act, tp)

    def build(self, cfg: HFModelConfig, weights: StateDict, ops: Ops, max_pos: int, tp: TensorParallel | None = None) -> CausalLM:
        """The model of ``cfg`` (the rank's local view under tensor parallelism) over ``weights``."""
        from executor.models.decoder import CausalLM

        return CausalLM(self, cfg, weights, ops, max_pos, tp)


def set_windows(cfg: HFModelConfig, raw: dict[str, Any], window: Any, slides: Callable[[int], bool]) -> None:
    """Give ``cfg`` its per-layer attention types and ``window``: the config's ``layer_types`` when
    it has them, else ``sliding_attention`` where ``slides(i)`` holds. No window (None, or one that
    spans every position) leaves every layer full attention."""
    if window is None or int(window) >= cfg.max_position_embeddings:
        cfg.layer_types, cfg.sliding_window = [FULL] * cfg.num_layers, None
        return
    types = raw.get("layer_types") or [SLIDING if slides(i) else FULL for i in range(cfg.num_layers)]
    if len(types) != cfg.num_layers or not set(types) <= {FULL, SLIDING}:
        raise ValueError(f"unsupported layer_types {types!r} (expected {cfg.num_layers} of {FULL!r}/{SLIDING!r})")
    cfg.layer_types, cfg.sliding_window = list(types), int(window)
