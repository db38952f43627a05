"""The consuming side: the worker process and its supervisor, the broker, actors, one runner per stage kind,
cancellation, the watchdog, models and token counting, middleware. Imported by nothing but the CLI's `worker` and
`demo` verbs (and tests); `python -m threadline.workers.worker` runs one process."""
