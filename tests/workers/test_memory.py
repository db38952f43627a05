"""The history stage fits a token budget, through real worker processes: every request a strict
OpenAI-compatible server receives fits the context window and carries a contiguous run of the newest
whole turns; fixed parts that cannot fit fail `context_too_large` before any model call; a branch from
an old message of a long conversation sees its own thread; and the stage records what it decided."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.strict_server import StrictChatServer, message_text
from threadline.pipeline import events as ev
from threadline.pipeline.tokens import MESSAGE_OVERHEAD_TOKENS, Tokenizer
from threadline.workers.clients.client import Client
from threadline.workers.worker.tokenizers import load_tokenizer

pytestmark = pytest.mark.integration

CONTEXT_WINDOW = 2000
MAX_OUTPUT = 200
TURNS = 40
TOOL_EVERY = 5
TIME_QUESTION = "What time is it?"
INSTRUCTIONS = "You answer questions about Ada's orders at Acme, in full sentences."

_WORDS = ["order", "parcel", "invoice", "refund", "courier", "warehouse", "address", "payment", "receipt",
          "delivery", "return", "label", "tracking", "customer", "support", "ticket", "status", "discount",
          "voucher", "basket", "checkout"]


def _filler(seed: int, words: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i) % len(_WORDS)] for i in range(words))


def _query(n: int) -> str:
    """The n-th question (0-based), ~150 tokens; every 5th asks the time (the server calls `clock`)."""
    ask = f"{TIME_QUESTION} " if n % TOOL_EVERY == TOOL_EVERY - 1 else ""
    return f"Q{n}: {ask}{_filler(n, 140)}"


def _answer_to(query: str) -> str:
    """The server's text answer to a question, ~100 tokens, determined by the question alone."""
    qid = query.split(":", 1)[0]
    return f"A{qid[1:]}: {_filler(len(query), 95)}"


def _asks_the_time(query: str) -> bool:
    return TIME_QUESTION in query


def _history_decision(client: Client, turn_id: str) -> dict[str, Any]:
    finished = [e for e in client.events(turn_id)
                if isinstance(e, ev.StageEvent) and e.stage == "history" and e.status == "finished"]
    assert len(finished) == 1, finished
    decision: dict[str, Any] | None = finished[0].decision
    assert decision is not None
    return decision


def _stored_decision(client: Client, conversation_id: str, turn_id: str) -> dict[str, Any] | None:
    raw = client.redis.hget(client.keys.decisions(conversation_id), f"{turn_id}:history")
    return json.loads(raw) if raw else None


# --- what the server received ---------------------------------------------------------------------


def messages_tokens(messages: list[dict[str, Any]], tokenizer: Tokenizer) -> int:
    """The tokens of messages as received: their text, tool calls' names and arguments, tool results,
    and 4 per message."""
    total = 0
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS + tokenizer.count(message_text(message))
        for call in message.get("tool_calls") or []:
            total += tokenizer.count(call["function"]["name"]) + tokenizer.count(call["function"]["arguments"])
    return total


def request_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> int:
    """The tokens of a request as received: its messages, and the JSON of the tool definitions."""
    tools = tokenizer.count(json.dumps(body["tools"])) if body.get("tools") else 0
    return messages_tokens(body["messages"], tokenizer) + tools


def history_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> int:
    """The tokens of the history a request carries: the messages between the system message and the
    current (last) user message."""
    messages = body["messages"]
    current = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages_tokens(messages[1:current], tokenizer)


@dataclass(frozen=True)
class Carried:
    """The history one request carries: the earlier turns' queries, and the current one."""

    history: list[str]
    current: str


