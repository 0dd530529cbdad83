"""`Weights`: a model's fused tensors by engine name, handed out to layers once each."""

from __future__ import annotations

import torch


class Weights:
    """The fused weights of a model (`executor.models.base.ModelFamily.fuse`); layers take theirs
    by name, and `check_all_used` then refuses any tensor no layer took (model code and
    checkpoint would disagree)."""

    __slots__ = ("_tensors", "_used")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (KeyError when absent)."""
        self._used.add(name)
        return self._tensors[name]

    def opt(self, name: str) -> torch.Tensor | None:
        """The tensor ``name``, or None when the model has none (an optional bias or norm)."""
        return self.take(name) if name in self._tensors else None

    def check_all_used(self) -> None:
        """``ValueError`` naming every tensor no layer took."""
        if unused := sorted(set(self._tensors) - self._used):
            # `executor.loader.check_checkpoint` refuses these first; this guards other callers.
            raise ValueError(f"weights the model does not use: {unused}")
