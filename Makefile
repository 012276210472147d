# The two commands of the README. Both create the environments first (idempotent; scripts/setup_envs.sh).
.PHONY: setup demo test lint
PY := .venv/bin/python

setup:
	bash scripts/setup_envs.sh

demo: setup
	$(PY) -m flows.eagle3_pipeline --preset tiny

test: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check eagle3 tasks flows tests bench scripts
