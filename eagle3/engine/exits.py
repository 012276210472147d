"""Exit codes of the vLLM drivers (besides 0 and Python's 1 for an uncaught error), read by the engine job runner.

Standard library only: the drivers import it in the vLLM environment.
"""

EXIT_OOM = 3  # out of memory with the in-job budget at its floor (eagle3.engine.oom)
EXIT_SELFCHECK = 4  # extraction's self-check found batch-dependent states (eagle3.extract.selfcheck)
EXIT_INCOMPLETE = 5  # the driver finished but some of its output never reached the disk
