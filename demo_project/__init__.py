"""A small SaaS (tenants, trials, invoices, inventory syncs) that uses every celery-safe-time feature."""
