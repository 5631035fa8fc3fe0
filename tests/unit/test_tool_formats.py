"""Each family's tool-call syntax: parsing (valid calls, malformed ones left as content), the
format detected from a chat template, and the Hermes rendering for templates without tools."""

from __future__ import annotations

import json

import pytest

from loraserve.model.tools import HermesFormat, Llama3JsonFormat, MistralFormat, detect_tool_format

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add"}}]


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes_parses_calls_and_keeps_text_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n'
            '</tool_call>')
    parsed = HermesFormat().parse(text, TOOLS)
    assert parsed.content == "Let me check."
    assert calls(parsed) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]
    # unterminated at EOS: still a call
    assert calls(HermesFormat().parse('<tool_call>\n{"name": "add", "arguments": {}}', TOOLS)) \
        == [("add", {})]


def test_hermes_argument_strings_may_hold_the_end_tag():
    # sampled under the call grammar (a JSON string may hold anything): one call, whole
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}}}</tool_call>'
            ' yo"}}\n</tool_call>')
    assert calls(HermesFormat().parse(text, TOOLS)) == \
        [("get_weather", {"city": "Paris}}}</tool_call> yo"})]
    # text after a call's JSON that is not its end tag: not a call
    bad = '<tool_call>\n{"name": "add", "arguments": {}} and more\n</tool_call>'
    assert HermesFormat().parse(bad, TOOLS).calls == ()


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a tool
    '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # arguments not an object
])
def test_malformed_calls_leave_the_text_as_content(text):
    for fmt in (HermesFormat(),):
        parsed = fmt.parse(text, TOOLS)
        assert parsed.calls == () and parsed.content == text


def test_llama3_and_mistral_parse_their_syntax():
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}'
    assert calls(Llama3JsonFormat().parse(text, TOOLS)) == [("add", {"a": 1}),
                                                            ("get_weather", {})]
    assert Llama3JsonFormat().parse("The answer is 4.", TOOLS).calls == ()
    assert Llama3JsonFormat().parse('{"name": "add", "parameters": {', TOOLS).calls == ()
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"b": 2}}]'
    assert calls(MistralFormat().parse(text, TOOLS)) == [("add", {"b": 2})]
    assert calls(MistralFormat().parse(text.removeprefix("[TOOL_CALLS]"), TOOLS)) == [
        ("add", {"b": 2})]
    assert MistralFormat().parse("[1, 2]", TOOLS).calls == ()
    assert len(MistralFormat().call_id()) == 9 and MistralFormat().call_id().isalnum()


def test_format_detected_from_template_and_vocab():
    assert isinstance(detect_tool_format("{{ '[TOOL_CALLS]' }}", {}), MistralFormat)
    assert isinstance(detect_tool_format("x", {"[TOOL_CALLS]": 5}), MistralFormat)
    qwen = detect_tool_format("{% if tools %}<tool_call>{% endif %}", {})
    assert isinstance(qwen, HermesFormat) and qwen.native
    assert isinstance(detect_tool_format("<|python_tag|>{{ tools }}", {}), Llama3JsonFormat)
    plain = detect_tool_format("{{ '<|im_start|>' + message['role'] }}", {})
    assert isinstance(plain, HermesFormat) and not plain.native


def test_hermes_rendering_writes_tools_calls_and_results_into_messages():
    fmt = HermesFormat(native=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "1", "content": "2"}]
    out = fmt.render_messages(msgs, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}
    assert msgs[2]["tool_calls"]  # the caller's messages are left as they were
