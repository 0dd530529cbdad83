"""What one step carries over Redis, in bytes: the part that admission by tokens does not bound.

A step (scheduler -> executor) carries each request new to its executor whole: its tokens and
block table (4 bytes each) and its sampling parameters (a grammar may be large). A prefill chunk
of a request with ``prompt_logprobs`` comes back with ``k + 1`` entries of 12 bytes a position,
and the gateway gets the whole prompt's in one output message. The token budget does not bound
these: a prefix-cache hit makes admitting a sibling of a long prompt nearly free to compute.

So the scheduler service keeps what each step counts here under ``SchedulerConfig.max_step_bytes``
(half a message: the rest is headroom for what is not counted), a request too big to fit even
alone is refused when it arrives (`check_fits`), and the gateway's output messages are split at
the same size (`scheduler.outputs`). In process (`LLM`) nothing crosses Redis: no limit.
"""

from __future__ import annotations

from common.codec import INT_BYTES, LOGPROB_ENTRY_BYTES
from common.sampling_params import wire_size
from scheduler.request import Request

REQUEST_OVERHEAD_BYTES = 256  # its id and the fixed fields of its entry in a step


def sampling_bytes(request: Request) -> int:
    """The encoded size of ``request``'s sampling parameters (computed once: `Scheduler.add_request`)."""
    return wire_size(request.sampling_params)


def new_request_bytes(request: Request, block_size: int, num_kv_groups: int = 1) -> int:
    """About what ``request`` adds to the step that sends it to an executor (it grows with its
    outputs); a hybrid model's table has one entry per KV-cache group and block."""
    blocks = -(-request.num_tokens // block_size) * num_kv_groups
    return REQUEST_OVERHEAD_BYTES + INT_BYTES * (request.num_tokens + blocks) + request.sampling_bytes


def prompt_logprob_bytes(request: Request) -> int:
    """Bytes a prompt position's logprobs take (0 without ``prompt_logprobs``)."""
    k = request.sampling_params.prompt_logprobs
    return 0 if k is None else INT_BYTES + LOGPROB_ENTRY_BYTES * (k + 1)


def check_fits(request: Request, block_size: int, max_model_len: int, max_step_bytes: int, num_kv_groups: int = 1) -> None:
    """``ValueError`` for a request no step or output message could carry, even alone."""
    whole = new_request_bytes(request, block_size, num_kv_groups) + INT_BYTES * (max_model_len - request.num_tokens)
    if whole > max_step_bytes:
        raise ValueError(
            f"request too large to send in one step ({whole} bytes with its tokens and sampling "
            f"parameters, over {max_step_bytes}); send a smaller grammar or fewer tokens"
        )
    prompt = prompt_logprob_bytes(request) * len(request.prompt_token_ids)
    if prompt > max_step_bytes:
        k = request.sampling_params.prompt_logprobs
        raise ValueError(
            f"prompt_logprobs={k} over a prompt of {len(request.prompt_token_ids)} tokens would be {prompt} bytes in "
            f"one output message, over {max_step_bytes}; ask for fewer prompt logprobs or send a shorter prompt"
        )
