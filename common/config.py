"""Engine configuration shared by the offline `LLM`, the scheduler and the executor."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# Limits of the integer options: the engine stores token counts and block ids as int32.
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CPU_DECODE_KERNEL_MODES = ("auto", "off")
DEFAULT_MAX_NUM_SEQS = 256  # SchedulerConfig's; also the largest decode batch an executor captures as a CUDA graph
MAX_TENSOR_PARALLEL = 64  # ranks of one executor (one machine; multi-node is not supported)
MAX_STEPS_IN_FLIGHT = 8  # `SchedulerConfig.steps_in_flight`: past a few, only the tokens wasted at a stop grow


def _check_int(name: str, value: object, lo: int = 1, hi: int = _INT32_MAX, optional: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int in ``[lo, hi]`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]{none}, got {value!r}")


def _device_type(device: str) -> str:
    """``cpu`` or ``cuda`` for a device option (``auto``: CUDA when present); ValueError if neither."""
    import torch  # only here: the config module is imported by services that do not need torch

    if not isinstance(device, str):
        raise ValueError(f"device must be a string (auto, cpu, cuda or cuda:N), got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine (use device='cpu')")
    return kind


@dataclass(slots=True)
class ModelConfig:
    """What to load and how: a local Hugging Face directory, dtype and device.

    ``max_model_len`` None means the checkpoint's ``max_position_embeddings``.
    """

    model: str
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 ("auto": fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None
    attention_backend: str = "auto"  # auto | torch | triton ("auto": triton on CUDA, torch on CPU)
    seed: int = 0
    num_threads: int | None = None  # CPU intra-op threads; None: CONVEYOR_NUM_THREADS, else OMP_NUM_THREADS, else the usable CPUs
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (every step runs eagerly)
    cpu_decode_kernel: str = "auto"  # auto | off: decode steps of a few rows in C on CPU (executor.cpu_decode)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option, before anything is loaded.

        The Triton backend on CPU runs only under Triton's interpreter, which must be chosen
        before any kernel is defined: it is refused unless ``TRITON_INTERPRET=1`` is set.
        """
        if not isinstance(self.model, (str, os.PathLike)) or not os.fspath(self.model):
            raise ValueError(f"model must be a non-empty path to a Hugging Face directory, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        _check_int("max_model_len", self.max_model_len, optional=True)
        _check_int("seed", self.seed, _INT64_MIN, _INT64_MAX)
        _check_int("num_threads", self.num_threads, 1, 4096, optional=True)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.cpu_decode_kernel not in CPU_DECODE_KERNEL_MODES:
            modes = ", ".join(CPU_DECODE_KERNEL_MODES)
            raise ValueError(f"cpu_decode_kernel must be one of {modes}, got {self.cpu_decode_kernel!r}")
        device = _device_type(self.device)
        if self.attention_backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
                "environment (slow, for tests), or use attention_backend='torch' (or 'auto') on CPU"
            )


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry and its memory budget."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes, CPU budget (None: 1 GiB)
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # force a pool size (tests); overrides the budget

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        _check_int("block_size", self.block_size)
        _check_int("kv_cache_memory", self.kv_cache_memory, hi=_INT64_MAX, optional=True)
        _check_int("num_blocks", self.num_blocks, optional=True)
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")


@dataclass(slots=True)
class ParallelConfig:
    """Parallelism of one executor: ``tensor_parallel_size`` ranks on one machine (see
    `executor.tp_executor`; the model's heads must split over them, checked at load)."""

    tensor_parallel_size: int = 1

    def validate(self) -> None:
        """Raise ``ValueError`` naming a bad option."""
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL)


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step limits of continuous batching, and the prefix cache.

    ``enable_prefix_caching``: reuse the K/V of full blocks an earlier request computed for the
    same leading tokens (see `scheduler.cache_manager`). It lives here, not in `CacheConfig`,
    because only the scheduler's block table knows it: the executor just follows block tables.
    ``async_scheduling``: schedule (and send) step N+1 while step N runs (see
    `scheduler.engine_core`); off, each step waits for the previous one's tokens.
    ``steps_in_flight``: with ``async_scheduling``, how many steps may be sent and not yet answered
    (2: one scheduled ahead). More hide a longer way from the scheduler to the executor and back,
    such as a Redis a network hop away (docs/performance.md), for one more token computed and
    dropped per request that stops, per extra step.
    ``max_step_bytes``: what a step may carry of new requests and prompt logprobs, in bytes
    (`scheduler.step_bytes`); None (in process): no limit. The scheduler service sets half its
    Redis message limit.
    ``scheduling_policy`` (vLLM's): ``fcfs``, or ``priority``: waiting requests are admitted by
    their ``priority`` (lower first), then arrival, and the lowest priority is preempted first
    (`scheduler.request_queue`). Under ``fcfs`` a request's priority must be 0.
    ``free_window_blocks``: with a model whose every attention layer has the same sliding window,
    free the blocks that fall out of it (`scheduler.cache_manager`); off, such a model keeps every
    block, as a full-attention one (a baseline for `bench.window_kv`).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    steps_in_flight: int = 2
    max_step_bytes: int | None = None
    scheduling_policy: str = "fcfs"
    free_window_blocks: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option (a zero limit would never schedule)."""
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_int("max_num_seqs", self.max_num_seqs)
        _check_int("steps_in_flight", self.steps_in_flight, 1, MAX_STEPS_IN_FLIGHT)
        _check_int("max_step_bytes", self.max_step_bytes, optional=True)
        for name in ("enable_prefix_caching", "async_scheduling", "free_window_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(slots=True)
class ExecutorInfo:
    """What an executor reports to its scheduler once the model and KV cache are up.

    ``sliding_window``: the window every attention layer shares (None: some layer attends to the
    whole sequence), so the scheduler may free blocks behind it; the executor's KV tensors then
    hold one block past the pool (id ``num_blocks``), zero and never written: the null block.
    ``kv_group_windows``: a hybrid model's KV-cache groups, each group's window (0: full
    attention); its blocks are one layer slot's, its tables per group (`scheduler.kv_groups`),
    and it has the null block too. Empty: one group, every layer's block together.
    """

    model_name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    sliding_window: int | None = None
    kv_group_windows: list[int] = field(default_factory=list)


class ServiceDefaults:
    """Defaults shared by the services' flags and configs (each is defined here only)."""

    namespace = "conveyor"
    redis_url = "redis://127.0.0.1:6379/0"
    heartbeat_ttl_ms = 3000
    # How often liveness is checked (gateways by schedulers, engines by gateways).
    liveness_check_s = 0.5
    # Seconds to wait for one step's result before declaring the executor lost.
    result_timeout_s = 120.0
    # Seconds a service's working thread (a scheduler's engine loop, an executor's step loop, a
    # gateway's event loop) may go without turning before its watchdog ends the process
    # (`common.watchdog`): as long as a scheduler waits for one step, the longest a turn may take.
    stall_timeout_s = result_timeout_s
    # Seconds a scheduler keeps its requests without an executor before failing them.
    recovery_timeout_s = 60.0
    # Seconds a resumable stream keeps generating after its gateway died, waiting to be resumed.
    resume_window_s = 60.0
    # How many times a gateway moves one request to another engine before giving up.
    migration_limit = 3

    @staticmethod
    def heartbeat_interval_s(ttl_ms: int) -> float:
        """Beat six times per TTL: a few late beats never expire a live process."""
        return max(0.1, ttl_ms / 6000)
