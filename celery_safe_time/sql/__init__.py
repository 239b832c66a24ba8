"""The package's SQL toolkit, shared by the delay store (``delays/``), beat and the locks on PostgreSQL:
:mod:`.engine` (drivers, per-call deadlines, engines) and :mod:`.named` (the ``-- name:`` statement files).

Importing this package loads nothing: :mod:`.named` needs the standard library only, :mod:`.engine`
loads SQLAlchemy.
"""
