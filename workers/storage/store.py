"""The Redis store of record, as the stage runners use it (async): one object made of its parts by
noun — turns (`turns.py`), conversations (`conversations.py`), model-call slots (`slots.py`), completion
webhooks (`webhooks.py`) — over
one connection (`base.py`). Every key comes from `protocol/keys.py`; every write that must hang
together is one of the scripts in `scripts/`, one typed method each."""

from __future__ import annotations

from threadline.workers.storage.conversations import ConversationStore
from threadline.workers.storage.slots import SlotStore
from threadline.workers.storage.turns import TurnStore
from threadline.workers.storage.webhooks import WebhookStore


class Store(TurnStore, ConversationStore, SlotStore, WebhookStore):
    """The whole store: what a worker's runtime holds (`rt.store`)."""
