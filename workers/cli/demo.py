"""`threadline demo`: real worker processes, a demo agent, and a three-turn conversation streamed
to the terminal as the model speaks. Everything it starts, it stops."""

from __future__ import annotations

import json
import sys
import time
import uuid
from importlib import resources

from threadline.pipeline import events
from threadline.pipeline.config import parse_agent_config
from threadline.workers.cli.common import connect, render_event
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.worker.process import Supervisor

QUESTIONS = (
    "Hi! I'm Ada and I'm planning a week in Lisbon.",
    "What should I pack for October there?",
    "Remind me: who am I, and what have I asked you so far?",
)


def run_demo(settings: Settings, *, delay_ms: int) -> int:
    url, server = connect(settings)
    log_path = settings.data_dir / "demo-workers.log"
    supervisor = Supervisor(url, processes=settings.processes, threads=settings.threads,
                            env={"TL_LOG_FORMAT": "json"}, log_path=log_path)
    supervisor.start()
    client = Client(url, prefix=settings.prefix)
    try:
        text = resources.files("threadline.workers.cli").joinpath("demo_agent.yaml").read_text()
        config = parse_agent_config(text)
        model = config.model.model_copy(update={"options": {"delay_ms": delay_ms}})
        config = config.model_copy(update={"model": model})
        # the same document as last run is the same version: `put` makes a new one only on a change
        put = client.put_agent_result(config)
        version = put.ref if put.created else f"{put.ref} (unchanged)"
        print(f"Threadline demo: {settings.processes} worker processes on {url}; agent {config.id} {version}\n")
        code = _conversation(client, config.id)
    finally:
        client.close()
        supervisor.stop()
        if server is not None:
            server.stop()
        print(f"\nworkers stopped (their logs: {log_path}; the demo's: {settings.data_dir / 'demo.log'})")
    if code == 0:
        print("\n" + "\n".join(next_steps(config.id)))
    return code


def next_steps(agent_id: str) -> list[str]:
    """What to try after the demo, each way in once: the console, HTTP, Python."""
    turn = {"app_id": "demo", "user_id": "ada", "agent_id": agent_id, "query": "Hello again"}
    python = ("from threadline.workers.clients.client import Client; "
              f"print(Client().start({({'tenant_id': 'demo', **turn})!r}).result().answer)")
    return [
        "Next steps (in a terminal of their own: `threadline worker`, and for 1 and 2 `threadline gateway`):",
        "  1. the console: open http://127.0.0.1:8080/ (an API key: `threadline keys create demo`)",
        "  2. curl: curl -sS http://127.0.0.1:8080/v1/turns "
        "-H \"Authorization: Bearer $(threadline keys create demo)\" "
        f"-H 'content-type: application/json' --data '{json.dumps(turn)}'",
        f"  3. Python: python -c \"{python}\"",
    ]


def _conversation(client: Client, agent_id: str) -> int:
    conversation_id: str | None = None
    run = uuid.uuid4().hex[:8]
    for number, question in enumerate(QUESTIONS, start=1):
        print(f"you> {question}")
        sys.stdout.write("assistant> ")
        sys.stdout.flush()
        started = time.perf_counter()
        turn_id = client.submit({
            "turn_id": f"demo-{run}-{number}", "tenant_id": "demo", "app_id": "demo", "user_id": "ada",
            "agent_id": agent_id, "conversation_id": conversation_id, "query": question,
            "inputs": {"customer_name": "Ada"},
        })
        terminal: events.Terminal | None = None
        for event in client.events(turn_id, follow=True, timeout_s=120):
            if isinstance(event, events.Accepted):
                conversation_id = event.conversation_id
            elif isinstance(event, events.TextDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, events.Terminal):
                terminal = event
        took = time.perf_counter() - started
        if not isinstance(terminal, events.Succeeded):
            print(render_event(terminal, as_json=False) if terminal else "\n[no terminal event]")
            return 1
        usage = terminal.usage
        counted = f", counted locally with {usage.counted_by}" if usage.counted_by else ""
        print(f"\n    ({took:.2f} s, {usage.input_tokens} tokens in, {usage.output_tokens} out{counted})\n")
    assert conversation_id is not None
    print(f"The conversation thread ({conversation_id}), as stored:")
    for message in client.thread(conversation_id):
        print(f"  [{message.status}] user: {message.query}")
        print(f"             assistant: {message.answer}")
    return 0
