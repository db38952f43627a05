"""Threadline's shell, in rooms by role: `protocol` (names, keys, record schema, message bytes),
`storage` (scripts and the store), `clients`, `gateway`, `cli`, `worker` (the consuming side), `telemetry`
and `operations`; `settings` is read once and shared by all. Each room's `ruff.toml` says what it may import."""
