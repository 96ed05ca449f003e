"""
Request bodies between OpenAI's chat completions and Anthropic's Messages
API (svcd.dialects.requests and svcd.dialects.turns): each field both
ways, what is refused (naming the field), the shapes made checked against
the official SDKs' types, and as properties: a request translated there
and back is the request again, every field having a counterpart.
"""

from __future__ import annotations

from typing import Any

import pytest
from dialectstrategies import (
    anthropicRequests,
    openAIRequests,
    validAnthropicRequest,
    validOpenAIRequest,
)
from hypothesis import given, settings

from svcd.common.errors import ErrorCode
from svcd.dialects.errors import Untranslatable
from svcd.dialects.requests import anthropicRequestOf, chatRequestOf, wantsUsage
from svcd.dialects.turns import INVALID_ARGUMENTS_KEY


def toAnthropic(**fields: Any) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat.update(fields)
    body = anthropicRequestOf(chat, defaultMaxTokens=4096)
    validAnthropicRequest(body)
    return body


def toOpenAI(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    chat = chatRequestOf(body)
    validOpenAIRequest(chat)
    return chat


def refusedToAnthropic(**fields: Any) -> str:
    chat: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat.update(fields)
    with pytest.raises(Untranslatable) as caught:
        anthropicRequestOf(chat, defaultMaxTokens=4096)
    return caught.value.field


def refusedToOpenAI(**fields: Any) -> str:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    with pytest.raises(Untranslatable) as caught:
        chatRequestOf(body)
    return caught.value.field


# Top-level fields, chat completions to Messages.


def test_minimalChatBody() -> None:
    """
    model and messages make a Messages body, with the output cap given
    when the client named none (Anthropic requires one).
    """
    assert toAnthropic() == {
        "model": "m",
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_outputCapToAnthropic() -> None:
    """
    max_completion_tokens, else max_tokens, is max_tokens.
    """
    assert toAnthropic(max_tokens=7)["max_tokens"] == 7
    assert toAnthropic(max_completion_tokens=9, max_tokens=7)["max_tokens"] == 9
    assert toAnthropic(max_completion_tokens=None)["max_tokens"] == 4096


def test_samplingToAnthropic() -> None:
    """
    temperature and top_p are copied as they are.
    """
    body = toAnthropic(temperature=0.5, top_p=1)
    assert (body["temperature"], body["top_p"]) == (0.5, 1)
    assert toAnthropic(temperature=1)["temperature"] == 1


def test_temperatureAboveOneRefused() -> None:
    """
    OpenAI's temperatures above 1 have no counterpart in Anthropic's range
    (0 to 1): refused, not scaled.
    """
    assert refusedToAnthropic(temperature=1.2) == "temperature"
    assert refusedToAnthropic(temperature="hot") == "temperature"


def test_stopToAnthropic() -> None:
    """
    stop, a string or a list, is stop_sequences; an empty list is none.
    """
    assert toAnthropic(stop="END")["stop_sequences"] == ["END"]
    assert toAnthropic(stop=["a", "b"])["stop_sequences"] == ["a", "b"]
    assert "stop_sequences" not in toAnthropic(stop=[])


def test_streamToAnthropic() -> None:
    """
    stream is copied; stream_options is the translator's (include_usage),
    not sent; wantsUsage reads it.
    """
    chat = {"stream": True, "stream_options": {"include_usage": True}}
    body = toAnthropic(**chat)
    assert body["stream"] is True and "stream_options" not in body
    assert wantsUsage(chat) and not wantsUsage({"stream": True})
    assert refusedToAnthropic(stream_options={"other": 1}) == "stream_options.other"


def test_userToMetadata() -> None:
    """
    user, and safety_identifier (its newer name), are metadata.user_id.
    """
    assert toAnthropic(user="u1")["metadata"] == {"user_id": "u1"}
    assert toAnthropic(safety_identifier="u2")["metadata"] == {"user_id": "u2"}
    assert toAnthropic(user="u3", safety_identifier="u3")["metadata"] == {"user_id": "u3"}
    assert refusedToAnthropic(user="a", safety_identifier="b") == "safety_identifier"


def test_neutralValuesAccepted() -> None:
    """
    Fields set to what asks for nothing are accepted and left out; a null
    is an absent field.
    """
    body = toAnthropic(
        n=1,
        logprobs=False,
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
        response_format={"type": "text"},
        modalities=["text"],
        store=False,
        metadata={},
        seed=None,
        top_logprobs=None,
    )
    assert set(body) == {"model", "max_tokens", "messages"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("n", True),
        ("logprobs", True),
        ("top_logprobs", 3),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("logit_bias", {"50256": -100}),
        ("seed", 7),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("reasoning_effort", "high"),
        ("audio", {"voice": "alloy", "format": "mp3"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("service_tier", "flex"),
        ("store", True),
        ("metadata", {"k": "v"}),
        ("web_search_options", {}),
        ("verbosity", "low"),
        ("prompt_cache_key", "k"),
        ("something_new", 1),
    ],
)
def test_noCounterpartInAnthropic(field: str, value: object) -> None:
    """
    A chat field that Anthropic cannot carry is refused, named, and makes
    a 400 VALIDATION_ERROR naming it.
    """
    assert refusedToAnthropic(**{field: value}) == field
    chat = {"model": "m", "messages": [], field: value}
    with pytest.raises(Untranslatable) as caught:
        anthropicRequestOf(chat, defaultMaxTokens=1)
    error = caught.value.apiError()
    assert error.code is ErrorCode.VALIDATION_ERROR and error.status == 400
    assert [each.field for each in error.fieldErrors] == [field]


def test_toolsToAnthropic() -> None:
    """
    A function tool is a tool with an input schema (an empty object schema
    when it has no parameters); strict is kept.
    """
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    assert toAnthropic(tools=tools)["tools"] == [
        {
            "name": "weather",
            "description": "Weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True,
        },
        {"name": "now", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert (
        refusedToAnthropic(tools=[{"type": "custom", "custom": {"name": "x"}}]) == "tools[0].type"
    )
    assert refusedToAnthropic(
        tools=[{"type": "function", "function": {"name": "x", "extra": 1}}]
    ) == ("tools[0].function.extra")


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("auto", None, {"type": "auto"}),
        ("none", None, {"type": "none"}),
        ("required", None, {"type": "any"}),
        ({"type": "function", "function": {"name": "f"}}, None, {"type": "tool", "name": "f"}),
        ("auto", False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", True, {"type": "any", "disable_parallel_tool_use": False}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("none", False, {"type": "none"}),
    ],
)
def test_toolChoiceToAnthropic(
    choice: object, parallel: bool | None, expected: dict[str, Any]
) -> None:
    """
    tool_choice and parallel_tool_calls make Anthropic's tool_choice (its
    disable_parallel_tool_use is the opposite of parallel_tool_calls).
    """
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = toAnthropic(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
    assert body["tool_choice"] == expected


def test_toolChoiceRefusedToAnthropic() -> None:
    """
    An allowed_tools choice, or an unknown one, has no counterpart.
    """
    assert (
        refusedToAnthropic(tool_choice={"type": "allowed_tools", "allowed_tools": {}})
        == "tool_choice.type"
    )
    assert refusedToAnthropic(tool_choice="sometimes") == "tool_choice"
    # parallel_tool_calls without tools asks nothing.
    assert "tool_choice" not in toAnthropic(parallel_tool_calls=False)


# Conversations, chat completions to Messages.


def test_systemAndDeveloperToSystem() -> None:
    """
    One system message of a string is the system string; several (system
    or developer, wherever they stand) are text blocks, in order.
    """
    body = toAnthropic(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert body["system"] == "Be brief."
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    body = toAnthropic(
        messages=[
            {"role": "developer", "content": "A"},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "B"}]},
        ]
    )
    assert body["system"] == [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_imagesToAnthropic() -> None:
    """
    A base64 data: URL is a base64 image source, an http(s) URL a URL
    source; detail is a hint left out. Other media or schemes are refused.
    """
    content = [
        {"type": "text", "text": "What is it?"},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64,iVBORw0K", "detail": "high"},
        },
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
    ]
    body = toAnthropic(messages=[{"role": "user", "content": content}])
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "What is it?"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
    ]
    for url in (
        "data:image/tiff;base64,AAAA",
        "data:image/png,rawbytes",
        "ftp://example.com/x.png",
    ):
        part = {"type": "image_url", "image_url": {"url": url}}
        assert refusedToAnthropic(messages=[{"role": "user", "content": [part]}]) == (
            "messages[0].content[0].image_url.url"
        )
    audio = {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}
    assert (
        refusedToAnthropic(messages=[{"role": "user", "content": [audio]}])
        == "messages[0].content[0].type"
    )


def test_toolCallsAndResultsToAnthropic() -> None:
    """
    An assistant's tool calls are tool_use blocks after its text (ids
    kept, arguments parsed); consecutive tool messages, and the user
    message right after them, are one user turn of tool_result blocks
    first.
    """
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city":"Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9C"}]},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": None, "tool_calls": [], "refusal": None},
    ]
    body = toAnthropic(messages=messages)
    assert body["messages"] == [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "call_1", "name": "w", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "w", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": [{"type": "text", "text": "9C"}],
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
        {"role": "assistant", "content": ""},
    ]


