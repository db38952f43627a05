"""The `threadline` command: one module per verb group, and the demo. Never imports the worker side, but
for `threadline worker` and `threadline demo`, which start it (`cli/serve.py`)."""
