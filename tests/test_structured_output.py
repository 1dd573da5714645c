"""Structured output (response_format) on the demo model, whose random weights make the grammar alone
responsible for valid JSON; and the grammar built from a checkpoint's tokenizer.json."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from cairn.engine.llm import LLM
from cairn.engine.outputs import accumulate
from cairn.errors import SamplingError
from cairn.request.grammar import BudgetedGrammar, GrammarCompiler, allowed_masks
from cairn.request.sampling_params import SamplingParams, StructuredOutput
from cairn.request.tokenizer import HFTokenizer
from tests.checkpoints import write_tokenizer

PROMPT = list(range(40, 70))
# schemas that bound the output's length: a small one for the model runs, a richer one for the grammar alone
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_gib=0.02, state_cache_gib=0.02, page_size=8, max_num_seqs=4)


def constrained(schema: dict | None, **kw) -> SamplingParams:
    spec = StructuredOutput("json_object") if schema is None else StructuredOutput("json_schema", json.dumps(schema))
    return SamplingParams(structured=spec, **{"max_tokens": 300, **kw})


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1)])
def test_json_schema_output_parses_and_validates(llm, temperature, seed):
    """Random weights: the grammar alone makes the output valid, and the schema bounds its length."""
    out = llm.generate(PROMPT, constrained(SMALL, temperature=temperature, seed=seed))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SMALL)


def test_constrained_request_beside_unconstrained_ones_leaves_them_unchanged(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate([PROMPT[:20], PROMPT[5:]], free)
    llm.engine.add_request(PROMPT, constrained(SMALL, temperature=1.0, seed=4), request_id="json-neighbour")
    together = llm.generate([PROMPT[:20], PROMPT[5:]], free)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_json_cut_by_max_tokens_finishes_with_length(llm):
    out = llm.generate(PROMPT, constrained(SMALL, max_tokens=6, temperature=0.0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_every_choice_of_n_follows_the_schema(llm):
    outs = llm.generate(PROMPT, constrained(SMALL, temperature=1.0, seed=5, n=2))
    assert [o.index for o in outs] == [0, 1]
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SMALL)


def test_unusable_schema_is_refused_at_add_request(llm):
    with pytest.raises(SamplingError):
        llm.engine.add_request(PROMPT, constrained({"type": "no-such-type"}))
    with pytest.raises(SamplingError):
        llm.engine.add_request(PROMPT, SamplingParams(structured=StructuredOutput("json_schema", "{not json")))


def test_grammar_from_a_checkpoint_tokenizer_forces_valid_json(tmp_path):
    """The HF tokenizer path (tokenizer.json): drive the grammar with random logits, masked."""
    write_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    vocab = 320  # the tiny checkpoints' embedding rows: more than the tokenizer's 259 tokens
    grammar = GrammarCompiler(tok, vocab).compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    gen = torch.Generator().manual_seed(0)
    ids = []
    while not grammar.done and len(ids) < 300:
        logits = torch.randn(vocab, generator=gen).masked_fill(~allowed_masks([grammar], vocab)[0], float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert token < tok.vocab_size and grammar.accept(token)
        ids.append(token)
    assert grammar.done
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


def test_thinking_budget_in_the_engine_forces_the_end_in_every_choice(llm):
    """The output starts inside a reasoning block: after 5 tokens `</think>` is forced, then the JSON."""
    spec = StructuredOutput("json_schema", json.dumps(SMALL), think_end="</think>", think_budget=5)
    outs = llm.generate(PROMPT, SamplingParams(structured=spec, max_tokens=200, temperature=1.0, seed=7, n=2))
    for out in outs:
        assert out.token_ids[5:13] == list(b"</think>") and out.finish_reason == "stop", out.text
        reasoning, answer = out.text.split("</think>", 1)
        jsonschema.validate(json.loads(answer.strip("\n")), SMALL)
    assert outs[0].token_ids[:5] != outs[1].token_ids[:5]  # the choices are sampled apart


def test_reasoning_without_a_budget_runs_until_the_model_ends_it(llm):
    """response_format while the prompt opened a reasoning block and no thinking budget was given: the
    grammar leaves the reasoning free (the demo model's random weights never write `</think>`), so
    nothing is forced and the output is all reasoning until max_tokens, unlike with a budget."""
    spec = StructuredOutput("json_schema", json.dumps(SMALL), think_end="</think>")
    (out,) = llm.generate(PROMPT, SamplingParams(structured=spec, max_tokens=16, temperature=1.0, seed=7))
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    assert "</think>" not in out.text
    budgeted = replace(spec, think_budget=5)
    (forced,) = llm.generate(PROMPT, SamplingParams(structured=budgeted, max_tokens=16, temperature=1.0, seed=7))
    assert forced.token_ids[:5] == out.token_ids[:5] and forced.token_ids[5:13] == list(b"</think>")


def test_unknown_structured_output_kind_is_refused_at_add_request(llm):
    """The offline API takes any StructuredOutput: a kind the compiler does not know is a SamplingError
    naming the known ones, and nothing is queued."""
    with pytest.raises(SamplingError, match=r"kind 'regex' is not one of \('json_object', 'json_schema'"):
        llm.generate(PROMPT, SamplingParams(structured=StructuredOutput("regex", "a+")))
    assert not llm.engine.has_unfinished()


class FailingMatcher:
    """An llguidance matcher whose method `failing` raises (an llguidance fault); the rest is the real one."""

    def __init__(self, real, failing: str):
        self._real, self._failing = real, failing

    def __getattr__(self, name: str):
        if name == self._failing:
            def fail(*args):
                raise RuntimeError(f"injected: {name}")
            return fail
        return getattr(self._real, name)

    def deep_copy(self) -> FailingMatcher:
        return FailingMatcher(self._real.deep_copy(), self._failing)


def inject_matcher_fault(monkeypatch, engine, failing: str, first_only: bool = False) -> None:
    """The grammars the engine compiles next get matchers whose `failing` method raises (with
    first_only: only the next one)."""
    original = engine.grammars.compile

    def compile(spec):
        grammar = original(spec)
        if first_only:
            monkeypatch.setattr(engine.grammars, "compile", original)
        for g in (grammar._thinking, grammar._forced) if isinstance(grammar, BudgetedGrammar) else (grammar,):
            g._matcher = FailingMatcher(g._matcher, failing)
        return grammar
    monkeypatch.setattr(engine.grammars, "compile", compile)


def finish_all(engine) -> dict:
    answers = {}
    while engine.has_unfinished():
        for out in engine.step():
            accumulate(answers, out)
    return answers


@pytest.mark.parametrize("spec", [StructuredOutput("json_schema", json.dumps(SMALL)),
                                  StructuredOutput("json_schema", json.dumps(SMALL), think_end="</think>",
                                                   think_budget=5)], ids=["plain", "budgeted"])
def test_grammar_refusing_a_token_its_mask_allowed_fails_that_request_alone(llm, monkeypatch, spec):
    """The matcher raises on the sampled token (its mask allowed it): the request finishes with "error"
    naming the refused token, and the request beside it answers as it does alone."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (alone,) = llm.generate(PROMPT[:20], free)
    inject_matcher_fault(monkeypatch, llm.engine, "consume_token")
    llm.engine.add_request(PROMPT, SamplingParams(structured=spec, max_tokens=50, temperature=0.0),
                           request_id="refused")
    llm.engine.add_request(PROMPT[:20], free, request_id="beside")
    answers = finish_all(llm.engine)
    refused = answers[("refused", 0)]
    assert refused.finish_reason == "error" and refused.token_ids == []
    assert re.fullmatch(r"the grammar refused token \d+: .*", refused.error), refused.error
    assert answers[("beside", 0)].token_ids == alone.token_ids


def test_grammar_whose_mask_cannot_be_computed_fails_its_request_alone(llm, monkeypatch, caplog):
    """Computing one grammar's mask raises: the batch's masks are computed one by one, that grammar
    allows nothing, so its request alone fails in sampling; the other constrained request still
    answers valid JSON."""
    inject_matcher_fault(monkeypatch, llm.engine, "unsafe_compute_mask_ptr", first_only=True)
    llm.engine.add_request(PROMPT, constrained(SMALL, temperature=0.0), request_id="maskless")
    llm.engine.add_request(PROMPT[5:], constrained(SMALL, temperature=0.0), request_id="valid")
    with caplog.at_level(logging.ERROR, logger="cairn.grammar"):
        answers = finish_all(llm.engine)
    assert "computing the grammar masks of the batch failed" in caplog.text
    maskless = answers[("maskless", 0)]
    assert maskless.finish_reason == "error" and maskless.error.startswith("no token can be sampled"), maskless.error
    assert answers[("valid", 0)].finish_reason == "stop"
    jsonschema.validate(json.loads(answers[("valid", 0)].text), SMALL)


def test_a_schema_past_llguidances_row_limit_is_refused_at_add_request_in_one_line(llm):
    """600 optional properties compile, then the parser refuses the value's first token: the admitted request
    failed (a 500), its error holding llguidance's whole parser state with the grammar (108 KB at 3,000
    properties). The first mask is computed at compile time now: a SamplingError (a 400), one line."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    with pytest.raises(SamplingError) as refused:
        llm.engine.add_request([5, 6, 7], constrained(schema, max_tokens=8))
    assert str(refused.value).count("\n") == 0 and len(str(refused.value)) < 700, str(refused.value)[:800]
    assert "Current row has" in str(refused.value) and str(refused.value).startswith("response_format")
    assert not llm.engine.has_unfinished()


def test_a_schema_llguidance_cannot_compile_is_refused_in_one_line_without_the_grammar(llm):
    """A schema over llguidance's size limit: its error went on with the grammar's whole source (1.2 MB for
    2,000 properties of 50-value enums) into the 400's message."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(50)]}
                                               for i in range(2000)}}
    with pytest.raises(SamplingError) as refused:
        llm.engine.add_request([5, 6, 7], constrained(schema, max_tokens=8))
    assert str(refused.value).count("\n") == 0 and len(str(refused.value)) < 700, str(refused.value)[:800]
    assert "schema too large" in str(refused.value)
