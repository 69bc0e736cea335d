"""Offline training of the draft proposers' weights (MTP heads, early-exit adapters).

A tool around the daemon: it imports the engine, never the other way round.
"""
