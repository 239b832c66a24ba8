"""The idle-sweep log filter on Celery's own log records (shapes as celery 5 emits them)."""

from __future__ import annotations

import logging

import pytest

from celery_safe_time.delays.idle_logs import IdleSweepFilter

SWEEP = "celery_safe_time.sweep"


def _record(name: str, msg: str, args: tuple[object, ...] = (), data: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    record = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
    if data is not None:
        record.data = data
    return record


IDLE = "{'claimed': 0, 'sent': 0, 'failed': 0}"


@pytest.mark.parametrize(
    ("record", "demoted"),
    [
        (_record("celery.beat", "Scheduler: Sending due task %s (%s)", (SWEEP, SWEEP)), True),
        (_record("celery.beat", "Scheduler: Sending due task %s (%s)", ("report", "proj.report")), False),
        (_record("celery.worker.strategy", "Task %(name)s[%(id)s] received", data={"name": SWEEP, "id": "x"}), True),
        (_record("celery.app.trace", "succeeded", data={"name": SWEEP, "return_value": IDLE}), True),
        (_record("celery.app.trace", "succeeded", data={"name": SWEEP, "return_value": "{'claimed': 2}"}), False),
        (_record("celery.app.trace", "succeeded", data={"name": "proj.remind", "return_value": "0"}), False),
        (_record("celery.worker.request", "Discarding revoked task: %s[%s]", (SWEEP, "x")), True),
        (_record("celery.worker.request", "Discarding revoked task: %s[%s]", ("proj.remind", "x")), False),
    ],
)
def test_only_idle_sweep_lines_are_demoted(record: logging.LogRecord, demoted: bool) -> None:
    logger = logging.getLogger(record.name)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        assert IdleSweepFilter().filter(record)  # kept at DEBUG level when DEBUG is on
        assert (record.levelno == logging.DEBUG) is demoted
        logger.setLevel(logging.INFO)
        record.levelno, record.levelname = logging.INFO, "INFO"
        assert IdleSweepFilter().filter(record) is not demoted  # dropped below DEBUG
    finally:
        logger.setLevel(old)
