"""Tensor parallelism (Megatron-style): which slice of each weight a rank holds, and its collectives.

`ShardLayout` is pure arithmetic (tested without processes): rank ``r`` of ``world`` holds query
heads ``[r*Hq/world, (r+1)*Hq/world)``, the KV heads those query heads read (a contiguous range
when ``Hkv % world == 0``; one head, replicated on ``world/Hkv`` ranks, when ``world % Hkv == 0``),
``1/world`` of the MLP's intermediate columns, and ``ceil(V/world)`` vocabulary rows. Column-parallel
layers (QKV, gate/up) need no communication; row-parallel ones (o_proj, down_proj) end in one
all-reduce; the vocabulary-parallel embedding is an all-reduce of masked lookups and the LM head an
all-gather of the rank's logit columns.

`TensorParallel` is one rank's handle on the process group: the tensor collectives the model calls
(NCCL on CUDA, gloo on CPU), and the control channel over which rank 0 sends every command (a step's
msgpack bytes, reset, ping, stop) and the sampled tokens to the other ranks. The control channel is
always a gloo group on CPU tensors, so a command never waits on a device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from executor.model_config import HFModelConfig

# A collective that waits longer than this fails (the rank exits; see executor.tp_executor). Idle
# ranks never wait this long: rank 0 sends a ping well within it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

# Commands rank 0 broadcasts to the others.
CMD_STEP, CMD_RESET, CMD_PING, CMD_STOP = 1, 2, 3, 4


@dataclass(slots=True, frozen=True)
class ShardLayout:
    """The slice of the model that rank ``rank`` of ``world`` holds (see the module docstring)."""

    rank: int
    world: int
    head_dim: int
    q_heads: tuple[int, int]  # [start, end) of the query heads
    kv_heads: tuple[int, int]  # [start, end) of the KV heads (one head may be held by several ranks)
    inter: tuple[int, int]  # [start, end) of the MLP intermediate columns
    vocab: tuple[int, int]  # [start, end) of the vocabulary rows (the last rank's may be short)
    vocab_per_rank: int  # ceil(V / world): every rank's logit block is padded to this
    q_size: int  # the whole model's query rows (heads x head_dim)
    kv_size: int  # the whole model's rows of K (and of V)
    inter_size: int  # the whole model's MLP intermediate size
    # [start, end) of each routed expert's / the shared expert's intermediate dim (mixtures of
    # experts: `executor.layers.moe`, per-expert tensor parallel); (0, 0) without experts.
    expert_inter: tuple[int, int] = (0, 0)
    shared_inter: tuple[int, int] = (0, 0)

    @staticmethod
    def build(cfg: HFModelConfig, rank: int, world: int) -> ShardLayout:
        """The layout of ``rank``; ``ValueError`` when ``cfg`` cannot be split ``world`` ways."""
        check_divisible(cfg, world)
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        per_q, group = hq // world, hq // hkv
        q0 = rank * per_q
        kv0, kv1 = q0 // group, (q0 + per_q - 1) // group + 1
        per_i = cfg.intermediate_size // world
        per_v = -(-cfg.vocab_size // world)
        v0 = min(rank * per_v, cfg.vocab_size)
        return ShardLayout(
            rank,
            world,
            cfg.head_dim,
            (q0, q0 + per_q),
            (kv0, kv1),
            (rank * per_i, (rank + 1) * per_i),
            (v0, min(v0 + per_v, cfg.vocab_size)),
            per_v,
            cfg.q_size,
            cfg.kv_size,
            cfg.intermediate_size,
            _rank_range(_expert_width(cfg), rank, world),
            _rank_range(_shared_width(cfg), rank, world),
        )

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def q_rows(self) -> tuple[int, int]:
        """Rows of ``q_proj`` (columns of ``o_proj``) this rank holds."""
        return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim

    def kv_rows(self) -> tuple[int, int]:
        """Rows of ``k_proj``/``v_proj`` this rank holds."""
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim

    def local_config(self, cfg: HFModelConfig) -> HFModelConfig:
        """``cfg`` as this rank's model sees it: its heads, KV heads and intermediate size."""
        return dataclasses.replace(
            cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, intermediate_size=self.inter[1] - self.inter[0]
        )


def _expert_width(cfg: HFModelConfig) -> int:
    return int(getattr(cfg, "moe_intermediate_size", 0))  # a mixture of experts' MoEConfig


def _shared_width(cfg: HFModelConfig) -> int:
    return int(getattr(cfg, "shared_expert_intermediate_size", 0))


def _rank_range(size: int, rank: int, world: int) -> tuple[int, int]:
    per = size // world
    return rank * per, (rank + 1) * per


