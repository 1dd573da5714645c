"""Reasoning and tool-call parsing of generated text, fed whole and split at every character.

Known generated texts (what Qwen3.5 / Qwen3-Next emit) are injected at the parser level, since the
demo model's random weights never write them: the split into reasoning, content and tool calls must
not depend on how the text arrives in pieces, and a malformed call must come back as content.
"""

from __future__ import annotations

import json

import pytest

from cairn.request.sampling_params import StructuredOutput
from cairn.request.tokenizer import ByteTokenizer
from cairn.server.chat.call_grammar import call_format
from cairn.server.chat.output import ChatPlan, ChatShaper, Constraints, openai_deltas, openai_message, plan_chat
from cairn.server.chat.parsers import ReasoningParser, ToolCallParser, parse_call

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "units": {"type": "object"}}},
         "search": {"type": "object", "properties": {"q": {"type": "string"}}}}
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n</function>\n"
            "</tool_call>")
JSON_CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "cairn <b>"}}\n</tool_call>'


def shape(text: str, plan: ChatPlan, pieces: list[str] | None = None):
    shaper = ChatShaper(plan)
    pieces = pieces if pieces is not None else [text]
    for i, piece in enumerate(pieces):
        shaper.feed(piece, final=i == len(pieces) - 1)
    m = shaper.message
    return m.reasoning, m.content, [(c.name, json.loads(c.arguments)) for c in m.calls], shaper


