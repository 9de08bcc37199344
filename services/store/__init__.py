"""The results store: policies, evaluations, episodes and API keys, on PostgreSQL or SQLite.

``models`` are the tables (Alembic in ``migrations/`` owns the schema), ``queries``
and ``api_keys`` are the reads and writes the API and the workers share,
``aggregates`` turns episode rows into success rates with Wilson intervals,
``db`` makes engines and sessions, ``settings`` says where the database is, and
``migrate`` runs Alembic from code. This package imports nothing else of EvalForge.
"""
