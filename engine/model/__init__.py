"""The Gemma 3 model and its files: pure functions over a params pytree, and how it loads.

- gemma.py: the text decoder (embedding, attention over paged KV views, MLP, tied
  logits) as pure functions; the layout of `Params`.
- ragged.py: one forward over a flat token axis, every token of a step of any row in one
  call (the only forward the engine runs).
- sharding.py: tensor parallelism: params and KV pools placed over a 1-D device mesh.
- gguf_file.py: GGUF files: the default file, its cached sha256, a fast header parser.
- weights.py: load a GGUF or a Hugging Face folder into `Params`.
- weights_cache.py: the converted weights, one .npy per leaf, memory-mapped on later loads.
- quant_weights.py: the weights served quantized (`--weights gguf|int8`): QuantWeight leaves
  from a GGUF's own blocks or int8 of float weights, cached; float32 where the kernel is missing.
- tokenizer.py: the SentencePiece tokenizer rebuilt from the GGUF's vocabulary.
- chat.py: Gemma's chat turn template.
"""
