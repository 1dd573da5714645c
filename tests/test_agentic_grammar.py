"""The grammars behind forced tool calls and the thinking budget, driven token by token with random
logits through the mask (as the sampler does): on the demo byte tokenizer and on a checkpoint tokenizer
whose `<tool_call>` / `</think>` are added tokens (llguidance treats those as special tokens)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from cairn.request.grammar import GrammarCompiler, allowed_masks, lark_tag, special_tokens
from cairn.request.sampling_params import StructuredOutput
from cairn.request.tokenizer import ByteTokenizer, HFTokenizer
from cairn.server.chat.call_grammar import calls_grammar
from cairn.server.chat.parsers import ToolCallParser
from tests.test_chat_templates import FIXTURES, write_checkpoint_tokenizer

VOCAB = 320  # the tiny checkpoints' embedding rows: more than either tokenizer's tokens
TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"},
        "at": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 2}},
        "required": ["city", "unit"], "additionalProperties": False},
    "lookup": {"type": "object", "properties": {"q": {"type": "string", "enum": ["alpha", "beta"]}},
               "required": ["q"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def checkpoint_tokenizer(tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_checkpoint_tokenizer(path, (FIXTURES / "qwen3_5_xml_tools.jinja").read_text())
    return HFTokenizer(path)


def compile_calls(tok, fmt: str, parallel: bool, tools: dict = TOOLS):
    lark = calls_grammar(tools, fmt, parallel, lambda text: lark_tag(tok, text))
    return GrammarCompiler(tok, VOCAB).compile(StructuredOutput("lark", lark))


def drive(tok, grammar, seed: int, most: int = 600, prefix: list[int] = ()) -> list[int]:
    """Sample under the grammar's mask from random logits until it is done or end-of-sequence is drawn."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for token in prefix:
        assert allowed_masks([grammar], VOCAB)[0][token] and grammar.accept(token)
        ids.append(token)
    while not grammar.done and len(ids) < most:
        logits = torch.randn(VOCAB, generator=gen).masked_fill(~allowed_masks([grammar], VOCAB)[0], float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token in tok.eos_token_ids:
            break
        assert grammar.accept(token), grammar.error
        ids.append(token)
    return ids


def allowed_text(tok, grammar) -> set[str]:
    return {tok.decode([t]) for t in allowed_masks([grammar], VOCAB)[0].nonzero().flatten().tolist()}


@pytest.mark.parametrize("fmt", ["xml", "json"])
@pytest.mark.parametrize("which", ["demo", "checkpoint"])
def test_forced_calls_parse_and_validate_against_the_tool_schemas(fmt, which, checkpoint_tokenizer):
    tok = ByteTokenizer() if which == "demo" else checkpoint_tokenizer
    for seed in range(4):
        grammar = compile_calls(tok, fmt, parallel=False)
        text = tok.decode(drive(tok, grammar, seed))
        assert grammar.done, text
        parser = ToolCallParser(TOOLS)
        content, calls = parser.feed(text)
        more, last = parser.finish()
        assert content + more == "" and len(calls + last) == 1, text
        (call,) = calls + last
        jsonschema.validate(json.loads(call.arguments), TOOLS[call.name])


@pytest.mark.parametrize("fmt,start", [("xml", "<tool_call>\n<function="), ("json", '<tool_call>\n{"name": "')])
def test_call_grammar_restricts_the_function_name_to_the_tools(fmt, start):
    tok = ByteTokenizer()
    grammar = compile_calls(tok, fmt, parallel=False)
    drive(tok, grammar, 0, prefix=tok.encode(start), most=len(start))
    assert allowed_text(tok, grammar) == {"g", "l"}  # get_weather, lookup


def test_one_call_stops_and_parallel_calls_may_go_on(checkpoint_tokenizer):
    tok = checkpoint_tokenizer
    call = tok.encode('<tool_call>\n{"name": "lookup", "arguments": {"q": "beta"}}\n</tool_call>')
    single = compile_calls(tok, "json", parallel=False)
    drive(tok, single, 0, prefix=call, most=len(call))
    assert single.done
    parallel = compile_calls(tok, "json", parallel=True)
    drive(tok, parallel, 0, prefix=call, most=len(call))
    assert not parallel.done and allowed_text(tok, parallel) == {"\n"} | {tok.decode([e]) for e in tok.eos_token_ids}


def test_tags_that_llguidance_treats_as_special_are_written_as_tokens(checkpoint_tokenizer):
    """An added token like `<tool_call>` is one special token to llguidance: a text literal would never
    match it (the model's own token would be refused), so the grammar names it by id."""
    tok = checkpoint_tokenizer
    ll = GrammarCompiler(tok, VOCAB)._lltokenizer()
    specials = special_tokens(tok)
    added = range(256, tok.vocab_size)  # (below: the 256 byte tokens; the 0xFF byte reads as special)
    assert {t for t in added if ll.is_special_token(t)} == set(specials.values())
    assert lark_tag(tok, "<tool_call>") == f"<[{specials['<tool_call>']}]>"
    assert lark_tag(ByteTokenizer(), "<tool_call>") == '"<tool_call>"'


@pytest.mark.parametrize("which", ["demo", "checkpoint"])
def test_thinking_budget_forces_the_end_then_the_answer_is_free(which, checkpoint_tokenizer):
    tok = ByteTokenizer() if which == "demo" else checkpoint_tokenizer
    compiler = GrammarCompiler(tok, VOCAB)
    grammar = compiler.compile(StructuredOutput("text", think_end="</think>", think_budget=5))
    ids = drive(tok, grammar, 1, most=5)
    end = tok.encode("</think>")
    forced = drive(tok, grammar, 2, most=len(end))
    assert forced == end  # one special token on the checkpoint, eight bytes on the demo
    mask = allowed_masks([grammar], VOCAB)[0]  # the answer: any text, any special token (a call's tags)
    assert all(mask[t] for t in [*tok.encode("a {\n<tool_call>"), *tok.eos_token_ids])
    fork = grammar.fork()
    assert fork.accept(ids[0]) and grammar.accept(ids[0])


def test_thinking_ended_by_the_model_is_not_forced_again(checkpoint_tokenizer):
    tok = checkpoint_tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    spec = StructuredOutput("json_schema", json.dumps(schema), think_end="</think>", think_budget=50)
    grammar = GrammarCompiler(tok, VOCAB).compile(spec)
    text = 'hm</think>\n\n{"ok":true}'
    drive(tok, grammar, 0, prefix=tok.encode(text), most=len(tok.encode(text)))
    assert grammar.done
    eager = GrammarCompiler(tok, VOCAB).compile(spec)
    drive(tok, eager, 0, prefix=tok.encode("hm"), most=2)
    mask = allowed_masks([eager], VOCAB)[0]
    assert not mask[tok.eos_token_ids[0]] and mask.sum() > 200  # free text, but no stop inside the reasoning


@pytest.mark.parametrize("which", ["demo", "checkpoint"])
def test_strict_tools_leave_text_free_until_a_call_starts_then_constrain_it(which, checkpoint_tokenizer):
    """tool_choice auto with strict tools: free text; a `<tool_call>` (text on the demo, a special token on
    the checkpoint) starts a call whose name and arguments are constrained."""
    tok = ByteTokenizer() if which == "demo" else checkpoint_tokenizer
    lark = calls_grammar(TOOLS, "xml", True, lambda text: lark_tag(tok, text), optional=True)
    compiler = GrammarCompiler(tok, VOCAB)
    free = compiler.compile(StructuredOutput("lark", lark))
    assert all(allowed_masks([free], VOCAB)[0][t] for t in [*tok.encode("Hi {<x"), *tok.eos_token_ids])
    grammar = compiler.compile(StructuredOutput("lark", lark))
    start = tok.encode("Let me check. <tool_call>\n<function=")
    drive(tok, grammar, 0, prefix=start, most=len(start))
    assert allowed_text(tok, grammar) == {"g", "l"}
    for seed in range(3):
        grammar = compiler.compile(StructuredOutput("lark", lark))
        text = tok.decode(drive(tok, grammar, seed, prefix=start, most=400))
        parser = ToolCallParser(TOOLS)
        content, calls = parser.feed(text)
        calls += parser.finish()[1]
        assert content.startswith("Let me check. ") and calls, text
        jsonschema.validate(json.loads(calls[0].arguments), TOOLS[calls[0].name])
