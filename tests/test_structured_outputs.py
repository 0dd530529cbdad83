"""Structured outputs offline: the spec and its wire form, the executor's grammar plumbing (mask
application, matcher advance and replay, forced EOS) and constrained generation with `LLM` on the
tiny random checkpoint (random weights: the output is arbitrary, but must obey the constraint)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch

from common.sampling_params import SamplingParams, sampling_from_dict, sampling_to_dict
from common.structured_outputs import INITIAL_LEXER_FUEL
from common.structured_outputs import StructuredOutputsParams as S
from executor.grammar import GrammarMask, GrammarStats, StructuredDecoding

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Any:
    from gateway.llm import LLM

    return LLM(str(tiny_model()), num_blocks=256)


def test_spec_validation_and_wire_round_trip() -> None:
    deep = S(json="[" * 200_000)  # a RecursionError in json.loads, which failed every request of a scheduler
    for bad in (S(), S(regex="a", choice=["x"]), S(choice=[]), S(choice=["", "x"]), S(json="{not json"), S(json=[1]), deep):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="^structured_outputs"):
            SamplingParams(structured_outputs=bad).validate()
    params = SamplingParams(max_tokens=5, structured_outputs=S(json=SCHEMA))
    wire = sampling_to_dict(params)
    assert wire["structured_outputs"] == {"json": json.dumps(SCHEMA, separators=(",", ":"))}
    back = sampling_from_dict(wire)
    assert back.structured_outputs is not None and back.structured_outputs.key() == params.structured_outputs.key()  # type: ignore[union-attr]
    assert sampling_from_dict(sampling_to_dict(SamplingParams())).structured_outputs is None
    assert S(regex="a(b").compile_error() is not None
    assert S(grammar="start: foo").compile_error() is not None
    assert S(json={"type": "nonsense"}).compile_error() is not None
    assert S(choice=["x", "y"]).compile_error() is None
    # Token ranges and special tokens need the vocabulary (`grammar_tokenizer`) to be checked.
    assert S(grammar="start: <[99999]>").compile_error() is None


def test_mask_applies_to_its_rows_only() -> None:
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[0, 2] = 1 << 1  # token 65
    done: Any = SimpleNamespace(result=lambda: None)
    out = GrammarMask([1], bitmask, done, torch.arange(32, dtype=torch.int32), GrammarStats()).apply(logits)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed == [5, 65] and torch.equal(out[1, allowed], logits[1, allowed])


def _batch(states: dict[str, Any], spec: S) -> Any:
    ids = list(states)
    return SimpleNamespace(
        request_ids=ids, sample=[True] * len(ids), sampling_params=[SamplingParams(structured_outputs=spec)] * len(ids)
    )


def _allowed(mask: GrammarMask, row: int) -> list[int]:
    mask.wait()
    bits = (mask.bitmask[row][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def test_matcher_advances_replays_and_forces_eos(tiny_model: Any) -> None:
    """Step by step and all at once (a resent request) reach the same mask; a complete grammar
    allows only EOS, and so does one that could not compile."""
    from executor.model_config import load_config

    path = tiny_model()
    cfg = load_config(path)
    decoding = StructuredDecoding(path, cfg.vocab_size, list(cfg.eos_token_ids), torch.device("cpu"))
    tokenizer = decoding.compiler.tokenizer()
    answer = tokenizer.tokenize_str("yes")
    prompt = [1, 2, 3]

    def state(outputs: list[int]) -> Any:
        return SimpleNamespace(num_prompt_tokens=len(prompt), token_ids=prompt + outputs, grammar=None)

    spec = S(choice=["yes", "no"])
    stepped = {"a": state([])}
    for token in answer:
        decoding.start(_batch(stepped, spec), stepped).wait()  # type: ignore[union-attr]
        stepped["a"].token_ids.append(token)
    replayed = {"b": state(list(answer))}
    last = decoding.start(_batch(stepped, spec), stepped)
    fresh = decoding.start(_batch(replayed, spec), replayed)
    assert last is not None and fresh is not None
    assert _allowed(last, 0) == _allowed(fresh, 0) == sorted(cfg.eos_token_ids)
    assert stepped["a"].grammar.matcher.is_accepting()

    broken = {"c": state([])}
    mask = decoding.start(_batch(broken, S(grammar="start: undefined_rule")), broken)
    assert mask is not None
    mask.wait()
    assert broken["c"].grammar.compiled and broken["c"].grammar.matcher is None
    assert _allowed(mask, 0) == sorted(cfg.eos_token_ids)
    decoding.close()


def test_matchers_are_built_with_the_shared_fuel_limit(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's matchers and the gateway's validation use `grammar_limits`: with llguidance's
    default fuel, the first mask of a{1000}{1000}{1000} stalled every request of its step for ~3 s
    on the development VM. That regex still ends its request (EOS only) after its first token."""
    import llguidance

    from executor.model_config import load_config

    limits: list[Any] = []
    real = llguidance.LLMatcher

    class Spy:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            limits.append(kwargs.get("limits"))
            return real(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:  # grammar_from_regex, validate_grammar...
            return getattr(real, name)

        @staticmethod
        def validate_grammar(*args: Any, **kwargs: Any) -> Any:
            limits.append(kwargs.get("limits"))
            return real.validate_grammar(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Spy())
    spec = S(regex="a{1000}{1000}{1000}")
    assert spec.compile_error() is None  # the gateway lets it through: it compiles
    path = tiny_model()
    cfg = load_config(path)
    decoding = StructuredDecoding(path, cfg.vocab_size, list(cfg.eos_token_ids), torch.device("cpu"))
    prompt = [1, 2, 3]
    requests = {"a": SimpleNamespace(num_prompt_tokens=len(prompt), token_ids=list(prompt), grammar=None)}
    first = decoding.start(_batch(requests, spec), requests)
    assert first is not None
    allowed = _allowed(first, 0)
    assert allowed and set(allowed) != set(cfg.eos_token_ids)
    requests["a"].token_ids.append(decoding.compiler.tokenizer().tokenize_str("a")[0])
    after = decoding.start(_batch(requests, spec), requests)
    assert after is not None and _allowed(after, 0) == sorted(cfg.eos_token_ids)
    decoding.close()
    assert len(limits) == 2 and all(lim is not None and lim.initial_lexer_fuel == INITIAL_LEXER_FUEL for lim in limits)


def test_generation_obeys_each_constraint(llm: Any) -> None:
    specs = [
        S(json=SCHEMA),
        S(regex=r"[a-z]{3}-[0-9]{2}"),
        S(choice=["red", "green", "blue"]),
        S(json_object=True),
        S(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'),
    ]
    prompts = ["hello", "def f(", "one two", "import os", "x"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=s) for i, s in enumerate(specs)]
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([*prompts, "plain"], [*params, plain])
    # Every constrained request finished by its grammar (forced EOS), not by max_tokens.
    assert [o.finish_reason for o in outs[:5]] == ["stop"] * 5
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", outs[1].text)
    assert outs[2].text in ("red", "green", "blue")
    assert isinstance(json.loads(outs[3].text), dict)
    assert re.fullmatch(r"x=[0-9]{1,4};", outs[4].text)
    # Compact JSON: no whitespace outside strings.
    assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", outs[0].text))
    # A constrained neighbour leaves the batch's plain request as it is alone.
    assert outs[5].token_ids == llm.generate("plain", plain)[0].token_ids


def test_grammar_ends_the_request_even_with_ignore_eos(llm: Any) -> None:
    spec = S(choice=["alpha", "beta"])
    out = llm.generate("q", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured_outputs=spec))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


