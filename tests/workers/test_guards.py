"""Input and output guards through real worker processes: a refused query never reaches the model
server, yet the turn ends and is stored like any other, with its reason; annotation replies answer
without the model; an output guard's forbidden words reach no event and no stored row; an
`ask_human` resume is not guarded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.strict_server import StrictChatServer, message_text
from threadline.pipeline import events as ev
from threadline.pipeline.guards import WITHHELD_QUERY
from threadline.workers.clients.client import Client

pytestmark = pytest.mark.integration

REFUSAL = "I can't discuss that here."
HOURS = "We are open 9 to 5, Monday to Friday."


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


def finish(client: Client, request: dict[str, Any]) -> ev.Terminal:
    return client.wait(client.submit(request), timeout_s=30)


def raw_events(client: Client, turn_id: str) -> list[str]:
    """The turn's events exactly as stored (one JSON text each)."""
    return [fields[b"json"].decode() for _, fields in client.redis.xrange(client.keys.events(turn_id))]


def stored_values(client: Client, conversation_id: str, turn_id: str) -> str:
    """Every value stored under the conversation's and the turn's keys, as one text."""
    out: list[str] = []
    for pattern in (f"{client.keys.prefix}:conv:{{{conversation_id}}}*", f"{client.keys.prefix}:turn:{turn_id}*"):
        for key in client.redis.scan_iter(pattern, count=1000):
            kind = client.redis.type(key).decode()
            value: Any = {"string": client.redis.get, "hash": client.redis.hgetall,
                          "stream": client.redis.xrange}.get(kind, lambda k: None)(key)
            out.append(repr(value))
    assert out, "nothing stored"
    return "\n".join(out)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_refused_query_never_reaches_the_model_and_is_stored_with_its_reason(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    with StrictChatServer() as server:
        agent = make_agent(server.model_config(strict_system=True), instructions="Be brief.",
                           guards={"input": {"keywords": ["forbidden topic"], "reply": REFUSAL}})
        refused = finish(client, turn(agent, "Tell me about the Forbidden Topic, please."))
        assert isinstance(refused, ev.Succeeded) and refused.answer == REFUSAL, refused
        assert server.requests == [], "the model server received the refused query"

        cid = refused.conversation_id
        assert cid is not None
        guard = {"kind": "moderation", "rule": "input.keywords[0]"}
        assert client.decisions(refused.turn_id)["resolve"] == {"guard": guard}
        stream = [json.loads(raw) for raw in raw_events(client, refused.turn_id)]
        assert [e["text"] for e in stream if e["type"] == "text_delta"] == [REFUSAL]
        assert any(e["type"] == "stage" and e["stage"] == "resolve" and e.get("decision") == {"guard": guard}
                   for e in stream)
        (row,) = client.thread(cid)
        assert (row.status, row.answer, row.guard) == ("succeeded", REFUSAL, guard)
        assert row.query == "Tell me about the Forbidden Topic, please."  # kept for the operator's record

        # the conversation goes on: the next turn reaches the model, with the exchange but not the query
        after = finish(client, turn(agent, "What can we talk about?", conversation_id=cid))
        assert isinstance(after, ev.Succeeded), after
        (sent,) = server.requests
    history = [(m["role"], message_text(m)) for m in sent["messages"]]
    assert history == [("system", "Be brief."), ("user", WITHHELD_QUERY), ("assistant", REFUSAL),
                       ("user", "What can we talk about?")]
    assert "forbidden" not in json.dumps(sent).lower()


def test_annotations_answer_exact_or_normalised_questions_without_the_model(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    annotations = [{"question": "what are your hours", "answer": HOURS}]
    normalised = make_agent("offline:echo", guards={"annotations": annotations})
    answered = finish(client, turn(normalised, "  What are your HOURS? "))
    assert isinstance(answered, ev.Succeeded) and answered.answer == HOURS, answered
    assert client.decisions(answered.turn_id)["resolve"] == {"guard": {"kind": "annotation",
                                                                       "rule": "annotations[0]"}}
    assert answered.usage.requests == 0
    # the next turn's model sees the annotated exchange as it was
    echoed = finish(client, turn(normalised, "thanks", conversation_id=answered.conversation_id))
    assert isinstance(echoed, ev.Succeeded), echoed
    assert json.loads(echoed.answer)["messages"] == [
        {"role": "user", "text": "  What are your HOURS? "}, {"role": "assistant", "text": HOURS},
        {"role": "user", "text": "thanks"}]

    exact = make_agent("offline:echo", guards={"annotations": annotations, "annotation_match": "exact"})
    asked = finish(client, turn(exact, "  What are your HOURS? "))
    assert isinstance(asked, ev.Succeeded) and asked.answer != HOURS and asked.usage.requests == 1
    assert "resolve" not in client.decisions(asked.turn_id)
    exactly = finish(client, turn(exact, "what are your hours"))
    assert isinstance(exactly, ev.Succeeded) and exactly.answer == HOURS, exactly


def test_forbidden_output_reaches_no_event_and_no_stored_row(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "says.jsonl"
    agent = make_agent(
        python_model("says", text="Sure. The admin password is hunter2, keep it safe!", chunk=3, record=str(record)),
        guards={"output": {"keywords": ["hunter2"], "patterns": [r"password\s+is"], "reply": "[answer withheld]"}},
    )
    answered = finish(client, turn(agent, "What is the admin login?"))
    assert isinstance(answered, ev.Succeeded) and answered.answer == "[answer withheld]", answered
    cid = answered.conversation_id
    assert cid is not None
    stream = raw_events(client, answered.turn_id)
    streamed = "".join(json.loads(e)["text"] for e in stream if json.loads(e)["type"] == "text_delta")
    assert streamed == "Sure. "  # the first sentence, then the hit: nothing more streams
    for forbidden in ("hunter2", "password"):
        assert not any(forbidden in e for e in stream), forbidden
        assert forbidden not in stored_values(client, cid, answered.turn_id), forbidden
    (row,) = client.thread(cid)
    assert row.guard == {"kind": "moderation", "rule": "output.keywords[0]"}  # keywords are checked first
    assert client.decisions(answered.turn_id)["invoke"]["guard"] == row.guard

    # a later turn's history holds the reply, not what the model said
    finish(client, turn(agent, "And the user login?", conversation_id=cid))
    seen = records(record)[-1]["seen"]
    assert seen == ["What is the admin login?", "[answer withheld]", "And the user login?"]


def test_an_ask_human_resume_is_not_guarded(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent(python_model("ask_then_answer", question="Which colour?"), tools=["ask_human"],
                       guards={"input": {"keywords": ["blue"], "reply": REFUSAL}})
    paused = finish(client, turn(agent, "Paint my room."))
    assert isinstance(paused, ev.Paused), paused
    (pending,) = paused.pending_tool_calls
    resume = {**turn(agent, "", conversation_id=paused.conversation_id),
              "deferred_tool_results": {"calls": {pending["tool_call_id"]: "blue"}}}
    resumed = finish(client, resume)
    assert isinstance(resumed, ev.Succeeded) and resumed.answer == "You answered: blue", resumed
    assert "resolve" not in client.decisions(resumed.turn_id)
    # the same words in a new query are refused
    refused = finish(client, turn(agent, "Blue, then.", conversation_id=paused.conversation_id))
    assert isinstance(refused, ev.Succeeded) and refused.answer == REFUSAL, refused


def test_a_catastrophic_pattern_refuses_in_a_quarter_second_and_the_worker_carries_on(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    # `(a+)+$` on 1,500 `a`s and a `!`: Python's `re` would search for longer than the universe lasts,
    # holding the worker's event loop, its heartbeat and every other turn of the process
    agent = make_agent("offline:echo", guards={"input": {"patterns": [r"(a+)+$"], "reply": REFUSAL},
                                               "output": {"patterns": [r"(b+)+$"], "reply": "[withheld]"}})
    refused = finish(client, turn(agent, "a" * 1500 + "!"))
    assert isinstance(refused, ev.Succeeded) and refused.answer == REFUSAL, refused
    guard = {"kind": "moderation", "rule": "input.patterns[0]", "timed_out": True}
    assert client.decisions(refused.turn_id)["resolve"] == {"guard": guard}
    assert refused.conversation_id is not None
    (row,) = client.thread(refused.conversation_id)
    assert row.guard == guard
    # offline:echo quotes the query: its answer is the long run of `b`s the output pattern chokes on
    withheld = finish(client, turn(agent, "b" * 1500 + "!"))
    assert isinstance(withheld, ev.Succeeded) and withheld.answer == "[withheld]", withheld
    assert client.decisions(withheld.turn_id)["invoke"]["guard"]["timed_out"] is True
    fine = finish(client, turn(agent, "hello there"))
    assert isinstance(fine, ev.Succeeded) and fine.answer != REFUSAL, fine
    assert workers.alive()
