"""Double texting: what a turn does when its conversation is busy (a turn of it runs or waits).

`on_busy` is a turn request's field, with a default in its agent's config. The decision itself is
taken atomically on the server (`submit.lua` when the producer names the policy, `admit.lua`
otherwise: `prelude.lua`'s `on_busy`), so two turns sent at once cannot both pass a `reject`; what is
here is the vocabulary and the pure steps the shell and its scripts share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, get_args

from .errors import ConversationBusy

#: `enqueue` waits in the conversation's line (in submission order); `reject` is refused at once
#: (`conversation_busy`, nothing written); `interrupt` cancels the running turn (its partial answer
#: kept, marked `interrupted_by`) and runs next, before every other waiting turn; `rollback` is
#: `interrupt` whose cancelled turn leaves no message in the thread.
OnBusy = Literal["enqueue", "reject", "interrupt", "rollback"]
ON_BUSY_POLICIES: Final[tuple[OnBusy, ...]] = get_args(OnBusy)
DEFAULT_ON_BUSY: Final[OnBusy] = "enqueue"


def on_busy_of(requested: OnBusy | None, agent_default: OnBusy) -> OnBusy:
    """The policy a turn runs with: its request's, else its agent's."""
    return requested if requested is not None else agent_default


def named_on_busy(value: object) -> str:
    """The policy an unchecked request names ("" when none, or not one of the policies: the workers
    refuse such a request anyway)."""
    return value if isinstance(value, str) and value in ON_BUSY_POLICIES else ""


def interrupts(policy: str) -> bool:
    """Whether the policy cancels the turns in its way (and so must name them to its script)."""
    return policy in ("interrupt", "rollback")


def interrupt_victims(turn_id: str, holder: str | None, ahead: Sequence[tuple[str, float]],
                      own_score: float | None) -> list[str]:
    """The turns an interrupting turn cancels, in the order its script lists them (prelude.lua's
    `busy_victims`): the conversation's holder, then the interrupting turns placed before it (those
    with a negative place in the line, ahead of the turn's own place when it has one already), so
    that of two corrections sent at once the later one wins."""
    victims = [holder] if holder and holder != turn_id else []
    for member, score in ahead:
        in_front = score < 0 and (own_score is None or own_score >= 0 or score < own_score)
        if in_front and member != turn_id and member != holder:
            victims.append(member)
    return victims


def interrupt_reason(turn_id: str) -> str:
    """The cancel reason an interrupted turn is given (its cancel flag's value)."""
    return f"interrupted by turn {turn_id}"


def busy_error(conversation_id: str, ahead: str = "") -> ConversationBusy:
    """The refusal of a `reject` turn: the conversation has a turn running or waiting."""
    who = f" (turn {ahead})" if ahead else ""
    return ConversationBusy(f"conversation {conversation_id} has a turn running or waiting{who}; "
                            "on_busy=reject refuses the new turn")
