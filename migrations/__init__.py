"""Alembic scripts for the telemetry schema (store.models); run through store.migrate."""
