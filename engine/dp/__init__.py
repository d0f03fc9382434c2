"""Data parallelism: one client, one coordinator process and N engine-rank processes.

`wavecore.engine.async_engine.open_engine` dispatches `dp_size > 1` here; see
`client` (the public API), `launcher` (processes and startup), `rank_process` (the busy
loop of one rank), `coordinator_process`, `collective` (the DP all-reduce),
`load_balancer` and `messages` (what travels between them).

This package's __init__ imports nothing, so that the coordinator process stays light
(it never loads torch).
"""
