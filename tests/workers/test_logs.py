"""Log lines carry no credential, and no user text at INFO or above: dramatiq's own lines included.
Unit level: a stub broker and an in-process dramatiq worker (threads), no worker processes."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import structlog
from dramatiq.brokers.stub import StubBroker

from threadline.workers.settings import Settings
from threadline.workers.telemetry import logs
from threadline.workers.telemetry.logs import ContentFreeMessages, configure_logging, redact_secrets

QUERY = "Where is my order? My card is 4111-1111-1111-1111"
KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(logs, "_secrets", ())
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def configured(level: str = "INFO", log_format: str = "json", **secrets: str) -> io.StringIO:
    stream = io.StringIO()
    settings = Settings(
        redis_url=None,
        data_dir=Path("."),
        log_format=log_format,  # type: ignore[arg-type]
        log_level=level,
        secrets=secrets,
    )
    configure_logging(settings, stream=stream)
    return stream


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def run_failing_turn(query: str) -> None:
    """A real dramatiq worker runs a `resolve` message whose actor fails on the query."""
    broker = StubBroker()

    @dramatiq.actor(broker=broker, actor_name="resolve", max_retries=0)
    def resolve(request: dict[str, Any]) -> None:
        raise ValueError(f"cannot route {request['query']!r}")

    resolve.send({"turn_id": "t-1", "query": query, "auth": f"Bearer {KEY}"})
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        broker.join("default", timeout=10_000, fail_fast=False)
        worker.join()
    finally:
        worker.stop()


def test_a_failed_message_is_logged_without_its_content_at_info() -> None:
    stream = configured("INFO")
    run_failing_turn(QUERY)
    output = stream.getvalue()
    # the card's digits with their dashes: a timestamp's microseconds can read 4111 too
    assert "Where is my order" not in output and "4111-1111" not in output and KEY not in output
    failed = [line for line in lines(stream) if line["event"].startswith("Failed to process message")]
    assert len(failed) == 1
    assert failed[0]["event"].startswith("Failed to process message resolve(message_id='")
    assert failed[0]["level"] == "error"
    # the traceback is kept, with the message's strings taken out of the exception text
    assert "ValueError: cannot route '<message content elided>'" in failed[0]["exception"]
    assert any(line["event"].startswith("Retries exceeded for message") for line in lines(stream))


def test_at_debug_the_content_is_there_but_never_the_credentials() -> None:
    stream = configured("DEBUG")
    run_failing_turn(QUERY)
    received = [line["event"] for line in lines(stream) if line["event"].startswith("Received message resolve(")]
    assert len(received) == 1 and QUERY in received[0]
    assert KEY not in stream.getvalue()
    assert "Bearer ***" in received[0]
    failed = [line for line in lines(stream) if line["event"].startswith("Failed to process message")]
    assert QUERY not in json.dumps(failed)


def test_console_format_too() -> None:
    stream = configured("INFO", "console")
    run_failing_turn(QUERY)
    output = stream.getvalue()
    assert "Failed to process message resolve(message_id='" in output
    assert "Traceback (most recent call last)" in output
    assert "Where is my order" not in output and KEY not in output


def message() -> dramatiq.Message[Any]:
    return dramatiq.Message(
        queue_name="resolve", actor_name="resolve", args=({"query": QUERY},), kwargs={}, options={}, message_id="m-1"
    )


@pytest.mark.parametrize(
    ("logger", "level", "fmt", "extra"),
    [  # every dramatiq 2.2 call that renders a message (worker.py)
        ("dramatiq.worker.WorkerThread", logging.WARNING, "Message %s was skipped.", ()),
        (
            "dramatiq.worker.WorkerThread",
            logging.INFO,
            "Failed to process message %s with expected exception %s.",
            ("ValueError",),
        ),
        ("dramatiq.worker.WorkerThread", logging.ERROR, "Failed to process message %s with unhandled exception.", ()),
        (
            "dramatiq.worker.ConsumerThread(resolve)",
            logging.WARNING,
            "Failed to post_process_message(%s) due to a connection error: %s\nThe operation will be retried in %s "
            "seconds until the connection recovers.",
            (ConnectionError("down"), 5),
        ),
        (
            "dramatiq.worker.ConsumerThread(resolve)",
            logging.ERROR,
            "Unhandled error during post_process_message(%s).  You've found a bug in Dramatiq.",
            (),
        ),
    ],
)
@pytest.mark.parametrize("proxy", [False, True])
def test_each_dramatiq_line_that_renders_a_message(
    logger: str, level: int, fmt: str, extra: tuple[Any, ...], proxy: bool
) -> None:
    stream = configured("INFO")
    msg: Any = dramatiq.MessageProxy(message()) if proxy else message()
    try:
        raise RuntimeError(f"while handling {QUERY}")
    except RuntimeError:
        logging.getLogger(logger).log(level, fmt, msg, *extra, exc_info=level >= logging.ERROR)
    [line] = lines(stream)
    assert "resolve(message_id='m-1')" in line["event"]
    assert "Where is my order" not in json.dumps(line)
    if level >= logging.ERROR:
        assert "RuntimeError: while handling <message content elided>" in line["exception"]


def test_the_filter_leaves_debug_records_and_foreign_arguments_alone() -> None:
    debug = logging.LogRecord(
        "dramatiq.worker.WorkerThread",
        logging.DEBUG,
        __file__,
        1,
        "Received message %s with id %r.",
        (message(), "m-1"),
        None,
    )
    assert ContentFreeMessages().filter(debug)
    assert QUERY in debug.getMessage()
    mine = logging.LogRecord("threadline", logging.INFO, __file__, 1, "rows %s of %s", ([1, 2], message()), None)
    assert ContentFreeMessages().filter(mine)
    assert mine.getMessage() == "rows [1, 2] of resolve(message_id='m-1')"
    theirs = logging.LogRecord(
        "dramatiq.actor", logging.INFO, __file__, 1, "Received args=%r kwargs=%r.", ((QUERY,), {"q": QUERY}), None
    )
    assert ContentFreeMessages().filter(theirs)
    assert theirs.getMessage() == "Received args=<1 items elided> kwargs=<1 items elided>."


def test_redact_secrets_processor() -> None:
    event = {
        "event": "model_error",
        "error": "Error code: 401 - {'error': {'headers': {'Authorization': 'Bearer " + KEY + "'}}}",
        "api_key": "abc",
        "token": 123,
        "usage": {"input_tokens": 3, "details": [f"url https://u:p@h/?key={KEY}"]},
        "ok": True,
    }
    assert redact_secrets(None, "info", event) == {
        "event": "model_error",
        "error": "Error code: 401 - {'error': {'headers': {'Authorization': 'Bearer ***'}}}",
        "api_key": "***",
        "token": "***",
        "usage": {"input_tokens": 3, "details": ["url https://***@h/?key=***"]},
        "ok": True,
    }


def test_configured_key_values_are_scrubbed_verbatim() -> None:
    stream = configured("INFO", OPENAI_API_KEY="opaque-value-1234", HOME="/home/someone")
    logs.add_secret("qwen-local-key-99")
    log = structlog.get_logger("threadline.test")
    log.info("upstream said", body="bad key opaque-value-1234 and qwen-local-key-99 in /home/someone")
    [line] = lines(stream)
    assert line["body"] == "bad key *** and *** in /home/someone"


def test_python_warnings_are_log_lines_and_a_deprecated_model_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-ai warns on each request to a model its provider deprecated; a worker logs it as one
    JSON line naming the model and its replacement, and every other warning as a line of its own
    whose text, which may hold a value, is left for DEBUG."""
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel
    from pydantic_ai.profiles import ModelDeprecation, ModelProfile

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
    stream = configured("INFO")
    deprecation = ModelDeprecation(source_url="https://example.invalid/deprecations", replacement="claude-sonnet-5-5")
    model = TestModel(model_name="claude-sonnet-4-5", profile=ModelProfile(deprecation=deprecation))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        Agent(model).run_sync("hello")
        warnings.warn(f"Expected `str` but got `int` with value {QUERY!r}", UserWarning, stacklevel=1)
        warnings.warn("pass `keys=` instead", DeprecationWarning, stacklevel=1)
    output = lines(stream)  # every line is JSON
    deprecated = [line for line in output if line["event"] == "model_deprecated"]
    assert len(deprecated) == 1 and deprecated[0]["level"] == "warning"
    assert "is deprecated by its provider" in deprecated[0]["detail"]
    assert "claude-sonnet-5-5" in deprecated[0]["detail"]
    others = [line for line in output if line["event"] == "python_warning"]
    assert [line["category"] for line in others] == ["UserWarning", "DeprecationWarning"]
    assert "detail" not in others[0] and QUERY not in json.dumps(output)
    assert others[1]["detail"] == "pass `keys=` instead" and others[1]["source"].startswith(__file__ + ":")


