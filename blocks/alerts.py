"""Lost runs and failure alerts: two Prefect automations. scripts/deploy.sh runs this after
`prefect deploy --all`.

    # saves a webhook block, then the automations:
    python -m eagle3_prefect.blocks.alerts --webhook-url https://hooks.example.com/eagle3
    # any saved notification block instead:
    python -m eagle3_prefect.blocks.alerts --block slack-webhook/oncall

`eagle3-run-lost` finds a run whose process is gone. Every eagle3 flow run sends Prefect's flow-run
heartbeat (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, 30 s: prefect.yaml sets it for every deployment,
flows/__init__.py for runs started in Python); a Running run of an eagle3 flow that sends neither a
heartbeat nor a final state for EAGLE3_LOST_AFTER_S (default 60 s) is set Crashed by the server,
whatever happened to its process or host (SIGKILL, OOM kill, power, a reclaimed instance). It is
created whether or not alerts have a destination.

`eagle3-run-failed` sends a notification when a pipeline, retrain, sweep or streaming run ends
Failed or Crashed, and when a GPU stage run ends Crashed (a lost GPU host: its parent runs the stage
again, so the pipeline may still complete; a *failed* stage run fails its parent, which alerts
once). The default destination is a Custom Webhook block (`custom-webhook/eagle3-alerts`) that POSTs
{"subject": ..., "body": ...} as JSON; `--block <type slug>/<name>` names any other notification
block (Slack, Teams, PagerDuty, email ...) saved in the UI or in Python. Re-running replaces both
automations (one of each per server).
"""

from __future__ import annotations

import argparse
import os
import sys

from prefect.automations import Automation
from prefect.blocks.core import Block
from prefect.blocks.notifications import CustomWebhookNotificationBlock, NotificationBlock
from prefect.events.actions import ChangeFlowRunState, SendNotification
from prefect.events.schemas.automations import CompoundTrigger, EventTrigger, Posture
from prefect.states import StateType

from eagle3.stages import STAGES

#: the flows whose failure pages someone (their GPU stage runs are their children)
ALERT_FLOWS = ("eagle3-pipeline", "eagle3-retrain", "eagle3-layer-sweep", "eagle3-stream")
#: the flows that run a GPU stage for a parent (flows/gpu_stages.py, flows/streaming.py)
STAGE_FLOWS = (
    *(f"eagle3-{n}" for n, s in STAGES.items() if s.gpu),
    "eagle3-stream-capture",
    "eagle3-stream-train",
)
AUTOMATION_NAME = "eagle3-run-failed"
LOST_AUTOMATION_NAME = "eagle3-run-lost"
WEBHOOK_BLOCK_NAME = "eagle3-alerts"
#: Prefect's flow-run heartbeat interval the eagle3 deployments set (Prefect's minimum; its default
#: is 180 s)
HEARTBEAT_S = 30
#: a Running run silent this long is lost (two heartbeats missed: a lost run is found 30-60 s after
#: it died)
DEFAULT_LOST_AFTER_S = 60
#: events that show a run is alive or has left Running by itself (a final state, a pause, a retry)
_ALIVE_EVENTS = {
    "prefect.flow-run.heartbeat",
    *(
        f"prefect.flow-run.{s}"
        for s in (
            "Completed",
            "Failed",
            "Crashed",
            "Cancelled",
            "Paused",
            "Suspended",
            "AwaitingRetry",
            "Scheduled",
            "Pending",
        )
    ),
}

SUBJECT = "eagle3: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = (
    "eagle3 flow run {{ flow.name }}/{{ flow_run.name }} ended {{ flow_run.state.name }} at "
    "{{ flow_run.state.timestamp }}.\n"
    "Flow run id: {{ flow_run.id }}\n"
    "Flow run URL: {{ flow_run|ui_url }}\n"
    "Message: {{ flow_run.state.message }}"
)


def lost_after_s() -> float:
    """EAGLE3_LOST_AFTER_S: at least two heartbeat intervals (one late heartbeat is no lost run)."""
    value = float(os.environ.get("EAGLE3_LOST_AFTER_S", DEFAULT_LOST_AFTER_S))
    if value < 2 * HEARTBEAT_S:
        raise SystemExit(
            f"EAGLE3_LOST_AFTER_S = {value:g}: use {2 * HEARTBEAT_S} or more (twice the flow-run "
            f"heartbeat interval, {HEARTBEAT_S} s), or a live run would be marked Crashed"
        )
    return value


def lost_message(after_s: float) -> str:
    return (
        f"lost: no flow-run heartbeat for {after_s:g} s (EAGLE3_LOST_AFTER_S; a live run sends "
        f"one every {HEARTBEAT_S} s): its process or host is gone. Set Crashed by the automation "
        f"{LOST_AUTOMATION_NAME}; its work dir lock is free and the next run resumes from what it "
        "left (a pipeline runs a lost GPU stage again itself)"
    )


def _flow_run_trigger(events: set[str], flow_names: tuple[str, ...], **kw) -> EventTrigger:
    return EventTrigger(
        expect=events,
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(flow_names)},
        **kw,
    )


def lost_run_trigger(
    after_s: float, flow_names: tuple[str, ...] = ALERT_FLOWS + STAGE_FLOWS
) -> EventTrigger:
    """Fires for a run of `flow_names` that started Running (or sent a heartbeat) and then sent
    neither another heartbeat nor a state that ends or pauses it within `after_s` (Prefect's own
    zombie-run pattern)."""
    return _flow_run_trigger(
        _ALIVE_EVENTS,
        flow_names,
        after={"prefect.flow-run.heartbeat", "prefect.flow-run.Running"},
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=after_s,
    )


