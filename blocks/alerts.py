"""Failure alerts: a Prefect automation that sends a notification when an eagle3 pipeline, retrain, sweep or
streaming run ends Failed or Crashed. scripts/deploy.sh runs it after `prefect deploy --all`.

    python -m eagle3_prefect.blocks.alerts --webhook-url https://hooks.example.com/eagle3   # saves a webhook block, then the automation
    python -m eagle3_prefect.blocks.alerts --block slack-webhook/oncall                     # any saved notification block instead

The default destination is a Custom Webhook block (`custom-webhook/eagle3-alerts`) that POSTs
{"subject": ..., "body": ...} as JSON; `--block <type slug>/<name>` names any other notification block
(Slack, Teams, PagerDuty, email ...) saved in the UI or in Python. Re-running replaces the automation (one per
server, named `eagle3-run-failed`). The GPU stage runs are children of these flows: their failure fails the
parent, so one alert per failed pipeline.
"""

from __future__ import annotations

import argparse
import os
import sys

from prefect.automations import Automation
from prefect.blocks.core import Block
from prefect.blocks.notifications import CustomWebhookNotificationBlock, NotificationBlock
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

#: the flows whose failure pages someone (their GPU stage runs are their children)
ALERT_FLOWS = ("eagle3-pipeline", "eagle3-retrain", "eagle3-layer-sweep", "eagle3-stream")
AUTOMATION_NAME = "eagle3-run-failed"
WEBHOOK_BLOCK_NAME = "eagle3-alerts"

SUBJECT = "eagle3: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = """eagle3 flow run {{ flow.name }}/{{ flow_run.name }} ended {{ flow_run.state.name }} at {{ flow_run.state.timestamp }}.
Flow run id: {{ flow_run.id }}
Flow run URL: {{ flow_run|ui_url }}
Message: {{ flow_run.state.message }}"""


def failure_trigger(flow_names: tuple[str, ...] = ALERT_FLOWS) -> EventTrigger:
    """Fires once per flow run of `flow_names` that enters Failed or Crashed."""
    return EventTrigger(
        expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(flow_names)},
        posture=Posture.Reactive,
        threshold=1,
        within=0,
    )


def save_webhook_block(url: str, name: str = WEBHOOK_BLOCK_NAME) -> CustomWebhookNotificationBlock:
    """A Custom Webhook notification block POSTing {"subject", "body"} as JSON to `url` (saved as `name`)."""
    block = CustomWebhookNotificationBlock(name="eagle3", url=url, method="POST",
                                           json_data={"subject": "{{subject}}", "body": "{{body}}"})
    block.save(name, overwrite=True)
    return CustomWebhookNotificationBlock.load(name)


def load_notification_block(ref: str) -> NotificationBlock:
    """`<block type slug>/<document name>` of a saved notification block (ConfigError-style message if not)."""
    if "/" not in ref:
        raise SystemExit(f"--block {ref!r}: write it as <block type slug>/<name>, e.g. slack-webhook/oncall")
    try:
        block = Block.load(ref)
    except ValueError as e:
        raise SystemExit(f"--block {ref!r}: no such block on this server ({e}); save it first (UI: Blocks)") from None
    if not isinstance(block, NotificationBlock):
        raise SystemExit(f"--block {ref!r} is a {type(block).__name__}, not a notification block "
                         "(Slack/Teams/Custom Webhook/...)")
    return block


def create_failure_automation(block: Block, flow_names: tuple[str, ...] = ALERT_FLOWS) -> Automation:
    """(Re)create the `eagle3-run-failed` automation sending through `block`; returns it."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(AUTOMATION_NAME):
            client.delete_automation(old.id)
    return Automation(
        name=AUTOMATION_NAME,
        description=f"notify when a run of {', '.join(flow_names)} fails or crashes (blocks/alerts.py)",
        trigger=failure_trigger(flow_names),
        actions=[SendNotification(block_document_id=block._block_document_id, subject=SUBJECT, body=BODY)],
    ).create()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_prefect.blocks.alerts", description=__doc__.splitlines()[0])
    parser.add_argument("--webhook-url", default=os.environ.get("EAGLE3_ALERT_WEBHOOK_URL"),
                        help="POST alerts here (default: $EAGLE3_ALERT_WEBHOOK_URL)")
    parser.add_argument("--block", default=os.environ.get("EAGLE3_ALERT_BLOCK"),
                        help="a saved notification block, <type slug>/<name> (default: $EAGLE3_ALERT_BLOCK)")
    args = parser.parse_args(argv)
    if args.block:
        block = load_notification_block(args.block)
        where = args.block
    elif args.webhook_url:
        block = save_webhook_block(args.webhook_url)
        where = f"custom-webhook/{WEBHOOK_BLOCK_NAME} -> {args.webhook_url}"
    else:
        print("eagle3 alerts: NOT set up (no --webhook-url / EAGLE3_ALERT_WEBHOOK_URL, no --block / "
              "EAGLE3_ALERT_BLOCK): a failed run will notify nobody", file=sys.stderr)
        return 0
    automation = create_failure_automation(block)
    print(f"automation {automation.name} ({automation.id}): failed/crashed runs of {', '.join(ALERT_FLOWS)} "
          f"notify {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
