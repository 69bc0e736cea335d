"""The process around the engine: no module here imports another part of the engine.

- allocator.py: glibc allocator tunables (huge pages) read before anything heavy
  loads; the CLI restarts itself once to apply them.
- compiles.py: jit lowering counts (warmup vs serving), `abstract` argument specs for
  ahead-of-time lowering, the persistent compilation cache, host-memory trimming.
- progress.py: the `progress(label, done, total)` callback long operations report
  through; the daemon draws it, the engine never does.
"""
