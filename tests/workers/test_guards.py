"""Input and output guards through real worker processes: a refused query never reaches the model
server, yet the turn ends and is stored like any other, with its reason; annotation replies answer
without the model; an output guard's forbidden words reach no event and no stored row; an
`ask_human` resume is not guarded. Patterns run on RE2: a catastrophic one gives its verdict at once,
one RE2 cannot run is refused at `agents put`, and long benign answers pass, however busy the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.strict_server import StrictChatServer, message_text
from tests.support.turns import keys_of
from threadline.pipeline import events as ev
from threadline.pipeline.config import GuardRules
from threadline.pipeline.contracts import new_conversation_id
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.guards import WITHHELD_QUERY, check_text
from threadline.workers.clients.client import Client, TurnHandle

pytestmark = pytest.mark.integration

REFUSAL = "I can't discuss that here."
HOURS = "We are open 9 to 5, Monday to Friday."


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


def finish(client: Client, request: dict[str, Any]) -> ev.Terminal:
    return client.wait(client.submit(request), timeout_s=30)


def raw_events(client: Client, turn_id: str) -> list[str]:
    """The turn's events exactly as stored (one JSON text each)."""
    return [fields[b"json"].decode() for _, fields in client.redis.xrange(keys_of(client, turn_id).events(turn_id))]


def stored_values(client: Client, conversation_id: str, turn_id: str) -> str:
    """Every value stored under the conversation's and the turn's keys, as one text."""
    out: list[str] = []
    for pattern in (f"{client.keys.conversation(conversation_id)}*", f"{keys_of(client, turn_id).turn(turn_id)}*"):
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


