"""What every capability needs around the task messages it publishes through Celery and kombu.

Beat's tick, the sweep and the lock runtime all publish task messages; the helpers they share live
here rather than in one capability, so none of beat/, delays/ or locks/ imports another for them:

- :mod:`.compat` what differs between the supported Celery and kombu versions (the one place that
  checks); :mod:`.publishing` batched publishes (a beat tick's due slots, the sweep's batches);
- :mod:`.requeue` the attempt token stamped on every published message, and re-queue timing;
  :mod:`.randomness` the random tokens of the per-message hot paths.

Nothing is imported here: importing :mod:`.requeue` connects its publish hook, and a process pays
only for the helpers it uses.
"""
