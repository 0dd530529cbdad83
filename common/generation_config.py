"""The model's own sampling defaults, from its ``generation_config.json`` (vLLM's ``--generation-config auto``).

A checkpoint says how it should be sampled (Qwen3: temperature 0.6, top_p 0.95, top_k 20); a
request that leaves a field out gets the model's value instead of OpenAI's default (temperature
1, no top-p or top-k), at the gateway and in the offline `LLM` alike, as from vLLM (whose log
says "Default sampling parameters have been overridden by the model's Hugging Face generation
config"). The gateway's ``--generation-config vllm`` keeps OpenAI's defaults. ``max_new_tokens``
is not taken: a request without ``max_tokens`` fills the context (offline, `SamplingParams`' 16).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The fields vLLM takes from a generation config (less ``max_new_tokens``).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_MODES = ("auto", "vllm")


def load_sampling_defaults(model_dir: str) -> dict[str, float]:
    """The sampling fields ``model_dir``'s ``generation_config.json`` sets (none without one);
    a value the engine would refuse is left out, with a warning, rather than fail every request."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: a file nested past the parser's limit
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    defaults: dict[str, float] = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        try:
            SamplingParams(**{name: value}).validate()
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring %s's %s: %s", path, name, exc)
            continue
        defaults[name] = 0 if name == "top_k" and value == -1 else value  # (a request's -1 is 0 too)
    if defaults:
        logger.info("default sampling parameters from the model's generation config (%s): %s", path, defaults)
    return defaults


def apply_sampling_defaults(sampling: SamplingParams, body: dict[str, Any], defaults: dict[str, float]) -> None:
    """Give ``sampling`` the model's value of every field the request left out, and write it into
    ``body`` too: a stream's journal keeps the body, which a resuming gateway parses again."""
    for name, value in defaults.items():
        if body.get(name) is None:
            setattr(sampling, name, value)
            body[name] = value
