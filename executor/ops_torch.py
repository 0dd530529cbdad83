"""The torch backend of `executor.ops`: the CPU path, and the reference for the Triton kernels.

Speed on a small CPU comes from doing per-step work once and batching everything else:

- `paged_attention` turns the step's `AttentionMetadata` into a *plan* once (the first layer to
  see it) and reuses it in every layer. The plan groups sequences: all decodes (one query token
  each) form one padded batch; prefill chunks are packed into padded batches while padding waste
  stays small. Each group gathers its K/V blocks with one ``index_select`` and runs one
  ``scaled_dot_product_attention`` with GQA, masked by sequence length and causal offset.
- `write_kv` is one ``index_copy_`` per cache; `rotary` indexes a precomputed cos/sin table.

That per-step work (the plan, the kept slots, the step's cos/sin rows) is memoised, and the K/V
gather buffers are reused, in a `TorchOpsState`: one per executor (`make_ops`), never module
state, so two engines in one process (even on two threads) share nothing. The module-level
`paged_attention`, `write_kv` and `rotary` are the same ops without memos (references, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from executor.attention_metadata import AttentionMetadata
from executor.moe_torch import fused_moe
from executor.ops import Ops

# Sequences share one padded SDPA call while its padding costs less than either share of the
# call's real work or one more call. Decode attention is memory-bound on CPU, so padding costs
# nearly its full share: more, smaller calls are cheaper than reading padding.
_PAD_WASTE = 1.05
# ...but a call has a fixed cost (gathers, mask, dispatch), worth this many cached K elements
# attended, which dominates for a narrow model (few KV heads of a small head size).
_CALL_COST_ELEMENTS = 40_000


@dataclass(slots=True)
class _Group:
    """Sequences attended in one padded SDPA call."""

    num_seqs: int
    max_q: int
    kv_len: int  # keys per sequence after padding (max seq_len in the group)
    row_start: int  # with q_index None: the group's tokens are rows row_start:row_start+num_seqs
    q_index: torch.Tensor | None  # [num_seqs * max_q] token rows (padding repeats a real row)
    out_valid: torch.Tensor | None  # positions of real tokens in the padded [num_seqs * max_q]
    out_rows: torch.Tensor | None  # their token rows in q/out
    block_index: torch.Tensor  # int64 [num_seqs * blocks_per_seq]
    mask: torch.Tensor | None  # bool [num_seqs, 1, max_q, kv_len]; None = no masking
    causal: bool  # mask-free causal attention (whole prompts, all of one length)
    q_lens: list[int]
    s_lens: list[int]


@dataclass(slots=True)
class _Plan:
    groups: list[_Group]
    identity: bool  # a single group whose padded rows are exactly the token rows
    max_seq_len: int  # a window at least this long hides nothing: the plain path serves it
    # Exact masks per sliding window (None: none) for the layers that need one, per group.
    masks: dict[int | None, list[torch.Tensor]] = field(default_factory=dict)

    def exact_masks(self, window: int | None, device: torch.device) -> list[torch.Tensor]:
        """Each group's full mask for ``window``, built by the first layer that asks."""
        if window not in self.masks:
            self.masks[window] = [_exact_mask(g, window, device) for g in self.groups]
        return self.masks[window]


def _exact_mask(g: _Group, window: int | None, device: torch.device) -> torch.Tensor:
    """bool ``[num_seqs, 1, max_q, kv_len]``: key l is visible to the query at position p iff
    l <= p, l < seq_len and (with a window W) l > p - W. Padding queries take their sequence's last
    position, so no row is empty."""
    seq_len = torch.tensor(g.s_lens, device=device)
    q_pos = (seq_len - torch.tensor(g.q_lens, device=device))[:, None] + torch.arange(g.max_q, device=device)[None, :]
    q_pos = torch.minimum(q_pos, seq_len[:, None] - 1)[:, :, None]
    key = torch.arange(g.kv_len, device=device)[None, None, :]
    mask = (key <= q_pos) & (key < seq_len[:, None, None])
    if window is not None:
        mask &= key > q_pos - window
    return mask.unsqueeze(1)


