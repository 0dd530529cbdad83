"""Offline API: `LLM(model, **options).generate(prompts, sampling_params)`.

Drives the very `Scheduler`, `CacheManager` and `ModelExecutor` the services use, in one process.
It is a frontend, as vLLM's ``LLM`` is (output processing around an in-process engine core), so
it lives with the gateway's frontend code: its text comes from the gateway's own output processor
(`gateway.output.processor`: detokenization, stop strings, the stop-token rule), and the same
tokens give the same text, ``finish_reason`` and ``stop_reason`` offline as served. It is the one
module of the gateway package that imports the scheduler and the executor (it composes them).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

from common.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from common.generation_config import GENERATION_CONFIG_MODES, load_sampling_defaults
from common.parallel_sampling import child_params, cumulative_logprob, num_children, select_best
from common.sampling_params import SamplingParams
from common.structured_outputs import grammar_tokenizer
from gateway.output.processor import OutputDelta, OutputProcessor
from scheduler.engine_core import EngineCore, InlineExecutor
from scheduler.kv_groups import cache_manager_for
from scheduler.request import Request
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt (vLLM's ``CompletionOutput``); ``index`` is its child index (with
    ``best_of`` > ``n``: the index among the ``best_of`` generated). ``cumulative_logprob``: the
    sum of its tokens' logprobs, None unless logprobs were computed (``logprobs`` or ``best_of``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    """The finished result of one prompt: ``outputs`` holds its ``n`` samples (vLLM's shape; with
    ``best_of``, the best first); ``token_ids``, ``text``, ``finish_reason``, ``logprobs`` and
    ``stop_reason`` are those of ``outputs[0]``, for the common ``n == 1``. ``prompt_logprobs``
    (with ``SamplingParams.prompt_logprobs``): one entry per prompt token, None for the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; EOS, length: None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None


def split_engine_options(options: dict[str, Any]) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig]:
    """Route flat ``LLM(**options)`` keywords to the config each belongs to."""
    model_kw: dict[str, Any] = {}
    cache_kw: dict[str, Any] = {}
    sched_kw: dict[str, Any] = {}
    par_kw: dict[str, Any] = {}
    targets = [(ModelConfig, model_kw), (CacheConfig, cache_kw), (SchedulerConfig, sched_kw), (ParallelConfig, par_kw)]
    for key, value in options.items():
        for cls, kw in targets:
            if key in {f.name for f in fields(cls)}:
                kw[key] = value
                break
        else:
            raise TypeError(f"unknown engine option {key!r}")
    model = model_kw.pop("model")
    return ModelConfig(model, **model_kw), CacheConfig(**cache_kw), SchedulerConfig(**sched_kw), ParallelConfig(**par_kw)


@dataclass(slots=True)
class _Text:
    """One sequence's output so far, from its `OutputProcessor`."""

    processor: OutputProcessor
    parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cut_short: bool = False  # a stop string ended it before the engine did (which was told to stop)

    def add(self, delta: OutputDelta) -> None:
        self.parts.append(delta.text)
        self.num_tokens += delta.num_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.cut_short = delta.finish_reason, delta.stop_reason, delta.cut_short


