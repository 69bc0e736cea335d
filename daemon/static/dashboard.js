// The crossover dashboard: fetches /dashboard/api/* (same origin, cookie or open loopback)
// and draws them with charts.js. Refreshes every 15 s; <body data-loaded> is set after
// the first complete load ("ok" or "error").
"use strict";

const REFRESH_MS = 15000;
const $ = id => document.getElementById(id);

async function getJSON(path) {
  const windowS = $("window").value;
  const sep = path.includes("?") ? "&" : "?";
  const resp = await fetch(`/dashboard/api/${path}${sep}window_s=${windowS}`,
                           {credentials: "same-origin", cache: "no-store"});
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

const pct = v => `${Math.round(v * 100)}%`;
const num = v => v >= 1000 ? `${(v / 1000).toFixed(v >= 10000 ? 0 : 1)}k` : `${+v.toFixed(2)}`;
const clock = t => new Date(t * 1000).toTimeString().slice(0, 5);
const stamp = t => {
  if (t == null) return "";
  const d = new Date(t * 1000), pad = n => String(n).padStart(2, "0");
  return `${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${d.toTimeString().slice(0, 8)}`;
};

function pill(html, warn) {
  const span = document.createElement("span");
  span.className = warn ? "pill warn" : "pill";
  span.innerHTML = html;
  return span;
}

function drawStatus(s) {
  $("model").textContent = s.model;
  const pool = s.pool, used = pool.used_fraction || 0, rec = s.recorder;
  const items = [
    pill(`up <b>${formatUptime(s.uptime_s)}</b>`),
    pill(`policy <b>v${s.policy_version ?? "?"}</b>`),
    pill(`KV pool <b>${pool.pages_used}/${pool.pages_total}</b>` +
         `<span class="meter"><i style="width:${Math.round(used * 100)}%"></i></span>`),
    pill(`running <b>${s.queue.running}</b> · waiting <b>${s.queue.waiting}</b>`),
    pill(`compiles <b>${s.compiles.total ?? "?"}</b>` +
         (s.compiles.since_warmup != null ? ` (since warmup <b>${s.compiles.since_warmup}</b>)` : ""),
         s.compiles.since_warmup > 0),
  ];
  if (rec) items.push(pill(`telemetry dropped <b>${rec.dropped}</b>`, rec.dropped > 0));
  $("status").replaceChildren(...items);
}

function formatUptime(sec) {
  const h = Math.floor(sec / 3600), m = Math.floor(sec % 3600 / 60);
  return h ? `${h}h ${m}m` : `${m}m ${Math.floor(sec % 60)}s`;
}

function acceptanceSeries(list) {
  return list.map(s => ({
    name: s.key,
    points: s.points.map(p => ({x: p.t, y: p.rate, title: `${pct(p.rate)} of ${p.proposed}`})),
  }));
}

function drawAcceptance(a) {
  const common = {xFormat: clock, xTicks: timeTicks, yFormat: pct, yMax: 1};
  Charts.line($("acceptance-technique"),
              {...common, name: "acceptance-technique", series: acceptanceSeries(a.by_technique)});
  Charts.line($("acceptance-tenant"),
              {...common, name: "acceptance-tenant", series: acceptanceSeries(a.by_tenant)});
  const techniques = [...new Set(a.by_position.map(p => p.technique))];
  Charts.bars($("positions"), {
    name: "positions", yFormat: pct, legend: techniques,
    bars: a.by_position.map(p => ({
      label: `${p.technique} #${p.position}`, value: p.rate || 0,
      color: Charts.PALETTE[techniques.indexOf(p.technique) % Charts.PALETTE.length],
    })),
  });
}

function drawBatch(b) {
  Charts.bars($("batch"), {name: "batch", yFormat: num,
                           bars: b.bins.map(x => ({label: String(x.batch_size), value: x.steps}))});
}

function drawGoodput(g) {
  const c = g.crossover;
  Charts.line($("goodput"), {
    name: "goodput", xFormat: v => String(Math.round(v)), yFormat: num,
    xTicks: integerTicks,
    marker: c && c.batch_size > 0
      ? {x: c.batch_size, label: `crossover ${c.batch_size} (policy v${c.policy_version})`} : null,
    series: g.series.map(s => ({
      name: s.technique,
      points: s.points.map(p => ({x: p.batch_size, y: p.tokens_per_s,
                                  title: `${num(p.tokens_per_s)} tok/s over ${p.steps} steps`})),
    })),
  });
  const note = !c ? "no crossover in any policy yet"
    : c.batch_size > 0 ? "" : `policy v${c.policy_version} never speculates (crossover 0)`;
  if (note) $("goodput").insertAdjacentHTML("beforeend", `<div class="note">${esc(note)}</div>`);
}

function timeTicks(t0, t1) {  // on round minutes or hours, at most 6
  const steps = [60, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];
  const step = steps.find(s => (t1 - t0) / s <= 6) || 86400;
  const out = [];
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) out.push(t);
  return out;
}

