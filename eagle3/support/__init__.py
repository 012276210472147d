"""Support modules shared by the stages: files, paths, dtypes, the verifier, GPUs, subprocesses, progress."""
