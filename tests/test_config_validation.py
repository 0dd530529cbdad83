"""Engine options are checked up front: a bad value is a ValueError naming it, before any loading."""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from executor.model_executor import ModelExecutor

pytestmark = pytest.mark.unit

NO_CUDA = not torch.cuda.is_available()


def test_defaults_are_valid(tmp_path) -> None:
    ModelConfig(str(tmp_path)).validate()
    ModelConfig(tmp_path).validate()  # type: ignore[arg-type]  # LLM accepts a Path
    CacheConfig().validate()
    ParallelConfig().validate()
    SchedulerConfig().validate()
    SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1, enable_prefix_caching=False).validate()
    CacheConfig(block_size=1, num_blocks=1, kv_cache_memory=1 << 40, gpu_memory_utilization=1.0).validate()
    ModelConfig("m", dtype="bfloat16", device="cpu", max_model_len=1, attention_backend="torch", seed=-5).validate()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_num_seqs=0), r"max_num_seqs must be an integer in \[1, 2147483647\], got 0"),
        (dict(max_num_seqs=-3), "max_num_seqs"),
        (dict(max_num_seqs=2.5), "max_num_seqs"),
        (dict(max_num_seqs=True), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(max_num_batched_tokens=2**31), "max_num_batched_tokens"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(steps_in_flight=0), r"steps_in_flight must be an integer in \[1, 8\], got 0"),
        (dict(steps_in_flight=9), "steps_in_flight"),
    ],
)
def test_scheduler_config(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kw).validate()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_size=0), r"block_size must be an integer in \[1, "),
        (dict(block_size=-16), "block_size"),
        (dict(block_size="16"), "block_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    ],
)
def test_cache_config(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kw).validate()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(model=""), "model must be"),
        (dict(dtype="float64"), r"dtype must be one of auto, float32, float16, bfloat16, got 'float64'"),
        (dict(dtype="fp16"), "dtype"),
        (dict(device="tpu"), r"device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (dict(device="gpu"), "device"),
        (dict(attention_backend="flash"), r"attention_backend must be one of auto, torch, triton, got 'flash'"),
        (dict(max_model_len=0), r"max_model_len must be an integer in \[1, 2147483647\] or None, got 0"),
        (dict(max_model_len=-1), "max_model_len"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_model_config(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{"model": "m", **kw}).validate()


def test_parallel_config() -> None:
    ParallelConfig(2).validate()
    for bad in (0, 65, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            ParallelConfig(bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig("m", enforce_eager="yes").validate()  # type: ignore[arg-type]


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        ModelConfig("m", device="cuda").validate()


def test_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' on CPU needs .*TRITON_INTERPRET=1"):
        ModelConfig("m", device="cpu", attention_backend="triton").validate()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ModelConfig("m", device="cpu", attention_backend="triton").validate()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ModelConfig("m", device="cpu", attention_backend="triton").validate()
    monkeypatch.delenv("TRITON_INTERPRET")
    ModelConfig("m", device="cpu", attention_backend="torch").validate()
    if NO_CUDA:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            ModelConfig("m", attention_backend="triton").validate()  # auto device: CPU here


def test_model_executor_validates_before_loading(tmp_path, monkeypatch) -> None:
    """The option error, not a missing-checkpoint error: nothing is read before validation."""
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        ModelExecutor(ModelConfig(missing, dtype="float64"), ParallelConfig())
    with pytest.raises(ValueError, match="block_size"):
        ModelExecutor(ModelConfig(missing), ParallelConfig(), CacheConfig(block_size=0))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelExecutor(ModelConfig(missing), ParallelConfig(4))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ModelExecutor(ModelConfig(missing, device="cpu", attention_backend="triton"), ParallelConfig())
    with pytest.raises(FileNotFoundError):  # valid options: now the checkpoint is looked for
        ModelExecutor(ModelConfig(missing, device="cpu"), ParallelConfig())


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(dtype="float64"), "dtype"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(num_blocks=-1), "num_blocks"),
    ],
)
@pytest.mark.model
def test_llm_refuses_bad_options(tiny_model, option: dict, match: str) -> None:
    from gateway.llm import LLM

    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model("llama")), **option)


@pytest.mark.model
@pytest.mark.parametrize("option", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0)])
def test_llm_refuses_bad_scheduler_options(tiny_model, option: dict) -> None:
    from gateway.llm import LLM

    # Construction only: without validation a zero limit would make `generate` spin forever.
    with pytest.raises(ValueError, match=next(iter(option))):
        LLM(str(tiny_model("llama")), **option)


def test_executor_service_reports_bad_options_as_usage_errors(capsys, tmp_path) -> None:
    from executor.service import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path), "--block-size", "0"])
    assert exc.value.code == 2
    assert "block_size must be an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--dtype", "float64"])
    assert "dtype must be one of" in capsys.readouterr().err
