"""/dashboard: who may look, what its JSON says, and what headless Chromium draws."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from daemon.dashboard import COOKIE, PLOTLY_JS, SESSION_S, cookie_value
from tests.daemon.dashboard_fill import CROSSOVER, TENANTS, fill
from tests.daemon.helpers import LiveServer

TOKEN = "dash-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
CHROMIUM = shutil.which("chromium")
SERIES_COLOURS = (0x4E79A7, 0xF28E2B, 0x59A14F)  # the first three of dashboard.js's PALETTE
MARKER_RED = 0xE15759


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A daemon over 40 minutes of telemetry, 4 policies and 4 retunes (read-only tests)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('dash') / 'telemetry.db'}"
    fill(url)
    server = LiveServer(db_url=url, admin_token=TOKEN).start()
    yield server
    server.close()


def test_the_token_buys_a_cookie_that_cannot_call_the_admin_api(filled: LiveServer) -> None:
    assert filled.get("/dashboard").status == 401
    assert filled.get("/dashboard?token=wrong").status == 403
    r = filled.get(f"/dashboard?token={TOKEN}")
    assert r.status == 303 and r.headers["location"] == "/dashboard"
    cookie = r.headers["set-cookie"]
    value = cookie.split(f"{COOKIE}=")[1].split(";")[0]
    expires = int(value.split(".")[0])
    assert value == cookie_value(TOKEN, expires) and TOKEN not in cookie
    assert abs(expires - time.time() - SESSION_S) < 60 and f"Max-Age={SESSION_S}" in cookie
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    with_cookie = {"Cookie": f"{COOKIE}={value}"}
    expired = {"Cookie": f"{COOKIE}={cookie_value(TOKEN, int(time.time()) - 1)}"}
    assert filled.get("/dashboard", expired).status == 401  # a copied cookie stops working
    forged = {"Cookie": f"{COOKIE}={expires + 10**6}.{value.split('.')[1]}"}
    assert filled.get("/dashboard", forged).status == 401  # its expiry cannot be moved
    page = filled.get("/dashboard", with_cookie)
    assert page.status == 200 and PLOTLY_JS.encode() in page.data
    assert filled.get("/dashboard/api/batch", with_cookie).status == 200
    assert filled.get("/dashboard/api/batch").status == 401
    assert filled.get("/dashboard/api/batch", ADMIN).status == 200
    assert filled.get("/admin/status", with_cookie).status == 401
    cookie_as_bearer = {"Authorization": f"Bearer {value}"}
    assert filled.get("/admin/status", cookie_as_bearer).status == 403
    assert filled.get("/dashboard/static/dashboard.js").status == 200  # code, no data
    library = filled.get(PLOTLY_JS)  # from the installed plotly package
    assert library.status == 200 and b"plotly.js v" in library.data[:200]


def test_without_a_token_only_open_loopback_shows_it(live: Callable[..., LiveServer]) -> None:
    open_server = live()
    assert open_server.get("/dashboard").status == 200
    assert open_server.get("/dashboard/api/status").json()["model"] == "fake-reverse"
    assert open_server.get("/dashboard/api/batch").status == 503  # no database here
    closed = live(open_mode=False)
    assert closed.get("/dashboard").status == 403
    assert closed.get("/dashboard/api/status").status == 403


def test_the_json_behind_the_charts(filled: LiveServer) -> None:
    acceptance = filled.get("/dashboard/api/acceptance", ADMIN).json()
    assert acceptance["bucket_s"] == 120
    assert [s["key"] for s in acceptance["by_technique"]] == ["mtp", "ngram"]
    assert [s["key"] for s in acceptance["by_tenant"]] == sorted(TENANTS)
    rates = [p["rate"] for s in acceptance["by_tenant"] for p in s["points"]]
    assert len(rates) >= 3 * 18 and all(0.0 < r < 1.0 for r in rates)
    team_a = [p["rate"] for p in acceptance["by_tenant"][0]["points"]]
    assert abs(sum(team_a) / len(team_a) - TENANTS["team-a"]) < 0.05
    assert {(p["technique"], p["position"]) for p in acceptance["by_position"]} == {
        ("mtp", 0), ("mtp", 1), ("ngram", 0), ("ngram", 1), ("ngram", 2)}
    batch = filled.get("/dashboard/api/batch", ADMIN).json()
    assert sum(b["steps"] for b in batch["bins"]) == 1200
    goodput = filled.get("/dashboard/api/goodput", ADMIN).json()
    assert goodput["crossover"] == {"batch_size": CROSSOVER, "policy_version": 4}
    assert [s["technique"] for s in goodput["series"]] == ["mtp", "ngram", "none"]
    retunes = filled.get("/dashboard/api/retunes", ADMIN).json()
    assert [r["status"] for r in retunes["retunes"]] == ["failed", "applied", "rejected", "applied"]
    assert [r["policy"]["version"] if r["policy"] else None for r in retunes["retunes"]] == [
        None, 4, 3, 2]
    assert retunes["retunes"][2]["policy"]["rolled_back_at"] is not None
    # per-tenant decisions: v4 chose rules for two tenants, v2 weighed them and kept one rule
    chosen, kept = retunes["retunes"][1]["tenants"], retunes["retunes"][3]["tenants"]
    assert chosen["chosen"] and chosen["gain"] == 0.062
    assert [(r["tenant"], r["technique"], r["depth"]) for r in chosen["rules"]] == [
        ("team-a", "ngram", 3), ("team-c", "none", 0)]
    assert kept["chosen"] is False and retunes["retunes"][0]["tenants"] is None
    assert kept["fill"] == [{"tenant": "team-c", "technique": "none", "depth": 0, "max_batch": 4}]
    assert chosen["fill"] == []
    assert filled.get("/dashboard/api/batch?window_s=5", ADMIN).status == 400


def chromium(tmp_path: Path, url: str, *action: str) -> str:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
           "--window-size=1280,1000", "--virtual-time-budget=5000", *action, url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_headless_chromium_draws_every_chart(filled: LiveServer, tmp_path: Path) -> None:
    url = f"{filled.url}/dashboard?token={TOKEN}"
    png = tmp_path / "dashboard.png"
    chromium(tmp_path, url, f"--screenshot={png}")
    with Image.open(png) as image:
        assert image.size == (1280, 1000)
        pixels = np.asarray(image.convert("RGB"))
    packed = (pixels[..., 0].astype(np.int32) << 16) | (pixels[..., 1].astype(np.int32) << 8) \
        | pixels[..., 2]
    colours, counts = np.unique(packed, return_counts=True)
    seen = dict(zip(colours.tolist(), counts.tolist(), strict=True))
    assert len(seen) > 300, "the page looks blank"
    for colour in SERIES_COLOURS:
        assert seen.get(colour, 0) > 2000, f"series colour #{colour:06x} is (nearly) missing"
    assert seen.get(MARKER_RED, 0) > 100, "the crossover marker is missing"

    dom = chromium(tmp_path, url, "--dump-dom")
    assert 'data-loaded="ok"' in dom
    drawn = {}
    for tag in re.findall(r'<div [^>]*data-chart="[^>]*>', dom):
        attrs = dict(re.findall(r'([a-z-]+)="([^"]*)"', tag))
        drawn[attrs["data-chart"]] = (int(attrs["data-series"]), int(attrs["data-points"]))
    assert drawn["acceptance-technique"][0] == 2 and drawn["acceptance-tenant"][0] == 3
    assert drawn["goodput"][0] == 3 and drawn["positions"] == (2, 5)
    assert all(points >= 5 for _, points in drawn.values()) and len(drawn) == 5
    assert dom.count('class="main-svg"') >= 5  # Plotly drew its SVG in every chart
    assert len(re.findall(r'class="trace scatter', dom)) == 2 + 3 + 3  # one per line series
    assert f'data-marker="crossover {CROSSOVER} (policy v4)"' in dom
    assert f"crossover {CROSSOVER} (policy v4)</text>" in dom  # the marker's label
    for title in ("batch size (sequences per step)", "goodput (output tokens/s)", "steps"):
        assert f">{title}</text>" in dom, f"axis title {title!r} is missing"
    assert re.search(r'<table data-chart="retunes" data-points="4">', dom)
    assert 'data-tenants="2">team-a ngram@3' in dom and "+6.2% predicted over the best single rule" in dom
    assert 'data-tenants="0">single rule kept (per tenant +1.1% predicted' in dom
    assert 'data-fill="1">where the window held none of their rows: team-c none' in dom
