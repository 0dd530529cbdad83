"""How a hybrid model's layers map onto KV-cache groups and the layer slots that hold their K/V.

Layers are grouped by attention type (their sliding window, None for full attention) into
groups of equal size ``s``, the smallest type's layer count, as vLLM's hybrid allocator does: a
type's layers in order, ``s`` at a time (its last group may hold fewer). Group ``g``'s ``j``-th
layer keeps its K/V in layer slot ``j``: the executor allocates ``s`` slots of K/V tensors, each
shared by every group, so a block id names the same bytes in any group and one pool serves them
all (`scheduler.kv_groups`). Full-attention groups come first.
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.model_config import HFModelConfig


@dataclass(slots=True)
class KVGroupLayout:
    """``groups[g]``: group g's layers; ``windows[g]``: their window (None: full attention);
    ``layer_group[i]``/``layer_slot[i]``: layer i's group and K/V slot; ``num_slots``: ``s``."""

    groups: list[list[int]]
    windows: list[int | None]
    layer_group: list[int]
    layer_slot: list[int]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def kv_group_layout(cfg: HFModelConfig) -> KVGroupLayout | None:
    """``cfg``'s KV-cache groups, or None when every layer has the same attention type (one group:
    each block holds all layers, as for any plain or pure-window model)."""
    by_type: dict[int | None, list[int]] = {}
    for i in range(cfg.num_layers):
        by_type.setdefault(cfg.window(i), []).append(i)
    if len(by_type) < 2:
        return None
    size = min(len(layers) for layers in by_type.values())
    groups: list[list[int]] = []
    windows: list[int | None] = []
    for window in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[window]
        for start in range(0, len(layers), size):
            groups.append(layers[start : start + size])
            windows.append(window)
    layer_group, layer_slot = [0] * cfg.num_layers, [0] * cfg.num_layers
    for g, layers in enumerate(groups):
        for j, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = g, j
    return KVGroupLayout(groups, windows, layer_group, layer_slot, size)
