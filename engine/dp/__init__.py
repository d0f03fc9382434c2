"""Data parallelism: the fleet of rank processes behind the front end.

`client` is the data-parallel core client; `launcher` starts, watches and reaps the
processes; `rank_process` is one rank's process (the same rank runner as in-process);
`coordinator_process` relays waves and loads; `collective` and `group_switch` are the
gloo all-reduces; `scaler` performs elastic scaling's script.

This package's __init__ imports nothing, so that the coordinator process stays light
(it never loads torch).
"""
