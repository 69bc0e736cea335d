"""The policy keeper: versions, applies, records, rolls back and pins policies.

Every policy the engine serves goes through here, from the tuner or an
admin: it gets the next version (above every recorded one and the serving
one), is handed to the engine (whose `set_policy` may refuse it with
ValueError, before anything is recorded), then saved with its whole body and
marked applied. Should the database fail to record it (locked, full, gone),
the engine is handed the previous policy again, so what serves is always
what the history says. A rollback re-applies the previous policy under its own
version and re-stamps its `applied_at`, so `store.history.active_policy`
names it again.

A pinned policy (`extra["pinned"] = True`, source "admin") overrides the
tuner until `unpin()`, which records the same rules again as a new, unpinned
version. At startup `restore()` re-applies the active policy from the
database (pin included); an empty history gets the default (the daemon's
starter policy, or never speculating) recorded as version 0, and a policy
this engine cannot run (a field `TunedPolicy` refuses, a proposer it lacks)
is logged as a warning and left in the history while the default serves,
unrecorded: a bad stored pin cannot take the engine down at every restart.
Admin bodies go through `parse_policy` (`TunedPolicy.from_dict`, the same
checks), so an invalid pin is refused with the field to blame.

A keeper serves one instance (`instance`, "" for a single daemon): it reads
and writes only that instance's policies, and its versions count per
instance. The schema makes (instance, version) unique; should another
process record the same version first (two daemons misconfigured with one
instance name), the insert fails and `apply` retries with the next version.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from engine.policy import NEVER, PolicyError, TunedPolicy
from store.db import session_scope
from store.history import (
    active_policy,
    mark_applied,
    mark_rolled_back,
    max_policy_version,
    save_policy,
)

log = logging.getLogger("crossover.tuner")
VERSION_ATTEMPTS = 10
"""Versions `apply` tries when another process records the same one first."""
RETRY_BACKOFF_S = 0.01
"""Random wait before the next try, up to this times the tries so far (so that one
process applying in a tight loop cannot win every race)."""


class PolicyPinned(RuntimeError):
    """The tuner may not replace a pinned policy."""


class PolicyHost(Protocol):
    """The engine surface the keeper needs (EngineCore and FakeEngine have it)."""

    def set_policy(self, policy: TunedPolicy) -> None: ...


class PolicyKeeper:
    """See the module docstring. Thread-safe: one lock around every change."""

    def __init__(self, db: Engine, host: PolicyHost,
                 wrap: Callable[[TunedPolicy], TunedPolicy] | None = None,
                 default: TunedPolicy = NEVER, instance: str = "") -> None:
        self._db = db
        self.instance = instance
        """The daemon whose policies these are."""
        self.default = default
        """Served when the history is empty or its active policy cannot run here."""
        self._host = host
        self._wrap = wrap or (lambda p: p)
        """What the engine is given for a policy (the daemon adds exploration)."""
        self._lock = threading.RLock()
        self.current: TunedPolicy = NEVER
        """The policy serving now, as recorded (without the exploration it is served with)."""

    @property
    def pinned(self) -> bool:
        return bool(self.current.extra.get("pinned"))

    def restore(self) -> TunedPolicy:
        """Serve the database's active policy again, else record the default."""
        with self._lock, session_scope(self._db) as session:
            row = active_policy(session, instance=self.instance)
            if row is None and max_policy_version(session, instance=self.instance) is None:
                self._host.set_policy(self._served(self.default))  # served with exploration too
                return self._record(session, self.default, "default")
        if row is not None:
            try:
                policy = TunedPolicy.from_dict(row.body)
                self._host.set_policy(self._served(policy))
                self.current = policy
                return policy
            except Exception as exc:  # a bad stored policy must not stop the start
                log.warning("cannot restore policy v%s (%s: %s); serving the default, unrecorded",
                            row.version, type(exc).__name__, exc)
        self._host.set_policy(self._served(self.default))
        self.current = self.default
        return self.default

    def apply(self, policy: TunedPolicy, source: str, extra: dict | None = None) -> TunedPolicy:
        """Version, serve and record `policy`; if the engine refuses: ValueError, no record."""
        extra = {**policy.extra, **(extra or {})}
        with self._lock:
            if source == "tuner" and self.pinned:
                raise PolicyPinned(f"policy v{self.current.version} is pinned by an admin")
            previous = self.current
            for attempt in range(VERSION_ATTEMPTS):
                served = False
                try:
                    with session_scope(self._db) as session:
                        latest = max_policy_version(session, instance=self.instance) or 0
                        version = max(latest, previous.version) + 1
                        versioned = dataclasses.replace(policy, version=version, source=source,
                                                        extra=extra)
                        self._host.set_policy(self._served(versioned))
                        served = True
                        return self._record(session, versioned, source)  # committed on leaving
                except IntegrityError:
                    if attempt == VERSION_ATTEMPTS - 1:
                        self._serve_again(previous)
                        raise
                except Exception:  # the database failed (locked, full, gone): serve what it records
                    if served:
                        self._serve_again(previous)
                    raise
                    log.warning("policy v%d of instance %r was recorded by another process; "
                                "trying the next version", version, self.instance)
                    time.sleep(random.uniform(0.0, RETRY_BACKOFF_S * (attempt + 1)))
            raise AssertionError("unreachable")

    def rollback(self, candidate: TunedPolicy, previous: TunedPolicy, reason: str) -> bool:
        """Serve `previous` again unless `candidate` was already replaced (then False)."""
        with self._lock:
            if self.current.version != candidate.version:
                return False
            self._host.set_policy(self._served(previous))
            with session_scope(self._db) as session:
                mark_rolled_back(session, candidate.version, reason, instance=self.instance)
                mark_applied(session, previous.version, instance=self.instance)
            self.current = previous
            return True

    def pin(self, body: Any) -> TunedPolicy:
        """Serve an admin's policy (a TunedPolicy dict) until unpinned; ValueError if invalid."""
        policy = parse_policy(body)
        with self._lock:
            return self.apply(policy, "admin", {"pinned": True})

    def unpin(self) -> TunedPolicy:
        """Hand control back to the tuner (LookupError when nothing is pinned)."""
        with self._lock:
            if not self.pinned:
                raise LookupError("no policy is pinned")
            extra = {k: v for k, v in self.current.extra.items() if k != "pinned"}
            return self.apply(dataclasses.replace(self.current, extra=extra), "admin",
                              {"unpinned_from": self.current.version})

    def _serve_again(self, previous: TunedPolicy) -> None:
        """Hand the engine `previous` again after a change that was not recorded."""
        self._host.set_policy(self._served(previous))
        self.current = previous

    def _served(self, policy: TunedPolicy) -> TunedPolicy:
        """What the engine gets: the policy itself when pinned, else `wrap(policy)`."""
        return policy if policy.extra.get("pinned") else self._wrap(policy)

    def _record(self, session: Any, policy: TunedPolicy, source: str) -> TunedPolicy:
        save_policy(session, policy.version, policy.to_dict(), source, instance=self.instance)
        mark_applied(session, policy.version, instance=self.instance)
        session.flush()  # a duplicate version fails here, before `current` changes
        self.current = policy
        return policy


def parse_policy(body: Any) -> TunedPolicy:
    """A TunedPolicy from an admin's JSON object (its version and source are the keeper's to
    set), or `engine.policy.PolicyError` (a ValueError) naming the field to blame."""
    if not isinstance(body, dict):
        raise PolicyError("policy", "a policy must be a JSON object (TunedPolicy.to_dict())")
    return TunedPolicy.from_dict({k: v for k, v in body.items() if k not in ("version", "source")})