def _make_group(seqs: list[int], meta: AttentionMetadata, qsl: list[int], block_size: int, device: torch.device) -> _Group:
    q_lens = [meta.query_lens_list[i] for i in seqs]
    s_lens = [meta.seq_lens_list[i] for i in seqs]
    num, max_q, kv_len = len(seqs), max(q_lens), max(s_lens)
    nblocks = -(-kv_len // block_size)
    starts = [qsl[i] for i in seqs]
    contiguous = max_q == 1 and starts == list(range(starts[0], starts[0] + num))
    if seqs == list(range(seqs[0], seqs[0] + num)):  # a run of the batch: a slice, no index tensor
        tables = meta.block_tables[seqs[0] : seqs[0] + num]
    else:
        tables = meta.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=meta.block_tables.device))
    block_index = tables[:, :nblocks].reshape(-1).to(device=device, dtype=torch.long)
    if max_q == 1:
        q_index = out_valid = out_rows = None
        if not contiguous:
            q_index = torch.tensor(starts, dtype=torch.long, device=device)
            out_rows = q_index
    else:
        rows: list[int] = []
        valid: list[int] = []
        real: list[int] = []
        for n, (start, ql) in enumerate(zip(starts, q_lens)):
            rows.extend(range(start, start + ql))
            rows.extend([start] * (max_q - ql))
            valid.extend(range(n * max_q, n * max_q + ql))
            real.extend(range(start, start + ql))
        q_index = torch.tensor(rows, dtype=torch.long, device=device)
        out_valid = torch.tensor(valid, dtype=torch.long, device=device)
        out_rows = torch.tensor(real, dtype=torch.long, device=device)

    # Whole prompts of one length need no explicit mask: plain causal attention.
    causal = max_q > 1 and all(ql == max_q for ql in q_lens) and all(sl == max_q for sl in s_lens)
    mask = None
    if max_q == 1 and min(s_lens) < kv_len:  # decodes: each sees its own keys, all but the padding
        mask = (torch.arange(kv_len, device=device) < torch.tensor(s_lens, device=device)[:, None]).view(num, 1, 1, kv_len)
    elif not causal and max_q > 1:
        seq_len = torch.tensor(s_lens, device=device)
        prefix = seq_len - torch.tensor(q_lens, device=device)
        key_pos = torch.arange(kv_len, device=device)
        q_pos = prefix[:, None] + torch.arange(max_q, device=device)[None, :]  # [num, max_q]
        # Key l is visible to a query at absolute position p iff l <= p and l < seq_len.
        # Padding queries sit past the end, so they still see >= 1 key (no NaN rows).
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_len[:, None, None])
        mask = mask.unsqueeze(1)
    return _Group(num, max_q, kv_len, starts[0], q_index, out_valid, out_rows, block_index, mask, causal, q_lens, s_lens)


