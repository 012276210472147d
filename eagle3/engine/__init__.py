"""The vLLM engine layer: what every stage that starts a vLLM engine shares.

- ``settings.EngineSettings``: the engine's settings (interpreter, tensor parallel size, memory share, eager mode,
  remote code, job timeout), set once on the pipeline config beside the verifier and inherited by regeneration,
  extraction and validation; ``llm_kwargs`` turns them into ``vllm.LLM`` arguments, with the CPU rule in one place.
- ``job.run_engine_job``: one driver run in the vLLM interpreter: its job file, its own process group holding the GPU
  guard's lock descriptors, its whole output in a log file with the pipeline's lines in the log, a follower thread
  for progress, the timeout, and the exit codes drivers use (``EXIT_OOM``, ...).
- ``oom.HalvingBudget``: the in-job out-of-memory rule (halve a batch budget down to its floor), used by the drivers
  and by the transformers extraction alike; what counts as out of memory is ``eagle3.support.gpu.is_oom_error`` /
  ``is_oom_text``.

Imports here stay light (pydantic, the standard library): the vLLM-side drivers import ``oom`` and the job codes.
"""
