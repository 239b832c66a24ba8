"""Issue 40, trap 5: the admin overview lists each entry once under SafeDatabaseScheduler: the table's
row, not also the ``beat_schedule`` copy of it that never fires."""

from __future__ import annotations

from celery_safe_time.contrib.django.overview import EntryRow, merged_entries


def _row(name: str, source: str) -> EntryRow:
    return EntryRow(name, source, "t", "every 10s", True, None, None)


def test_a_config_entry_copied_into_the_table_shows_once_as_the_row() -> None:
    entries = [_row("celery_safe_time.sweep", "config"), _row("nightly", "config"), _row("rt", "runtime")]
    database = [_row("celery_safe_time.sweep", "database"), _row("report", "database")]
    merged = merged_entries(entries, database)
    assert [(r.name, r.source) for r in merged] == [
        ("nightly", "config"),
        ("rt", "runtime"),
        ("celery_safe_time.sweep", "database"),
        ("report", "database"),
    ]