def every_split(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


PLAN = ChatPlan("qwen3", True, TOOLS)
CASES = {
    "reasoning_then_xml_call": (
        "I should look it up.\n</think>\n\nChecking.\n\n" + XML_CALL,
        ("I should look it up.\n", "Checking.\n\n",
         [("get_weather", {"city": "New York", "days": 3, "units": {"t": "C"}})])),
    "two_calls_json_and_xml": (
        "ok</think>\n\n" + JSON_CALL + "\n\n" + XML_CALL,
        ("ok", "", [("search", {"q": "cairn <b>"}),
                    ("get_weather", {"city": "New York", "days": 3, "units": {"t": "C"}})])),
    "malformed_call_is_content": (
        "hm</think>\nText <tool_call>\n{not json}\n</tool_call> end",
        ("hm", "Text <tool_call>\n{not json}\n</tool_call> end", [])),
    "unknown_function_is_content": (
        "</think>" + '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        ("", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', [])),
    "unfinished_reasoning_is_all_reasoning": ("still thinking </thi", ("still thinking </thi", "", [])),
    "tag_like_text_is_content": ("x</think>a <tool b <tool_cal", ("x", "a <tool b <tool_cal", [])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reasoning_content_and_calls_do_not_depend_on_how_the_text_is_split(name):
    text, (reasoning, content, calls) = CASES[name]
    for pieces in every_split(text):
        got = shape(text, PLAN, pieces)[:3]
        assert got == (reasoning, content, calls), pieces


def test_think_tag_at_the_start_opens_reasoning_when_the_prompt_did_not():
    plan = ChatPlan("qwen3", False, None)
    for pieces in every_split("\n<think>\nplan</think>\n\nanswer <think> kept"):
        assert shape("", plan, pieces)[:2] == ("\nplan", "answer <think> kept")


def test_reasoning_parser_none_keeps_everything_in_content():
    text = "a</think>b" + XML_CALL
    reasoning, content, calls, _ = shape(text, ChatPlan("none", False, None))
    assert (reasoning, content, calls) == ("", text, [])


CUT_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=da"


def test_unterminated_forced_call_is_parsed():
    """A forced call may be cut by max_tokens (length) before its closing tags: the call still comes back,
    with its complete parameters."""
    _, content, calls, _ = shape("", ChatPlan("qwen3", False, TOOLS), [CUT_CALL])
    assert calls == [("get_weather", {"city": "Oslo"})] and content == ""


def test_a_tool_call_cut_by_max_tokens_finishes_with_length():
    """The engine's "length" stays "length" when a call was parsed (the call may be incomplete: a client
    must not run it); only an answer that ended on its own finishes with "tool_calls"."""
    _, _, _, cut = shape("", ChatPlan("qwen3", False, TOOLS), [CUT_CALL])
    assert cut.finish_reason("length") == "length" and cut.finish_reason("abort") == "abort"
    _, _, _, whole = shape("", ChatPlan("qwen3", False, TOOLS), [XML_CALL])
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"


@pytest.mark.parametrize("text", [CUT_CALL, XML_CALL[: XML_CALL.index("</function>")]],
                         ids=["inside_a_parameter", "before_its_closing_function_tag"])
def test_an_answer_that_ended_inside_its_last_call_finishes_with_stop_not_tool_calls(text):
    """A stop string (or the model's end of turn) inside a call ended the answer with "stop": it reported
    "tool_calls", and a client ran a call missing the parameters the stop cut off."""
    _, _, calls, shaper = shape("", ChatPlan("qwen3", False, TOOLS), [text])
    assert calls and calls[0][0] == "get_weather"
    assert shaper.finish_reason("stop") == "stop"


@pytest.mark.parametrize("text", [XML_CALL.removesuffix("</tool_call>"), JSON_CALL.removesuffix("</tool_call>")],
                         ids=["xml", "json"])
def test_a_call_whose_only_missing_part_is_its_closing_tool_call_tag_finishes_with_tool_calls(text):
    """A stop string `</tool_call>` (one call at a time) leaves the call itself whole."""
    _, _, calls, shaper = shape("", ChatPlan("qwen3", False, TOOLS), [text])
    assert len(calls) == 1 and shaper.finish_reason("stop") == "tool_calls"


def test_call_format_follows_the_template():
    assert call_format("... <function=example> ...") == "xml"
    assert call_format('{"name": <function-name>}') == "json"


def test_plan_closes_the_reasoning_the_template_opened_before_a_forced_call():
    tok = ByteTokenizer()
    forced = Constraints(forced={"search": TOOLS["search"]}, one_call=True)
    plan = plan_chat(tok, "qwen3", "qwen3", {"enable_thinking": True}, TOOLS, True, forced)
    assert plan.generation_prefix == "\n</think>\n\n" and not plan.starts_in_reasoning
    assert plan.structured.kind == "lark" and plan.structured.think_end is None
    assert '"<function=search>\\n"' in plan.structured.schema and "get_weather" not in plan.structured.schema
    assert plan_chat(tok, "qwen3", "qwen3", {"enable_thinking": True}, None, True).starts_in_reasoning
    assert not plan_chat(tok, "qwen3", "qwen3", {"enable_thinking": False}, None, True).starts_in_reasoning
    assert plan_chat(tok, "qwen3", "none", {}, TOOLS, True).tools is None


def test_plan_puts_response_format_and_the_budget_after_the_reasoning():
    tok = ByteTokenizer()
    fmt = StructuredOutput("json_object")
    thinking = plan_chat(tok, "qwen3", "qwen3", {"enable_thinking": True}, None, True, Constraints(response_format=fmt))
    assert thinking.structured == StructuredOutput("json_object", think_end="</think>")
    plain = plan_chat(tok, "qwen3", "qwen3", {"enable_thinking": False}, None, True,
                      Constraints(response_format=fmt, think_budget=4))
    assert plain.structured == fmt  # no reasoning block: nothing to bound
    budget = plan_chat(tok, "qwen3", "qwen3", {"enable_thinking": True}, None, True, Constraints(think_budget=4))
    assert budget.structured == StructuredOutput("text", think_end="</think>", think_budget=4)
    assert plan_chat(tok, "none", "qwen3", {"enable_thinking": True}, None, True, Constraints(think_budget=4)) \
        .structured is None  # --reasoning-parser none: no reasoning block to end


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = ChatPlan("qwen3", False, TOOLS, parallel_tool_calls=False)
    assert [c[0] for c in shape(JSON_CALL + XML_CALL, plan)[2]] == ["search"]


def test_xml_values_follow_the_schema_types():
    call = parse_call("<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nsoon\n"
                      "</parameter>\n</function>", TOOLS, True)
    assert json.loads(call.arguments) == {"city": "42", "days": "soon"}


def test_openai_shapes_of_a_message_with_calls():
    _, _, _, shaper = shape("", PLAN, ["r</think>", "hi " + JSON_CALL])
    message = openai_message(shaper.message)
    assert message["content"] == "hi " and message["reasoning_content"] == "r"
    assert message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": "cairn <b>"}'}
    deltas = openai_deltas(shaper.message, 0)
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "search", "arguments": ""}
    assert deltas[3]["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"q": "cairn <b>"}'}}


def test_reasoning_parser_holds_back_only_a_possible_tag():
    p = ReasoningParser(in_reasoning=True)
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("inking") == ("</thinking", "")
    t = ToolCallParser(TOOLS)
    assert t.feed("x <tool_") == ("x ", [])
    assert t.finish() == ("<tool_", [])


def test_odd_tool_schemas_never_break_parsing():
    """Schemas come from the request: whatever their shape, a call parses or stays content, never raises."""
    odd = {"f": {"properties": ["not", "a", "dict"]}, "g": {"properties": {"x": "not a schema"}}, "h": None}
    for name in odd:
        call = parse_call(f"<function={name}>\n<parameter=x>\n1\n</parameter>\n</function>", odd, True)
        assert json.loads(call.arguments) == {"x": 1}


@pytest.mark.parametrize("block", [
    "\n<function=search>\n<parameter=q>\nx\n</parameter>\n",  # closed call without </function>
    '{"name": "search", "arguments": "{oops"}',  # arguments a string that is not JSON
    '{"name": 5, "arguments": {}}',  # a name that is not a string
    '["search", {"q": "x"}]',  # JSON, not an object
    "search(q='x')",  # neither JSON nor XML
])
def test_malformed_call_the_model_writes_stays_content(block):
    text = f"</think>Sure. <tool_call>{block}</tool_call>"
    _, content, calls, _ = shape(text, PLAN)
    assert calls == [] and content == f"Sure. <tool_call>{block}</tool_call>"


def test_call_whose_arguments_are_a_json_string_is_a_call():
    _, content, calls, _ = shape('</think><tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>',
                                 PLAN)
    assert calls == [("search", {"q": "x"})] and content == ""
