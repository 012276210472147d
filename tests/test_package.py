"""The library outside a checkout: every module of eagle3/ imports with the package copied elsewhere (as an install
puts it in site-packages), nothing reaches for checkout files at import time, and what needs the checkout (the
presets) says so in one clear line. Also the one direction of imports (eagle3 <- tasks <- flows; eagle3 never
imports Prefect)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def test_every_library_module_imports_outside_the_checkout(tmp_path):
    shutil.copytree(REPO / "eagle3", tmp_path / "site" / "eagle3", ignore=shutil.ignore_patterns("__pycache__"))
    modules = sorted(".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "eagle3").rglob("*.py")
                     if p.name != "__init__.py" and "vllm_" not in p.name)  # vllm_* modules import vllm
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "import eagle3\n"
        "assert eagle3.__file__.startswith(sys.argv[1]), eagle3.__file__\n"
        "from eagle3.config import ConfigError, load_config\n"
        "try:\n"
        "    load_config('tiny')\n"
        "except ConfigError as e:\n"
        "    print('preset error:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path, capture_output=True, check=False,
                         text=True, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "presets live in" in out.stdout and "installed outside a checkout" in out.stdout


def test_imports_go_one_way():
    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        return names

    for path in (REPO / "eagle3").rglob("*.py"):
        bad = imported(path) & {"prefect", "tasks", "flows"}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    for path in (REPO / "tasks").rglob("*.py"):
        assert "flows" not in imported(path), path


def test_library_has_no_import_cycle_and_no_file_over_600_lines():
    """Module-level imports between eagle3's modules form no cycle (imports inside functions are deliberate late
    imports and do not count), and no library file is over 600 lines."""
    def module_of(path: Path) -> str:
        parts = path.relative_to(REPO).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {module_of(p): p for p in (REPO / "eagle3").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:  # module level only
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    long = {str(p.relative_to(REPO)): n for p in modules.values() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


@pytest.mark.parametrize(("ci", "outcome"), [("true", "1 error"), ("", "1 skipped")])
def test_ci_cannot_pass_without_the_vllm_environment(ci, outcome):
    """A vLLM test without the vLLM environment skips on a developer's machine and FAILS under CI=true (a broken
    setup step must not give a green CI): the rule of tests/conftest.py, run here in a real pytest process."""
    env = {**os.environ, "CI": ci, "EAGLE3_VLLM_PYTHON": "/nonexistent/vllm/bin/python"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_extract_vllm.py::test_vllm_timeout_kills_process_group"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert outcome in out.stdout, out.stdout[-2000:]
    if ci:
        assert "CI=true and a vLLM test cannot run: vLLM interpreter not found" in out.stdout
