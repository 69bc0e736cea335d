"""One search: telemetry -> model -> Optuna ask/tell -> the best feasible policy.

`run_search(job)` is a plain function of a picklable job, so the daemon can
run it in another process (off the serving path, away from the engine's GIL)
or a thread (tests). Data flow:

1. Read this instance's raw steps and finished requests of the fit window,
   and each policy version's draft vocabulary, in one session; and the
   steps of every other instance sharing the database.
2. Fit the PerfModel (error held out) on this instance's steps, refit its
   acceptance (rates, shares, depth factors) on every instance's steps
   (`pool_acceptance`: it follows model, heads and text, not hardware) and
   recall older per-tenant rates of techniques the window barely ran
   (`PerfModel.remembering`); observe the last `traffic_window_s`' Traffic.
3. Open the study in the same database (RDB storage, `load_if_exists`), its
   name carrying the space's fingerprint (and a generation number once a
   study holds `max_study_trials`); the sampler's seed, when one is
   configured, is offset by the trial count so a restart never repeats.
4. Solve for the best policy exactly (`tuner.split`: for each pool split,
   capacity priced at it, `tuner.exact`'s Dinkelbach solve per KV footprint;
   milliseconds). **The solve decides** whenever it can: when its optimum
   meets every constraint (the p95 TPOT target too) and one objective is
   asked for, enqueue it and the current policy and ask/tell only those two;
   the better of them is chosen, the optimum on a tie. Optuna decides
   nothing here: it records both under today's model (each trial is a dozen
   small database commits; sampling more could not find better). When the
   solve finds no policy that fits the KV pool at any split, no policy of the
   space can: nothing is asked and nothing is chosen.
5. Otherwise (two objectives, the optimum misses the TPOT target, or
   `TunerConfig.exact` is off) **TPE decides**: enqueue the current policy,
   a greedy policy built from the model
   (the best (technique, depth) of each batch-size range on its own), the
   exact optimum and the study's (or the previous generation's) best earlier
   parameters, so they are scored under today's model and traffic and TPE
   starts from them; then ask/tell `trials` times: suggest a policy, evaluate
   it, store its constraints (KV pages, TPOT) with `Trial.set_constraint`,
   which TPE honours.
6. Pick the best feasible trial of this run (two-objective: the highest
   goodput on this run's Pareto front).
7. One objective: add per-tenant rules to it where they pay by more than
   `tenant_min_gain` (tuner.tenants: exact while the combinations are few,
   else coordinate ascent and TPE in an in-memory study; its method, seconds
   and predicted gain are the outcome's `tenants`). The study's parameters
   are the batch rules only; tenant rules are a layer on its best. Then each
   measured tenant gets its own cell where the window held none of its rows
   (below the observed batch sizes; anywhere for one it did not serve) where
   its acceptance says so (tuner.tenant_fill; the outcome's `tenants.fill`).
   Return the policy with the evidence (tuner.outcome.SearchOutcome).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import IntegrityError, ProgrammingError

from engine.policy import BatchRule, TunedPolicy
from engine.types import StepStats
from store.db import install_sqlite_pragmas, is_sqlite, make_engine, resolve_url, session_scope
from store.history import draft_vocab_by_instance
from tuner.acceptance import fit_acceptance, fit_depth_factors, fit_draft_share
from tuner.data import read_requests, read_steps, read_steps_by_instance
from tuner.model import MIN_FIT_ROWS, PerfModel
from tuner.objective import Evaluation, evaluate
from tuner.outcome import ParetoPoint, SearchJob, SearchOutcome
from tuner.space import SearchSpace
from tuner.split import solve_splits
from tuner.stepfit import MIN_SHAPE_STEPS, cost_history
from tuner.tenant_fill import fill_tenant_rules
from tuner.tenants import add_tenant_rules
from tuner.traffic import Traffic, observe
from tuner.validate import MAX_FIGURE_BATCH, decode_figures

CONSTRAINT_NAMES = ("tenant_kv_pages", "speculation_kv_pages", "p95_tpot_ms")
REVISIT = 3
"""Best earlier parameter sets re-scored in every run."""
SQLITE_TIMEOUT_S = 30

optuna.logging.set_verbosity(logging.WARNING)


__all__ = ["ParetoPoint", "SearchJob", "SearchOutcome", "run_search"]


def make_storage(db_url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the project's database (its tables sit beside the xo_ ones).

    On SQLite its connections get the store's settings (WAL, synchronous NORMAL,
    a busy timeout): a trial is a dozen small commits, and a full fsync each
    made them the search's main cost.
    """
    url = resolve_url(db_url)
    if not is_sqlite(url):
        return _server_storage(url)
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {
        "timeout": SQLITE_TIMEOUT_S}})
    install_sqlite_pragmas(storage.engine, SQLITE_TIMEOUT_S * 1000)
    storage.engine.dispose()  # connections opened while creating tables lack the pragmas
    return storage


