"""Choose an executor's kernel backend: the `Ops` of ``torch`` (CPU, the reference) or ``triton``."""

from __future__ import annotations

from executor.ops import Ops


def get_ops(backend: str) -> Ops:
    """Ops of ``backend`` (``torch`` or ``triton``) for one executor.

    Call it once per executor (or model) and keep the result: the torch ops carry that executor's
    per-step memos and buffers (`executor.ops_torch.TorchOpsState`), a new set on every call, so
    no two executors share state. The Triton ops keep none (one shared, immutable set), and their
    module is imported only when asked for (it decides on Triton's interpreter at import).
    """
    if backend == "torch":
        from executor import ops_torch

        return ops_torch.make_ops()
    if backend == "triton":
        from executor.kernels import OPS

        return OPS
    raise ValueError(f"unknown backend {backend!r}; expected 'torch' or 'triton'")
