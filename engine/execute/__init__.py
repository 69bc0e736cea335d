"""What one forward runs on: the device side of a step and the host state it reads.

- runner.py: `ModelRunner`, a model's params and KV pools on the device and its output
  layer; `RunnerConfig` sizes them.
- ragged_calls.py: a step's rows (decode, verify, prefill chunks) laid out as one ragged
  call of model/ragged.py, padded to a token bucket, jitted once per shape.
- sampling.py: token sampling inside the jitted call (adjustments, greedy, top-k/p,
  min-p, seeds) and lossless verification of drafts.
- penalties.py: the host side of the logit adjustments (repetition, presence, frequency,
  min_tokens), written as sparse entries for sampling.
- sequence.py: the host-side state of one request while the engine works on it, and
  its detokenizer.
"""
