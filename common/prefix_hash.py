"""The prefix cache's block hashes: one chained hash per full KV block, computable from token ids alone.

The scheduler keys its prefix cache with them (`scheduler.cache_manager`) and publishes a summary
of what it holds (`summary_key`, `EngineStatus.cached_prefixes`); a gateway hashes a prompt the
same way to find the engine that holds the longest part of it (`gateway.engine.prefix_index`).
Both import this module, so the two can never hash differently.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from functools import lru_cache

BlockHash = bytes

# Parent of a request's first block. Hashes are blake2b-128 over a fixed-width encoding, so they
# are stable across processes and a collision (two prefixes sharing KV) is out of reach.
ROOT_HASH: BlockHash = hashlib.blake2b(b"conveyor prefix cache v1", digest_size=16).digest()

# Bytes of a block hash an engine publishes (`summary_key`): a false match costs one routing
# choice, not correctness, so 64 bits are plenty and 4,096 keys fit in 32 KiB.
SUMMARY_KEY_BYTES = 8


@lru_cache(maxsize=8)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """``hash((parent, tokens, extra))``: one full block, chained to the block before it.

    The parent (16 bytes) and the tokens (8 bytes each, a block's fixed count) have fixed widths,
    so the encoding is unambiguous. ``extra`` carries keys that must keep otherwise equal prefixes
    apart (a request's ``cache_salt``); it is given for the first block only, and the chain
    carries it on. A cryptographic hash on purpose: with a weak one (Python's ``hash``) a client
    could craft a prompt whose block collides with another's prefix and poison its cache.
    """
    return hashlib.blake2b(parent + _packer(len(tokens)).pack(*tokens) + extra, digest_size=16).digest()


def extra_keys(cache_salt: str | None) -> bytes:
    """The first block's extra keys, tagged so that no salt and an empty salt hash apart."""
    return b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8", "surrogatepass")


def iter_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> Iterator[BlockHash]:
    """The chained hashes of ``token_ids``' full blocks, first block first (lazily: a caller that
    stops early hashes no further)."""
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys(cache_salt) if i == 0 else b"")
        yield parent


def summary_key(cache_key: bytes) -> bytes:
    """What an engine publishes of a prefix-cache key: its first `SUMMARY_KEY_BYTES` (the block
    hash's, whatever KV-cache group suffix the key carries)."""
    return cache_key[:SUMMARY_KEY_BYTES]


def decode_summary(packed: bytes) -> frozenset[bytes]:
    """The keys of an engine's packed summary (`EngineStatus.cached_prefixes`)."""
    n = SUMMARY_KEY_BYTES
    return frozenset(packed[i : i + n] for i in range(0, len(packed) - n + 1, n))
