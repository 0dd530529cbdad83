"""The 2D attention kernel's work lists for mixed batches (host side, no kernel runs)."""

from __future__ import annotations

import pytest
import torch

from executor.attention_metadata import AttentionMetadata
from executor.kernels.paged_attention import launch_config, work_lists

pytestmark = pytest.mark.unit


def _meta(query_lens: list[int]) -> AttentionMetadata:
    n = len(query_lens)
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.full((n,), 64, dtype=torch.int32),
        block_tables=torch.zeros((n, 4), dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=64,
        query_lens_list=query_lens,
        seq_lens_list=[64] * n,
    )


def test_one_token_rows_go_to_the_decode_tile_and_chunks_get_exactly_their_blocks() -> None:
    meta = _meta([5, 1, 0, 1, 40, 16])
    decode, seqs, blocks = work_lists(meta, 16, torch.device("cpu"))
    assert decode.tolist() == [1, 3]
    # 5 tokens: 1 block; 40: 3 blocks; 16: 1 block; no program for the empty row.
    assert seqs.tolist() == [0, 4, 4, 4, 5]
    assert blocks.tolist() == [0, 0, 1, 2, 0]
    assert {t.dtype for t in (decode, seqs, blocks)} == {torch.int32}
    # Each list starts on 16 bytes, as the JIT's pointer specialisation assumes.
    assert all(t.data_ptr() % 16 == 0 for t in (decode, seqs, blocks))


def test_the_lists_are_made_once_per_step() -> None:
    meta = _meta([3, 1])
    first = work_lists(meta, 32, torch.device("cpu"))
    again = work_lists(meta, 32, torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again))
    other = work_lists(meta, 8, torch.device("cpu"))  # another tile height: its own lists
    assert other[1].tolist() == [0] and other[0].tolist() == [1]


def test_decode_and_prefill_tiles() -> None:
    """The decode tile holds one token's GQA group; fp32 prefill tiles are smaller than 16-bit
    ones (the exact dot's registers: tests/sm90_build.py reports no spills for these)."""
    dec = launch_config(1, 4, 128, torch.bfloat16)
    assert dec["BLOCK_Q"] == 1 and dec["BLOCK_M"] == 16
    bf = launch_config(512, 4, 128, torch.bfloat16)
    fp = launch_config(512, 4, 128, torch.float32)
    assert bf["BLOCK_M"] == 128 and fp["BLOCK_M"] == 64 and fp["TILE_N"] == 16
    assert launch_config(512, 2, 256, torch.float32)["BLOCK_M"] == 32
