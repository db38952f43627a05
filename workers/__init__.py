"""Threadline's shell: settings, the Redis store, the broker, the five stage actors, control and CLI."""