@pytest.mark.parametrize("package", ["httpx", "httpx2"])
def test_the_http_clients_request_lines_stay_out_of_info(package: str) -> None:
    """Every model call is an HTTP request through httpx or httpx2 (the provider SDKs' and
    pydantic-ai's client), each of which logs a line per request at INFO."""
    import importlib

    http = importlib.import_module(package)
    stream = configured("INFO")
    with http.Client(transport=http.MockTransport(lambda request: http.Response(200))) as client:
        client.get("http://model.invalid/v1/messages")
    logging.getLogger(package).warning("kept: a warning still shows")
    assert [line["event"] for line in lines(stream)] == ["kept: a warning still shows"]


def test_lines_are_made_without_the_lookups_none_of_them_prints() -> None:
    """The caller's file and line, the thread and the process of a record are not looked up (no
    line prints them); the logging module's defaults come back with `record_lookups(True)`."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            seen.append(record)
            return True

    stream = configured("INFO")
    logging.getLogger().handlers[0].addFilter(Keep())
    try:
        structlog.get_logger("t").info("plain", n=1)
        logs.record_lookups(True)
        structlog.get_logger("t").info("looked_up", n=2)
    finally:
        logs.record_lookups(False)
    plain, looked_up = seen
    assert (plain.lineno, plain.threadName, plain.process) == (0, None, None)
    assert looked_up.lineno > 0 and looked_up.threadName and looked_up.process
    assert [line["event"] for line in lines(stream)] == ["plain", "looked_up"]
