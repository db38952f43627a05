"""Each tenant's namespace of ids: the tag the gateway appends to the turn and conversation ids a
tenant chooses (`order-1001` is stored as `order-1001@<tag>`, `workers/gateway/tenancy.py`), defined
once here so that whatever shows a tenant its ids — the gateway's answers, the completion webhooks'
bodies — takes out the same tag."""

from __future__ import annotations

import hashlib

#: "@" and 12 hex digits.
TAG_CHARS = 13


def tenant_tag(tenant_id: str) -> str:
    """The suffix of the tenant's namespace (deterministic: every process agrees)."""
    return "@" + hashlib.sha256(f"threadline.tenant\0{tenant_id}".encode()).hexdigest()[:TAG_CHARS - 1]
