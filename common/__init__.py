"""Pieces shared by every service: sampling parameters, batch messages, configs, protocol."""

from common.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