class LLM:
    """Generate from a local Hugging Face checkpoint with continuous batching and a paged KV cache.

    Options: ``dtype``, ``device``, ``block_size``, ``max_num_batched_tokens``, ``max_num_seqs``,
    ``max_model_len``, ``kv_cache_memory`` (bytes), ``num_blocks``, ``attention_backend``, ``seed``,
    ``enable_prefix_caching`` (default True), ``async_scheduling`` (default True), ``steps_in_flight``
    (default 2), ``scheduling_policy`` (``fcfs``, or ``priority``: `generate`'s ``priority``),
    ``num_threads`` (CPU intra-op threads), ``tensor_parallel_size`` (ranks spawned by this process;
    call `shutdown` to stop them early), ``enforce_eager`` (no CUDA graphs), ``cpu_decode_kernel`` (``auto``/``off``:
    few-row decode steps in C on CPU, `executor.cpu_decode`), ``generation_config``
    (``auto``: `generate` without parameters samples as the model's ``generation_config.json`` says;
    ``vllm``: `SamplingParams`' defaults).
    """

    def __init__(self, model: str, **options: Any) -> None:
        from executor.threads import set_openmp_env_defaults

        set_openmp_env_defaults()  # effective only if nothing imported torch yet (see executor.threads)
        from transformers import AutoTokenizer

        from executor.tp_executor import build_executor

        generation_config = options.pop("generation_config", "auto")  # vLLM's: "vllm" ignores the model's defaults
        if generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {generation_config!r}")
        configs = split_engine_options({"model": model, **options})
        self.model_config, self.cache_config, self.scheduler_config, self.parallel_config = configs
        self.scheduler_config.validate()  # before the model loads: a bad option fails fast
        self.executor = build_executor(
            self.model_config, self.parallel_config, self.cache_config, self.scheduler_config.max_num_seqs
        )
        info = self.executor.info
        self.cache_manager = cache_manager_for(info, self.scheduler_config)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_manager, info)
        sc = self.scheduler_config
        self.inline = InlineExecutor(self.executor)
        self.engine_core = EngineCore(self.scheduler, self.inline, sc.async_scheduling, sc.steps_in_flight)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.sampling_defaults = load_sampling_defaults(model) if generation_config == "auto" else {}
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the executor (its tensor-parallel ranks) and free its memory."""
        self.executor.shutdown()

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

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` uses without any: the model's sampling defaults from its
        ``generation_config.json`` (vLLM's), else `SamplingParams`' own."""
        return SamplingParams(**self.sampling_defaults)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``priority``: one per prompt, lower first (vLLM's; needs ``scheduling_policy="priority"``).
        All input is validated before any request is queued, so a bad prompt raises
        ``ValueError`` and leaves the engine as it was.
        """
        batch: Sequence[str | Sequence[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast("str | Sequence[int]", prompts)]
        else:
            batch = cast("Sequence[str | Sequence[int]]", prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = [sampling_params] * len(batch) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling params")
        priorities = [0] * len(batch) if priority is None else list(priority)
        if len(priorities) != len(batch) or not all(type(p) is int for p in priorities):
            raise ValueError(f"priority must hold one integer per prompt ({len(batch)})")
        if any(priorities) and self.scheduler.config.scheduling_policy != "priority":
            raise ValueError("priority needs scheduling_policy='priority' (this engine's is fcfs)")
        groups: list[tuple[SamplingParams, list[Request]]] = []  # per prompt: its params and children
        vocab = self.executor.info.vocab_size
        for prompt, params, rank in zip(batch, params_list, priorities):
            params.validate(vocab)
            spec = params.structured_outputs
            if spec is not None and (error := spec.compile_error(grammar_tokenizer(self.tokenizer, vocab))):
                raise ValueError(f"structured_outputs does not compile: {error}")
            text, ids = self._prompt_ids(prompt)
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
            base = str(next(self._ids))
            k = num_children(params)
            group = base if k > 1 else None
            children = [
                Request(
                    base if k == 1 else f"{base}_{i}", ids, child_params(params, i), prompt=text, group_id=group, priority=rank
                )
                for i in range(k)
            ]
            groups.append((params, children))
        requests = [r for _, children in groups for r in children]
        texts = {r.request_id: _Text(OutputProcessor(self.tokenizer, r.sampling_params)) for r in requests}
        pending: set[str] = set()
        try:
            for request in requests:  # one refused: those added before it are aborted (finally)
                self.scheduler.add_request(request)
                pending.add(request.request_id)
            while pending:
                for out in self.engine_core.step():
                    if out.request_id not in pending:
                        continue  # (a step scheduled before a stop string ended its request)
                    seq = texts[out.request_id]
                    if seq.processor.stop.stops:  # read as they come, so that a stop string stops the engine
                        seq.add(seq.processor.add(out.new_token_ids, out.finished, out.finish_reason, out.stop_reason))
                        if seq.cut_short:
                            self.scheduler.abort(out.request_id)
                    if out.finished or seq.finish_reason is not None:
                        pending.discard(out.request_id)
            while self.engine_core.in_flight:  # steps scheduled one ahead for requests now finished
                self.engine_core.step()
        except BaseException:
            # Interrupted (Ctrl-C) or failed anywhere in a step: nothing in flight is trusted. The
            # executor drops its state and every request left is resent as new: the LLM stays usable.
            self.engine_core.reset()
            self.inline.reset()
            raise
        finally:
            for request_id in pending:  # only after an error: leave no half-run request behind
                self.scheduler.abort(request_id)
        return [self._output(params, children, texts) for params, children in groups]

    def _output(self, params: SamplingParams, children: list[Request], texts: dict[str, _Text]) -> RequestOutput:
        """One prompt's result: its children as `CompletionOutput`s (the best ``n`` with ``best_of``)."""
        samples = []
        for i, request in enumerate(children):
            seq = texts[request.request_id]
            if seq.finish_reason is None:  # without stop strings: all its tokens at once (the same text)
                seq.add(seq.processor.add(request.output_token_ids, True, request.finish_reason, request.stop_reason))
            if request.finish_reason in ("abort", "error") and not seq.cut_short:
                seq.finish_reason = request.finish_reason  # the engine's own end, not the API's stop or length
            token_ids = request.output_token_ids[: seq.num_tokens]  # (a stop string's: up to it)
            computed = request.sampling_params.logprobs is not None  # asked, or added to rank by
            logprobs = request.output_logprobs[: seq.num_tokens]
            total = cumulative_logprob(token_ids, logprobs) if computed else None
            samples.append(
                CompletionOutput(
                    index=i,
                    text="".join(seq.parts),
                    token_ids=token_ids,
                    cumulative_logprob=total,
                    logprobs=list(logprobs) if params.logprobs is not None else None,  # type: ignore[arg-type]
                    finish_reason=seq.finish_reason or "stop",
                    stop_reason=seq.stop_reason,
                )
            )
        outputs = [samples[i] for i in select_best([s.cumulative_logprob for s in samples], params.n)]
        first, leader = outputs[0], children[0]
        return RequestOutput(
            request_id=leader.group_id or leader.request_id,
            prompt=leader.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            token_ids=first.token_ids,
            text=first.text,
            finish_reason=first.finish_reason,
            logprobs=first.logprobs,
            stop_reason=first.stop_reason,
            outputs=outputs,
            prompt_logprobs=[None, *leader.prompt_logprobs] if params.prompt_logprobs is not None else None,
        )
