"""tasks.logs: inside a task, lines logged from a plain thread and lines streamed from a subprocess by
eagle3.support.subproc reach that task run's logs. Prefect's test harness (a real temporary server); the logs are read back
through the API's log endpoint, with a deadline (log shipping is batched and asynchronous)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid

import pytest

from eagle3.support.subproc import run_subprocess

log = logging.getLogger("eagle3.extract")


def _log_from_a_thread(message: str) -> None:
    t = threading.Thread(target=log.info, args=("%s", message))  # a fresh thread: no Prefect run context
    t.start()
    t.join()


@pytest.fixture
def eagle3_info_logs():
    """The flow module sets the library's logger to INFO; Prefect's root logger stays at WARNING."""
    lg = logging.getLogger("eagle3")
    previous = lg.level
    lg.setLevel(logging.INFO)
    yield
    lg.setLevel(previous)


def _read_messages(flow_run_id, want: set[str], deadline_s: float = 60.0) -> dict[str, object]:
    """message -> task_run_id of this flow run's logs, once every string of ``want`` is in some message."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            found = {entry.message: entry.task_run_id for entry in logs}
            if all(any(w in m for m in found) for w in want) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def test_thread_and_subprocess_lines_reach_the_task_run_logs(prefect_harness, eagle3_info_logs):
    from prefect import flow, task
    from prefect.logging.handlers import APILogHandler

    from tasks.logs import logs_from_all_threads

    assert any(isinstance(h, APILogHandler) for h in logging.getLogger("eagle3").handlers), (
        "the eagle3 logger has no API handler: PREFECT_LOGGING_EXTRA_LOGGERS=eagle3 was not set before Prefect "
        "was imported (tasks/prefect_env.py)")
    marker = uuid.uuid4().hex[:12]

    @task(name="threaded-stage")
    def threaded_stage() -> str:
        from prefect.runtime import task_run

        _log_from_a_thread(f"{marker} control: thread outside the block")  # what every stage did until now
        with logs_from_all_threads():
            _log_from_a_thread(f"{marker} thread")
            run_subprocess([sys.executable, "-c", f"print('{marker} subprocess')"], log_prefix="[sub] ",
                           timeout_s=60).check()
        return task_run.id

    @flow(name="threaded-logs")
    def threaded_logs() -> str:
        return threaded_stage()

    state = threaded_logs(return_state=True)  # the control line is dropped as before (asserted below)
    task_run_id = uuid.UUID(str(state.result()))
    found = _read_messages(state.state_details.flow_run_id, {f"{marker} thread", f"[sub] {marker} subprocess"})
    assert found.get(f"[threaded-stage] {marker} thread") == task_run_id, found  # with its stage tag (below)
    assert found.get(f"[threaded-stage] [sub] {marker} subprocess") == task_run_id, found
    assert not any("control" in m for m in found), found  # shipped in order before the others: it never went

    # the block is closed: the filter is gone from the handlers again
    assert not any(f for h in logging.getLogger("eagle3").handlers for f in h.filters
                   if type(f).__module__ == "tasks.logs")


def test_every_line_of_a_run_says_which_stage_wrote_it(prefect_harness, eagle3_info_logs):
    """Issue 20: the Logs tab showed "Finished in state Completed()" once per task with no task name, and library
    lines such as "holding host-cpu" without a stage. Every line the run sends now starts with its task's name (the
    flow's name for the flow's own lines); a library tag naming a word of the stage gives way to the stage."""
    from prefect import flow, get_run_logger, task

    from tasks.logs import logs_from_all_threads, tag_run_logs

    tag_run_logs()  # what the flow module does at import, before the flow's first line
    marker = uuid.uuid4().hex[:12]

    @task(name="demo-train")
    def demo_train() -> None:
        with logs_from_all_threads():
            log.info("[train] %s epoch 1", marker)  # the library's tag names a word of the stage: replaced
            logging.getLogger("eagle3.support.gpu").info("%s holding host-cpu", marker)  # no tag of its own
            _log_from_a_thread(f"[vllm] {marker} from a thread")  # another tag: kept after the stage's

    @task(name="describe-prompts")
    def describe_prompts() -> None:  # a plain task: Prefect's own "Finished in state" line only
        return None

    @flow(name="tagged-logs")
    def tagged_logs() -> None:
        get_run_logger().info("%s the flow's own line", marker)
        demo_train()
        describe_prompts()

    state = tagged_logs(return_state=True)
    found = _read_messages(state.state_details.flow_run_id, {f"{marker} the flow's own line",
                                                              f"{marker} from a thread", "[tagged-logs] Finished in state"})
    assert f"[demo-train] {marker} epoch 1" in found, found
    assert f"[demo-train] {marker} holding host-cpu" in found, found
    assert f"[demo-train] [vllm] {marker} from a thread" in found, found
    assert f"[tagged-logs] {marker} the flow's own line" in found, found
    finished = sorted(m for m in found if "Finished in state" in m)
    assert [m.split("]")[0] for m in finished] == ["[demo-train", "[describe-prompts", "[tagged-logs"], finished
    untagged = [m for m in found if not m.startswith(("[demo-train] ", "[describe-prompts] ", "[tagged-logs] "))]
    assert not untagged, untagged


def test_stage_tag_rule():
    from tasks.logs import with_stage_tag

    assert with_stage_tag("prepare-data", "[data] rows 60/60") == "[prepare-data] rows 60/60"
    assert with_stage_tag("prepare-regenerated", "[data] rows 60/60") == "[prepare-regenerated] [data] rows 60/60"
    assert with_stage_tag("validate-draft", "[vllm] [vllm_check] ready") == "[validate-draft] [vllm] [vllm_check] ready"
    assert with_stage_tag("train-draft", "[train-draft] done") == "[train-draft] done"
    assert with_stage_tag("train-draft", "Finished in state Completed()") == "[train-draft] Finished in state Completed()"
    assert with_stage_tag(None, "outside any run") == "outside any run"
