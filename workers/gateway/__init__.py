"""The HTTP + Server-Sent Events gateway and the web console it serves. Imported by the CLI's `gateway`
verb; never imports the worker side."""
