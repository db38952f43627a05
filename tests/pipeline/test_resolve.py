"""Turn request parsing, config documents and the resolve stage's decisions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from threadline.pipeline.config import AgentConfig, expand_variables, parse_agent_config, whitelisted_settings
from threadline.pipeline.contracts import (
    extract_conversation_id,
    extract_turn_id,
    new_conversation_id,
    parse_turn_request,
    valid_turn_id,
)
from threadline.pipeline.errors import Forbidden, InvalidRequest, SessionConfigurationChanged
from threadline.pipeline.records import ConversationRecord
from threadline.pipeline.resolve import ConfigRef, choose_config, resolve_turn


def request(**fields: Any) -> dict[str, Any]:
    return {"schema": "threadline.turn/v1", "tenant_id": "t", "app_id": "a", "user_id": "u", "agent_id": "bot",
            "query": "hello", **fields}


def parse(raw: object, limit: int = 100) -> Any:
    return parse_turn_request(raw, fallback_turn_id="msg-1", max_query_chars=limit)


def conversation(**fields: Any) -> ConversationRecord:
    base = {"id": "c1", "tenant_id": "t", "app_id": "a", "user_id": "u", "agent_id": "bot", "config_ref": "v2",
            "layers": ["history"], "tip": "m9"}
    return ConversationRecord.model_validate({**base, **fields})


CONFIG = AgentConfig.model_validate({"id": "bot", "model": "offline:echo", "instructions": "Help {{name}}.",
                                     "settings": {"temperature": 0.1}})


def test_request_from_json_text_or_object_and_turn_id_fallback() -> None:
    assert parse(json.dumps(request())).turn_id == "msg-1"
    assert parse(request(turn_id="t-1")).turn_id == "t-1"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (request(query=""), "query is empty"),
        (request(query="   \n"), "query is empty"),
        (request(query="x" * 101), "the limit is 100"),
        ({k: v for k, v in request().items() if k != "agent_id"}, "agent_id"),
        (request(schema="threadline.turn/v2"), "schema"),
        (request(surprise=1), "surprise"),
        (request(turn_id="has space"), "turn_id"),
        (request(turn_id="a:b"), "turn_id"),
        (request(turn_id="t" * 121), "turn_id"),
        (request(conversation_id="c:1"), "conversation_id"),
        (request(conversation_id="{c1}"), "conversation_id"),
        (request(agent_id="bot:v:1"), "agent_id"),
        (request(tenant_id="acme:other"), "tenant_id"),
        (request(user_id="-leading-dash"), "user_id"),
        (request(conversation_id="c1", parent_message_id="m:1"), "parent_message_id"),
        (request(invoke_from="draft"), "draft_id"),
        (request(deferred_tool_results={"calls": {"x": 1}}), "conversation_id"),
    ],
)
def test_bad_requests_are_invalid_with_a_clear_message(raw: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse(raw)


def test_turn_id_of_an_invalid_request_is_still_found() -> None:
    assert extract_turn_id(json.dumps({"turn_id": "t-9", "query": ""})) == "t-9"
    assert extract_turn_id("{oops") is None and extract_turn_id({"turn_id": "bad id"}) is None
    assert extract_turn_id({"turn_id": "a:b"}) is None
    assert extract_conversation_id({"conversation_id": "c-1", "query": ""}) == "c-1"
    assert extract_conversation_id({"conversation_id": "c:1"}) is None


def test_ids_name_no_other_key_and_a_first_turn_names_its_conversation() -> None:
    """No id holds `:` or braces, so none can name another turn's or conversation's key; a turn id
    is short enough that the conversation it starts, `c-<turn_id>`, is a valid id too."""
    longest = "t" * 120
    assert valid_turn_id(longest) == longest and valid_turn_id("t" * 121) is None
    assert valid_turn_id("user@example.com_1.2-3") == "user@example.com_1.2-3"
    assert valid_turn_id("tl:turn:x") is None and valid_turn_id(7) is None
    assert new_conversation_id("t-1") == "c-t-1"
    assert parse(request(conversation_id=new_conversation_id(longest))).conversation_id == f"c-{longest}"
    first = resolve(request(turn_id="t-1"))[0]
    assert first.conversation_id == "c-new" and first.new_conversation


def test_new_conversation_uses_the_active_version_and_existing_one_keeps_its_own() -> None:
    assert choose_config(parse(request()), None) == ConfigRef("active")
    assert choose_config(parse(request(conversation_id="c1")), conversation()) == ConfigRef("version", "2")
    draft = parse(request(invoke_from="draft", draft_id="d1"))
    assert choose_config(draft, None) == ConfigRef("draft", "d1")


def test_draft_and_published_surfaces_do_not_mix() -> None:
    with pytest.raises(Forbidden):
        choose_config(parse(request(invoke_from="draft", draft_id="d1", conversation_id="c1")), conversation())
    with pytest.raises(Forbidden):
        choose_config(parse(request(conversation_id="c1")), conversation(config_ref="draft:d1"))


def resolve(req: dict[str, Any], conv: ConversationRecord | None = None, config: AgentConfig = CONFIG) -> Any:
    return resolve_turn(parse(req), conversation=conv, config=config, config_ref="v2", new_conversation_id="c-new",
                        now=100.0)


def test_resolve_pins_config_expands_variables_and_whitelists_settings() -> None:
    resolved, decision = resolve(request(inputs={"name": "Ada"}))
    assert resolved.instructions == "Help Ada."
    assert resolved.conversation_id == "c-new" and resolved.parent_message_id is None
    assert resolved.config.settings == {"temperature": 0.1, "max_tokens": 1024}
    assert resolved.deadline_s == 120 and decision.missing_variables == []
    _, decision = resolve(request())
    assert decision.missing_variables == ["name"]


def test_existing_conversation_continues_from_the_tip_or_branches() -> None:
    assert resolve(request(conversation_id="c1"), conversation())[0].parent_message_id == "m9"
    assert resolve(request(conversation_id="c1", parent_message_id="m3"), conversation())[0].parent_message_id == "m3"
    assert resolve(request(conversation_id="c1", parent_message_id="root"), conversation())[0].parent_message_id is None


def test_a_parent_outside_the_conversation_is_refused_before_anything_else() -> None:
    """The shell looked the parent up in the conversation; a message of another conversation is
    refused as bad input (the shell writes nothing before resolve succeeds)."""
    foreign = request(conversation_id="c1", parent_message_id="m-of-c2")
    with pytest.raises(InvalidRequest, match="not in this conversation"):
        resolve_turn(parse(foreign), conversation=conversation(), config=CONFIG, config_ref="v2",
                     new_conversation_id="c-new", now=100.0, parent_known=False)
    known, _ = resolve_turn(parse(foreign), conversation=conversation(), config=CONFIG, config_ref="v2",
                            new_conversation_id="c-new", now=100.0, parent_known=True)
    assert known.parent_message_id == "m-of-c2"


def test_scope_is_checked() -> None:
    with pytest.raises(Forbidden):
        resolve(request(conversation_id="c1", user_id="someone-else"), conversation())
    with pytest.raises(Forbidden):
        resolve(request(conversation_id="c1", tenant_id="other"), conversation())


def test_layer_topology_change_ends_the_session_but_value_edits_keep_it() -> None:
    changed = CONFIG.model_copy(update={"layers": ["history", "tools"]})
    with pytest.raises(SessionConfigurationChanged) as e:
        resolve(request(conversation_id="c1"), conversation(), changed)
    assert e.value.code == "agent_session_configuration_changed"
    edited = CONFIG.model_copy(update={"instructions": "Totally new prompt."})
    assert resolve(request(conversation_id="c1"), conversation(), edited)[0].instructions == "Totally new prompt."


def test_resume_must_answer_exactly_the_pending_calls() -> None:
    paused = conversation(pending_tool_calls=[{"tool_call_id": "call-1", "name": "ask_human", "args": {}}])
    ok = resolve(request(conversation_id="c1", query="", deferred_tool_results={"calls": {"call-1": "blue"}}), paused)
    assert ok[0].deferred_answers == {"call-1": "blue"}
    with pytest.raises(InvalidRequest, match="unknown or already answered"):
        resolve(request(conversation_id="c1", query="", deferred_tool_results={"calls": {"call-2": "x"}}), paused)
    with pytest.raises(InvalidRequest, match="nothing to resume"):
        resolve(request(conversation_id="c1", query="", deferred_tool_results={"calls": {"call-1": "x"}}),
                conversation())


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("id: x\nmodel: offline:echo\nsettings: {seed: 3}\n", "settings not allowed"),
        ("id: x\nmodel: {provider: openai, name: gpt, api_key: sk-123}\n", "never put an API key"),
        ("id: x\nmodel: offline:echo\ntools: [rm_rf]\n", "unknown tools"),
        ("id: x\nmodel: nonsense\n", "provider:name"),
        ("- not a mapping\n", "must be a mapping"),
        ("id: x\nmodel: offline:echo\n  bad: [indent\n", "not valid YAML"),
    ],
)
def test_bad_configs_are_refused_with_a_clear_message(doc: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_agent_config(doc)


def test_settings_whitelist_and_variables() -> None:
    assert whitelisted_settings({"temperature": 1, "seed": 2, "top_p": 0.5}) == {"temperature": 1, "top_p": 0.5}
    assert expand_variables("Hi {{ name }}, {{missing}}!", {"name": "Ada"}) == ("Hi Ada, !", ["missing"])
