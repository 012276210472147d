"""Following a file another process writes, while it runs: the one follower of the pipeline's subprocesses (the
extraction driver's store manifest, the regeneration driver's journal, training rank 0's log).

``LineTail`` reads the complete lines appended since its last read (a torn last line waits for its newline; a file
rewritten under it, by inode or size, is read again from its start: the caller ignores what it already saw).
``following(poll)`` calls ``poll()`` on a thread every ``every_s`` seconds while the block runs and once more after
it, so the last lines the process wrote before it ended are read too.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class LineTail:
    """Complete new lines of ``path`` from the current end (``from_start``: from the beginning)."""

    def __init__(self, path: str | os.PathLike, from_start: bool = False):
        self.path = Path(path)
        st = self.path.stat() if self.path.exists() and not from_start else None
        self.offset, self.inode = (st.st_size, st.st_ino) if st else (0, None)

    def lines(self) -> list[bytes]:
        """The complete lines written since the last call (without their newlines)."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            if (self.inode is not None and st.st_ino != self.inode) or st.st_size < self.offset:
                self.offset = 0  # rewritten (a repair, a restart): read it again from the start
            self.inode = st.st_ino
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].splitlines()

    def json_lines(self) -> list[dict[str, Any]]:
        """The new complete lines that are JSON objects (others are skipped)."""
        out = []
        for line in self.lines():
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                if line.strip():
                    entry = json.loads(line)
                    if isinstance(entry, dict):
                        out.append(entry)
        return out

    def text_lines(self) -> list[str]:
        return [line.decode("utf-8", errors="replace") for line in self.lines()]


@contextlib.contextmanager
def following(poll: Callable[[], None] | None, every_s: float = 0.5, name: str = "eagle3-follow") -> Iterator[None]:
    """Run ``poll()`` every ``every_s`` seconds on a daemon thread while the block runs, then once more after it
    (nothing when ``poll`` is None). An exception in ``poll`` ends the thread and is re-raised at the block's end
    unless the block itself raised."""
    if poll is None:
        yield
        return
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            while not stop.wait(every_s):
                poll()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=30)
    if errors:
        raise errors[0]
    poll()  # what was written after the thread's last look