def _pack(seqs: list[int], meta: AttentionMetadata, row_elements: int) -> list[list[int]]:
    """Split ``seqs`` into groups whose padded work (query x key pairs) exceeds the real work by
    at most ``_PAD_WASTE`` x, or by the cost of one more call (``row_elements``: a cached key's
    elements, KV heads x head size).

    Sequences are taken longest query first, then longest sequence, so each group spans similar
    lengths and its first member sets its padded query length. (Runs once a step, on every decode:
    kept to plain arithmetic.)
    """
    call_cost = _CALL_COST_ELEMENTS / row_elements
    ql, sl = meta.query_lens_list, meta.seq_lens_list
    order = sorted(seqs, key=lambda i: (-ql[i], -sl[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    real = max_q = max_kv = 0
    for i in order:
        q, s = ql[i], sl[i]
        if current:
            total, kv = real + q * s, s if s > max_kv else max_kv
            if (len(current) + 1) * max_q * kv - total <= max((_PAD_WASTE - 1) * total, call_cost):
                current.append(i)
                real, max_kv = total, kv
                continue
            groups.append(current)
        current, real, max_q, max_kv = [i], q * s, q, s
    if current:
        groups.append(current)
    return groups


def _build_plan(meta: AttentionMetadata, block_size: int, row_elements: int, device: torch.device) -> _Plan:
    qsl = [0]
    for ql in meta.query_lens_list:
        qsl.append(qsl[-1] + ql)
    decodes = [i for i, ql in enumerate(meta.query_lens_list) if ql == 1]
    prefills = [i for i, ql in enumerate(meta.query_lens_list) if ql > 1]
    # Members in batch order, so that a group of consecutive decodes needs no index tensors.
    groups = [
        _make_group(sorted(members), meta, qsl, block_size, device)
        for part in (decodes, prefills)
        if part
        for members in _pack(part, meta, row_elements)
    ]
    identity = len(groups) == 1 and groups[0].max_q == 1 and groups[0].q_index is None
    return _Plan(groups, identity, max(meta.seq_lens_list))


def _gather_into(workspace: dict, cache: torch.Tensor, index: torch.Tensor, which: str) -> torch.Tensor:
    """``cache.index_select(0, index)`` into a persistent buffer of ``workspace``."""
    shape = (index.numel(), *cache.shape[1:])
    numel = index.numel() * cache[0].numel()
    # Inference-mode tensors cannot be written outside inference mode (and vice versa is slow).
    key = (which, cache.device, cache.dtype, torch.is_inference_mode_enabled())
    buf = workspace.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 20), dtype=cache.dtype, device=cache.device)
        workspace[key] = buf
    out = buf[:numel].view(shape)
    torch.index_select(cache, 0, index, out=out)
    return out


def _exact_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention with soft-capped scores and/or sink logits (which SDPA has not), in fp32:
    q ``[n, Hq, Q, D]``, keys/vals ``[n, Hkv, K, D]``, mask ``[n, 1, Q, K]`` -> ``[n, Hq, Q, D]``."""
    n, hq, mq, _ = q.shape
    rep = hq // keys.shape[1]
    if rep > 1:
        keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink joins the denominator as one more column, dropped after the softmax
        sink = sinks.float().view(1, hq, 1, 1).expand(n, hq, mq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, vals.float()).to(q.dtype)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _Plan,
    scale: float,
    workspace: dict | None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Run ``plan``'s padded attention calls; K/V are gathered into ``workspace`` (fresh when None).

    The plain case takes SDPA with the plan's own masks (or none); a window needs the exact mask,
    and soft-capping or sinks the explicit softmax (`_exact_attention`)."""
    num_tokens, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = None if plan.identity else q.new_empty(num_tokens, hq, d)
    if sliding_window is not None and sliding_window >= plan.max_seq_len:
        sliding_window = None
    plain = sliding_window is None and sinks is None and softcap is None
    masks = None if plain else plan.exact_masks(sliding_window, q.device)
    for gi, g in enumerate(plan.groups):
        # [num_seqs * nblocks, block_size, hkv, d] -> [num_seqs, kv_len, hkv, d] -> heads first.
        if workspace is None:
            k_rows, v_rows = k_cache.index_select(0, g.block_index), v_cache.index_select(0, g.block_index)
        else:
            k_rows = _gather_into(workspace, k_cache, g.block_index, "k")
            v_rows = _gather_into(workspace, v_cache, g.block_index, "v")
        keys = k_rows.view(g.num_seqs, -1, hkv, d)[:, : g.kv_len]
        vals = v_rows.view(g.num_seqs, -1, hkv, d)[:, : g.kv_len]
        if g.q_index is None:
            qg = q[g.row_start : g.row_start + g.num_seqs]
        else:
            qg = q.index_select(0, g.q_index)
        qg = qg.reshape(g.num_seqs, g.max_q, hq, d).transpose(1, 2)
        if masks is None:
            og = F.scaled_dot_product_attention(
                qg,
                keys.transpose(1, 2),
                vals.transpose(1, 2),
                attn_mask=g.mask,
                is_causal=g.causal,
                scale=scale,
                enable_gqa=hq != hkv,
            )  # [num_seqs, hq, max_q, d]
        elif sinks is None and softcap is None:
            og = F.scaled_dot_product_attention(
                qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=masks[gi], scale=scale, enable_gqa=hq != hkv
            )
        else:
            og = _exact_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), masks[gi], scale, sinks, softcap)
        og = og.transpose(1, 2).reshape(g.num_seqs * g.max_q, hq, d)
        if plan.identity:
            return og
        if g.out_valid is not None:
            og = og.index_select(0, g.out_valid)
        assert out is not None  # allocated above whenever the plan is not the identity
        if g.out_rows is None:
            out[g.row_start : g.row_start + g.num_seqs] = og
        else:
            out.index_copy_(0, g.out_rows, og)
    assert out is not None
    return out