def check_divisible(cfg: HFModelConfig, world: int) -> None:
    """``ValueError`` unless heads, KV heads and the MLP split evenly over ``world`` ranks."""
    hq, hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if hq % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the model's {hq} attention heads")
    if hkv % world and world % hkv:
        raise ValueError(
            f"tensor_parallel_size={world} must divide the model's {hkv} KV heads, or be a multiple of them "
            "(then each KV head is replicated)"
        )
    if inter % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the model's intermediate_size={inter}")
    for name, size in (("moe_intermediate_size", _expert_width(cfg)), ("shared_expert_intermediate_size", _shared_width(cfg))):
        if size % world:
            raise ValueError(f"tensor_parallel_size={world} must divide the model's {name}={size}")


class StepPhase(IntEnum):
    """Where a rank is in a step (`TensorParallel.settle`)."""

    AGREED = 0  # between steps: every rank is at the same point
    STARTED = 1  # a step was sent or received, before its first collective
    COLLECTIVES = 2  # among the step's collectives, up to its last


class TensorParallel:
    """One rank's process group: tensor collectives, and rank 0's command channel."""

    __slots__ = ("rank", "world", "layout", "control", "device", "phase")

    def __init__(self, rank: int, world: int, layout: ShardLayout, device: torch.device) -> None:
        self.rank, self.world, self.layout, self.device = rank, world, layout, device
        self.phase = StepPhase.AGREED
        # Commands and tokens travel over gloo on CPU tensors whatever the device backend is.
        self.control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if device.type == "cuda" else None

    @staticmethod
    def init_group(rank: int, world: int, store: dist.Store, device: torch.device) -> None:
        """Join the process group of ``world`` ranks that rendezvous at ``store``."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)

    # -- where this rank is in a step (which errors leave the ranks out of step) --
    def begin_step(self) -> None:
        """A step was sent (rank 0) or received (the others): no collective yet."""
        self.phase = StepPhase.STARTED

    def enter_collectives(self) -> None:
        """The step's collectives begin: from here an error on one rank strands the others."""
        self.phase = StepPhase.COLLECTIVES

    def end_step(self) -> None:
        """The step is over alike on every rank (its last collective is done, or it had none)."""
        self.phase = StepPhase.AGREED

    def settle(self, exc: BaseException) -> str | None:
        """Rank 0's view after ``exc`` ended its step (it reports its own errors, and the scheduler
        then resets every rank): None if the ranks are still in step (the error came when the step
        was over everywhere, or it is a `ValueError` of a bad step, which every rank raises alike
        before any collective); else why they are not, and any later command would be read as
        part of a collective some rank still waits in. Ranks > 0: `executor.tp_executor.serve_rank`."""
        if self.phase == StepPhase.AGREED or (self.phase == StepPhase.STARTED and isinstance(exc, ValueError)):
            self.phase = StepPhase.AGREED
            return None
        return f"tensor-parallel rank {self.rank} failed amid a step ({exc!r}): the ranks are out of step"

    # -- tensor collectives (the model's) --
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        dist.all_reduce(x)
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows it holds, the sum has them all."""
        v0, v1 = self.layout.vocab
        inside = (ids >= v0) & (ids < v1)
        local = torch.where(inside, ids - v0, torch.zeros_like(ids))
        h = torch.nn.functional.embedding(local, table)
        h.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """All ranks' logit columns side by side (``[N, vocab_size]``; the padding columns cut)."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # -- control channel (rank 0 -> the others) --
    def send_command(self, cmd: int, payload: bytes = b"") -> None:
        """Rank 0: broadcast one command and its payload."""
        header = torch.tensor([cmd, len(payload)], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.control)

    def recv_command(self) -> tuple[int, bytes]:
        """Ranks > 0: wait for rank 0's next command."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        cmd, size = (int(v) for v in header.tolist())
        if not size:
            return cmd, b""
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.control)
        return cmd, data.numpy().tobytes()

    def share_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """Rank 0 passes the step's ``n`` sampled tokens (None: its sampling failed) to every rank.

        The other ranks' persistent batches append them, as rank 0's does, so the next step reads
        the same sequences everywhere. Raises `PeerStepFailed` on the other ranks when rank 0 failed.
        """
        buf = torch.empty(n + 1, dtype=torch.int64)
        if self.rank == 0:
            buf[0] = 0 if tokens is None else 1
            if tokens is not None:
                buf[1:] = torch.tensor(tokens, dtype=torch.int64)
        dist.broadcast(buf, 0, group=self.control)
        self.end_step()
        if int(buf[0]) == 0 and self.rank != 0:  # (rank 0 raises its own error)
            raise PeerStepFailed("rank 0 failed to sample this step")
        return buf[1:].tolist()


class PeerStepFailed(RuntimeError):
    """Rank 0 could not finish a step every rank started: the others drop their state too."""
