from hypothesis import given, settings, strategies as st
from pydantic_ai.messages import ModelRequest, SystemPromptPart
from tests.pipeline.test_mapping import _histories, _instructions, _dump
from pipeline.mapping import normalise_messages

def ok(h):
    return not any(isinstance(m, ModelRequest) and all(isinstance(p, SystemPromptPart) for p in m.parts) for m in h)

@settings(max_examples=3000)
@given(_histories.filter(ok), _instructions, st.booleans())
def test_x(history, instructions, repair_last):
    once, _ = normalise_messages(history, instructions=instructions, repair_last_response=repair_last)
    twice, _ = normalise_messages(once, repair_last_response=repair_last)
    assert _dump(twice) == _dump(once)