def test_bad_grammar_is_rejected_before_queueing(llm: Any) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        llm.generate("q", SamplingParams(structured_outputs=S(regex="a(b")))
    with pytest.raises(ValueError, match="Token range end too large"):  # checked against the vocabulary
        llm.generate("q", SamplingParams(structured_outputs=S(grammar="start: <[99999]>")))
    assert llm.generate("q", SamplingParams(max_tokens=2))[0].finish_reason == "length"  # the engine goes on


def test_grammar_that_slips_through_ends_only_its_request(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar the engine cannot compile (the gateway's check skipped) makes its request end with
    EOS at once; the step and its batch mate go on unchanged."""
    monkeypatch.setattr(S, "compile_error", lambda self, tokenizer=None: None)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    bad = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=S(grammar="start: undefined_rule"))
    broken, ok = llm.generate(["a", "b"], [bad, plain])
    assert broken.finish_reason == "stop" and broken.text == ""
    assert ok.token_ids == llm.generate("b", plain)[0].token_ids and ok.finish_reason == "length"


def test_preempted_requests_keep_their_grammar(tiny_model: Any) -> None:
    """Requests preempted (KV freed, recomputed) mid-output resume their grammar where they were:
    every output still validates."""
    from gateway.llm import LLM

    small = LLM(str(tiny_model()), num_blocks=10, block_size=16, max_model_len=128)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=S(json=SCHEMA)) for i in range(8)]
    outs = small.generate([f"prompt number {i}" for i in range(8)], params)
    assert small.scheduler.num_preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


DEEP_GRAMMARS = """
import json, sys
from common.sampling_params import SamplingParams
from common.structured_outputs import StructuredOutputsParams
from gateway.llm import LLM

lark = "start: r0\\n" + "".join(f'r{i}: "[" r{i + 1} "]"\\n' for i in range(3000)) + 'r3000: "x"\\n'  # 60 KB
defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(1100)}
defs["d1100"] = {"type": "integer"}
schema = {"$ref": "#/$defs/d0", "$defs": defs}
# The gateway's check, then the executor's matcher (its compile and its first steps).
print("checked", StructuredOutputsParams(grammar=lark).compile_error(), StructuredOutputsParams(json=schema).compile_error())
llm = LLM(sys.argv[1], block_size=16)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(grammar=lark)))
print("generated", len(out[0].token_ids), out[0].text[:6].strip("[") == "")
"""


def test_deeply_nested_grammars_compile_instead_of_crashing_the_process(tiny_model: Any, tmp_path: Any) -> None:
    """llguidance compiles recursively: on a default thread stack 1,000 levels of nested rules (a
    70 KB request, well under the size caps) crashed the gateway (SIGSEGV). Run in a process of its
    own, so a regression fails this test instead of ending the test run."""
    import subprocess
    import sys

    script = tmp_path / "deep.py"
    script.write_text(DEEP_GRAMMARS)
    done = subprocess.run([sys.executable, str(script), str(tiny_model())], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked None None" in done.stdout
    assert "generated 6 True" in done.stdout
