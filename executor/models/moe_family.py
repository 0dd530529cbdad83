"""What every mixture-of-experts family shares: its config fields and its experts' weights.

`MoEConfig` adds the expert geometry to `HFModelConfig`. `MoEFamily` reads per-expert checkpoint
tensors (``{prefix}experts.{j}.{gate, up, down}`` as Qwen2-MoE, Qwen3-MoE and Mixtral save them),
stacks them into the layout `Ops.fused_moe` takes, shards each expert's intermediate dim for
tensor parallel (`executor.layers.moe`), and builds the `MoE` layer on the sparse layers and the
dense MLP elsewhere. Engine names of a sparse layer ``i`` (prefix ``layers.{i}.``): ``router``,
``router_bias``?, ``w13``, ``w2``, ``b13``?, ``b2``?, ``shared_gate_up``?, ``shared_down``?,
``shared_gate``?.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from executor.layers.linear import Linear
from executor.layers.mlp import DenseMLP
from executor.layers.moe import MoE, Router, SharedExpert
from executor.layers.weights import Weights
from executor.model_config import HFModelConfig, base_config
from executor.models.base import ModelFamily, Shapes, ShardSpec, StateDict, rows
from executor.ops import Ops

if TYPE_CHECKING:
    from executor.parallel import ShardLayout, TensorParallel


@dataclass(slots=True)
class MoEConfig(HFModelConfig):
    """`HFModelConfig` plus the experts: ``num_experts`` of width ``moe_intermediate_size``, ``top_k``
    of them per token (``renormalize``: their weights divided by their sum); ``sparse_layers[i]``:
    layer ``i`` is a mixture of experts (else the dense MLP of width ``intermediate_size``);
    ``shared_expert_intermediate_size`` 0: no shared expert."""

    num_experts: int = 0
    top_k: int = 0
    renormalize: bool = False
    moe_intermediate_size: int = 0
    sparse_layers: list[bool] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0


def expert_count(raw: dict[str, Any]) -> int:
    """The expert count: ``num_experts`` or ``num_local_experts`` (transformers saves either)."""
    n = raw.get("num_experts", raw.get("num_local_experts"))
    if not n:
        raise ValueError("config has no num_experts/num_local_experts")
    return int(n)


class MoEFamily(ModelFamily):
    """A family whose feed-forward blocks are (some or all) mixtures of experts."""

    # The sparse block's checkpoint module (replaces ``mlp.``) and its children's names.
    moe_module: ClassVar[str] = "mlp."
    router_name: ClassVar[str] = "gate"
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    activation: ClassVar[str] = "silu"  # `Ops.fused_moe`'s

    # -- config --
    def moe_fields(self, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """`MoEConfig`'s own fields from ``raw`` (each family says where they live)."""
        raise NotImplementedError

    def parse(self, arch: str, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> HFModelConfig:
        base = base_config(arch, raw, generation_config)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        cfg = MoEConfig(**fields, **self.moe_fields(raw, base.num_layers))
        if not 0 < cfg.top_k <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.top_k} must be in 1..{cfg.num_experts} (num_experts)")
        self.configure(cfg, raw)
        return cfg

    @staticmethod
    def moe(cfg: HFModelConfig) -> MoEConfig:
        assert isinstance(cfg, MoEConfig), "a mixture-of-experts family is always given its MoEConfig"
        return cfg

    def router(self, cfg: MoEConfig) -> Router:
        """How this family routes (`executor.layers.moe.Router`)."""
        raise NotImplementedError

    # -- checkpoint --
    def _moe_prefix(self, m: str) -> str:
        return m[: -len("mlp.")] + self.moe_module

    def mlp_shapes(self, cfg: HFModelConfig, layer: int, m: str) -> Shapes:
        c = self.moe(cfg)
        if not c.sparse_layers[layer]:
            return super().mlp_shapes(cfg, layer, m)
        return self.sparse_shapes(c, self._moe_prefix(m))

    def sparse_shapes(self, cfg: MoEConfig, m: str) -> Shapes:
        """The sparse block's tensors under prefix ``m`` (per-expert projections)."""
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        gate, up, down = self.expert_names
        shapes: Shapes = {m + self.router_name + ".weight": (cfg.num_experts, h)}
        for j in range(cfg.num_experts):
            x = f"{m}experts.{j}."
            shapes.update({x + gate + ".weight": (inter, h), x + up + ".weight": (inter, h), x + down + ".weight": (h, inter)})
        if s := cfg.shared_expert_intermediate_size:
            x = m + "shared_expert."
            shapes.update({x + "gate_proj.weight": (s, h), x + "up_proj.weight": (s, h), x + "down_proj.weight": (h, s)})
            shapes[m + "shared_expert_gate.weight"] = (1, h)
        return shapes

    def fuse_mlp(self, cfg: HFModelConfig, layer: int, sd: StateDict, m: str, e: str) -> StateDict:
        c = self.moe(cfg)
        if not c.sparse_layers[layer]:
            return super().fuse_mlp(cfg, layer, sd, m, e)
        return self.fuse_sparse(c, sd, self._moe_prefix(m), e)

    def fuse_sparse(self, cfg: MoEConfig, sd: StateDict, m: str, e: str) -> StateDict:
        """Stack the experts: ``w13`` ``[E, 2I, H]`` (each expert's gate rows, then up rows), ``w2``
        ``[E, H, I]`` (a rank's slices: sizes come from the tensors)."""
        gate, up, down = self.expert_names
        experts = [f"{m}experts.{j}." for j in range(cfg.num_experts)]
        out = {
            e + "router": sd[m + self.router_name + ".weight"],
            e + "w13": torch.stack([torch.cat([sd[x + gate + ".weight"], sd[x + up + ".weight"]]) for x in experts]),
            e + "w2": torch.stack([sd[x + down + ".weight"] for x in experts]),
        }
        if cfg.shared_expert_intermediate_size:
            x = m + "shared_expert."
            out[e + "shared_gate_up"] = torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]])
            out[e + "shared_down"] = sd[x + "down_proj.weight"]
            out[e + "shared_gate"] = sd[m + "shared_expert_gate.weight"]
        return out

    # -- tensor parallel: per-expert (each expert's intermediate dim split over the ranks) --
    def shard_spec(self, name: str, layout: ShardLayout) -> ShardSpec | None:
        gate, up, down = self.expert_names
        if ".experts." in name:
            if name.endswith((f".{gate}.weight", f".{up}.weight")):
                return rows(0, layout.expert_inter)
            if name.endswith(f".{down}.weight"):
                return rows(1, layout.expert_inter)
        if ".shared_expert." in name:
            if name.endswith((".gate_proj.weight", ".up_proj.weight")):
                return rows(0, layout.shared_inter)
            if name.endswith(".down_proj.weight"):
                return rows(1, layout.shared_inter)
        if name.endswith((f"{self.moe_module}{self.router_name}.weight", "shared_expert_gate.weight")):
            return None  # routers and the shared expert's gate: whole on every rank
        return super().shard_spec(name, layout)

    # -- layers --
    def make_mlp(
        self, cfg: HFModelConfig, layer: int, w: Weights, ops: Ops, tp: TensorParallel | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        c = self.moe(cfg)
        if not c.sparse_layers[layer]:
            return super().make_mlp(cfg, layer, w, ops, tp)
        e = f"layers.{layer}."
        shared = None
        if (gate_up := w.opt(e + "shared_gate_up")) is not None:
            # Not reduced on its own: the MoE layer all-reduces routed and shared output together.
            mlp = DenseMLP(Linear(gate_up), Linear(w.take(e + "shared_down")), ops, c.hidden_act, None)
            shared = SharedExpert(mlp, w.take(e + "shared_gate"))
        return MoE(
            ops,
            self.router(c),
            w.take(e + "router"),
            w.take(e + "w13"),
            w.take(e + "w2"),
            router_bias=w.opt(e + "router_bias"),
            b13=w.opt(e + "b13"),
            b2=w.opt(e + "b2"),
            activation=self.activation,
            shared=shared,
            tp=tp,
        )
