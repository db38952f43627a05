"""Redis as the store of record: the Lua scripts and their loader, the store split by noun (turns,
conversations, slots, webhooks), agent configs, API keys, and the embedded server. Imported by clients,
the worker side, the gateway, the CLI and operations; imports only `protocol`, `settings` and `pipeline`."""
