"""The wire and storage protocol: queue and actor names, Redis keys, how records sit in hashes, and
dramatiq's message bytes. Imports nothing else of Threadline (no pydantic-ai, no dramatiq): anyone may import it."""