function integerTicks(x0, x1) {
  const step = Math.max(1, Math.ceil((x1 - x0) / 8));
  const out = [];
  for (let v = Math.ceil(x0); v <= x1; v += step) out.push(v);
  return out;
}

function drawRetunes(r) {
  const root = $("retunes");
  if (!r.retunes.length) {
    root.innerHTML = '<div class="empty" data-chart="retunes" data-points="0">no retunes yet</div>';
    return;
  }
  const head = "<tr><th>started</th><th>trigger</th><th>status</th><th>trial</th>" +
               "<th>predicted tok/s</th><th>measured tok/s</th><th>policy</th><th>crossover</th>" +
               "<th>policy body</th></tr>";
  root.innerHTML = `<table data-chart="retunes" data-points="${r.retunes.length}">` +
                   `${head}${r.retunes.map(retuneRow).join("")}</table>`;
}

function retuneRow(t) {
  const p = t.policy, body = p ? p.body : null;
  const cross = body ? body.crossover : null;
  const json = body ? JSON.stringify(body) : "";
  return `<tr><td>${stamp(t.started_at)}</td><td>${esc(t.triggered_by)}</td>` +
    `<td><span class="badge ${esc(t.status)}">${esc(t.status)}</span></td>` +
    `<td class="num">${t.trial_number ?? ""}</td>` +
    `<td class="num">${whole(t.predicted_goodput)}</td>` +
    `<td class="num">${whole(t.measured_goodput)}</td>` +
    `<td>${p ? policyCell(p) : `<span class="note">${esc(t.error || "")}</span>`}</td>` +
    `<td class="num">${cross ?? ""}</td>` +
    `<td class="body" title="${esc(json)}"><code>${esc(json)}</code></td></tr>`;
}

function policyCell(p) {
  const rolled = p.rolled_back_at != null
    ? ` <span class="rolled" title="${esc(p.rollback_reason || "")}">rolled back</span>` : "";
  return `v${p.version} <span class="note">${esc(p.source)}</span>${rolled}`;
}

const whole = v => v == null ? "" : Math.round(v).toLocaleString("en-US");

function esc(s) {
  return String(s).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
}

async function refresh() {
  const jobs = [["status", drawStatus], ["acceptance", drawAcceptance], ["batch", drawBatch],
                ["goodput", drawGoodput], ["retunes", drawRetunes]];
  const results = await Promise.allSettled(jobs.map(([path, draw]) => getJSON(path).then(draw)));
  const failed = results.filter(r => r.status === "rejected").map(r => r.reason.message);
  $("footer").textContent = failed.length ? `failed: ${failed.join("; ")}`
                                          : `updated ${new Date().toTimeString().slice(0, 8)}`;
  document.body.dataset.loaded = failed.length ? "error" : "ok";
}

$("window").addEventListener("change", refresh);
refresh();
setInterval(refresh, REFRESH_MS);
