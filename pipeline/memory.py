"""Long-term memory's vocabulary: the records one user's memory holds
(profile facts and notes, bi-temporal, with provenance), the hard partition they live under
(`Scope`), how their values are cleaned and compared, and their JSON form. Its config
(`LongTermSpec`, `memory.long_term` of an agent config) lives with the rest of the config in
`config.py` and is re-exported here.

Extraction (`extraction.py`), consolidation (`consolidation.py`) and recall (`recall.py`) build on
these; the shell stores the records and passes time and ids in.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import (
    TypeAdapter,
    ValidationError,
)

from .config import OFFLINE_EXTRACTOR as OFFLINE_EXTRACTOR
from .config import LongTermSpec as LongTermSpec
from .config import MemoryLimits as MemoryLimits
from .config import Order as Order
from .config import ScopeKind
from .contracts import valid_id
from .errors import InvalidRequest, SnapshotCorrupt

Kind = Literal["fact", "note"]
Origin = Literal["extracted", "user", "operator"]

#: Fact keys are snake_case words (any script): at most this long.
MAX_KEY_CHARS = 64
#: What a spoken or model-made key means, in the canonical keys the offline extractor uses.
KEY_ALIASES: dict[str, str] = {
    "language": "preferred_language", "reply_language": "preferred_language", "answer_language": "preferred_language",
    "preferred_name": "name", "first_name": "name", "nickname": "name",
    "dietary_preference": "diet", "diet_preference": "diet",
    "city": "location", "home": "location", "residence": "location", "lives_in": "location",
}


# --- scope ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scope:
    """The hard partition one user's memory lives under. Built from the turn's own ids (validated ids
    hold no `/`, `:` or braces), so no partition string can name another's."""

    tenant_id: str
    user_id: str
    app_id: str | None = None
    agent_id: str | None = None

    def __post_init__(self) -> None:
        ids = [self.tenant_id, self.user_id, *(i for i in (self.app_id, self.agent_id) if i is not None)]
        if any(valid_id(i) is None for i in ids):
            raise InvalidRequest("a memory scope is made of valid ids")
        if self.app_id is not None and self.agent_id is not None:
            raise InvalidRequest("a memory scope narrows to an app or to an agent, not both")

    @property
    def user_tag(self) -> str:
        """`<tenant>/<user>`: shared by every partition of one user (one Redis Cluster hash slot, so
        forgetting everything about a user is one script over one slot)."""
        return f"{self.tenant_id}/{self.user_id}"

    @property
    def partition(self) -> str:
        """`<tenant>/<user>`, `<tenant>/<user>/app/<app>` or `<tenant>/<user>/agent/<agent>`."""
        if self.app_id is not None:
            return f"{self.user_tag}/app/{self.app_id}"
        if self.agent_id is not None:
            return f"{self.user_tag}/agent/{self.agent_id}"
        return self.user_tag


def scope_for(kind: ScopeKind, *, tenant_id: str, user_id: str, app_id: str, agent_id: str) -> Scope:
    """The partition a turn of (tenant, user, app, agent) reads and writes under the configured kind."""
    if kind == "app":
        return Scope(tenant_id, user_id, app_id=app_id)
    if kind == "agent":
        return Scope(tenant_id, user_id, agent_id=agent_id)
    return Scope(tenant_id, user_id)


