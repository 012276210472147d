"""Provenance saved beside every model the project writes: package versions and the git revision."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from eagle3.support.paths import REPO_ROOT


def git_revision(root: str | Path | None = None) -> str | None:
    """``<sha>`` or ``<sha>-dirty`` of the checkout holding this package; None outside git."""
    root = Path(root) if root else REPO_ROOT
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def versions() -> dict[str, str]:
    import safetensors
    import tokenizers
    import torch
    import transformers

    import eagle3

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
            "eagle3": getattr(eagle3, "__version__", "unknown")}
