"""What an operator asks a running deployment: status, dead letters, usage, and the /metrics, /healthz,
/livez server. Never imports the worker side: the queue list comes from the stage graph."""
