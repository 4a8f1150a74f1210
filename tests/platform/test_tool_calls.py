"""Function calling without Ray: what the chat template is given (the tools, the history's calls
with their arguments as objects), and how a constrained answer becomes ``tool_calls``."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from kvharbor.engine.tokenizer import byte_tokenizer
from kvharbor.platform.openai_protocol import ChatRequest, TokenizeRequest
from kvharbor.platform.prompts import Prompts
from kvharbor.platform.tool_calls import (NamedToolChoice, Tool, ToolCall, calls_of, constraint, template_calls,
                                          template_tools, tool_mode)
from tests.conftest import prompt_principal

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# A template of the kind tool-using models ship: the tools up front, calls as JSON objects.
TEMPLATE = ("{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
            "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}")


def rendered(body) -> str:
    """``body``'s prompt through the template above: a chat's as the chat route builds it, a
    /tokenize request's as that route counts it."""
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    prompts = Prompts(tok, 4096)
    if isinstance(body, TokenizeRequest):
        return tok.decode(prompts.chat_ids(body))
    return tok.decode(prompts.fit_chat(body, prompt_principal()).token_ids)


def test_the_template_gets_the_tools_and_the_historys_calls_as_objects():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    text = rendered(ChatRequest(model="m", messages=messages, tools=TOOLS, tool_choice="none"))
    assert text.startswith("TOOLS get_weather\n")
    assert text.endswith("<user>weather?<assistant>CALL get_weather Oslo<tool>rain FOR call_1")
    assert rendered(TokenizeRequest(model="m", messages=messages, tools=TOOLS)) == text   # /tokenize counts the same


def test_answers_become_tool_calls():
    named = calls_of('{"city":"Lima"}', "get_weather")
    assert [c["function"] for c in named] == [{"name": "get_weather", "arguments": '{"city":"Lima"}'}]
    assert calls_of('{"city":"Li', "get_weather")[0]["function"]["arguments"] == '{"city":"Li'   # cut: as it came
    required = calls_of('[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]', "required")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in required] == [("a", {"x": 1}), ("b", {})]
    assert len({c["id"] for c in required}) == 2 and all(c["type"] == "function" for c in required)
    assert calls_of('[{"name":"a","param', "required") is None


def test_a_named_function_constrains_to_its_arguments_and_required_to_a_list_of_calls():
    """The engine's constraint: compact JSON; for a named function its arguments' schema (any
    object when it has none); for "required" at least one call, each naming one of the tools
    with that tool's arguments and nothing else."""
    tools = [Tool.model_validate(t) for t in [*TOOLS, {"type": "function", "function": {"name": "now"}}]]
    assert constraint(tools, "get_weather") == {"json": TOOLS[0]["function"]["parameters"], "disable_any_whitespace": True}
    assert constraint(tools, "now") == {"json": {"type": "object"}, "disable_any_whitespace": True}
    required = constraint(tools, "required")
    assert required["disable_any_whitespace"] is True
    check = jsonschema.Draft202012Validator(required["json"]).is_valid
    assert check([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}])
    for wrong in ([], [{"name": "get_time", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                  [{"name": "now", "parameters": {}, "why": "x"}], [{"name": "now", "parameters": 3}]):
        assert not check(wrong), wrong
    one = jsonschema.Draft202012Validator(constraint(tools, "required", one=True)["json"]).is_valid
    assert one([{"name": "now", "parameters": {}}])
    assert not one([{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}])     # parallel_tool_calls false


def test_which_tool_choices_can_be_served():
    tools = [Tool.model_validate(t) for t in TOOLS]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    assert (tool_mode(tools, "required"), tool_mode(tools, named), tool_mode(tools, "none"), tool_mode(None, None),
            tool_mode(tools, "auto"), tool_mode(tools, None)) == ("required", "get_weather", None, None, "auto", "auto")
    for choice_tools, choice, why in ((None, "auto", "needs tools"), (None, "required", "needs tools"),
                                      (tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}),
                                       "'x', which is not among")):
        with pytest.raises(ValueError, match=why):
            tool_mode(choice_tools, choice)


def test_a_function_name_has_at_most_64_characters():
    assert Tool.model_validate({"type": "function", "function": {"name": "f" * 64}})
    with pytest.raises(ValidationError, match="pattern"):
        Tool.model_validate({"type": "function", "function": {"name": "f" * 65}})


def test_the_template_sees_only_the_fields_sent_and_unparsable_arguments_as_text():
    """A template that asks ``if 'description' in tool.function`` must not see a null one; a
    history call whose arguments are not JSON reaches the template as the text it was."""
    assert template_tools([Tool.model_validate({"type": "function", "function": {"name": "now"}})]) == [
        {"type": "function", "function": {"name": "now"}}]
    call = ToolCall.model_validate({"id": "c", "type": "function", "function": {"name": "now", "arguments": "{cut"}})
    assert template_calls([call])[0]["function"]["arguments"] == "{cut"