# --- records ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a record came from: extracted from a turn (which one, by which extractor), or set by the
    user or an operator through the API."""

    origin: Origin
    conversation_id: str | None = None
    message_id: str | None = None
    turn_id: str | None = None
    extractor: str | None = None
    extractor_version: str | None = None


@dataclass(frozen=True, slots=True)
class MemoryRecord:
    """One version of a fact (`key` and `value`, one current per key) or a note (`value` is its text).

    Bi-temporal: `valid_at` is when the claim was made (the end of the turn it was extracted from, or
    the moment a user or operator set it), `recorded_at` when Threadline wrote it, `invalid_at` when a
    correction or an invalidation closed it (None: current). A closed record is kept, with the id of
    the record that superseded it, so its history stays readable."""

    id: str
    partition: str
    kind: Kind
    key: str | None
    value: str
    valid_at: float
    recorded_at: float
    source: Provenance
    invalid_at: float | None = None
    superseded_by: str | None = None
    vector: tuple[float, ...] | None = None

    @property
    def current(self) -> bool:
        return self.invalid_at is None

    @property
    def text(self) -> str:
        """A note's text (the same field as a fact's value)."""
        return self.value


def in_scope(record: MemoryRecord, scope: Scope) -> bool:
    """Whether `record` belongs to `scope`'s partition: every read filters by it, whatever storage returned."""
    return record.partition == scope.partition


def current_in_scope(records: Iterable[MemoryRecord], scope: Scope) -> list[MemoryRecord]:
    """The current records of `scope`'s partition, in the order given."""
    return [r for r in records if r.current and in_scope(r, scope)]


_RECORD: TypeAdapter[MemoryRecord] = TypeAdapter(MemoryRecord)


def record_to_json(record: MemoryRecord) -> bytes:
    return _RECORD.dump_json(record)


def record_from_json(data: bytes | str) -> MemoryRecord:
    """A stored record, or `SnapshotCorrupt` (never quoting the value: it is the user's data)."""
    try:
        return _RECORD.validate_json(data)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['type']}" for err in e.errors()[:3])
        raise SnapshotCorrupt(f"memory record is not valid: {where}") from None


# --- values -----------------------------------------------------------------------------------------

_KEY_JUNK = re.compile(r"[\W_]+")
#: Characters dropped from stored values: controls, format characters (zero-width, bidi overrides),
#: surrogates, private use, line and paragraph separators.
_DROPPED = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def fact_key(text: str) -> str | None:
    """A key as stored: NFKC, casefolded, non-word runs to `_`, at most `MAX_KEY_CHARS`, aliases
    resolved (`language` → `preferred_language`); None when nothing is left."""
    folded = _KEY_JUNK.sub("_", unicodedata.normalize("NFKC", text[: MAX_KEY_CHARS * 4]).casefold())
    key = folded.strip("_")[:MAX_KEY_CHARS].rstrip("_")
    return KEY_ALIASES.get(key, key) or None


def clean_value(text: str) -> str:
    """A value as stored: NFKC, control and format characters dropped, white space collapsed to one
    line (so no value can start a line of its own where it is rendered)."""
    if text.isprintable() and unicodedata.is_normalized("NFKC", text):
        return " ".join(text.split())  # the usual case, without a look at each character
    normal = unicodedata.normalize("NFKC", text)
    kept = "".join(" " if unicodedata.category(c) in _DROPPED else c for c in normal)
    return " ".join(kept.split())


def normalise_value(text: str) -> str:
    """What two values are compared by: cleaned, casefolded, trailing punctuation dropped
    ("Ada." and " ada" are the same name)."""
    folded = clean_value(text).casefold()
    end = len(folded)
    while end and (folded[end - 1].isspace() or unicodedata.category(folded[end - 1]).startswith("P")):
        end -= 1
    return folded[:end]


#: A word for ranking and similarity: one CJK ideograph or kana (those scripts write no spaces), or a
#: run of other letters and digits.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")
#: English function words: they say nothing about what a note is about.
STOPWORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "do", "does", "for", "from", "have", "i", "in",
    "is", "it", "its", "me", "my", "of", "on", "or", "so", "that", "the", "this", "to", "was", "we", "what", "when",
    "where", "which", "who", "will", "with", "you", "your",
    # what apostrophes leave: "I'm", "it's", "don't", "we'll", "you're", "I've", "I'd"
    "m", "s", "t", "ll", "re", "ve", "d",
})


def words(text: str) -> list[str]:
    """The words of `text` for ranking: NFKC, casefolded, stopwords left out."""
    return [w for w in _WORD.findall(unicodedata.normalize("NFKC", text).casefold()) if w not in STOPWORDS]
