"""Offline API: `LLM(model, **options).generate(prompts, sampling_params)`.

Drives the very `Scheduler`, `CacheManager` and `ModelExecutor` the services use, in one process.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

from common.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from scheduler.cache_manager import CacheManager
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.request import Request
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """The finished result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    stop_reason: int | None = None  # the stop token id (of ``stop_token_ids``) that ended it; EOS, length: None


def split_engine_options(options: dict[str, Any]) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """Route flat ``LLM(**options)`` keywords to the config each belongs to."""
    model_kw: dict[str, Any] = {}
    cache_kw: dict[str, Any] = {}
    sched_kw: dict[str, Any] = {}
    targets = [(ModelConfig, model_kw), (CacheConfig, cache_kw), (SchedulerConfig, sched_kw)]
    for key, value in options.items():
        for cls, kw in targets:
            if key in {f.name for f in fields(cls)}:
                kw[key] = value
                break
        else:
            raise TypeError(f"unknown engine option {key!r}")
    model = model_kw.pop("model")
    return ModelConfig(model, **model_kw), CacheConfig(**cache_kw), SchedulerConfig(**sched_kw)


class LLM:
    """Generate from a local Hugging Face checkpoint with continuous batching and a paged KV cache.

    Options: ``dtype``, ``device``, ``block_size``, ``max_num_batched_tokens``, ``max_num_seqs``,
    ``max_model_len``, ``kv_cache_memory`` (bytes), ``num_blocks``, ``attention_backend``, ``seed``,
    ``enable_prefix_caching`` (default True), ``async_scheduling`` (default True), ``num_threads``
    (CPU intra-op threads).
    """

    def __init__(self, model: str, **options: Any) -> None:
        from executor.threads import set_openmp_env_defaults

        set_openmp_env_defaults()  # effective only if nothing imported torch yet (see executor.threads)
        from transformers import AutoTokenizer

        from executor.model_executor import ModelExecutor

        self.model_config, self.cache_config, self.scheduler_config = split_engine_options({"model": model, **options})
        self.scheduler_config.validate()  # before the model loads: a bad option fails fast
        self.executor = ModelExecutor(self.model_config, ParallelConfig(), self.cache_config)
        info = self.executor.info
        self.cache_manager = CacheManager(info.num_blocks, info.block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_manager, info)
        self.engine_core = EngineCore(self.scheduler, InlineExecutor(self.executor), self.scheduler_config.async_scheduling)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._ids = itertools.count()

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache entry: the next requests find nothing cached."""
        self.scheduler.cache.reset_prefix_cache()

    @property
    def max_model_len(self) -> int:
        return self.executor.info.max_model_len

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.executor.info.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return None, ids

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All input is validated before any request is queued, so a bad prompt raises
        ``ValueError`` and leaves the engine as it was.
        """
        batch: Sequence[str | Sequence[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast("str | Sequence[int]", prompts)]
        else:
            batch = cast("Sequence[str | Sequence[int]]", prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = [sampling_params] * len(batch) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling params")
        requests: list[Request] = []
        vocab = self.executor.info.vocab_size
        for prompt, params in zip(batch, params_list):
            params.validate(vocab)
            if params.structured_outputs is not None and (error := params.structured_outputs.compile_error()):
                raise ValueError(f"structured_outputs does not compile: {error}")
            text, ids = self._prompt_ids(prompt)
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
            requests.append(Request(str(next(self._ids)), ids, params, prompt=text))
        for request in requests:
            self.scheduler.add_request(request)
        pending = {r.request_id for r in requests}
        try:
            while pending:
                for out in self.engine_core.step():
                    if out.finished:
                        pending.discard(out.request_id)
            while self.engine_core.in_flight:  # steps scheduled one ahead for requests now finished
                self.engine_core.step()
        finally:
            for request_id in pending:  # only after an error: leave no half-run request behind
                self.scheduler.abort(request_id)
        return [self._output(r) for r in requests]

    def _output(self, request: Request) -> RequestOutput:
        wants_logprobs = request.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=cast(str, self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)),
            finish_reason=request.finish_reason or "stop",
            logprobs=list(request.output_logprobs) if wants_logprobs else None,  # type: ignore[arg-type]
            stop_reason=request.stop_reason,
        )
