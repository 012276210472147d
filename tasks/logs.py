"""Log lines from every thread of a stage task reach that task's run logs in the Prefect UI.

How Prefect 3.9 decides where a record goes (prefect/logging/handlers.py, ``APILogHandler.prepare``): it reads
``record.flow_run_id`` / ``record.task_run_id`` and, when they are absent, the run context of the EMITTING thread
(``get_run_context()``, a contextvar). Threads started by the library (the extraction writer, the progress reporter,
``eagle3.support.subproc``'s output readers) begin with an empty context, so their records have no flow run id and are
dropped with "attempted to send logs to the API without a flow run id".

``logs_from_all_threads()`` puts a filter on Prefect's API log handlers for as long as the task runs: a record that
carries no run id and comes from a thread without a run context gets the ids of the task that entered the block.
Records from threads that have a context of their own (Prefect's, or another task's) are left alone. While two such
blocks are open at once in one process (tasks running concurrently in threads), context-less records go to the one
entered last. The library stays free of Prefect: it only logs to ``logging.getLogger("eagle3...")``; that logger
reaches the API handler through PREFECT_LOGGING_EXTRA_LOGGERS=eagle3 (tasks/prefect_env.py).

``tag_run_logs()`` makes every line a run sends to the API say which stage wrote it: the API handlers get a formatter
that starts each message with ``[<task name>]`` (the stage: ``[train-draft]``, ``[describe-prompts]``), or with
``[<flow name>]`` for the flow's own lines. Prefect's lines carry no tag of their own ("Finished in state
Completed()" once per task), nor do some library lines ("holding host-cpu"). A library tag that names a word of the
stage (``[train]`` in train-draft, ``[data]`` in prepare-data) gives way to the stage's name; any other stays after
it (``[validate-draft] [vllm] ...``). The Prefect UI's Logs tab shows the message and the logger, not the task run,
so the tag is the only place a reader finds the stage. Only the API's copy is tagged; the console keeps Prefect's
own "Task run '<name>'" format.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from uuid import UUID

_lock = threading.Lock()
_scopes: list[tuple[UUID, UUID | None, str | None]] = []  # (flow_run_id, task_run_id, task name) of the open
# blocks, innermost last
_installed: list[logging.Handler] = []  # the API handlers that carry the filter while any block is open


class _RunIdsForThreadsWithoutContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "flow_run_id", None) or not _scopes:
            return True
        from prefect.context import FlowRunContext, TaskRunContext

        if TaskRunContext.get() is None and FlowRunContext.get() is None:  # this thread has no run of its own
            with contextlib.suppress(IndexError):  # the last block may close while this record is in flight
                record.flow_run_id, record.task_run_id, record.task_name = _scopes[-1]
        return True


_FILTER = _RunIdsForThreadsWithoutContext()


def _api_handlers() -> list[logging.Handler]:
    """Every run-log API handler of this process (one instance, shared by prefect.flow_runs, prefect.task_runs,
    prefect.extra and the extra loggers), but not the worker's handler, whose records need a worker id instead."""
    from prefect.logging.handlers import APILogHandler, WorkerAPILogHandler

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    found: dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, APILogHandler) and not isinstance(h, WorkerAPILogHandler):
                found[id(h)] = h
    return list(found.values())


def _current_run_ids() -> tuple[UUID, UUID | None, str | None] | None:
    from prefect.context import FlowRunContext, TaskRunContext

    if (task_ctx := TaskRunContext.get()) is not None:
        return task_ctx.task_run.flow_run_id, task_ctx.task_run.id, task_ctx.task.name
    if (flow_ctx := FlowRunContext.get()) is not None and flow_ctx.flow_run is not None:
        return flow_ctx.flow_run.id, None, None
    return None


_LEADING_TAG = re.compile(r"\[([\w.-]+)\] ?")


def stage_of(record: logging.LogRecord) -> str | None:
    """The stage that wrote ``record``: the task's name (Prefect's task-run loggers name it; records from threads
    without a run context got it from ``logs_from_all_threads``; else the emitting thread's task run), or the flow's
    name for the flow's own lines; None outside any run."""
    if name := getattr(record, "task_name", None):
        return name
    from prefect.context import FlowRunContext, TaskRunContext

    if (task_ctx := TaskRunContext.get()) is not None:
        return task_ctx.task.name
    if name := getattr(record, "flow_name", None):
        return name
    if (flow_ctx := FlowRunContext.get()) is not None and flow_ctx.flow is not None:
        return flow_ctx.flow.name
    return None


def with_stage_tag(stage: str | None, message: str) -> str:
    """``[stage] message``; a leading library tag that names a word of the stage gives way to it."""
    if not stage:
        return message
    if (m := _LEADING_TAG.match(message)) and (m.group(1) == stage or m.group(1) in stage.split("-")):
        message = message[m.end():]
    return f"[{stage}] {message}"


class StageTagFormatter(logging.Formatter):
    """The API handlers' formatter: every message a run sends starts with its stage (``with_stage_tag``)."""

    def format(self, record: logging.LogRecord) -> str:
        return with_stage_tag(stage_of(record), super().format(record))


def tag_run_logs() -> None:
    """Put ``StageTagFormatter`` on this process's run-log API handlers (idempotent). Call after Prefect set up its
    logging (``import prefect``) and before the run: at the import of the flow module and when a stage starts."""
    for h in _api_handlers():
        if not isinstance(h.formatter, StageTagFormatter):
            h.setFormatter(StageTagFormatter())


@contextlib.contextmanager
def logs_from_all_threads() -> Iterator[None]:
    """Inside a task (or flow) run: records logged from any thread without a run context while the block runs go
    to this run's logs. Outside a run (``task.fn()`` in unit tests) it does nothing."""
    ids = _current_run_ids()
    if ids is None or ids[0] is None:  # a task run outside any flow run has no flow run to log to
        yield
        return
    tag_run_logs()
    with _lock:
        if not _scopes:
            _installed[:] = _api_handlers()
            for h in _installed:
                h.addFilter(_FILTER)
        _scopes.append(ids)
    try:
        yield
    finally:
        with _lock:
            _scopes.remove(ids)
            if not _scopes:
                for h in _installed:
                    h.removeFilter(_FILTER)
                _installed.clear()