def test_a_catastrophic_pattern_re2_runs_gives_its_verdict_at_once_and_the_pool_carries_on(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    # `(a+)+$` on 1,500 `a`s and a `!`: Python's `re` would search for longer than the universe lasts,
    # holding the worker's event loop, its heartbeat and every other turn of the process; RE2 is linear
    agent = make_agent("offline:echo", guards={"input": {"patterns": [r"(a+)+$"], "reply": REFUSAL},
                                               "output": {"patterns": [r"(b+)+!"], "reply": "[withheld]"}})
    refused = finish(client, turn(agent, "a" * 1500))  # matches: refused
    assert isinstance(refused, ev.Succeeded) and refused.answer == REFUSAL, refused
    guard = {"kind": "moderation", "rule": "input.patterns[0]"}  # no "timed_out": nothing can time out
    assert client.decisions(refused.turn_id)["resolve"] == {"guard": guard}
    assert refused.conversation_id is not None
    (row,) = client.thread(refused.conversation_id)
    assert row.guard == guard
    # no match, found as fast: the query reaches the model (offline:echo quotes it in its answer)
    answered = finish(client, turn(agent, "a" * 1500 + "!"))
    assert isinstance(answered, ev.Succeeded) and "a" * 1500 + "!" in answered.answer, answered
    # the output pattern on the long run of `b`s the answer quotes: no `!` after them, then one
    passed = finish(client, turn(agent, "b" * 1500 + "?"))
    assert isinstance(passed, ev.Succeeded) and "b" * 1500 + "?" in passed.answer, passed
    withheld = finish(client, turn(agent, "b" * 1500 + "!"))
    assert isinstance(withheld, ev.Succeeded) and withheld.answer == "[withheld]", withheld
    assert client.decisions(withheld.turn_id)["invoke"]["guard"] == {"kind": "moderation",
                                                                     "rule": "output.patterns[0]"}
    fine = finish(client, turn(agent, "hello there"))
    assert isinstance(fine, ev.Succeeded) and fine.answer != REFUSAL, fine
    assert workers.alive()


#: How `threadline agents put` is run (the CLI's package, as a module).
CLI = [sys.executable, "-m", "threadline.workers.cli"]
#: Patterns RE2 cannot run, and RE2's reason.
NOT_RE2 = [
    (r"(\w+)\s+\1", r"invalid escape sequence: \1"),  # a repeated word: a backreference
    (r"(a|aa)+(?=b)", "invalid perl operator: (?="),  # catastrophic on `re`, and a lookahead
]


def test_a_pattern_re2_cannot_run_is_refused_at_agents_put_in_one_line(
    redis_url: str, prefix: str, client: Client, tmp_path: Path
) -> None:
    for pattern, reason in NOT_RE2:
        agent_id = f"agent-{uuid.uuid4().hex[:10]}"
        document = {"id": agent_id, "model": "offline:echo",
                    "guards": {"output": {"patterns": [r"\bok\b", pattern], "reply": "[withheld]"}}}
        expected = ("guards.output.patterns[1]: RE2 cannot run this pattern (it supports no backreferences or "
                    f"lookarounds): {reason}")
        with pytest.raises(InvalidRequest) as refused:
            client.put_agent(json.dumps(document))
        assert expected in refused.value.message
        assert agent_id not in [a.agent_id for a in client.agents()]  # nothing was registered
    # the command itself: exit 2, one line on stderr
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(document))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TL_")},
           "REDIS_URL": redis_url, "TL_PREFIX": prefix}
    put = subprocess.run([*CLI, "agents", "put", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert put.returncode == 2, put
    (line,) = put.stderr.strip().splitlines()
    assert expected in line and "Traceback" not in put.stderr, put.stderr
    assert agent_id not in [a.agent_id for a in client.agents()]


def benign_answer(n: int) -> str:
    """~80,000 characters of an ordinary support answer, with the words and digits the card patterns
    look for, never in their order (answer `n` differs from the others in its numbers)."""
    sentences = [
        f"Your order {n:04d}-{n * 7 % 10000:04d} shipped today and the invoice is attached.",
        "The card on file was charged once; your credit is unchanged.",
        f"Card number ending in {4000 + n:04d} was used, as you asked.",
        "Call us on 0800-1234-5678 if anything looks wrong!",
        f"Reference 2026-{n:04d}-0042 is on the receipt.",
        "Do you want the credit applied to your next order?",
        "A gift card can be used with any credit card or number of items.\n",
    ]
    text = ""
    i = 0
    while len(text) < 80_000:
        text += sentences[i % len(sentences)] + ("" if sentences[i % len(sentences)].endswith("\n") else " ")
        i += 1
    return text[:80_000]


def test_fifty_long_benign_answers_pass_the_card_patterns_none_replaced(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    # issue 25: on a busy machine an 80,000-character answer checked against these two patterns ran out
    # of the old 0.25 s wall-time budget and was replaced by the moderation reply. Fifty such answers at
    # once (ten conversations of five turns, all submitted before the first ends) keep the pool busy;
    # on RE2 the verdict is work, not time: every answer passes whole
    guards = {"output": {"patterns": [r"\bcredit\s+card\s+number\b", r"\d{4}-\d{4}-\d{4}-\d{4}"],
                         "reply": "[answer withheld]"}}
    assert check_text(GuardRules.model_validate(guards["output"]), benign_answer(0), where="output") is None
    agents = [make_agent(python_model("says", text=benign_answer(n), chunk=4000), guards=guards) for n in range(10)]
    handles: list[tuple[int, str, TurnHandle]] = []
    for n, agent in enumerate(agents):  # one conversation per agent: five turns, each after the one before
        first = client.submit(turn(agent, "Where is my order?"))
        cid = new_conversation_id(first.turn_id)
        handles.append((n, cid, first))
        handles.extend((n, cid, client.submit(turn(agent, f"And now? ({k})", conversation_id=cid))) for k in range(4))
    assert len(handles) == 50
    for n, cid, handle in handles:
        done = client.wait(handle, timeout_s=120)
        assert isinstance(done, ev.Succeeded), done
        assert done.conversation_id == cid
        assert done.answer == benign_answer(n), f"answer of turn {handle.turn_id} replaced: {done.answer[:80]!r}"
        assert "guard" not in client.decisions(handle.turn_id).get("invoke", {})
    for n, cid, _ in handles[::5]:
        rows = client.thread(cid)
        assert len(rows) == 5 and all(r.guard is None and r.answer == benign_answer(n) for r in rows)
    assert workers.alive()
