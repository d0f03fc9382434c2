"""What the scheduler hands an executor and what comes back (`batch`), and the null
executor: deterministic tokens at no cost, for protocol tests and benchmarks."""