def test_assistantRefusalToAnthropic() -> None:
    """
    An assistant's earlier refusal (a string or refusal parts) is its text.
    """
    body = toAnthropic(
        messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "refusal": "I can't."},
            {"role": "user", "content": "y"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        ]
    )
    assert body["messages"][1]["content"] == [{"type": "text", "text": "I can't."}]
    assert body["messages"][3]["content"] == [{"type": "text", "text": "No."}]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": "x", "name": "bob"}], "messages[0].name"),
        ([{"role": "function", "content": "x", "name": "f"}], "messages[0].role"),
        ([{"role": "assistant", "content": "x", "audio": {"id": "a"}}], "messages[0].audio"),
        (
            [
                {
                    "role": "assistant",
                    "content": "x",
                    "function_call": {"name": "f", "arguments": "{}"},
                }
            ],
            "messages[0].function_call",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "[1]"},
                        }
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}],
            "messages[0].tool_calls[0].type",
        ),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        (
            [{"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url"}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "system", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ("not a list", "messages"),
        ([["not an object"]], "messages[0]"),
    ],
)
def test_conversationRefusedToAnthropic(messages: object, field: str) -> None:
    """
    What a conversation cannot carry to Anthropic, or holds in the wrong
    shape, is refused naming the field: never a TypeError.
    """
    assert refusedToAnthropic(messages=messages) == field


