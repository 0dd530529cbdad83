"""Architecture name -> model family: the one list of what the engine serves.

A new family is a `executor.models.base.ModelFamily` subclass in its own module, added to
`FAMILIES`; `SUPPORTED_ARCHITECTURES` and the unsupported-architecture error follow from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from executor.model_config import HFModelConfig
from executor.models.base import ModelFamily
from executor.models.gemma import GemmaFamily
from executor.models.gpt_oss import GptOssFamily
from executor.models.llama import LlamaFamily
from executor.models.mixtral import MixtralFamily
from executor.models.phi3 import Phi3Family
from executor.models.qwen_moe import QwenMoEFamily

FAMILIES: tuple[ModelFamily, ...] = (LlamaFamily(), GemmaFamily(), Phi3Family(), QwenMoEFamily(), MixtralFamily(), GptOssFamily())

_BY_ARCH = MappingProxyType({arch: family for family in FAMILIES for arch in family.architectures})
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCH)


def family_for(architectures: Sequence[str]) -> tuple[str, ModelFamily]:
    """The first of a config's ``architectures`` the engine serves, and its family; a
    ``ValueError`` listing what is supported when none is."""
    for arch in architectures:
        if arch in _BY_ARCH:
            return arch, _BY_ARCH[arch]
    raise ValueError(f"unsupported architectures {list(architectures)!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def family_of(cfg: HFModelConfig) -> ModelFamily:
    """The family of a parsed config."""
    return family_for([cfg.architecture])[1]
