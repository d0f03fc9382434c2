"""The checking harness: a whole DP deployment in miniature, simulated and explored.

The protocol modules (``rank``, ``rank_loop``, ``coordinator``, ``scaling``) know
nothing of it. Here they run against modelled effects: ``network`` (FIFO channels),
``toy`` (a scheduler of toy requests), ``client`` (the client's view and its refusals),
``world`` (everything together, one move at a time), ``invariants`` (the properties
checked after every move), ``reduction`` (the state key that merges equivalent
states), ``explore`` (every interleaving, breadth first) and ``variants`` (broken
rules the checks must catch).
"""