# Top-level fields, Messages to chat completions.


def test_minimalMessagesBody() -> None:
    """
    model, max_tokens and messages make a chat body; the cap goes under the
    model's cap field.
    """
    assert toOpenAI() == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 100,
    }
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    assert chatRequestOf(body, capField="max_tokens")["max_tokens"] == 5


def test_fieldsToOpenAI() -> None:
    """
    temperature, top_p copied; stop_sequences is stop; metadata.user_id is
    user; a stream asks for its usage; cache_control and thinking disabled
    are left out.
    """
    chat = toOpenAI(
        temperature=0.2,
        top_p=0.9,
        stop_sequences=["\n\nHuman:"],
        metadata={"user_id": "u-1"},
        stream=True,
        cache_control={"type": "ephemeral"},
        thinking={"type": "disabled"},
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["\n\nHuman:"],
        "user": "u-1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert toOpenAI(stream=False)["stream"] is False and "stream_options" not in toOpenAI(
        stream=False
    )


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("top_k", 40, "top_k"),
        ("thinking", {"type": "enabled", "budget_tokens": 2048}, "thinking"),
        ("thinking", {"type": "adaptive"}, "thinking"),
        ("service_tier", "auto", "service_tier"),
        ("container", "c", "container"),
        ("mcp_servers", [], "mcp_servers"),
        ("output_config", {"format": {"type": "json_schema"}}, "output_config"),
        ("metadata", {"user_id": "u", "other": 1}, "metadata.other"),
        ("tools", [{"type": "web_search_20250305", "name": "web_search"}], "tools[0].type"),
        (
            "tools",
            [{"name": "t", "input_schema": {}, "input_examples": [{}]}],
            "tools[0].input_examples",
        ),
        ("tool_choice", {"type": "sometimes"}, "tool_choice.type"),
    ],
)
def test_noCounterpartInOpenAI(field: str, value: object, named: str) -> None:
    """
    A Messages field that chat completions cannot carry is refused, named.
    """
    assert refusedToOpenAI(**{field: value}) == named


