"""Engine configuration shared by the offline `LLM`, the scheduler and the executor."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry and its memory budget."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes, CPU budget (None: 1 GiB)
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # force a pool size (tests); overrides the budget


@dataclass(slots=True)
class ParallelConfig:
    """Parallelism of one executor. Only a single device is implemented today."""

    tensor_parallel_size: int = 1


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step limits of continuous batching, and the prefix cache.

    ``enable_prefix_caching``: reuse the K/V of full blocks an earlier request computed for the
    same leading tokens (see `scheduler.cache_manager`). It lives here, not in `CacheConfig`,
    because only the scheduler's block table knows it: the executor just follows block tables.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class ExecutorInfo:
    """What an executor reports to its scheduler once the model and KV cache are up."""

    model_name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int


class ServiceDefaults:
    """Defaults shared by the services' flags and configs (each is defined here only)."""

    namespace = "conveyor"
    redis_url = "redis://127.0.0.1:6379/0"
    heartbeat_ttl_ms = 3000
    # How often liveness is checked (gateways by schedulers, engines by gateways).
    liveness_check_s = 0.5
    # Seconds to wait for one step's result before declaring the executor lost.
    result_timeout_s = 120.0
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
