"""Many stream appends as one Redis command: a server-side script instead of a pipeline.

A gateway journals every event of every stream it serves (one XADD per response per read, a
PEXPIRE where the journal's TTL is due: `common.transport`). Pipelined, redis-py builds and
parses those commands in Python; as one EVALSHA, Redis does that work instead
(docs/performance.md has the numbers). Where the server refuses scripts (an ACL without
``EVAL``, a Redis stand-in without Lua) the caller falls back to the pipeline: same effect, one
round trip either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from common.protocol import ENTRY_FIELD

# KEYS: the streams. ARGV[1]: the entry field; ARGV[2]: one msgpack array of [data, maxlen, ttl_ms]
# per stream (-1: untrimmed / no TTL). One packed argument instead of three per stream: redis-py
# encodes every argument in Python, so fewer arguments cost the client less CPU. Redis's Lua
# `cmsgpack` reads only the old msgpack spec: raw strings, no bin type.
# MAXLEN "~" as `TransportCore._xadd`: trimming whole radix nodes is cheap.
APPEND_SCRIPT = """
local field = ARGV[1]
local entries = cmsgpack.unpack(ARGV[2])
for i, key in ipairs(KEYS) do
  local data, maxlen, ttl = entries[i][1], entries[i][2], entries[i][3]
  if maxlen < 0 then
    redis.call('XADD', key, '*', field, data)
  else
    redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', field, data)
  end
  if ttl >= 0 then
    redis.call('PEXPIRE', key, ttl)
  end
end
return #KEYS
"""


def script_arguments(
    sends: Sequence[tuple[str, bytes, int | None, int | None]], ttls: Sequence[int | None]
) -> tuple[list[str], list[bytes]]:
    """KEYS and ARGV of `APPEND_SCRIPT` for ``(stream, data, maxlen, _)`` appends, in order, each
    with the TTL of ``ttls`` (None: none set; `TransportCore.ttls_due`)."""
    keys = [stream for stream, _, _, _ in sends]
    entries = [
        [data, -1 if maxlen is None else maxlen, -1 if ttl_ms is None else ttl_ms]
        for (_, data, maxlen, _), ttl_ms in zip(sends, ttls, strict=True)
    ]
    return keys, [ENTRY_FIELD, msgpack.packb(entries, use_bin_type=False)]