def failure_trigger(
    flow_names: tuple[str, ...] = ALERT_FLOWS, stage_flow_names: tuple[str, ...] = STAGE_FLOWS
) -> CompoundTrigger:
    """Fires once per run of `flow_names` that enters Failed or Crashed, and per run of
    `stage_flow_names` that enters Crashed (a failed stage run fails its parent, which alerts)."""
    events = {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}
    return CompoundTrigger(
        require="any",
        within=0,
        triggers=[
            _flow_run_trigger(events, flow_names, posture=Posture.Reactive, threshold=1, within=0),
            _flow_run_trigger(
                {"prefect.flow-run.Crashed"},
                stage_flow_names,
                posture=Posture.Reactive,
                threshold=1,
                within=0,
            ),
        ],
    )


def save_webhook_block(url: str, name: str = WEBHOOK_BLOCK_NAME) -> CustomWebhookNotificationBlock:
    """A Custom Webhook notification block POSTing {"subject", "body"} as JSON to `url` (saved as
    `name`)."""
    block = CustomWebhookNotificationBlock(
        name="eagle3",
        url=url,
        method="POST",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    )
    block.save(name, overwrite=True)
    return CustomWebhookNotificationBlock.load(name)


def load_notification_block(ref: str) -> NotificationBlock:
    """`<block type slug>/<document name>` of a saved notification block (ConfigError-style message
    if not)."""
    if "/" not in ref:
        raise SystemExit(
            f"--block {ref!r}: write it as <block type slug>/<name>, e.g. slack-webhook/oncall"
        )
    try:
        block = Block.load(ref)
    except ValueError as e:
        raise SystemExit(
            f"--block {ref!r}: no such block on this server ({e}); save it first (UI: Blocks)"
        ) from None
    if not isinstance(block, NotificationBlock):
        raise SystemExit(
            f"--block {ref!r} is a {type(block).__name__}, not a notification block "
            "(Slack/Teams/Custom Webhook/...)"
        )
    return block


def _replace(name: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)


def create_failure_automation(
    block: Block, flow_names: tuple[str, ...] = ALERT_FLOWS
) -> Automation:
    """(Re)create the `eagle3-run-failed` automation sending through `block`; returns it."""
    _replace(AUTOMATION_NAME)
    return Automation(
        name=AUTOMATION_NAME,
        description=(
            f"notify when a run of {', '.join(flow_names)} fails or crashes, or a GPU stage run "
            "crashes (blocks/alerts.py)"
        ),
        trigger=failure_trigger(flow_names),
        actions=[
            SendNotification(block_document_id=block._block_document_id, subject=SUBJECT, body=BODY)
        ],
    ).create()


def create_lost_run_automation(after_s: float | None = None) -> Automation:
    """(Re)create the `eagle3-run-lost` automation: a Running eagle3 run without a heartbeat for
    `after_s` (EAGLE3_LOST_AFTER_S) is set Crashed."""
    after_s = lost_after_s() if after_s is None else after_s
    _replace(LOST_AUTOMATION_NAME)
    return Automation(
        name=LOST_AUTOMATION_NAME,
        description=(
            f"set Crashed a Running eagle3 run that sent no flow-run heartbeat for {after_s:g} s "
            "(blocks/alerts.py)"
        ),
        trigger=lost_run_trigger(after_s),
        # not forced: the server refuses to set Crashed a run that has already ended. A run's last
        # heartbeat can reach the server just after its final state (Prefect's heartbeat thread
        # checks the state, then sends), which opens a window that nothing closes; forced, this
        # automation would turn that Failed or Completed run into a lost one a minute later.
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=lost_message(after_s))],
    ).create()


def drain_events(timeout_s: float = 10.0) -> None:
    """Wait until Prefect's client has sent what it still queues (the events of the blocks and
    automations just saved, log records) before the process exits. Its exit stops those queues,
    and a queue stopped with items left prints "Still processing items: N items remaining..."
    (the last line deploy.sh printed); an empty one exits silently."""
    import threading

    from prefect._internal.concurrency.services import QueueService

    for service in list(QueueService._instances.values()):
        waiter = threading.Thread(target=service.wait_until_empty, daemon=True)
        waiter.start()
        waiter.join(timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_prefect.blocks.alerts", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--webhook-url",
        default=os.environ.get("EAGLE3_ALERT_WEBHOOK_URL"),
        help="POST alerts here (default: $EAGLE3_ALERT_WEBHOOK_URL)",
    )
    parser.add_argument(
        "--block",
        default=os.environ.get("EAGLE3_ALERT_BLOCK"),
        help="a saved notification block, <type slug>/<name> (default: $EAGLE3_ALERT_BLOCK)",
    )
    args = parser.parse_args(argv)
    lost = create_lost_run_automation()
    print(
        f"automation {lost.name} ({lost.id}): a Running eagle3 run without a flow-run heartbeat "
        f"for {lost.trigger.within.total_seconds():g} s is set Crashed"
    )
    if args.block:
        block = load_notification_block(args.block)
        where = args.block
    elif args.webhook_url:
        block = save_webhook_block(args.webhook_url)
        where = f"custom-webhook/{WEBHOOK_BLOCK_NAME} -> {args.webhook_url}"
    else:
        print(
            "eagle3 alerts: NOT set up (no --webhook-url / EAGLE3_ALERT_WEBHOOK_URL, no --block / "
            "EAGLE3_ALERT_BLOCK): a failed run will notify nobody",
            file=sys.stderr,
        )
        drain_events()
        return 0
    automation = create_failure_automation(block)
    print(
        f"automation {automation.name} ({automation.id}): failed/crashed runs of "
        f"{', '.join(ALERT_FLOWS)} and crashed GPU stage runs notify {where}"
    )
    drain_events()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
