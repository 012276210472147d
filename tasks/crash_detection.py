"""Deployment setup: the automation that marks a flow run Crashed when its heartbeats stop.

A flow process killed with kill -9 (or the OOM killer, or a host that dies) reports nothing, and a self-hosted
server leaves its run Running forever. Prefect's documented remedy ("detect zombie flows"): every flow run emits a
``prefect.flow-run.heartbeat`` event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (tasks/prefect_env.py, and
prefect.yaml's job env for deployments), and a proactive automation expects, after each heartbeat of a run, another
event of that run (a heartbeat or a state change) within the window; when none comes it sets the run Crashed.

A run killed before its first heartbeat reached the server never arms the trigger and stays Running (the window
starts at a heartbeat). A server that cannot receive events for longer than the window marks live runs Crashed.

    python -m tasks.crash_detection [--window-seconds S]    # what deployments/setup_prefect.sh runs; idempotent
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from tasks.prefect_env import HEARTBEAT_SECONDS, ZOMBIE_AFTER_MISSED_HEARTBEATS

AUTOMATION_NAME = "eagle3: crash flow runs whose heartbeats stopped"
DEFAULT_WINDOW_SECONDS = HEARTBEAT_SECONDS * ZOMBIE_AFTER_MISSED_HEARTBEATS


def zombie_automation(window_seconds: float = DEFAULT_WINDOW_SECONDS, name: str = AUTOMATION_NAME):
    """The automation of Prefect's "detect zombie flows" guide, with our window (seconds after a heartbeat)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=name,
        description=(f"A flow run that sent a heartbeat and then no event for {window_seconds:.0f} s (heartbeats "
                     f"every {HEARTBEAT_SECONDS} s) is marked Crashed: its process died without reporting."),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            # any event of the run disarms it: heartbeats, and state changes under any state name
            expect={"prefect.flow-run.*"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=window_seconds),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"No heartbeat for {window_seconds:.0f} s: the flow process died without reporting "
                    f"(kill -9, out of memory, host lost). Marked by the automation {name!r}.",
        )],
    )


def _comparable(automation) -> dict:
    d = automation.model_dump(mode="json", include={"name", "description", "enabled", "trigger", "actions"})
    d["trigger"].pop("id", None)  # every trigger object gets a fresh id
    return d


def ensure_zombie_automation(window_seconds: float = DEFAULT_WINDOW_SECONDS, name: str = AUTOMATION_NAME) -> str:
    """Create the automation, or bring the one of that name up to date (one left if several); returns
    "created", "updated" or "unchanged". Talks to PREFECT_API_URL."""
    from prefect.client.orchestration import get_client

    wanted = zombie_automation(window_seconds, name)
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(name)
        for extra in existing[1:]:
            client.delete_automation(extra.id)
        if not existing:
            client.create_automation(wanted)
            return "created"
        if _comparable(existing[0]) == _comparable(wanted):
            return "unchanged"
        client.update_automation(existing[0].id, wanted)
        return "updated"


def main() -> None:
    ap = argparse.ArgumentParser(description="Create or update the automation that marks flow runs Crashed when "
                                             "their heartbeats stop (needs PREFECT_API_URL).")
    ap.add_argument("--window-seconds", type=float, default=DEFAULT_WINDOW_SECONDS,
                    help=f"seconds after a heartbeat with no event of the run before it is marked Crashed "
                         f"(default {DEFAULT_WINDOW_SECONDS}: {ZOMBIE_AFTER_MISSED_HEARTBEATS} heartbeat intervals)")
    ap.add_argument("--name", default=AUTOMATION_NAME, help="the automation's name")
    args = ap.parse_args()
    outcome = ensure_zombie_automation(args.window_seconds, args.name)
    print(f"automation {args.name!r} ({args.window_seconds:.0f} s without a heartbeat -> Crashed): {outcome}")


if __name__ == "__main__":
    main()
