"""`conveyor make-model` writes checkpoints transformers loads, with a working tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from executor.loader import checkpoint_files, read_state_dict
from executor.make_model import main as make_model_main

pytestmark = pytest.mark.model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_model_and_tokenizer(tiny_model, arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(arch)
    cfg = json.loads((path / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(model).__name__ == cfg["architectures"][0]
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == cfg["vocab_size"]
    # Whatever tokenizer class transformers picks for the arch, it encodes exactly as tokenizer.json.
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "class A:\n    def f(self, x):  # 42 ünïcode\n        return x ** 2\n"
    assert tok(text).input_ids == raw.encode(text).ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<s><|im_start|>user")
    assert cfg["tie_word_embeddings"] == (arch == "qwen2")
    if arch == "llama":
        assert cfg["rope_scaling"]["rope_type"] == "llama3"
    if arch == "qwen3":
        assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
    # transformers sees exactly the weights we wrote (nothing newly initialised).
    assert not AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)[1]["missing_keys"]
    ours = read_state_dict(path)
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    with torch.no_grad():
        logits = model(torch.tensor([[tok.bos_token_id, 100, 200]])).logits
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_chat_template(tiny_model) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    text = "def main(argv):\n    return 0  # héllo, 日本 ✓"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.bos_token == "<s>"  # BOS added on encode
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # BPE merges actually happened
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(rendered, add_special_tokens=False).input_ids
    assert chat_ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_every_file_is_readable_by_other_users(tiny_model) -> None:
    """A container's non-root user must be able to read a checkpoint made by root (and vice versa)."""
    for path in [*tiny_model().iterdir(), *tiny_model(shards=2).iterdir()]:
        assert path.stat().st_mode & 0o044 == 0o044, f"{path.name} is not readable by group and others"


def test_sharded_checkpoint_matches_single_file(tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    single, sharded = tiny_model("qwen3"), tiny_model("qwen3", shards=3)
    assert len(checkpoint_files(sharded)) == 3 and (sharded / "model.safetensors.index.json").is_file()
    a, b = read_state_dict(single), read_state_dict(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[0, 5, 17, 300, 301]])
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(str(single), dtype=torch.float32)(ids).logits
        lb = AutoModelForCausalLM.from_pretrained(str(sharded), dtype=torch.float32)(ids).logits
    assert torch.equal(la, lb)


def test_cli_and_determinism(tmp_path, capsys) -> None:
    assert make_model_main(["--arch", "mistral", "--size", "tiny", "--seed", "3", "--out", str(tmp_path / "a")]) == 0
    assert "mistral/tiny" in capsys.readouterr().out
    make_model_main(["--arch", "mistral", "--seed", "3", "--out", str(tmp_path / "b")])
    make_model_main(["--arch", "mistral", "--seed", "4", "--out", str(tmp_path / "c")])
    a, b, c = (read_state_dict(tmp_path / x) for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "c" / "tokenizer.json").read_text()


def test_greedy_decoding_is_decisive(tiny_model) -> None:
    """Top-1/top-2 logit gaps over a long greedy run dwarf fp32 error (no near-ties)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model("llama")), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[0, 100, 200, 300]]),
            max_new_tokens=200,
            min_new_tokens=200,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    assert min(gaps) > 1e-3
    assert len(set(out.sequences[0, 4:].tolist())) > 50  # not stuck repeating one token


def test_bias_options_follow_transformers_architectures() -> None:
    """``mlp_bias`` exists only for Llama and ``attention_bias`` for Llama/Qwen3, as in transformers."""
    from executor.make_model import build_config
    from executor.model_config import parse_config

    ids = {"<s>": 0, "</s>": 1, "<pad>": 2}
    cfg = build_config("llama", "tiny", 1024, ids, mlp_bias=True, attention_bias=True)
    assert cfg["mlp_bias"] and cfg["attention_bias"]
    parsed = parse_config(cfg)
    assert parsed.mlp_bias and parsed.attention_bias and parsed.o_bias
    qwen2 = parse_config(build_config("qwen2", "tiny", 1024, ids))
    assert qwen2.attention_bias and not qwen2.o_bias and not qwen2.mlp_bias
    assert not parse_config(build_config("mistral", "tiny", 1024, ids) | {"attention_bias": True}).attention_bias
    with pytest.raises(ValueError, match="mlp_bias"):
        build_config("qwen2", "tiny", 1024, ids, mlp_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        build_config("mistral", "tiny", 1024, ids, attention_bias=True)
