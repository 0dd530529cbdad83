"""`conveyor make-model`: write a small random checkpoint of a supported family in Hugging Face format.

The checkpoint is real enough for every consumer: transformers loads it with
``AutoModelForCausalLM``/``AutoTokenizer``, and the engine loads it with its own loader. The
tokenizer is a byte-level BPE trained here on the Python standard library's own source (present
on every machine, so no download). Weights are initialised for *decisive* greedy decoding: the
output head has a large init std, so the typical top-1/top-2 logit gap (~2) dwarfs fp32
rounding error (~1e-5) and two correct implementations agree token for token on all but very
long runs. ``tiny`` is ~0.2M parameters (fast tests); ``small`` ~80-107M (benchmarks); ``1b`` ~1.0B
(the GPU check).

The Llama family's tensors are written here directly; the other families (`HF_ARCHS`) are built
with transformers' own config and model classes and saved with ``save_pretrained``, their
parameters then overwritten by the same seeded, decisive initialisation (`init_hf_params`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import save_file

from executor.make_moe_model import MOE_ARCHS, MOE_GEOMETRY, write_moe_checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

LLAMA_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
HF_ARCHS = ("gemma2", "gemma3", "phi3")
ARCHS = LLAMA_ARCHS + HF_ARCHS + tuple(MOE_ARCHS)
# Sliding window of the families that have one by default (gemma2/gemma3), per size: short
# enough at ``tiny`` that the test prompts run past it.
DEFAULT_WINDOW = {"tiny": 16, "tiny-mqa": 16, "small": 512, "1b": 1024}
# Gemma 2's soft-caps at the sizes here: low enough that they change the outputs of a random model
# (the released 50/30 would not bite at these score and logit scales).
GEMMA2_SOFTCAPS = (2.0, 20.0)
SIZES: tuple[str, ...] = ("tiny", "tiny-mqa", "small", "1b")

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
# transformers maps model_type qwen2 to Qwen2Tokenizer, which rebuilds the tokenizer with this
# unk token and the split regex below; having both already makes every class load it the same.
UNK = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END, UNK]
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Enough text for a few-thousand-token vocabulary; training takes about a second.
CORPUS_CHARS = 2_000_000

# Geometry per size. GQA everywhere (heads != kv heads) so that path is always exercised.
GEOMETRY: dict[str, dict[str, int]] = {
    "tiny": dict(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, max_pos=2048),
    # One KV head: split over 2+ tensor-parallel ranks, it is replicated (executor.parallel).
    "tiny-mqa": dict(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=1, head_dim=16, inter=128, max_pos=2048),
    "small": dict(vocab=8192, hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, inter=2048, max_pos=4096),
    # ~1.0B parameters (Llama 3.2 1B's shape, a smaller vocabulary): the GPU check's end-to-end model.
    "1b": dict(vocab=8192, hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, inter=8192, max_pos=4096),
}

# Output-head std is HEAD_GAIN/sqrt(hidden): logits have std ~HEAD_GAIN, so greedy is decisive.
HEAD_GAIN = 8.0
# Residual-branch outputs (o_proj, down_proj) are amplified so the layers, not the current token's
# own embedding, dominate the residual stream: attention over the context then visibly matters.
OUT_GAIN = 3.0

_TOKENIZER_CACHE: dict[int, str] = {}


def _corpus() -> list[str]:
    """Standard-library ``.py`` files in sorted order, capped at ``CORPUS_CHARS`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= CORPUS_CHARS:
            break
    return texts


def train_tokenizer_json(vocab_size: int) -> str:
    """Train (once per process per size) a byte-level BPE and return its ``tokenizer.json`` text."""
    if vocab_size not in _TOKENIZER_CACHE:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        bos_id = tok.token_to_id(BOS)
        # BOS is added on encode, like Llama tokenizers.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A:0", pair=f"{BOS} $A:0 {BOS} $B:1", special_tokens=[(BOS, bos_id)]
        )
        _TOKENIZER_CACHE[vocab_size] = tok.to_str()
    return _TOKENIZER_CACHE[vocab_size]


def write_tokenizer(out: Path, vocab_size: int, max_len: int) -> dict[str, int]:
    """Write tokenizer files into ``out``; return the special token ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(train_tokenizer_json(vocab_size))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=max_len
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Name a class every transformers version knows and keep the template inline too (older
    # versions do not read chat_template.jinja).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE, add_bos_token=True)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    # Every special token was added to the vocabulary by `train_tokenizer_json`.
    return {name: cast(int, tok.token_to_id(name)) for name in SPECIAL_TOKENS}


def build_config(
    arch: str,
    size: str,
    vocab_size: int,
    ids: dict[str, int],
    mlp_bias: bool = False,
    attention_bias: bool = False,
    sliding_window: int | None = None,
) -> dict:
    """The ``config.json`` contents for ``arch``/``size`` (a Llama-family ``arch``).

    ``mlp_bias`` (Llama only) and ``attention_bias`` (Llama and Qwen3: q/k/v/o biases) add the
    biases transformers builds for those flags; Qwen2 always has q/k/v biases. ``sliding_window``
    (Mistral: every layer; Qwen2/Qwen3: every layer but the first, as ``max_window_layers=1``).
    """
    if sliding_window is not None and arch == "llama":
        raise ValueError("llama has no sliding window")
    if mlp_bias and arch != "llama":
        raise ValueError(f"mlp_bias is a Llama option; {arch} has no MLP biases")
    if attention_bias and arch not in ("llama", "qwen3"):
        raise ValueError(f"attention_bias is a Llama/Qwen3 option, not {arch}'s")
    g = GEOMETRY[size]
    model_type, cls = {
        "llama": ("llama", "LlamaForCausalLM"),
        "qwen2": ("qwen2", "Qwen2ForCausalLM"),
        "qwen3": ("qwen3", "Qwen3ForCausalLM"),
        "mistral": ("mistral", "MistralForCausalLM"),
    }[arch]
    head_dim = g["head_dim"] * 2 if arch == "qwen3" else g["head_dim"]  # qwen3: head_dim != hidden/heads
    cfg: dict = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": g["hidden"],
        "intermediate_size": g["inter"],
        "num_hidden_layers": g["layers"],
        "num_attention_heads": g["heads"],
        "num_key_value_heads": g["kv_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": g["max_pos"],
        "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5,
        "rope_theta": 10000.0 if size.startswith("tiny") else 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": arch == "qwen2",
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
    }
    if arch == "llama":
        # llama3 scaling with an original context short enough that some frequencies are scaled
        # and some smoothed, so the whole code path matters.
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": g["max_pos"] // 8,
        }
        cfg["mlp_bias"] = mlp_bias
    elif arch in ("qwen2", "qwen3"):
        if sliding_window is None:
            cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=g["layers"])
        else:
            cfg.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
    elif arch == "mistral":
        cfg["sliding_window"] = sliding_window
    return cfg


def build_hf_config(
    arch: str, size: str, vocab_size: int, ids: dict[str, int], sliding_window: int | None = None
) -> PretrainedConfig:
    """A transformers config object of a non-Llama ``arch`` (`HF_ARCHS`) at ``size``.

    gemma2: alternating sliding (even) and full layers, soft-capping (`GEMMA2_SOFTCAPS`);
    gemma3: the same alternation (``sliding_window_pattern`` 2), its own local rotary base and
    linear scaling on the global layers; phi3: partial rotary (half of each head), LongRoPE, no
    window unless asked. ``query_pre_attn_scalar`` differs from the head size so the scale matters.
    """
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config

    g = GEOMETRY[size]
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=g["hidden"],
        intermediate_size=g["inter"],
        num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"],
        max_position_embeddings=g["max_pos"],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        dtype="float32",
    )
    window = sliding_window if sliding_window is not None else DEFAULT_WINDOW[size]
    sliding = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(g["layers"])]
    if arch == "gemma2":
        attn_cap, final_cap = GEMMA2_SOFTCAPS
        return Gemma2Config(
            **common,
            head_dim=g["head_dim"],
            query_pre_attn_scalar=g["head_dim"] + 8,
            sliding_window=window,
            layer_types=sliding,
            attn_logit_softcapping=attn_cap,
            final_logit_softcapping=final_cap,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "gemma3":
        return Gemma3TextConfig(
            **common,
            head_dim=g["head_dim"],
            query_pre_attn_scalar=g["head_dim"] + 8,
            sliding_window=window,
            layer_types=sliding,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    if arch == "phi3":
        rot = g["hidden"] // g["heads"] // 2
        factors = [1.0 + 0.25 * i for i in range(rot // 2)]
        return Phi3Config(
            **common,
            original_max_position_embeddings=g["max_pos"] // 2,
            sliding_window=sliding_window,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": factors,
                "long_factor": [2 * f for f in factors],
            },
        )
    raise ValueError(f"unknown arch {arch!r}; expected one of {HF_ARCHS}")


def init_weights(cfg: dict, seed: int, special_ids: list[int]) -> dict[str, torch.Tensor]:
    """Random fp32 weights under Hugging Face parameter names."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qwen2, qwen3 = cfg["model_type"] == "qwen2", cfg["model_type"] == "qwen3"
    attn_bias, mlp_bias = bool(cfg.get("attention_bias")), bool(cfg.get("mlp_bias"))

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        # std gain/sqrt(fan_in): attention scores and MLP outputs are O(1), so every layer matters.
        return normal((out_f, in_f), gain / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        # Not all ones, so a missing norm weight would show up in tests.
        return 1.0 + normal((n,), 0.1)

    # A large output-head std makes greedy decoding decisive (big top-1/top-2 gaps).
    head_std = HEAD_GAIN / math.sqrt(hidden)
    w: dict[str, torch.Tensor] = {}
    embed = normal((vocab, hidden), head_std if cfg["tie_word_embeddings"] else 1.0)
    w["model.embed_tokens.weight"] = embed
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = linear(hq * d, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(hkv * d, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(hkv * d, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, hq * d, OUT_GAIN)
        if qwen2 or attn_bias:
            w[p + "self_attn.q_proj.bias"] = normal((hq * d,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((hkv * d,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((hkv * d,), 0.1)
        if attn_bias:  # Llama/Qwen3: o_proj too (Qwen2 never has one)
            w[p + "self_attn.o_proj.bias"] = normal((hidden,), 0.1)
        if qwen3:
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter, OUT_GAIN)
        if mlp_bias:
            w[p + "mlp.gate_proj.bias"] = normal((inter,), 0.1)
            w[p + "mlp.up_proj.bias"] = normal((inter,), 0.1)
            w[p + "mlp.down_proj.bias"] = normal((hidden,), 0.1)
    # Random signs on the final norm: with tied embeddings the residual stream still holds the
    # current token's embedding E_t, and h.E_t ~ |E_t|^2 would make the model repeat its input.
    signs = torch.randint(0, 2, (hidden,), generator=gen) * 2.0 - 1.0
    w["model.norm.weight"] = norm(hidden) * signs
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((vocab, hidden), head_std)
    # Special tokens get small output rows: greedy decoding then never emits EOS by chance, so
    # generation lengths (and benchmarks) are deterministic; sampling still can, rarely.
    head = w["model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"]
    head[special_ids] *= 0.1
    return {k: v.contiguous() for k, v in w.items()}


def init_hf_params(model: PreTrainedModel, seed: int, special_ids: list[int], gemma_norm: bool) -> None:
    """Overwrite a transformers model's parameters with `init_weights`' seeded, decisive scheme:
    linears ``gain/sqrt(fan_in)`` (residual outputs amplified), norms near one (Gemma's stored as
    the offset from one), biases and sinks small, a large-std output head with small special-token
    rows, and random signs on the final norm."""
    gen = torch.Generator().manual_seed(seed)
    tied = bool(model.config.tie_word_embeddings)
    hidden = model.config.hidden_size
    head_std = HEAD_GAIN / math.sqrt(hidden)
    params = dict(model.named_parameters(remove_duplicate=True))
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("embed_tokens.weight"):
                value = torch.randn(p.shape, generator=gen) * (head_std if tied else 1.0)
            elif name == "lm_head.weight":
                value = torch.randn(p.shape, generator=gen) * head_std
            elif "norm" in name:
                scale = 1.0 + torch.randn(p.shape, generator=gen) * 0.1
                if name == "model.norm.weight":  # see `init_weights`: the head must not echo the input
                    scale = scale * (torch.randint(0, 2, p.shape, generator=gen) * 2.0 - 1.0)
                value = scale - 1.0 if gemma_norm else scale
            elif name.endswith(".bias") or name.endswith("sinks"):
                value = torch.randn(p.shape, generator=gen) * 0.1
            else:
                gain = OUT_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                value = torch.randn(p.shape, generator=gen) * (gain / math.sqrt(p.shape[-1]))
            p.copy_(value)
        head = params["model.embed_tokens.weight" if tied else "lm_head.weight"]
        head[special_ids] *= 0.1


def count_params(weights: dict[str, torch.Tensor]) -> int:
    """Number of parameters in a state dict."""
    return sum(t.numel() for t in weights.values())


def _save(weights: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """`save_file`, then readable by all like the checkpoint's other files: safetensors writes 0600,
    and a service running as another user (a container's non-root user) could not read it."""
    save_file(weights, str(path), metadata=meta)
    path.chmod(0o644)


def save_weights(weights: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """Write one ``model.safetensors`` or ``shards`` files plus ``model.safetensors.index.json``."""
    meta = {"format": "pt"}
    if shards <= 1:
        _save(weights, out / "model.safetensors", meta)
        return
    names = list(weights)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per : (s + 1) * per]}
        _save(part, out / fname, meta)
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_model(
    arch: str,
    size: str = "tiny",
    seed: int = 0,
    out: str | Path | None = None,
    shards: int = 1,
    mlp_bias: bool = False,
    attention_bias: bool = False,
    sliding_window: int | None = None,
) -> Path:
    """Write a random ``arch``/``size`` checkpoint into ``out`` (a new temp dir if None).

    ``mlp_bias``/``attention_bias``/``sliding_window``: see `build_config` and `build_hf_config`
    (off by default for the Llama family, as in its real checkpoints).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    moe = arch in MOE_ARCHS
    sizes = tuple(MOE_GEOMETRY) if moe else SIZES
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for {arch}; expected one of {sizes}")
    if moe and (shards > 1 or mlp_bias or attention_bias or sliding_window is not None):
        raise ValueError(f"{arch} checkpoints are written as `executor.make_moe_model` configures them: no options")
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"conveyor-{arch}-{size}-"))
    out.mkdir(parents=True, exist_ok=True)
    g = MOE_GEOMETRY[size] if moe else GEOMETRY[size]
    ids = write_tokenizer(out, g["vocab"], g["max_pos"])
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_str(train_tokenizer_json(g["vocab"])).get_vocab_size()
    if moe:
        write_moe_checkpoint(arch, size, seed, out, ids, vocab_size)
    elif arch in HF_ARCHS:
        if mlp_bias or attention_bias:
            raise ValueError(f"mlp_bias/attention_bias are Llama-family options, not {arch}'s")
        _save_hf_model(build_hf_config(arch, size, vocab_size, ids, sliding_window), out, seed, list(ids.values()), shards)
    else:
        cfg = build_config(arch, size, vocab_size, ids, mlp_bias, attention_bias, sliding_window)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        save_weights(init_weights(cfg, seed, list(ids.values())), out, shards)
    gen_cfg = {
        "bos_token_id": ids[BOS],
        # A list, as in Llama 3 / Qwen checkpoints: end-of-text and end-of-turn both stop.
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return out


def _save_hf_model(config: PretrainedConfig, out: Path, seed: int, special_ids: list[int], shards: int) -> None:
    """Build ``config``'s transformers model, initialise it (`init_hf_params`) and save it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_hf_params(model, seed, special_ids, gemma_norm=config.model_type.startswith("gemma"))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    max_shard = f"{max(1, size // max(shards, 1) // 1000 + 1)}KB" if shards > 1 else "50GB"
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size=max_shard)
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)  # see `_save`


CACHE_DIR = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor")) / "models"


def cached_model(arch: str = "llama", size: str = "tiny") -> Path:
    """``CACHE_DIR/{size}-{arch}`` (seed 0), made on first use.

    Written to a temporary sibling and renamed, so a concurrent first run never sees half a model.
    """
    out = CACHE_DIR / f"{size}-{arch}"
    if not (out / "config.json").exists():
        print(f"conveyor: making the {size} {arch} checkpoint in {out}", file=sys.stderr)
        tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:6]}")
        make_model(arch, size, 0, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conveyor make-model``."""
    ap = argparse.ArgumentParser(prog="conveyor make-model", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--size", choices=SIZES, default="tiny", help=f"{', '.join(MOE_ARCHS)}: tiny or small only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--mlp-bias", action="store_true", help="biases on gate/up/down (llama)")
    ap.add_argument("--attention-bias", action="store_true", help="biases on q/k/v/o (llama, qwen3)")
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="attention window: mistral (every layer), qwen2/qwen3 (all but the first layer), phi3; "
        "gemma2/gemma3 alternate window and full layers (default window by size)",
    )
    args = ap.parse_args(argv)
    out = make_model(
        args.arch, args.size, args.seed, args.out, args.shards, args.mlp_bias, args.attention_bias, args.sliding_window
    )
    cfg = json.loads((out / "config.json").read_text())
    n = sum(
        math.prod(info["shape"])
        for f in sorted(out.glob("*.safetensors"))
        for info in _header(f).values()
        if isinstance(info, dict) and "shape" in info
    )
    print(f"wrote {args.arch}/{args.size} ({n / 1e6:.1f}M params, vocab {cfg['vocab_size']}) to {out}")
    return 0


def _header(path: Path) -> dict:
    """The JSON header of a safetensors file (for counting parameters without loading)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))
