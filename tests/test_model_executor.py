"""ModelExecutor driven directly with hand-built batches, checked against transformers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.config import CacheConfig, ModelConfig, ParallelConfig
from common.protocol import SchedulerOutput
from common.sampling_params import SamplingParams
from executor.input_batch import Batch
from executor.model_config import load_config, parse_config
from executor.model_executor import ModelExecutor
from executor.ops_torch import write_kv

pytestmark = pytest.mark.model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
COLUMNS = (
    "request_ids input_ids positions slot_mapping query_lens seq_lens block_tables sample output_lens sampling_params".split()
)
BLOCK = 4  # small blocks so every sequence spans several, out of order


@dataclass
class Seq:
    """A sequence whose blocks we hand out ourselves (the scheduler's job in the engine)."""

    rid: str
    tokens: list[int]
    blocks: list[int]
    computed: int = 0
    prompt_len: int = 0
    outputs: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)


def make_executor(path: Path, dtype: str = "float32", num_blocks: int = 64) -> ModelExecutor:
    return ModelExecutor(
        ModelConfig(str(path), dtype=dtype, device="cpu", max_model_len=128),
        ParallelConfig(),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
    )


def step(ex: ModelExecutor, plan: list[tuple[Seq, int]], logprobs: int = 20) -> None:
    """Run one batch: each ``(seq, n)`` computes the seq's next ``n`` tokens."""
    b = SimpleNamespace(**{k: [] for k in COLUMNS})
    for seq, n in plan:
        start = seq.computed
        end = start + n
        assert end <= len(seq.tokens)
        b.request_ids.append(seq.rid)
        b.input_ids += seq.tokens[start:end]
        b.positions += list(range(start, end))
        b.slot_mapping += [seq.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        b.query_lens.append(n)
        b.seq_lens.append(end)
        b.block_tables.append(seq.blocks[: -(-end // BLOCK)])
        b.sample.append(end == len(seq.tokens))
        b.output_lens.append(len(seq.outputs))
        b.sampling_params.append(SamplingParams(temperature=0.0, logprobs=logprobs))
    batch = Batch(**vars(b))
    batch.check()
    out = ex.execute_batch(batch)
    for i, (seq, n) in enumerate(plan):
        seq.computed += n
        if batch.sample[i]:
            assert out.token_ids[i] >= 0 and out.logprobs[i] is not None
            seq.outputs.append(out.token_ids[i])
            seq.logprobs.append(out.logprobs[i])
            seq.tokens.append(out.token_ids[i])
        else:
            assert out.token_ids[i] == -1 and out.logprobs[i] is None


def hf_logprobs(path: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_against(seq: Seq, ref: torch.Tensor, atol: float) -> None:
    """Every sampled step's logprobs equal the reference at the position that produced it."""
    for j, (tok, lps) in enumerate(zip(seq.outputs, seq.logprobs)):
        pos = seq.prompt_len - 1 + j
        assert tok == int(ref[pos].argmax()), f"{seq.rid}: greedy token {j} differs"
        assert len(lps) == 20
        for t, lp in lps.items():
            assert abs(lp - float(ref[pos, t])) < atol, (seq.rid, j, t, lp, float(ref[pos, t]))


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batches_match_transformers(tiny_model, arch: str) -> None:
    """Full prefills, chunked prefills and decodes mixed in one batch all match HF's forward."""
    path = tiny_model(arch)
    ex = make_executor(path)
    a = Seq("a", prompt(1, 21), [5, 2, 9, 14, 30, 31, 7, 8, 40])
    b = Seq("b", prompt(2, 30), [1, 17, 3, 11, 12, 13, 19, 20, 21, 22, 23])
    c = Seq("c", prompt(3, 6), [4, 25, 26, 27])
    d = Seq("d", prompt(4, 21), [41, 42, 43, 44, 45, 46, 47])
    for s in (a, b, c, d):
        s.prompt_len = len(s.tokens)
    step(ex, [(a, 21), (b, 10), (d, 21)])  # a, d: whole prompts; b: first chunk, not sampled
    step(ex, [(b, 13), (a, 1), (c, 6)])  # b: middle chunk (cached prefix); decode after prefills
    step(ex, [(a, 1), (b, 7), (c, 1)])  # b: last chunk, sampled; decodes not contiguous
    for _ in range(6):
        step(ex, [(c, 1), (a, 1), (b, 1)])  # decodes of different lengths (masking)
    step(ex, [(d, 1)])
    for s in (a, b, c, d):
        check_against(s, hf_logprobs(path, s.tokens), atol=2e-4)


def test_chunked_equals_one_shot(tiny_model) -> None:
    """Prefill in chunks + decodes gives the same logprobs as a one-shot prefill + decodes."""
    path = tiny_model("llama")
    ex = make_executor(path)
    one = Seq("one", prompt(7, 26), list(range(1, 12)))
    chunked = Seq("chunked", prompt(7, 26), list(range(20, 31))[::-1])
    step(ex, [(one, 26)])
    for n in (5, 9, 1, 11):
        step(ex, [(chunked, n)])
    for _ in range(5):
        step(ex, [(one, 1), (chunked, 1)])
    assert one.outputs == chunked.outputs
    for x, y in zip(one.logprobs, chunked.logprobs):
        assert x.keys() == y.keys()
        assert max(abs(x[t] - y[t]) for t in x) < 5e-5, max(abs(x[t] - y[t]) for t in x)


def test_kv_pool_too_small_names_both_numbers(tiny_model) -> None:
    path = tiny_model("llama")
    with pytest.raises(ValueError, match=r"hold 48 tokens.*max_model_len=100"):
        ModelExecutor(ModelConfig(str(path), max_model_len=100), ParallelConfig(), CacheConfig(block_size=16, num_blocks=3))
    with pytest.raises(ValueError, match=r"hold 16 tokens.*max_model_len=2048.*10000 bytes"):
        ModelExecutor(ModelConfig(str(path)), ParallelConfig(), CacheConfig(kv_cache_memory=10_000))


def test_max_model_len_beyond_positions_is_refused(tiny_model) -> None:
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="max_position_embeddings=2048"):
        ModelExecutor(ModelConfig(str(path), max_model_len=4096), ParallelConfig(), CacheConfig(num_blocks=512))


def test_info(tiny_model) -> None:
    path = tiny_model("qwen3")
    ex = make_executor(path)
    gen = json.loads((path / "generation_config.json").read_text())
    assert ex.info.model_name == path.name
    assert ex.info.eos_token_ids == gen["eos_token_id"] and len(ex.info.eos_token_ids) == 2
    assert ex.info.vocab_size == json.loads((path / "config.json").read_text())["vocab_size"]
    assert (ex.info.num_blocks, ex.info.block_size, ex.info.max_model_len) == (64, BLOCK, 128)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_runs_on_cpu(tiny_model, dtype: str) -> None:
    path = tiny_model("qwen2")
    ex = make_executor(path, dtype=dtype)
    s = Seq("s", prompt(5, 17), list(range(1, 12)))
    s.prompt_len = 17
    step(ex, [(s, 10)])
    step(ex, [(s, 7)])
    for _ in range(3):
        step(ex, [(s, 1)])
    assert ex.kv_caches[0][0].dtype == getattr(torch, dtype)
    assert all(all(math.isfinite(v) and v <= 0 for v in lps.values()) for lps in s.logprobs)
    # Low precision stays close to fp32 on the first (prefill) step.
    ref = hf_logprobs(path, s.tokens)
    top = s.outputs[0]
    assert abs(s.logprobs[0][top] - float(ref[16, top])) < 0.3


def test_transformers5_rope_parameters_are_parsed(tiny_model) -> None:
    """``rope_parameters`` (transformers 5) and ``rope_theta``/``rope_scaling`` give one config."""
    path = tiny_model("llama")
    classic = json.loads((path / "config.json").read_text())
    v5 = dict(classic)
    scaling = v5.pop("rope_scaling")
    v5["rope_parameters"] = {**scaling, "rope_theta": v5.pop("rope_theta")}
    assert parse_config(classic) == parse_config(v5)
    assert parse_config(v5).rope_scaling["rope_type"] == "llama3"
    plain = dict(classic, rope_scaling=None)
    plain_v5 = {k: v for k, v in plain.items() if k not in ("rope_scaling", "rope_theta")}
    plain_v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert parse_config(plain_v5) == parse_config(plain) and parse_config(plain).rope_scaling is None
    assert load_config(path).eos_token_ids == json.loads((path / "generation_config.json").read_text())["eos_token_id"]


def test_write_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    key = torch.arange(12, dtype=torch.float32).view(3, 1, 4) + 1
    # Slot 3 is not the last slot, so a -1 wrapping around to slot 5 would show up there.
    write_kv(key, -key, k_cache, v_cache, torch.tensor([3, -1, 0]))
    flat_k, flat_v = k_cache.view(6, 4), v_cache.view(6, 4)
    assert torch.equal(flat_k[3], key[0, 0]) and torch.equal(flat_k[0], key[2, 0])
    assert torch.equal(flat_v[3], -key[0, 0])
    assert int((flat_k != 0).any(dim=1).sum()) == 2


def naive_attention(q, k_cache, v_cache, q_lens, s_lens, tables, scale):
    """Per-sequence reference: gather keys token by token, repeat KV heads, causal softmax."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    rep = q.shape[1] // hkv
    outs, start = [], 0
    for ql, sl, table in zip(q_lens, s_lens, tables):
        slots = [table[p // bs] * bs + p % bs for p in range(sl)]
        k = k_cache.view(-1, hkv, k_cache.shape[3])[slots].repeat_interleave(rep, dim=1)
        v = v_cache.view(-1, hkv, v_cache.shape[3])[slots].repeat_interleave(rep, dim=1)
        qs = q[start : start + ql]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(sl - ql, sl)[:, None]
        scores = scores.masked_fill(torch.arange(sl)[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize("split", [False, True], ids=["call-cost", "no-call-cost"])
@pytest.mark.parametrize("seed", range(20))
def test_paged_attention_random_mixed_batches(seed: int, split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random mixes of decodes, whole prompts and chunks with cached prefixes (grouping/padding).

    With a call's fixed cost counted, these narrow heads mostly share one padded call per kind;
    without it (``split``), sequences split into many groups, as a wide model's would."""
    from executor import ops_torch
    from executor.attention_metadata import AttentionMetadata
    from executor.ops_torch import paged_attention

    if split:
        monkeypatch.setattr(ops_torch, "_CALL_COST_ELEMENTS", 0)

    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs, nblocks = 6, 2, 8, 4, 200
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g)
    n = int(torch.randint(1, 24, (1,), generator=g))
    q_lens, s_lens, tables = [], [], []
    free = torch.randperm(nblocks, generator=g).tolist()
    for _ in range(n):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        sl = int(torch.randint(1, 40, (1,), generator=g))
        ql = 1 if kind == 0 else sl if kind == 1 else int(torch.randint(1, sl + 1, (1,), generator=g))
        q_lens.append(ql)
        s_lens.append(sl)
        tables.append([free.pop() for _ in range(-(-sl // bs))])
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
        query_lens_list=q_lens,
        seq_lens_list=s_lens,
    )
    got = paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    want = naive_attention(q, k_cache, v_cache, q_lens, s_lens, tables, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_staggered_decodes_share_one_masked_call() -> None:
    """A decode batch whose requests started at different steps (every server's case) is planned
    as one call over the batch's rows, masked past each sequence's length; in lockstep, unmasked."""
    from executor.attention_metadata import AttentionMetadata
    from executor.ops_torch import _build_plan, _Plan

    def plan(s_lens: list[int]) -> tuple[_Plan, torch.Tensor]:
        n, bs = len(s_lens), 16
        tables = torch.arange(n * 8, dtype=torch.int32).view(n, 8)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.tensor(s_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.zeros(n, dtype=torch.int64),
            max_query_len=1,
            max_seq_len=max(s_lens),
            query_lens_list=[1] * n,
            seq_lens_list=s_lens,
        )
        return _build_plan(meta, bs, 2 * 16, torch.device("cpu")), tables

    s_lens = [100, 93, 107, 98, 101, 95, 104, 99]
    p, tables = plan(s_lens)
    assert p.identity and len(p.groups) == 1
    g = p.groups[0]
    assert g.kv_len == 107 and g.q_index is None and g.out_rows is None
    assert torch.equal(g.block_index, tables[:, :7].reshape(-1).long())
    assert g.mask is not None and g.mask.shape == (8, 1, 1, 107)
    assert g.mask[:, 0, 0].sum(1).tolist() == s_lens
    assert plan([100] * 8)[0].groups[0].mask is None


def test_min_tokens_bans_eos_and_bad_ids_are_refused(tiny_model) -> None:
    ex = make_executor(tiny_model("llama"))
    eos = ex.info.eos_token_ids
    # The tiny models almost never pick EOS, so check which tokens get banned (the sampler test
    # checks that banned tokens are never drawn).

    def banned(params: SamplingParams, output_len: int) -> list[list[int]] | None:
        out = SchedulerOutput(step=1, finished_req_ids=["r"])
        out.add_new("r", params, 1, [5], [0])
        ex.input_batch.prepare(out)
        batch = Batch(request_ids=["r"], sampling_params=[params], output_lens=[output_len])
        return ex._constraints(batch, [0], [params], [output_len])[0]

    assert banned(SamplingParams(min_tokens=3, stop_token_ids=[7]), 1) == [[7, *eos]]
    assert banned(SamplingParams(min_tokens=3, ignore_eos=True), 1) is None
    assert banned(SamplingParams(min_tokens=3), 3) is None
    b = Batch(
        request_ids=["x"],
        input_ids=[ex.info.vocab_size],
        positions=[0],
        slot_mapping=[4],
        query_lens=[1],
        seq_lens=[1],
        block_tables=[[1]],
        sample=[True],
        output_lens=[0],
        sampling_params=[SamplingParams()],
    )
    with pytest.raises(ValueError, match="token ids must be in"):
        ex.execute_batch(b)


@pytest.mark.parametrize(
    "arch, biases",
    [("llama", dict(mlp_bias=True)), ("llama", dict(mlp_bias=True, attention_bias=True)), ("qwen3", dict(attention_bias=True))],
)
def test_bias_checkpoints_match_transformers(tmp_path, arch: str, biases: dict) -> None:
    """Llama ``mlp_bias``/``attention_bias`` and Qwen3 ``attention_bias``: the biases are loaded and used."""
    from transformers import AutoModelForCausalLM

    from executor.loader import read_state_dict
    from executor.make_model import make_model

    path = make_model(arch, "tiny", 0, tmp_path / "m", **biases)
    sd = read_state_dict(path)
    bias_names = [n for n in sd if n.endswith(".bias")]
    per_layer = 3 * biases.get("mlp_bias", False) + 4 * biases.get("attention_bias", False)
    assert len(bias_names) == 2 * per_layer
    # transformers reads exactly these tensors too (none missing or unexpected), and they matter:
    # zeroing them moves its logits, so the parity below is not vacuous.
    hf, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([prompt(10, 8)])
    with torch.no_grad():
        ref = hf(ids).logits
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
        assert (hf(ids).logits - ref).abs().max() > 0.1

    ex = make_executor(path)
    a = Seq("a", prompt(11, 19), [3, 9, 1, 7, 20, 21, 22])
    b = Seq("b", prompt(12, 9), [5, 2, 30, 31, 32])
    for s in (a, b):
        s.prompt_len = len(s.tokens)
    step(ex, [(a, 12), (b, 9)])
    step(ex, [(a, 7), (b, 1)])
    for _ in range(5):
        step(ex, [(b, 1), (a, 1)])
    for s in (a, b):
        check_against(s, hf_logprobs(path, s.tokens), atol=2e-4)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with its tensors and config passed through ``edit``."""
    import shutil

    from safetensors.torch import save_file

    from executor.loader import read_state_dict

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    sd = read_state_dict(src)
    cfg = json.loads((src / "config.json").read_text())
    edit(sd, cfg)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unused_checkpoint_tensors_are_refused(tiny_model, tmp_path) -> None:
    """A tensor the model would not read is an error naming it, never silently dropped."""
    llama = tiny_model("llama")

    def extra(sd, cfg):
        sd["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    with pytest.raises(ValueError, match=r"does not use: 'model\.layers\.1\.mlp\.extra_proj\.weight'"):
        make_executor(_rewrite(llama, tmp_path / "extra", extra))

    # Biases in the weights that the config does not announce (mlp_bias false): all named.
    def undeclared_bias(sd, cfg):
        for i in range(cfg["num_hidden_layers"]):
            sd[f"model.layers.{i}.mlp.down_proj.bias"] = torch.zeros(cfg["hidden_size"])

    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.bias', 'model\.layers\.1\.mlp\.down_proj\.bias'"):
        make_executor(_rewrite(llama, tmp_path / "undeclared", undeclared_bias))

    # The reverse: the config announces biases the weights lack.
    def missing_bias(sd, cfg):
        cfg["mlp_bias"] = True

    with pytest.raises(ValueError, match=r"missing tensor\(s\).*'model\.layers\.0\.mlp\.down_proj\.bias'"):
        make_executor(_rewrite(llama, tmp_path / "missing", missing_bias))

    # Mistral builds no biases whatever attention_bias says, so its bias tensors are unused.
    def mistral_bias(sd, cfg):
        cfg["attention_bias"] = True
        sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(cfg["num_attention_heads"] * cfg["head_dim"])

    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        make_executor(_rewrite(tiny_model("mistral"), tmp_path / "mistral", mistral_bias))

    def wrong_shape(sd, cfg):
        sd["model.norm.weight"] = sd["model.norm.weight"][:-1]

    with pytest.raises(ValueError, match=r"model\.norm\.weight: \(63,\), expected \(64,\)"):
        make_executor(_rewrite(llama, tmp_path / "shape", wrong_shape))


def test_rotary_buffers_and_tied_head_copies_are_accepted(tiny_model, tmp_path) -> None:
    """Deliberate exceptions: rotary inv_freq buffers (recomputed) and an exact copy of a tied head."""
    qwen2 = tiny_model("qwen2")  # tied embeddings
    tokens = prompt(21, 12)

    def first_token(path: Path) -> int:
        s = Seq("s", list(tokens), [1, 2, 3, 4])
        step(make_executor(path), [(s, len(tokens))])
        return s.outputs[0]

    want = first_token(qwen2)

    def buffers_and_copy(sd, cfg):
        d = cfg["head_dim"]
        for i in range(cfg["num_hidden_layers"]):
            sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()

    assert first_token(_rewrite(qwen2, tmp_path / "ok", buffers_and_copy)) == want

    def different_head(sd, cfg):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"] * 2

    with pytest.raises(ValueError, match=r"lm_head\.weight that differs.*tie_word_embeddings"):
        make_executor(_rewrite(qwen2, tmp_path / "bad", different_head))

    # Untied (llama) without lm_head: missing, not silently tied.
    def no_head(sd, cfg):
        del sd["lm_head.weight"]

    with pytest.raises(ValueError, match=r"missing tensor\(s\).*'lm_head\.weight'"):
        make_executor(_rewrite(tiny_model("llama"), tmp_path / "nohead", no_head))
