"""The Tuner: single-flight retunes, from a trigger to a validated policy.

1. `trigger(source)` (an admin request, or `scheduled()` from the periodic
   job) records a running retune (`store.history.start_retune`) and starts
   one worker thread, unless a retune is running: then it returns that one's
   handle (single-flight). A pinned policy makes it record a skip instead;
   `scheduled()` also skips, recorded with its reason, when fewer than
   `min_new_steps` steps (counted per sequence) arrived since the last retune that ran.
2. The worker hands a `SearchJob` to the search runner (`run_search` in
   a helper thread, or `ProcessSearch`: a spawned process, off the serving
   path and the engine thread's GIL): fit the model, observe the traffic,
   ask/tell the study (tuner.search). Either is bounded by
   `search_timeout_s`; a search process that dies or runs past it is
   replaced for the next retune (tuner.process).
3. No feasible candidate, a candidate equal to the serving policy, or one
   that does not beat the serving policy's predicted goodput by `min_gain`:
   the retune ends "rejected" with that evidence. A candidate that drafts as
   the serving policy does at every batch size the window observed, for
   every tenant it served (same predicted goodput), and differs only at sizes
   or for tenants it did not is applied: it fills those with what the model
   prefers for them now (tuner.exact, 5; tuner.tenant_fill), e.g. n-gram for
   when a busy phase drains to batch 1-4, and where it was observed nothing
   changes that `min_gain` would guard against.
4. Otherwise the keeper applies it (next version, source "tuner").
5. Validation window: every `poll_s` the worker reads the new
   version's steps until `validation_min_steps` of them (exploration left
   out) or `validation_s` has passed (a window whose steps are too few for
   any verdict, `tuner.validate.enough_evidence`, runs on to
   VALIDATION_STRETCH times `validation_s` for them: at batch 32 a short
   window held 3-4 steps and ended "inconclusive", keeping whatever it
   had applied), then compares them at matched batch
   sizes with the previous policy's steps of the `baseline_s` before the
   apply, or, where it has none there (a low phase at batch 1-2), with the
   model's prediction for it at the batch sizes served (tuner.validate).
6. "rollback": the keeper serves the previous policy again, records why,
   and the retune ends "rejected"; otherwise it ends "applied". Either way
   `finish_retune` stores predicted and measured goodput (the prediction
   taken at the batch sizes measured, weighted like the observed traffic, so
   the two compare) and the details: the full-traffic prediction, fit error,
   traffic, trials, Pareto front, verdict.
Any exception ends the retune "failed" with its message (a timed-out or dead
search, or a candidate whose fields fail `TunedPolicy`'s checks, included).

At startup `restore()` closes the retunes a stopped daemon left "running" as
"interrupted"; one that had applied its policy and not yet validated it gets
that policy rolled back, so an unvalidated policy never outlives a restart.

A Tuner serves its keeper's instance (`keeper.instance`): it records, reads
and closes only that instance's retunes and policies, and validates against
that instance's steps; the search fits step time on them too and may pool
acceptance over every instance (tuner.search).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from engine.policy import TunedPolicy
from store.db import session_scope
from store.history import (
    active_policy,
    finish_retune,
    get_retune,
    last_real_retune_start,
    mark_applied,
    mark_rolled_back,
    retune_history,
    running_retunes,
    start_retune,
)
from store.models import Retune
from tuner.config import TunerConfig
from tuner.data import count_step_rows, read_steps
from tuner.keeper import PolicyKeeper, PolicyPinned
from tuner.model import NotEnoughTelemetry
from tuner.objective import Capacity, Evaluation
from tuner.process import ProcessSearch, SearchCrashed, SearchRunner, SearchTimeout, bounded, lower_priority
from tuner.search import SearchJob, SearchOutcome, run_search
from tuner.space import SearchSpace
from tuner.tenant_fill import served_tenants
from tuner.validate import (
    Verdict,
    against_prediction,
    against_replaced,
    chooses_same,
    compare,
    enough_evidence,
    measured_goodput,
    own_steps,
    unmatched,
    weighted_rate,
)

log = logging.getLogger("crossover.tuner")
VALIDATION_STRETCH = 4.0
"""How far past `validation_s` a window runs on while its steps are too few for a verdict
(tuner.validate.enough_evidence)."""
__all__ = ["ProcessSearch", "RetuneHandle", "SearchRunner", "Tuner", "lower_priority"]


@dataclass
class RetuneHandle:
    """A retune this process started; `phase` moves while it runs."""

    id: int
    source: str
    phase: str = "searching"
    done: threading.Event = field(default_factory=threading.Event)


class Tuner:
    """See the module docstring."""

    def __init__(self, db: Engine, db_url: str, keeper: PolicyKeeper,
                 capacity: Callable[[], Capacity], config: TunerConfig = TunerConfig(),  # noqa: B008
                 search: SearchRunner = run_search) -> None:
        self.db, self.db_url, self.keeper = db, db_url, keeper
        self.instance = keeper.instance
        self.config = config
        self._capacity = capacity
        self._search = search
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._running: RetuneHandle | None = None
        self._thread: threading.Thread | None = None
        self.last_outcome: SearchOutcome | None = None

    # -- startup ---------------------------------------------------------------
    def restore(self) -> TunedPolicy:
        """At startup, before any retune: close each retune a stopped daemon left "running"
        as "interrupted", rolling back the policy such a retune applied but never validated
        (the daemon stopped in its validation window), then serve the active policy
        (PolicyKeeper.restore). Returns the policy serving."""
        with session_scope(self.db) as session:
            for retune in running_retunes(session, instance=self.instance):
                self._interrupt(session, retune)
        return self.keeper.restore()

    def _interrupt(self, session: Any, retune: Retune) -> None:
        own = self.instance
        reason = "interrupted: the daemon stopped before this retune finished"
        details: dict[str, Any] = {"interrupted": True, "phase": "unknown"}
        active = active_policy(session, instance=own)
        extra = (active.body or {}).get("extra") if active is not None else None
        version = None
        if active is not None and isinstance(extra, dict) and extra.get("retune_id") == retune.id:
            version = active.version
            why = (f"never validated: the daemon stopped during retune {retune.id}'s "
                   "validation window")
            mark_rolled_back(session, version, why, instance=own)
            session.flush()
            previous = active_policy(session, instance=own)
            if previous is not None:
                mark_applied(session, previous.version, instance=own)  # the active one again
            details.update(phase="validating", rolled_back=version,
                           restored=None if previous is None else previous.version)
            reason += f"; its policy v{version} was rolled back, never validated"
        log.warning("retune %d was left running by a stopped daemon: %s", retune.id, reason)
        finish_retune(session, retune.id, "interrupted", error=reason, details=details,
                      chosen_policy_version=version)

    # -- triggers --------------------------------------------------------------
    def trigger(self, source: str = "admin") -> tuple[dict[str, Any], bool]:
        """(the retune's view, whether this call started it); see step 1."""
        with self._lock:
            if self._running is not None:
                return self._view(self._running.id), False
            if self._stop.is_set():
                raise RuntimeError("the tuner is closed")
            if self.keeper.pinned:
                return self._skip(source, f"policy v{self.keeper.current.version} is pinned by "
                                          "an admin; unpin it to tune"), False
            study = SearchSpace.build(self.config, self._capacity()).study_name(
                self.config.study_name)
            with session_scope(self.db) as session:
                retune_id = start_retune(session, source, study, instance=self.instance).id
            handle = self._running = RetuneHandle(retune_id, source)
            self._thread = threading.Thread(target=self._work, args=(handle,),
                                            name=f"retune-{retune_id}", daemon=True)
            self._thread.start()
            return self._view(retune_id), True

    def scheduled(self) -> dict[str, Any] | None:
        """The periodic job: skip (recorded, with the reason) on thin telemetry, else trigger."""
        if self._stop.is_set():
            return None
        if self._running is None and not self.keeper.pinned:
            with session_scope(self.db) as session:
                since = last_real_retune_start(session, instance=self.instance) or 0.0
                new = count_step_rows(session, since, instance=self.instance)
            if new < self.config.min_new_steps:
                return self._skip("schedule", f"only {new} new steps (per sequence) since the "
                                              f"last retune (need {self.config.min_new_steps})")
        return self.trigger("schedule")[0]

    # -- reading -----------------------------------------------------------------
    def get(self, retune_id: int) -> dict[str, Any] | None:
        """One retune (in-memory phase added while it runs), or None."""
        return self._view(retune_id)

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        with session_scope(self.db) as session:
            return [self._row_view(r)
                    for r in retune_history(session, limit, instance=self.instance)]

    def wait(self, retune_id: int, timeout: float | None = None) -> bool:
        handle = self._running
        if handle is None or handle.id != retune_id:
            return True
        return handle.done.wait(timeout)

    def describe(self) -> dict[str, Any]:
        """What /admin/tuner shows."""
        last = self.last_outcome
        shown = None if last is None else last.details()
        return {
            "instance": self.instance, "config": dataclasses.asdict(self.config),
            "policy": self.keeper.current.to_dict(), "pinned": self.keeper.pinned,
            "running": self._running.id if self._running else None,
            "search_ready": self.search_ready,
            "search_pid": self._search.pid if isinstance(self._search, ProcessSearch) else None,
            "last_search": None if last is None or shown is None else {
                "study_name": last.study_name, "best_trial": last.best_trial, "fit": shown["fit"],
                "method": last.method, "seconds": last.seconds, "tenants": shown.get("tenants"),
                "traffic": shown["traffic"], "pareto": shown["pareto"], "predicted": shown["predicted"]},
        }  # fmt: skip

    def start_search(self) -> None:
        """Start the search process and warm it up, when searches run in one (no wait)."""
        if isinstance(self._search, ProcessSearch):
            self._search.start(self.db_url)

    @property
    def search_ready(self) -> bool:
        """Whether a search would start at once: no search process, or its worker is warm."""
        return not isinstance(self._search, ProcessSearch) or self._search.ready

    def close(self, timeout: float = 10.0) -> None:
        """Stop waiting in a validation window and join the worker (bounded)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if hasattr(self._search, "close"):
            self._search.close()

    # -- the worker ----------------------------------------------------------------
    def _work(self, handle: RetuneHandle) -> None:
        try:
            status, fields = self._retune(handle)
        except NotEnoughTelemetry as exc:
            status, fields = "skipped", {"error": f"skipped: {exc}",
                                         "details": {"skipped": True, "reason": str(exc)}}
        except (SearchCrashed, SearchTimeout) as exc:  # said in full by the message: no traceback
            log.warning("retune %d failed: %s: %s", handle.id, type(exc).__name__, exc)
            status, fields = "failed", {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:
            log.exception("retune %d failed", handle.id)
            status, fields = "failed", {"error": f"{type(exc).__name__}: {exc}"}
        log.info("retune %d %s: %s", handle.id, status,
                 fields.get("error") or (fields.get("details") or {}).get("reason", ""))
        try:
            with session_scope(self.db) as session:
                finish_retune(session, handle.id, status, **fields)
        finally:
            with self._lock:
                self._running = None
            handle.phase = "done"
            handle.done.set()

    def _retune(self, handle: RetuneHandle) -> tuple[str, dict[str, Any]]:
        incumbent = self.keeper.current
        now = time.time()
        job = SearchJob(self.db_url, self.config, self._capacity(), incumbent,
                        since=now - self.config.fit_window_s, until=now + 1.0, retune_id=handle.id,
                        instance=self.instance)
        # a process search bounds (and kills) itself; any other runs under `bounded`
        outcome = (self._search(job) if isinstance(self._search, ProcessSearch)
                   else bounded(self._search, job))
        self.last_outcome = outcome
        details = outcome.details()
        common = {"trial_number": outcome.best_trial, "details": details}
        candidate, reason = self._candidate(outcome, incumbent)
        if candidate is None:
            details["reason"] = reason
            return "rejected", {**common, "predicted_goodput": _goodput(outcome.predicted)}
        predicted = _goodput(outcome.predicted)
        handle.phase = "validating"
        try:
            applied = self.keeper.apply(candidate, "tuner", {"retune_id": handle.id,
                                                             "predicted_goodput": predicted})
        except PolicyPinned as exc:
            details["reason"] = f"{exc} (pinned during the search)"
            return "rejected", {**common, "predicted_goodput": predicted}
        verdict, measured, matched = self._validate(applied, incumbent, outcome)
        details["validation"] = verdict.to_dict()
        details["predicted_at_measured_batches"] = matched
        fields = {**common, "predicted_goodput": predicted if matched is None else matched,
                  "measured_goodput": measured, "chosen_policy_version": applied.version}
        if verdict.decision == "rollback":
            if self.keeper.rollback(applied, incumbent, verdict.reason):
                return "rejected", fields
            details["reason"] = "replaced (an admin pin) before it could be rolled back"
        return "applied", fields

    def _candidate(self, outcome: SearchOutcome,
                   incumbent: TunedPolicy) -> tuple[TunedPolicy | None, str]:
        if outcome.best is None:
            return None, "no trial satisfied the constraints (KV capacity, p95 TPOT)"
        # rebuilt through the constructor's checks: an outcome unpickled from the search
        # process skipped them (PolicyError here fails the retune, naming the field)
        candidate = TunedPolicy.from_dict(outcome.best.to_dict())
        best, current = _goodput(outcome.predicted) or 0.0, _goodput(outcome.incumbent) or 0.0
        if _shape(candidate) == _shape(incumbent):
            return None, "the serving policy is still the best found"
        observed = list(outcome.traffic.batch_weights)
        served = served_tenants(outcome.traffic.tenant_mix) or None  # others: tenant_fill
        if observed and chooses_same(candidate, incumbent, observed, served) and best >= current * (1 - 1e-9):
            return candidate, ""  # only batch sizes the window did not see change (module doc, 3)
        if outcome.incumbent.feasible and best < current * (1 + self.config.min_gain):
            return None, (f"best predicted goodput {best:.1f} does not beat the serving "
                          f"policy's {current:.1f} by {self.config.min_gain:.0%}")
        return candidate, ""

    def _validate(self, applied: TunedPolicy, previous: TunedPolicy,
                  outcome: SearchOutcome) -> tuple[Verdict, float | None, float | None]:
        """The verdict, the measured goodput, and the model's prediction at the same batch sizes."""
        cfg = self.config
        start = time.time()
        rows = self._steps(start, applied.version)

        def waiting() -> bool:
            own, elapsed = own_steps(rows, applied), time.time() - start
            if len(own) >= cfg.validation_min_steps:
                return False
            return elapsed < cfg.validation_s or (
                not enough_evidence(own) and elapsed < cfg.validation_s * VALIDATION_STRETCH)

        while (waiting() and self.keeper.current.version == applied.version
               and not self._stop.wait(cfg.poll_s)):
            rows = self._steps(start, applied.version)
        rows = self._steps(start, applied.version)
        with session_scope(self.db) as session:
            baseline = read_steps(session, start - cfg.baseline_s, start, version=previous.version,
                                  instance=self.instance)
        verdict = compare(rows, baseline, applied, previous, cfg.rollback_margin, cfg.noise_z)
        own = own_steps(rows, applied)
        weights = {b: float(n) for b, n in Counter(r.batch_size for r in own).items()}
        served = set(weights)
        predicted = weighted_rate({b: v for b, v in outcome.per_batch.items() if b in served},
                                  weights)
        measured = measured_goodput(own, weights)
        before = own_steps(baseline, previous)
        alone = unmatched(own, before)  # the prediction judges only where `before` cannot
        sizes = {r.batch_size for r in alone}
        verdict = against_prediction(
            verdict, alone, measured_goodput(alone, weights),
            weighted_rate({b: v for b, v in outcome.per_batch.items() if b in sizes}, weights),
            cfg.prediction_margin)
        verdict = against_replaced(verdict, own, outcome.incumbent_per_batch, weights, applied,
                                   previous, cfg.rollback_margin, cfg.noise_z, before)
        return verdict, measured, predicted

    def _steps(self, since: float, version: int) -> list:
        with session_scope(self.db) as session:
            return read_steps(session, since - 1.0, version=version, instance=self.instance)

    # -- records -------------------------------------------------------------------
    def _skip(self, source: str, reason: str) -> dict[str, Any]:
        """Record a retune that did not run (status "skipped", details.reason)."""
        with session_scope(self.db) as session:
            retune = start_retune(session, source, instance=self.instance)
            finish_retune(session, retune.id, "skipped", error=f"skipped: {reason}",
                          details={"skipped": True, "reason": reason})
            return self._row_view(retune)

    def _view(self, retune_id: int) -> dict[str, Any] | None:
        with session_scope(self.db) as session:
            row = get_retune(session, retune_id, instance=self.instance)
            view = None if row is None else self._row_view(row)
        handle = self._running
        if view is not None and handle is not None and handle.id == retune_id:
            view["phase"] = handle.phase
        return view

    @staticmethod
    def _row_view(r: Retune) -> dict[str, Any]:
        return {
            "id": r.id, "instance": r.instance, "triggered_by": r.triggered_by,
            "status": r.status,
            "phase": "done" if r.status != "running" else "running",
            "skipped": r.status == "skipped",
            "started_at": r.started_at, "finished_at": r.finished_at,
            "study_name": r.study_name, "trial_number": r.trial_number,
            "predicted_goodput": r.predicted_goodput, "measured_goodput": r.measured_goodput,
            "chosen_policy_version": r.chosen_policy_version, "error": r.error,
            "details": r.details,
        }  # fmt: skip


def _goodput(evaluation: Evaluation | None) -> float | None:
    """Predicted goodput to the 4 decimals `details` records, so the retune row's figure and
    its details agree."""
    return None if evaluation is None else round(evaluation.goodput, 4)


def _shape(p: TunedPolicy) -> tuple:
    """What a policy does, without its version, source and notes."""
    return p.rules, p.crossover, round(p.pool_split, 6), p.draft_vocab, p.tenants
