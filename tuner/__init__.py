"""crossover tuner: telemetry -> performance model -> exact solve (or TPE) -> a validated TunedPolicy.

Every module, in the order a retune uses them (README.md beside this file walks one retune
step by step and says which optimizer decides):

    service     Tuner: single-flight retunes from trigger to validated policy
    process     ProcessSearch: the search in a low-priority process, killed past its timeout
    outcome     SearchJob in, SearchOutcome out: what crosses that process boundary
    search      run_search(SearchJob): read, fit, solve, record in the study, tenant rules
    data        the tuner's reads of xo_steps (as StepStats) and xo_requests (RequestRow)
    model       PerfModel: step time by the sequences and token rows a step runs, proposer
                cost; its error on held-out steps
    stepfit     the step-time fits (least squares) and the older steps that fill their gaps
    rows        a step's row classes as the fits count them (per tenant; several proposers)
    acceptance  the model's acceptance fits: by technique, draft position, tenant and depth
    traffic     Traffic: batch-size mix, concurrency, arrival rate, lengths, tenant mix
    capacity    what a pool split costs tenants and buys a draft model
    objective   Capacity, evaluate(): predicted goodput, p95 TPOT, KV page budgets
    mixed       Pricer: a batch whose rows draft differently (per-tenant rules), priced
    space       SearchSpace: a TunedPolicy as Optuna parameters and back
    split       solve_splits(): the exact solve at each pool split; the optimum over splits
    exact       solve(): Dinkelbach's method per KV footprint; fills unobserved ranges
    tenants     add_tenant_rules(): per-tenant rules on top of the chosen policy
    tenant_fill rules for tenants the window holds none of, from their own acceptance
    keeper      PolicyKeeper: versions, applies, records, rolls back and pins policies
    validate    compare(): measured goodput at matched batch sizes; rollback verdict
    explore     ExplorationPlan: the exploration each served policy carries; startup profile
    config      TunerConfig: every knob, also the daemon's [tuner] settings
"""
