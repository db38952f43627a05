"""The producers' Python API: `Client` and `AsyncClient` over shared helpers. Imported by the gateway, the CLI and
users; never imports the worker side, the gateway or the CLI."""
