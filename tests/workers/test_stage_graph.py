"""The stage graph is declared once: a stage added to the table (one entry, one pure function)
runs for every turn, with no edit to the actors, the runners or the scripts."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.conftest import InProcessWorker, turn
from threadline.pipeline import events
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.history import decode_messages
from threadline.pipeline.stages import DEFAULT_GRAPH, Stage, StageInput, StageOutput

pytestmark = pytest.mark.integration


def audit(given: StageInput) -> StageOutput:
    """A no-op stage: passes the mapped history on, and says how many messages it saw."""
    return StageOutput(given.artifact, {"audited": len(decode_messages(given.artifact, where="test"))})


GRAPH = DEFAULT_GRAPH.with_stage(Stage("audit", "transform", audit), after="map")


def test_a_stage_added_to_the_table_runs_for_every_turn(inprocess: Callable[..., InProcessWorker]) -> None:
    worker = inprocess(graph=GRAPH)
    client = worker.client
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    conversation = None
    for n in (1, 2):
        turn_id = client.submit(turn("echo", f"question {n}", conversation_id=conversation))
        terminal = client.wait(turn_id, timeout_s=30)
        assert isinstance(terminal, events.Succeeded), terminal
        conversation = terminal.conversation_id
        seen = list(client.events(turn_id))
        stages = [(e.stage, e.status) for e in seen if isinstance(e, events.StageEvent)]
        assert [s for s, _ in stages[::2]] == ["resolve", "history", "map", "audit", "invoke", "persist"]
        audited = next(e for e in seen if isinstance(e, events.StageEvent) and e.stage == "audit"
                       and e.status == "finished")
        # turn 2 sees turn 1's question and answer, then its own question goes to the model
        assert audited.decision == {"audited": 2 * (n - 1)}
        assert [m["text"] for m in json.loads(terminal.answer)["messages"] if m["role"] == "user"] == [
            f"question {i}" for i in range(1, n + 1)]
    # the artifacts of every stage, the added one's too, are gone once the turns ended
    assert not [k for shard in client.keys.every_shard() for k in client.redis.scan_iter(shard.artifact("*", "*"))]
