"""Threadline's pure domain: turn contracts, agent configs and the logic of the five stages.

Nothing here talks to a queue or to Redis, reads the clock or draws random ids: the shell in
`workers/` loads state, calls these functions and saves what they return.
"""
