"""The engine loop: one synchronous step, schedule -> execute -> update.

- core.py: `EngineCore`: an inbox of commands from any thread; `step()` on the engine
  thread plans, runs one ragged step, samples, and emits `TokenEvent`s.
- scheduler.py: continuous batching with chunked prefill, page-aware admission and
  preemption; each step's plan.
- ragged_step.py: one plan as ragged calls: the decode rows draft by their (technique,
  depth), then one forward verifies and prefills everything.
- ahead.py: a plain decode step dispatches the next step's call before reading its own
  tokens (fed on the device); the next step takes it when its own plan is that call.
- chooser.py: `StepChooser`, the serving policy applied per row each step (a tenant
  rule's choice, else the batch's).
- faults.py: fault containment: a sequence's own fault ends that sequence alone.
"""
