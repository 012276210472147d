"""Shared helpers used by every stage (files, paths, progress, subprocesses, GPUs, dtypes, plots, ...)."""
