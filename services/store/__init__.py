"""The results store: policies, evaluations, episodes and API keys, on PostgreSQL or SQLite.

``models`` are the tables (Alembic in ``migrations/`` owns the schema), ``queries``
and ``api_keys`` are the reads and writes the API and the workers share,
``aggregates`` turns episode rows into success rates with Wilson intervals,
``db`` makes engines and sessions, ``settings`` says where the database is,
``migrate`` runs Alembic from code, and ``statuses`` holds the status and
failure-reason enums (stdlib only: the API's schemas and the HTTP client use them
without SQLAlchemy). This package imports nothing else of EvalForge.
"""
