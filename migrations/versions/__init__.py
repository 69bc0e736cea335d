"""Alembic revisions (a package only so that setuptools ships them)."""