def _check_tool_exchange(segment: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Checks that every tool call in `segment` (the messages after a user message) is answered by a
    tool message right after its assistant message; returns what follows the exchanges."""
    i = 0
    while i < len(segment) and segment[i]["role"] == "assistant" and segment[i].get("tool_calls"):
        calls = {c["id"] for c in segment[i]["tool_calls"]}
        i += 1
        answered: set[str] = set()
        while i < len(segment) and segment[i]["role"] == "tool":
            assert segment[i]["tool_call_id"] in calls, f"{where}: tool result without its call"
            answered.add(segment[i]["tool_call_id"])
            i += 1
        assert answered == calls, f"{where}: tool call without its result"
    return segment[i:]


def carried_turns(body: dict[str, Any]) -> Carried:
    """Splits a request into whole turns, asserting each earlier turn is whole: its user message, any
    tool calls each with its result, then exactly the full answer the server gave to that query."""
    messages = body["messages"]
    assert messages[0]["role"] == "system" and message_text(messages[0]) == INSTRUCTIONS
    assert all(m["role"] != "system" for m in messages[1:])
    rest = messages[1:]
    starts = [i for i, m in enumerate(rest) if m["role"] == "user"]
    assert starts and starts[0] == 0, "the history starts with a user message"
    segments = [rest[a:b] for a, b in zip(starts, [*starts[1:], len(rest)], strict=True)]
    queries = [message_text(s[0]) for s in segments]
    for query, segment in zip(queries[:-1], segments[:-1], strict=True):
        after = _check_tool_exchange(segment[1:], f"turn {query[:4]}")
        assert [(m["role"], message_text(m)) for m in after] == [("assistant", _answer_to(query))], (
            f"turn {query[:4]} is not whole: {after}")
    current = _check_tool_exchange(segments[-1][1:], "the current turn")
    assert current == [], "the current turn ends with its query or its tool results"
    return Carried(queries[:-1], queries[-1])


# --- 1. the budget contract -----------------------------------------------------------------------


@pytest.fixture
def memory_server() -> Iterator[StrictChatServer]:
    with StrictChatServer(tool_when=_asks_the_time, text_for=_answer_to) as server:
        yield server


@pytest.mark.slow  # 40 turns (~25 s on a loaded machine): the slow tier (`.ci/run`) runs it
def test_every_request_fits_the_window_and_carries_the_newest_whole_turns(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, memory_server: StrictChatServer
) -> None:
    tokenizer = load_tokenizer(None, "openai-compatible")
    assert tokenizer.name == "tiktoken:cl100k_base"
    queries = [_query(n) for n in range(TURNS)]
    sizes = [tokenizer.count(q) for q in queries] + [tokenizer.count(_answer_to(q)) for q in queries]
    assert all(120 <= size <= 180 for size in sizes[:TURNS]), sizes  # ~150-token queries
    assert all(80 <= size <= 120 for size in sizes[TURNS:]), sizes  # ~100-token answers
    model = {**memory_server.model_config(strict_system=True), "context_window": CONTEXT_WINDOW,
             "max_output_tokens": MAX_OUTPUT}
    agent = make_agent(model, instructions=INSTRUCTIONS, tools=["clock"])

    started = time.monotonic()
    turn_ids: list[str] = []
    requests_per_turn: list[list[dict[str, Any]]] = []
    conversation_id: str | None = None
    for query in queries:
        before = len(memory_server.requests)
        request = turn(agent, query, **({"conversation_id": conversation_id} if conversation_id else {}))
        turn_ids.append(client.submit(request))
        terminal = client.wait(turn_ids[-1], timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        assert terminal.answer == _answer_to(query)
        conversation_id = terminal.conversation_id
        requests_per_turn.append(memory_server.requests[before:])
    elapsed = time.monotonic() - started
    assert conversation_id is not None

    room = CONTEXT_WINDOW - MAX_OUTPUT
    kept: list[int] = []  # how many earlier turns each turn's requests carry
    largest = 0
    for n, sent in enumerate(requests_per_turn):
        assert len(sent) == (2 if _asks_the_time(queries[n]) else 1), f"turn {n}: {len(sent)} requests"
        carried = [carried_turns(body) for body in sent]
        for body, c in zip(sent, carried, strict=True):
            tokens = request_tokens(body, tokenizer)
            largest = max(largest, tokens)
            assert tokens <= room, f"turn {n}: the request holds {tokens} tokens, more than {room}"
            assert c.current == queries[n]
            k = len(c.history)
            assert c.history == queries[n - k:n], f"turn {n}: not the newest {k} queries in order"
        assert len({len(c.history) for c in carried}) == 1, "the tool loop's requests carry the same history"
        kept.append(len(carried[0].history))
    assert all(e.status == 200 for e in memory_server.exchanges)

    # the conversation overflows, and from then on the oldest turns are dropped; never the last one
    starts = [n - k for n, k in enumerate(kept)]
    assert all(k >= 1 for k in kept[1:]), kept
    assert starts == sorted(starts), f"a later request went back to an older turn: {starts}"
    first_over = next(n for n, k in enumerate(kept) if k < n)
    assert first_over < TURNS // 2, kept
    assert all(kept[n] < n for n in range(first_over, TURNS)), kept
    assert starts[-1] > TURNS // 2, starts

    # the decision records agree with what was sent, and report how often the prefix was kept
    decisions = [_history_decision(client, t) for t in turn_ids]
    for n, (decision, t) in enumerate(zip(decisions, turn_ids, strict=True)):
        first_request = requests_per_turn[n][0]
        assert decision["tokenizer"] == tokenizer.name
        assert decision["window"]["kept_turns"] == kept[n], (n, decision)
        # the stage counted what went over the wire: the kept turns, the instructions, the query
        assert decision["window"]["kept_tokens"] == history_tokens(first_request, tokenizer), (n, decision)
        assert decision["budget"]["instructions"] == messages_tokens(first_request["messages"][:1], tokenizer)
        assert decision["budget"]["query"] == messages_tokens(first_request["messages"][-1:], tokenizer)
        assert decision["window"]["kept_tokens"] <= decision["budget"]["history"], (n, decision)
        assert _stored_decision(client, conversation_id, t) == decision
    # each turn is counted once, when it is first a parent: the last turn has not been yet
    assert client.redis.hlen(client.keys.token_counts(conversation_id)) == TURNS - 1
    over = range(first_over, TURNS)
    same_prefix = [n for n in over if starts[n] == starts[n - 1]]
    rate = len(same_prefix) / len(over)
    reasons = [decisions[n]["window"]["reason"] for n in over]
    assert set(reasons) <= {"prefix_kept", "pruned_to_low_water"}, reasons
    reported = reasons.count("prefix_kept") / len(over)
    assert rate == reported, (rate, reported, reasons)
    assert [decisions[n]["window"]["reason"] == "prefix_kept" for n in over] == [
        starts[n] == starts[n - 1] for n in over]
    wire_tools = tokenizer.count(json.dumps(requests_per_turn[-1][0]["tools"]))
    print(f"\ntool definitions: {decisions[-1]['budget']['tools']} tokens budgeted, {wire_tools} as received")
    print(f"prefix-stability rate: {rate:.2f} ({len(same_prefix)} of {len(over)} over-budget turns kept the "
          f"previous request's first user message); kept turns per request: {kept}; largest request "
          f"{largest} of {room} tokens; {TURNS} turns in {elapsed:.1f} s")
    assert rate >= 0.5, f"low-water pruning should keep the prefix on most over-budget turns: {rate:.2f}"


# --- 2. context_too_large -------------------------------------------------------------------------


def test_instructions_larger_than_the_window_fail_before_any_model_call(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, memory_server: StrictChatServer
) -> None:
    instructions = " ".join(_filler(i, 100) for i in range(25))  # ~2,500 tokens
    assert load_tokenizer(None, "openai-compatible").count(instructions) > CONTEXT_WINDOW
    model = {**memory_server.model_config(strict_system=True), "context_window": CONTEXT_WINDOW,
             "max_output_tokens": MAX_OUTPUT}
    agent = make_agent(model, instructions=instructions, tools=["clock"])

    terminal = client.wait(client.submit(turn(agent, "Where is my parcel?")), timeout_s=30)

    assert isinstance(terminal, ev.Failed), terminal
    assert terminal.code == "context_too_large", terminal
    assert "instructions" in (terminal.message or ""), terminal.message
    assert memory_server.requests == []


# --- 3. branching from old messages of a long conversation ----------------------------------------


BRANCH_WINDOW = 2000
BRANCH_OUTPUT = 200


def _old_query(n: int) -> str:
    return f"question number {n} about the order"


def _old_answer(n: int) -> str:
    return f"answer number {n}: it ships on day {n} from the warehouse"


def _echo(terminal: ev.Event) -> dict[str, Any]:
    assert isinstance(terminal, ev.Succeeded), terminal
    seen: dict[str, Any] = json.loads(terminal.answer)
    return seen


@pytest.fixture
def long_conversation(client: Client, make_agent: AgentFactory) -> tuple[str, str]:
    """An `offline:echo` agent with a 2,000-token window, and a 600-turn conversation imported for it."""
    model = {"provider": "offline", "name": "echo", "context_window": BRANCH_WINDOW,
             "max_output_tokens": BRANCH_OUTPUT}
    agent = make_agent(model)
    conversation_id = f"c-long-{uuid.uuid4().hex[:10]}"
    client.import_conversation(
        conversation_id=conversation_id, tenant_id="t1", app_id="app", user_id="u1", agent_id=agent,
        turns=[(_old_query(n), _old_answer(n), None) for n in range(1, 601)],
    )
    return agent, conversation_id


def test_a_branch_from_the_first_message_of_a_long_conversation_sees_only_its_thread(
    workers: WorkerPool, client: Client, long_conversation: tuple[str, str]
) -> None:
    agent, conversation_id = long_conversation
    request = turn(agent, "and the first one?", conversation_id=conversation_id,
                   parent_message_id=f"{conversation_id}-m1")

    terminal = client.wait(client.submit(request), timeout_s=30)

    seen = _echo(terminal)
    assert seen["messages"] == [
        {"role": "user", "text": _old_query(1)},
        {"role": "assistant", "text": _old_answer(1)},
        {"role": "user", "text": "and the first one?"},
    ]
    decision = _history_decision(client, terminal.turn_id)
    assert decision["window"]["reason"] == "all_fit" and decision["window"]["kept_turns"] == 1
    assert decision["read"] == {"turns": 1, "complete": True}


def test_a_branch_from_message_150_sees_the_newest_turns_up_to_it_that_fit(
    workers: WorkerPool, client: Client, long_conversation: tuple[str, str]
) -> None:
    agent, conversation_id = long_conversation
    query = "and the one before?"
    request = turn(agent, query, conversation_id=conversation_id, parent_message_id=f"{conversation_id}-m150")

    terminal = client.wait(client.submit(request), timeout_s=30)

    seen = _echo(terminal)["messages"]
    assert seen[-1] == {"role": "user", "text": query}
    history = seen[:-1]
    k = len(history) // 2
    assert k >= 1 and len(history) == 2 * k
    assert history == [item for n in range(151 - k, 151) for item in (
        {"role": "user", "text": _old_query(n)}, {"role": "assistant", "text": _old_answer(n)})], (
        "not a contiguous run of the newest turns up to #150")

    # exactly the newest turns that fit: the budget, counted independently, then cut to low water
    tokenizer = load_tokenizer(None, "offline")
    cost = {n: tokenizer.count(_old_query(n)) + tokenizer.count(_old_answer(n)) + 2 * MESSAGE_OVERHEAD_TOKENS
            for n in range(1, 151)}
    assert sum(cost.values()) > BRANCH_WINDOW, "turns 1..150 must not all fit"
    budget = BRANCH_WINDOW - BRANCH_OUTPUT - 256 - (tokenizer.count(query) + MESSAGE_OVERHEAD_TOKENS)
    target = int(budget * 0.7)
    fit, used = 0, 0
    for n in range(150, 0, -1):
        if used + cost[n] > target:
            break
        fit, used = fit + 1, used + cost[n]
    assert k == fit, (k, fit)
    decision = _history_decision(client, terminal.turn_id)
    assert decision["budget"]["history"] == budget
    assert decision["window"] == {**decision["window"], "reason": "pruned_to_low_water", "kept_turns": k,
                                  "kept_tokens": used, "start": f"{conversation_id}-m{151 - k}"}
    assert decision["read"]["turns"] < 150, "the thread is read back only as far as the budget needs"


# --- 4. the decision record -----------------------------------------------------------------------


def test_the_history_decision_is_on_the_finished_event_and_stored_under_the_turn(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    model = {"provider": "offline", "name": "echo", "context_window": 4000, "max_output_tokens": 300,
             "tokenizer": "tiktoken:cl100k_base"}
    agent = make_agent(model, instructions="Be brief.", tools=["clock"], memory={"safety_margin_tokens": 100})
    first = client.wait(client.submit(turn(agent, "hello there")), timeout_s=30)
    assert isinstance(first, ev.Succeeded), first
    second_id = client.submit(turn(agent, "and again", conversation_id=first.conversation_id))
    second = client.wait(second_id, timeout_s=30)
    assert isinstance(second, ev.Succeeded), second
    assert second.conversation_id is not None

    decision = _history_decision(client, second_id)

    tokenizer = load_tokenizer("tiktoken:cl100k_base", "offline")
    assert decision["tokenizer"] == "tiktoken:cl100k_base"
    budget = decision["budget"]
    assert {k: budget[k] for k in ("context_window", "max_output", "safety_margin")} == {
        "context_window": 4000, "max_output": 300, "safety_margin": 100}
    assert budget["instructions"] == tokenizer.count("Be brief.") + MESSAGE_OVERHEAD_TOKENS
    assert budget["query"] == tokenizer.count("and again") + MESSAGE_OVERHEAD_TOKENS
    assert budget["tools"] > 0
    assert budget["history"] == 4000 - 300 - 100 - budget["instructions"] - budget["query"] - budget["tools"]
    window = decision["window"]
    assert window["reason"] == "all_fit"
    assert (window["kept_turns"], window["dropped_turns"], window["dropped_tokens"]) == (1, 0, 0)
    assert window["start"] == first.turn_id
    assert window["kept_tokens"] == (tokenizer.count("hello there") + tokenizer.count(first.answer)
                                     + 2 * MESSAGE_OVERHEAD_TOKENS)
    assert decision["messages_out"] == 2
    assert _stored_decision(client, second.conversation_id, second_id) == decision
    assert _stored_decision(client, second.conversation_id, first.turn_id) == _history_decision(client, first.turn_id)
