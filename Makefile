# The two commands of the README. Both create the environments first (idempotent; scripts/setup_envs.sh).
.PHONY: setup demo demo-real demo-kimi test test-fast lint
PY := .venv/bin/python

setup:
	bash scripts/setup_envs.sh

demo: setup
	$(PY) -m flows.eagle3_pipeline --preset tiny

demo-real: setup
	$(PY) -m flows.eagle3_pipeline --preset smollm2

demo-kimi: setup  # Kimi-K2.5's architecture end to end (models/kimi-mini, an MLA draft, vLLM validation)
	$(PY) -m flows.eagle3_pipeline --preset kimi-mini

test: setup
	$(PY) -m pytest -q

test-fast: setup  # the quick tier: no vLLM, nothing marked slow (under 3 minutes on 2 cores)
	$(PY) -m pytest -q -m "not slow and not vllm"

lint: setup
	$(PY) -m ruff check eagle3 tasks flows tests bench scripts tools