def _server_storage(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    """RDBStorage on a database server. Daemons sharing a fresh database may create Optuna's
    tables at the same moment; the loser of that race (PostgreSQL: a duplicate type or
    table) finds them made when it tries again."""
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url)
        except (IntegrityError, ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def open_study(storage: optuna.storages.RDBStorage, name: str, two_objective: bool,
               seed: int | None) -> optuna.Study:
    """Create or load the study (ask/tell; multivariate TPE, constraint-aware)."""
    if seed is not None:
        seed += _trial_count(storage, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)
    directions = ["maximize", "minimize"] if two_objective else ["maximize"]
    return optuna.create_study(storage=storage, sampler=sampler, study_name=name,
                               directions=directions, load_if_exists=True)


def trial_constraints(trial: FrozenTrial) -> list[float]:
    """The trial's constraint values (<= 0 feasible), in CONSTRAINT_NAMES order."""
    values = trial.constraints
    return [values.get(name, 0.0) for name in CONSTRAINT_NAMES]


def _trial_count(storage: optuna.storages.RDBStorage, name: str) -> int:
    try:
        return storage.get_n_trials(storage.get_study_id_from_name(name))
    except KeyError:
        return 0


def generation(storage: optuna.storages.RDBStorage, name: str,
               cap: int) -> tuple[str, str | None]:
    """(the study generation with room, the full one before it): `name`, `name.2`, ...

    TPE reads every trial of its study at each ask, so a study stops growing at
    `cap` trials and the next generation starts from the last one's best.
    """
    previous, k = None, 1
    while True:
        current = name if k == 1 else f"{name}.{k}"
        if _trial_count(storage, current) < cap:
            return current, previous
        previous, k = current, k + 1


def warm_up(db_url: str | None = None) -> int:
    """Import and run once what a search uses lazily (SciPy's NNLS, Optuna's multivariate
    TPE with constraints, its RDB storage and Alembic) and, given the database, open Optuna's
    storage there (its first open creates Optuna's tables), so a fresh search process pays
    for them before traffic and not in the first retune; returns the process id. Under
    `lower_priority` the worker gets only the CPU serving leaves, so a busy engine would
    stretch that one-time cost to several times its CPU time inside the first retune."""
    import os

    import numpy as np
    import optuna.storages._rdb.storage  # its models and Alembic, read per search
    from scipy.optimize import nnls

    nnls(np.eye(2), np.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=0, multivariate=True, n_startup_trials=1)
    study = optuna.create_study(sampler=sampler)
    for _ in range(3):
        trial = study.ask()
        trial.set_constraint(CONSTRAINT_NAMES[0], 0.0)
        study.tell(trial, float(trial.suggest_categorical("x", [0, 1])))
    if db_url is not None:
        make_storage(db_url).engine.dispose()
    return os.getpid()


def run_search(job: SearchJob) -> SearchOutcome:
    """See the module docstring."""
    start = time.perf_counter()
    cfg = job.config
    steps, requests, vocab_of, older, others = _read(job)
    model, report = PerfModel.fit_with_report(steps, requests, vocab_of,
                                              history=cost_history(steps, older))
    model, pooled_from = pool_acceptance(model, job.instance, steps, vocab_of, others)
    model = model.remembering(steps, older, vocab_of)
    traffic = observe_recent(steps, requests, job.until - cfg.traffic_window_s,
                             cfg.concurrency_quantile)
    space = SearchSpace.build(cfg, job.capacity)
    storage = make_storage(job.db_url)
    try:
        name, previous = generation(storage, space.study_name(cfg.study_name),
                                    cfg.max_study_trials)
        study = open_study(storage, name, cfg.two_objective, cfg.seed)

        def score(policy: TunedPolicy, on: Traffic = traffic) -> Evaluation:
            return evaluate(policy, model, on, job.capacity, cfg.tpot_p95_ms)

        incumbent = job.incumbent
        sizes = range(1, min(job.capacity.max_batch, MAX_FIGURE_BATCH) + 1)
        exact = solve_splits(space, model, traffic, job.capacity, job.incumbent) if cfg.exact else None
        if cfg.exact and exact is None:  # nothing fits the pool: no trial could be feasible
            method, trials = "exact", 0
        elif exact is not None and not cfg.two_objective and score(exact).feasible:
            method, trials = "exact", _enqueue(study, None, space, [exact, incumbent], cfg.trials)
        else:
            donor = optuna.load_study(study_name=previous, storage=storage) if previous else study
            _enqueue(study, donor, space, [incumbent, greedy_policy(space, score, traffic), exact],
                     cfg.trials)
            method, trials = "tpe", cfg.trials
        scored: dict[int, Evaluation] = {}
        told = [_one_trial(study, space, score, job.retune_id, scored) for _ in range(trials)]
        best, pareto = _choose(told, cfg.two_objective)
        chosen = _policy(best) if best else None
        predicted = scored[best.number] if best else None
        tenants = None
        if chosen is not None and cfg.tenant_rules and not cfg.two_objective:
            ruled, record = add_tenant_rules(
                chosen, space, model, traffic, job.capacity, tpot_target_ms=cfg.tpot_p95_ms,
                min_gain=cfg.tenant_min_gain, exact_limit=cfg.tenant_exact_limit,
                trials=cfg.tenant_trials, seed=cfg.seed)
            filled, record.fill = fill_tenant_rules(ruled, space, model, traffic, job.capacity)
            tenants = record
            if filled is not chosen:
                chosen, predicted = filled, score(filled)
        return SearchOutcome(
            study_name=study.study_name,
            best=chosen,
            best_trial=best.number if best else None,
            predicted=predicted,
            incumbent=score(incumbent),
            fit=report, model=model, traffic=traffic, acceptance_from=pooled_from,
            trials=[t.number for t in told],
            pareto=[ParetoPoint(t.number, t.values[0], t.values[1], _policy(t)) for t in pareto],
            per_batch=decode_figures(chosen, score, traffic, sizes) if chosen else {},
            incumbent_per_batch=decode_figures(incumbent, score, traffic, sizes),
            method=method, seconds=round(time.perf_counter() - start, 3), tenants=tenants,
        )  # fmt: skip
    finally:
        storage.engine.dispose()


def observe_recent(steps: list, requests: list, since: float, quantile: float) -> Traffic:
    """The traffic of the steps and requests from `since` on, or of all of them when fewer
    than MIN_FIT_ROWS steps are that recent."""
    recent = [s for s in steps if s.time >= since]
    if len(recent) < MIN_FIT_ROWS:
        return observe(steps, requests, quantile)
    return observe(recent, [r for r in requests if r.finish_time >= since], quantile)


Foreign = dict[str, tuple[list[StepStats], dict[int, int]]]
"""Another instance -> its steps of the fit window and its versions' draft vocabularies."""


def pool_acceptance(model: PerfModel, instance: str, steps: list[StepStats],
                    vocab_of: dict[int, int], others: Foreign) -> tuple[PerfModel, dict[str, int]]:
    """`model` with its acceptance (rates, draft shares, depth factors) refitted on the steps
    of every instance, and the steps each instance gave. Policy versions count per instance,
    so other instances' steps are keyed by their own versions' draft vocabularies under
    negative versions no instance has."""
    pooled_from = {instance: len(steps)}
    if not any(rows for rows, _ in others.values()):
        return model, pooled_from
    pooled, vocab = list(steps), dict(vocab_of)
    key = -1
    for name, (rows, vocab_of_other) in sorted(others.items()):
        remap: dict[int, int] = {}
        for s in rows:
            if s.policy_version not in remap:
                remap[s.policy_version] = key
                vocab[key] = vocab_of_other.get(s.policy_version, 0)
                key -= 1
            pooled.append(dataclasses.replace(s, policy_version=remap[s.policy_version]))
        pooled_from[name] = len(rows)
    acceptance = fit_acceptance(pooled, vocab)
    share = fit_draft_share(pooled, vocab)
    depth = fit_depth_factors(pooled, vocab, acceptance, share)
    return dataclasses.replace(model, acceptance=acceptance, draft_share=share,
                               depth_factor=depth), pooled_from


def _read(job: SearchJob) -> tuple[list, list, dict[int, int], list, Foreign]:
    """This instance's fit-window steps and requests, draft vocabularies, and steps of the
    cost window before it; the other instances' fit-window steps and vocabularies."""
    engine = make_engine(job.db_url)
    cfg = job.config
    own = job.instance
    try:
        with session_scope(engine) as session:
            steps = read_steps(session, job.since, job.until, limit=cfg.max_fit_rows,
                               instance=own)
            requests = read_requests(session, job.since, job.until, instance=own)
            # cost_history keeps at most MIN_SHAPE_STEPS of a (batch, depth): the newest that
            # many of each (batch, depth, technique) hold them, and not a whole 6 h of steps
            older = (read_steps(session, job.since - cfg.cost_window_s, job.since,
                                limit=cfg.max_fit_rows, per_shape=MIN_SHAPE_STEPS, instance=own)
                     if cfg.cost_window_s else [])
            vocabs = draft_vocab_by_instance(session)
            by_instance = read_steps_by_instance(session, job.since, job.until,
                                                 limit=cfg.max_fit_rows)
            others = {name: (rows, vocabs.get(name, {})) for name, rows in by_instance.items()
                      if name != own}
            return steps, requests, vocabs.get(own, {}), older, others
    finally:
        engine.dispose()


def greedy_policy(space: SearchSpace, score: Any, traffic: Traffic) -> TunedPolicy | None:
    """Each range's best (technique, depth) scored on its own batch sizes; the crossover
    after the last range that speculates; the smallest pool split that is feasible."""
    cells = [("none", 0)] + [(t, d) for t in space.techniques if t != "none"
                             for d in space.depths]
    rules, lower, crossover = [], 0, 0
    for i, upper in enumerate(space.ranges):
        last = i == len(space.ranges) - 1
        weights = {b: w for b, w in traffic.batch_weights.items()
                   if b > lower and (last or b <= upper)}
        best = ("none", 0)
        if weights:
            shares = traffic.token_shares()
            part = dataclasses.replace(traffic, batch_weights=weights,
                                       token_weights={b: shares[b] for b in weights})
            best = max(cells, key=lambda c: score(_single(upper, c, space), part).goodput)
        rules.append(BatchRule(upper, *best))
        crossover = upper if best[0] != "none" else crossover
        lower = upper
    vocab = space.draft_vocabs[0] if space.draft_vocabs else 0
    for split in space.pool_splits() if space.max_pool_split > 0 else [0.0]:
        policy = TunedPolicy(tuple(rules), crossover, split, draft_vocab=vocab, source="tuner")
        if score(policy, traffic).feasible:
            return policy
    return None


def _single(upper: int, cell: tuple[str, int], space: SearchSpace) -> TunedPolicy:
    vocab = space.draft_vocabs[0] if space.draft_vocabs else 0
    return TunedPolicy((BatchRule(upper, *cell),), crossover=1 << 30,
                       pool_split=space.max_pool_split, draft_vocab=vocab)


def _enqueue(study: optuna.Study, donor: optuna.Study | None, space: SearchSpace,
             policies: list[TunedPolicy | None], limit: int) -> int:
    """Queue `policies` and the donor study's best feasible parameter sets (deduplicated, at
    most `limit`, so none is left waiting for the next run); how many were queued."""
    given = [p for p in (space.params_of(x) for x in policies if x is not None) if p is not None]
    queued = [p for i, p in enumerate(given) if p not in given[:i]]
    done = [] if donor is None else [
        t for t in donor.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if all(c <= 0 for c in trial_constraints(t))]
    done.sort(key=lambda t: t.values[0], reverse=True)
    revisits = [t.params for t in done[: REVISIT * 4] if t.params not in queued]
    queued = (queued + [p for i, p in enumerate(revisits) if p not in revisits[:i]][:REVISIT])[:limit]
    for p in queued:
        study.enqueue_trial(p)
    return len(queued)


def _one_trial(study: optuna.Study, space: SearchSpace, score: Any, retune_id: int | None,
               scored: dict[int, Evaluation]) -> FrozenTrial:
    """Ask a trial, score its policy and tell it; its Evaluation goes into `scored` under
    the trial's number."""
    trial = study.ask()
    policy = space.suggest(trial)
    ev = scored[trial.number] = score(policy)
    trial.set_user_attr("policy", policy.to_dict())
    trial.set_user_attr("evaluation", ev.to_dict())
    for name, value in zip(CONSTRAINT_NAMES, ev.constraints(), strict=True):
        trial.set_constraint(name, value)
    if retune_id is not None:
        trial.set_user_attr("retune_id", retune_id)
    values = [ev.goodput, ev.p95_tpot_ms] if len(study.directions) == 2 else ev.goodput
    return study.tell(trial, values)


def _choose(told: list[FrozenTrial], two_objective: bool) -> tuple[FrozenTrial | None, list]:
    """Best feasible trial of this run, and this run's feasible Pareto front (two objectives)."""
    feasible = [t for t in told if t.state == TrialState.COMPLETE
                and all(c <= 0 for c in trial_constraints(t))]
    if not feasible:
        return None, []
    if not two_objective:
        return max(feasible, key=lambda t: t.values[0]), []
    front = [t for t in feasible if not any(_dominates(o, t) for o in feasible)]
    front.sort(key=lambda t: (-t.values[0], t.values[1]))
    return front[0], front


def _dominates(a: FrozenTrial, b: FrozenTrial) -> bool:
    """a is no worse in goodput (max) and TPOT (min) and better in one."""
    (ga, ta), (gb, tb) = a.values, b.values
    return ga >= gb and ta <= tb and (ga > gb or ta < tb)


def _policy(t: FrozenTrial) -> TunedPolicy:
    """The policy a trial scored, rebuilt from its stored form (what the study records)."""
    return TunedPolicy.from_dict(t.user_attrs["policy"])
