"""Pieces shared by every service: sampling parameters, batch messages, configs, protocol."""

from common.sampling_params import SamplingParams
from common.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
