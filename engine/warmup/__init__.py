"""Before serving: every shape compiled, then every compiled shape run once.

- warm.py: compile (or load from the persistent cache) every ragged call on the engine
  thread, then the proposers' shapes, in the background when asked (the fast start).
- first_runs.py: run each compiled ragged shape once, since a first execution costs far
  more than the later ones.
"""
