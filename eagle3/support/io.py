"""Crash-safe file writes and content fingerprints shared by every stage.

Every artifact is written to a temporary name in the destination folder and renamed into place, so a crash
never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

_CHUNK_BYTES = 1 << 20
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same folder + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; artifacts are shared files like any other (usual_mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def usual_mode(path: str | os.PathLike) -> None:
    """Give a file the mode any new file gets under this process's umask (0644 under umask 022): writers that
    create files owner-only (safetensors: 0600, mkstemp) would make an artifact unreadable to a vLLM server or a
    colleague running under another account."""
    os.chmod(path, 0o666 & ~_UMASK)


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """``safetensors.torch.save_file`` with the usual file mode (``usual_mode``): THE way eagle3 writes a
    safetensors file to a path (callers write to a temp path and rename, e.g. inside ``atomic_path``)."""
    from safetensors.torch import save_file  # late: this module is imported where only the stdlib is wanted

    save_file(tensors, str(path), metadata=metadata)
    usual_mode(path)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to ``path`` for writers that need a file name (safetensors, save_to_disk).

    The temp file or folder is renamed to ``path`` when the block succeeds and removed when it fails.
    An existing folder at ``path`` is replaced.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    _remove(tmp)
    try:
        yield tmp
        if tmp.is_dir() and path.exists():
            old = path.parent / f".{path.name}.{os.getpid()}.old"
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Fingerprint of a JSON-serialisable value (key order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint_paths(paths: Iterable[str | os.PathLike], skip_suffixes: tuple[str, ...] = (".tmp",)) -> str:
    """Content fingerprint of files and folders (relative names + bytes), independent of where they lie."""
    h = hashlib.sha256()
    for root in sorted(Path(p) for p in paths):
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        for f in files:
            rel = f.relative_to(root.parent if root.is_file() else root)  # hidden entries BELOW the root are skipped
            if f.name.endswith(skip_suffixes) or (root.is_dir() and any(p.startswith(".") for p in rel.parts)):
                continue
            h.update(str(rel).encode())
            h.update(sha256_file(f).encode())
    return h.hexdigest()
