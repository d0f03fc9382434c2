"""`wavecore generate` and `wavecore rank`: the command line, its demo prompts and
its latency summary."""
