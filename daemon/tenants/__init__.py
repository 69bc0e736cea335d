"""Tenants: who may call the daemon, with which limits, and how many requests each has in flight.

- `limits`: `TenantLimits` and `TenantInfo` (an authenticated caller), the one
  list of per-tenant limits (`LIMIT_FIELDS`), and how a stored tenant row and
  the daemon's settings combine into limits. Light on purpose (no SQLAlchemy):
  the CLI builds its flags from it at `crossover --help` time.
- `auth`: `authenticate(request)` — open mode, or the bearer key looked up in
  the cached `TenantDirectory` (verified off the event loop against the
  store's salted hashes).
- `gate`: `TenantGates`, per-tenant admission (max_concurrent in flight,
  max_queued waiting, 429 past both).
- `admin_ops`: adding, listing and revoking tenants, shared by
  `crossover tenants` and /admin/tenants.

The modules are imported by their full names (`daemon.tenants.limits`, ...);
this file imports nothing, so the CLI's `limits` stays cheap to load.
"""
