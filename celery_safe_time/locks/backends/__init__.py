"""Lock backends: where overlap locks, idempotency markers and unique keys live (see :mod:`.base`)."""