def test_toolsToOpenAI() -> None:
    """
    A client tool is a function tool; cache_control is left out.
    """
    tools = [
        {
            "name": "get_weather",
            "description": "d",
            "input_schema": {"type": "object", "properties": {}},
            "cache_control": {"type": "ephemeral"},
            "strict": False,
        },
        {"type": "custom", "name": "n", "input_schema": {"type": "object"}},
    ]
    assert toOpenAI(tools=tools)["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "d",
                "parameters": {"type": "object", "properties": {}},
                "strict": False,
            },
        },
        {"type": "function", "function": {"name": "n", "parameters": {"type": "object"}}},
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "f"},
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        ),
        (
            {"type": "auto", "disable_parallel_tool_use": True},
            {"tool_choice": "auto", "parallel_tool_calls": False},
        ),
        (
            {"type": "tool", "name": "f", "disable_parallel_tool_use": False},
            {
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "parallel_tool_calls": True,
            },
        ),
    ],
)
def test_toolChoiceToOpenAI(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    """
    Each tool choice, and the parallel tool use flag.
    """
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    chat = toOpenAI(tools=tools, tool_choice=choice)
    assert {key: chat[key] for key in expected} == expected
    assert ("parallel_tool_calls" in chat) == ("parallel_tool_calls" in expected)


# Conversations, Messages to chat completions.


def test_systemToOpenAI() -> None:
    """
    A system string is one system message; text blocks are one system
    message of text parts (cache_control left out); no blocks, none.
    """
    assert toOpenAI(system="S")["messages"][0] == {"role": "system", "content": "S"}
    blocks = [
        {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "B"},
    ]
    assert toOpenAI(system=blocks)["messages"][0] == {
        "role": "system",
        "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
    }
    assert toOpenAI(system=[])["messages"] == [{"role": "user", "content": "hi"}]
    assert refusedToOpenAI(system=[{"type": "image"}]) == "system[0].type"


def test_imagesToOpenAI() -> None:
    """
    A base64 image is a data: URL, a URL image its URL; a file source has
    no counterpart.
    """
    content = [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "text", "text": "Compare."},
    ]
    chat = toOpenAI(messages=[{"role": "user", "content": content}])
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    image = {"type": "image", "source": {"type": "file", "file_id": "f"}}
    assert (
        refusedToOpenAI(messages=[{"role": "user", "content": [image]}])
        == "messages[0].content[0].source.type"
    )


def test_toolUseAndResultsToOpenAI() -> None:
    """
    tool_use blocks are tool calls (arguments as compact JSON, ids kept);
    a user turn's tool results are tool messages before the rest of the
    turn; is_error, cache_control and thinking blocks are left out.
    """
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "w",
                    "input": {"city": "Paris", "days": 2},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "w",
                    "input": {INVALID_ARGUMENTS_KEY: "{bad"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "18C",
                    "cache_control": {"type": "ephemeral"},
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "is_error": True,
                    "content": [{"type": "text", "text": "no"}],
                },
                {"type": "tool_result", "tool_use_id": "toolu_3"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    chat = toOpenAI(messages=messages)
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city":"Paris","days":2}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "w", "arguments": "{bad"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "text", "text": "no"}]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "system", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x", "name": "n"}], "messages[0].name"),
        (
            [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}],
            "messages[0].content[0].citations",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "image", "source": {}}],
                        }
                    ],
                }
            ],
            "messages[0].content[0].content[0].type",
        ),
        (
            [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}],
            "messages[0].content[0].type",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "n", "input": []}],
                }
            ],
            "messages[0].content[0].input",
        ),
        ([{"role": "user", "content": None}], "messages[0].content"),
    ],
)
def test_conversationRefusedToOpenAI(messages: object, field: str) -> None:
    """
    What a conversation cannot carry to OpenAI, or holds in the wrong
    shape, is refused naming the field.
    """
    assert refusedToOpenAI(messages=messages) == field


# There and back.


@settings(max_examples=300, deadline=None)
@given(anthropicRequests())
def test_anthropicRequestThereAndBack(body: dict[str, Any]) -> None:
    """
    A Messages body of fields that have counterparts, made a chat body and
    back, is itself; each made body is valid by the SDKs' types.
    """
    validAnthropicRequest(body)
    chat = chatRequestOf(body)
    validOpenAIRequest(chat)
    again = anthropicRequestOf(chat, defaultMaxTokens=1)
    assert again == body


@settings(max_examples=300, deadline=None)
@given(openAIRequests())
def test_openAIRequestThereAndBack(chat: dict[str, Any]) -> None:
    """
    A chat body of fields that have counterparts, made a Messages body and
    back, is itself; each made body is valid by the SDKs' types.
    """
    validOpenAIRequest(chat)
    body = anthropicRequestOf(chat, defaultMaxTokens=1)
    validAnthropicRequest(body)
    again = chatRequestOf(body)
    assert again == chat
