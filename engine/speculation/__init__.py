"""Speculative decoding: who proposes draft tokens and what they are made of.

- proposers.py: the `Proposer` protocol and the n-gram (prompt lookup) proposer;
  proposals are point masses, so verification stays lossless.
- heads.py: the trained draft heads (MTP heads, early-exit adapters, draft vocabulary),
  one safetensors file per model.
- layer_draft.py: what the layer-based proposers share: draft-vocabulary slices and one
  ragged call of a layer stack.
- drafting.py: the model-based proposers: MTP heads and early-exit self-drafts, and
  `add_model_proposers`, which the loader calls.
- draft_model.py: the draft-model proposer, its KV lent by the policy's pool split.
- fake_speculation.py: the fake engine's proposers and cost model (engine/fake.py).
"""