def _kept_slots(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """Indices of the slots >= 0, or None when all are (the common case: nothing to drop)."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        return torch.nonzero(slot_mapping >= 0).flatten()
    return None


def _write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    keep: torch.Tensor | None,
) -> None:
    slots = slot_mapping
    if keep is not None:
        slots, key, value = slot_mapping.index_select(0, keep), key.index_select(0, keep), value.index_select(0, keep)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = cos.shape[-1]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        x1.copy_(r1)
        x2.copy_(r2)


# More entries than any model has KV-cache groups: a bound for callers whose steps share buffers.
_MEMO_LIMIT = 64


def _remember(memo: list, step: object, key: object, value: object) -> None:
    """Add ``(step, key, value)`` to ``memo``, first dropping entries of another step (what the
    step's tensors share: a step memoises one entry per KV-cache group)."""
    if memo and (memo[0][0] is not step or len(memo) >= _MEMO_LIMIT):
        memo.clear()
    memo.append((step, key, value))


class TorchOpsState:
    """The torch ops of one executor, with their per-step memos and reusable buffers.

    Every layer of a step passes the same `AttentionMetadata`, ``slot_mapping``, ``positions``
    and cos/sin table objects, so the work derived from them (attention plan, kept slots, cos/sin
    rows) is done by the first layer and reused. Each memo holds its key objects (not their ids),
    so a stale hit is impossible. The K/V gather buffers persist across steps: a fresh multi-MB
    tensor per layer costs page faults on CPU. Not thread-safe by itself: an executor runs one
    step at a time, and each executor has its own state.
    """

    __slots__ = ("_plans", "_workspace", "_keeps", "_rope_key", "_rope")

    def __init__(self) -> None:
        # (metadata, its plan) and (slot mapping, its kept slots) of the step: one each, or one
        # per KV-cache group of a hybrid model (each group has its own tables and slots).
        self._plans: list[tuple[torch.Tensor, AttentionMetadata, _Plan]] = []
        self._workspace: dict[tuple[str, torch.device, torch.dtype, bool], torch.Tensor] = {}
        self._keeps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._rope_key: torch.Tensor | None = None
        # (table, cos, sin) of each cos/sin table used with the step's positions (layer types
        # with their own rotary, such as Gemma 3's local and global layers, have one each).
        self._rope: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`paged_attention`, with the step's plan (and its masks) built once and gathers into
        reused buffers."""
        plan = next((p for _, m, p in self._plans if m is meta), None)
        if plan is None:
            plan = _build_plan(meta, k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3], q.device)
            _remember(self._plans, meta.query_start_loc, meta, plan)  # the groups' metadata share it
        return _attend(q, k_cache, v_cache, plan, scale, self._workspace, sliding_window, sinks, softcap)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """`write_kv`, with the step's kept slots found once."""
        found = [kept for _, slots, kept in self._keeps if slots is slot_mapping]
        keep = found[0] if found else _kept_slots(slot_mapping)
        if not found:  # the groups' slot mappings are rows of one tensor
            base = slot_mapping._base
            _remember(self._keeps, slot_mapping if base is None else base, slot_mapping, keep)
        _write_kv(key, value, k_cache, v_cache, slot_mapping, keep)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
        """`rotary`, with the step's cos/sin rows gathered once per table."""
        if self._rope_key is not positions:
            self._rope_key, self._rope = positions, []
        for table, cos, sin in self._rope:
            if table is cos_sin_cache:
                _rotate(q, k, cos, sin)
                return
        cos, sin = _cos_sin(positions, cos_sin_cache)
        self._rope.append((cos_sin_cache, cos, sin))
        _rotate(q, k, cos, sin)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached K/V (see `executor.ops`).

    Stateless: plans the batch on every call (`TorchOpsState.paged_attention` memoises it).
    """
    plan = _build_plan(meta, k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3], q.device)
    return _attend(q, k_cache, v_cache, plan, scale, None, sliding_window, sinks, softcap)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping`` (skip < 0)."""
    _write_kv(key, value, k_cache, v_cache, slot_mapping, _kept_slots(slot_mapping))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally of ``x + residual`` (returned as the new residual)."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    # Low precision: normalise in fp32, then scale in the model dtype (as transformers does).
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight, x


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Neox-style rotary embedding of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place."""
    _rotate(q, k, *_cos_sin(positions, cos_sin_cache))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``."""
    inter = x.shape[-1] // 2
    out = F.silu(x[..., :inter])
    return out.mul_(x[..., inter:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :I], approximate="tanh") * x[:, I:]`` (GeGLU, Gemma)."""
    inter = x.shape[-1] // 2
    out = F.gelu(x[..., :inter], approximate="tanh")
    return out.mul_(x[..., inter:])


def make_ops() -> Ops:
    """A new set of torch ops with its own `TorchOpsState` (one per executor)."""
    state = TorchOpsState()
    return Ops(
        name="torch",
        write_kv=state.write_kv,
        paged_attention=state.paged_attention,
        rms_norm=rms_norm,
        rotary=state.rotary,
        silu_and_mul=silu_and_mul,
        gelu_tanh_and_mul=gelu_tanh_and_mul,
        fused_moe=fused_moe,
    )
