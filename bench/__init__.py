"""Threadline's benchmark suite (issue 6): idle latency, idle load, throughput and time to first
token, each measured against a bare five-actor dramatiq chain in the same run.

Run it with `python -m bench.run` (see `bench/run.py`). Nothing here is collected by the test
suite: benchmarks start their own server and worker processes and take minutes.
"""
