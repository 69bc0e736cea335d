"""`crossover retune`: ask a running daemon to retune its policy now.

    crossover retune                      # start one (or join the running one), print its id
    crossover retune --wait               # ... and follow it until it ends
    crossover retune --url http://10.0.0.5:8000 --admin-token T --wait

It calls the daemon's admin API (`POST /admin/retune`, then
`GET /admin/retunes/{id}`); the token comes from --admin-token or
$CROSSOVER_ADMIN_TOKEN. A retune already running is returned instead of a
new one (single-flight). Exit status with --wait: 0 when the retune applied
or rejected a policy, 1 when it failed or was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
TOKEN_ENV = "CROSSOVER_ADMIN_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"the daemon's base URL (default {DEFAULT_URL})")
    p.add_argument("--admin-token", help=f"admin bearer token (default: ${TOKEN_ENV})")
    p.add_argument("--wait", action="store_true", help="follow the retune until it ends")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="give up waiting after this long (default 1800)")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the final retune record as JSON")


def run(args: argparse.Namespace) -> int:
    from daemon.user_error import UserError

    token = args.admin_token or os.environ.get(TOKEN_ENV)
    if not token:
        raise UserError(f"no admin token: pass --admin-token or set ${TOKEN_ENV}")
    base = args.url.rstrip("/")
    answer = _call("POST", f"{base}/admin/retune", token)
    retune = answer["retune"]
    verb = "started" if answer.get("started") else ("skipped" if retune.get("skipped")
                                                    else "already running")
    print(f"retune {retune['id']} {verb} ({retune['triggered_by']})", file=sys.stderr)
    if args.wait and retune["status"] == "running":
        retune = _follow(base, token, retune, args)
    if args.json:
        print(json.dumps(retune, indent=2))
    else:
        print(describe(retune))
    if not args.wait:
        return 0
    return 0 if retune["status"] in ("applied", "rejected") else 1


def _follow(base: str, token: str, retune: dict[str, Any], args: argparse.Namespace) -> dict:
    from daemon.user_error import UserError

    end = time.monotonic() + args.timeout
    phase = retune.get("phase")
    while retune["status"] == "running":
        if time.monotonic() > end:
            raise UserError(f"retune {retune['id']} still running after {args.timeout:g} s")
        time.sleep(args.poll)
        retune = _call("GET", f"{base}/admin/retunes/{retune['id']}", token)
        if retune.get("phase") != phase:
            phase = retune.get("phase")
            print(f"retune {retune['id']}: {phase}", file=sys.stderr)
    return retune


def describe(r: dict[str, Any]) -> str:
    """One line: status, chosen version, predicted vs measured goodput, error or reason; then,
    when the search weighed per-tenant rules, a line with its decision (tenant_line)."""
    tenants = tenant_line((r.get("details") or {}).get("tenants"))
    return _summary(r) + (f"\n{tenants}" if tenants else "")


def tenant_line(t: dict[str, Any] | None) -> str:
    """The per-tenant decision of a retune's search (details.tenants): which tenant got which
    technique and depth up to which batch size, and the predicted gain over the best
    single-rule policy; then the rules where the window held none of a tenant's rows
    (tuner.tenant_fill); empty when the search gave and weighed none.

    >>> tenant_line({"chosen": True, "gain": 0.087, "method": "tpe", "seconds": 0.06,
    ...              "margin": 0.03, "rules": [{"tenant": "copy", "technique": "ngram",
    ...              "depth": 4, "max_batch": 8}, {"tenant": "prose", "technique": "none",
    ...              "depth": 0, "max_batch": 8}]})  # doctest: +NORMALIZE_WHITESPACE
    'per-tenant rules, +8.7% predicted over the best single-rule policy (tpe, 0.06 s): copy ngram@4,
    prose none (up to batch 8)'
    >>> tenant_line({"chosen": False, "gain": 0.01, "method": "exact", "seconds": 0.01,
    ...              "margin": 0.03, "rules": []})
    'per-tenant rules not chosen: +1.0% predicted over the best single-rule policy, margin 3% (exact, 0.01 s)'
    >>> tenant_line({"method": "skipped", "fill": [{"tenant": "prose", "technique": "none",
    ...              "depth": 0, "max_batch": 8}]})
    'per-tenant rules where the window held none of their rows: prose none (up to batch 8)'
    """
    if not t:
        return ""
    fill = (f"per-tenant rules where the window held none of their rows: {_groups(t['fill'])}"
            if t.get("fill") else "")
    if t.get("method") == "skipped":
        return fill
    how = f"({t.get('method')}, {t.get('seconds', 0):.2g} s)"
    gain = f"{t.get('gain', 0.0):+.1%} predicted over the best single-rule policy"
    if not t.get("chosen"):
        line = f"per-tenant rules not chosen: {gain}, margin {t.get('margin', 0.0):.0%} {how}"
    else:
        line = f"per-tenant rules, {gain} {how}: {_groups(t.get('rules') or [])}"
    return "; ".join(x for x in (line, fill) if x)


def _groups(rules: list[dict[str, Any]]) -> str:
    """Tenant rules grouped by their largest batch size: "copy ngram@4, prose none (up to batch 8)"."""
    groups: dict[int, list[str]] = {}
    for rule in rules:
        cell = f"{rule['technique']}@{rule['depth']}" if rule.get("depth") else "none"
        groups.setdefault(int(rule.get("max_batch", 0)), []).append(f"{rule['tenant']} {cell}")
    return "; ".join(f"{', '.join(names)} " + (f"(up to batch {upto})" if upto < 1 << 30
                                              else "(every batch size)")
                     for upto, names in sorted(groups.items()))


def _summary(r: dict[str, Any]) -> str:
    parts = [f"retune {r['id']}: {r['status']}"]
    if r.get("chosen_policy_version") is not None:
        parts.append(f"policy v{r['chosen_policy_version']}")
    if r.get("predicted_goodput") is not None:
        parts.append(f"predicted {r['predicted_goodput']:.1f} tokens/s")
    if r.get("measured_goodput") is not None:
        parts.append(f"measured {r['measured_goodput']:.1f} tokens/s")
    details = r.get("details") or {}
    validation = details.get("validation") or {}
    reason = r.get("error") or details.get("reason") or validation.get("reason")
    return ", ".join(parts) + (f" — {reason}" if reason else "")


def _call(method: str, url: str, token: str) -> dict[str, Any]:
    """One admin API call; UserError naming the URL when it fails."""
    import urllib.error
    import urllib.request

    from daemon.user_error import UserError

    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise UserError(f"{method} {url}: HTTP {exc.code}: {_message(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"cannot reach the daemon at {url}: {reason} "
                        "(is `crossover serve` running there?)") from None


def _message(exc: Any) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except Exception:
        return str(exc.reason)
