"""crossover tuner: telemetry -> performance model -> Optuna -> a validated TunedPolicy.

    data       the tuner's reads of xo_steps (as StepStats) and xo_requests (RequestRow)
    model      PerfModel: step time by the sequences and token rows a step runs, proposer
               cost; its error on held-out steps
    stepfit    the step-time fits (least squares) and the older steps that fill their gaps
    acceptance the model's acceptance fits: by technique, draft position, tenant and depth
    rows       a step's row classes as the fits count them (per tenant; several proposers)
    traffic    Traffic: batch-size mix, concurrency, arrival rate, lengths, tenant mix
    objective  Capacity, evaluate(): predicted goodput, p95 TPOT, KV page budgets
    mixed      Pricer: a batch whose rows draft differently (per-tenant rules), priced
    tenants    add_tenant_rules(): per-tenant rules on top of the best single-rule policy
    space      SearchSpace: a TunedPolicy as Optuna parameters and back
    search     run_search(SearchJob): one ask/tell search in the project's database
    validate   compare(): measured goodput at matched batch sizes; rollback verdict
    explore    ExplorationPlan: the exploration each served policy carries; startup profile
    keeper     PolicyKeeper: versions, applies, records, rolls back and pins policies
    service    Tuner: single-flight retunes from trigger to validated policy
See README.md beside this file.
"""
