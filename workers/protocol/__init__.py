"""The wire and storage protocol: queue and actor names, Redis keys, how records sit in hashes, and
dramatiq's message bytes. Imports nothing else of `workers/`, and no dramatiq, pydantic-ai or redis:
anyone may import it (the record types it lays out come from `pipeline/`, loaded where a record is built)."""
