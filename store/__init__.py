"""crossover store: the telemetry database's models, engine and schema versioning.

    models     SQLAlchemy 2 models (`xo_` tables) — a public interface
    db         make_engine (SQLite: WAL + busy timeout), session_scope, default_url
    migrate    upgrade / check_schema / ensure_schema through Alembic (`xo_alembic_version`)
    versioning the version table's name and the filter to crossover's tables (read by migrations/env.py)
    apikeys    salted API-key hashes for tenants
    tenants    tenant rows: add, find by key, revoke
    history    policy and retune writers (readers: telemetry.queries)
"""
