// The crossover dashboard: fetches /dashboard/api/* (same origin, cookie or open loopback)
// and draws them with plotly.js, which the daemon serves from the installed `plotly` Python
// package (/dashboard/lib/plotly.min.js), so the page works offline. Refreshes every 15 s;
// <body data-loaded> is set after the first complete load ("ok" or "error"). Each chart's
// element carries data-chart, data-series and data-points (the traces and points Plotly
// holds), so tests can check what was drawn.
"use strict";

const REFRESH_MS = 15000;
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                 "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];  // series colours, in order
const MARKER = "#e15759";  // the crossover line
const FONT = '"DejaVu Sans", "Liberation Sans", Arial, sans-serif';
const PLOT_CONFIG = {displayModeBar: false, responsive: true};  // drag zooms, double-click resets
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
  // each speculation technique's shapes: "compiling" in the background after start, then "ready"
  for (const [name, state] of Object.entries(s.techniques || {})) {
    items.push(pill(`${name} <b>${state}</b>`, state !== "ready"));
  }
  const spec = s.speculation;
  if (spec && spec.clamped) {
    items.push(pill(`policy v${spec.clamped.policy_version} speculates to batch ` +
                    `<b>${spec.clamped.speculates_up_to}</b>, served to <b>${spec.max_batch}</b>`, true));
  }
  $("status").replaceChildren(...items);
}

function formatUptime(sec) {
  const h = Math.floor(sec / 3600), m = Math.floor(sec % 3600 / 60);
  return h ? `${h}h ${m}m` : `${m}m ${Math.floor(sec % 60)}s`;
}

// A Plotly layout with titled axes (with units) and a legend above the plot.
function layout(xTitle, yTitle, more = {}) {
  const axis = title => ({title: {text: title, standoff: 6}, gridcolor: "#e3e6eb",
                          linecolor: "#9aa3af", zeroline: false, automargin: true});
  return {
    height: 260, margin: {l: 56, r: 12, t: 30, b: 44}, autosize: true,
    paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff", colorway: PALETTE,
    font: {family: FONT, size: 11, color: "#1f2430"}, hovermode: "closest", showlegend: true,
    legend: {orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom"},
    ...more,
    xaxis: {...axis(xTitle), ...more.xaxis},
    yaxis: {...axis(yTitle), rangemode: "tozero", ...more.yaxis},
  };
}

// Draw `traces` into the element `id` (an "empty" note when no trace has a point).
async function plot(id, traces, lay) {
  const el = $(id);
  const points = traces.reduce((n, t) => n + t.x.length, 0);
  if (!points) {
    Plotly.purge(el);
    el.innerHTML = '<div class="empty">no data in this window</div>';
    Object.assign(el.dataset, {chart: id, series: "0", points: "0"});
    return;
  }
  if (el.querySelector(".empty")) el.replaceChildren();
  await Plotly.react(el, traces, lay, PLOT_CONFIG);
  Object.assign(el.dataset, {chart: id, series: String(el.data.length),
                             points: String(el.data.reduce((n, t) => n + t.x.length, 0))});
}

const LINE = {type: "scatter", mode: "lines+markers", line: {width: 2.5}, marker: {size: 7}};

function acceptanceTraces(list) {
  return list.map(s => ({
    ...LINE, name: s.key,
    x: s.points.map(p => new Date(p.t * 1000)), y: s.points.map(p => p.rate),
    text: s.points.map(p => `${pct(p.rate)} of ${p.proposed} proposed`),
    hovertemplate: "%{x|%H:%M}: %{text}",
  }));
}

function drawAcceptance(a) {
  const lay = () => layout("time (local, HH:MM)", "acceptance (% of proposed tokens)",
                           {yaxis: {range: [0, 1.02], tickformat: ".0%"},
                            xaxis: {type: "date", tickformat: "%H:%M"}});
  const techniques = [...new Set(a.by_position.map(p => p.technique))];
  const positions = techniques.map(name => {
    const rows = a.by_position.filter(p => p.technique === name);
    return {type: "bar", name, x: rows.map(p => p.position), y: rows.map(p => p.rate || 0),
            hovertemplate: "position %{x}: %{y:.0%}"};
  });
  return Promise.all([
    plot("acceptance-technique", acceptanceTraces(a.by_technique), lay()),
    plot("acceptance-tenant", acceptanceTraces(a.by_tenant), lay()),
    plot("positions", positions,
         layout("draft position (0 = first drafted token)", "acceptance (% of drafts)",
                {barmode: "group", yaxis: {range: [0, 1.02], tickformat: ".0%"},
                 xaxis: {dtick: 1}})),
  ]);
}

function drawBatch(b) {
  const steps = {type: "bar", name: "engine steps", marker: {color: PALETTE[0]},
                 x: b.bins.map(x => x.batch_size), y: b.bins.map(x => x.steps),
                 hovertemplate: "batch %{x}: %{y} steps"};
  return plot("batch", [steps], layout("batch size (sequences per step)", "steps"));
}

function drawGoodput(g) {
  const c = g.crossover;
  const traces = g.series.map(s => ({
    ...LINE, name: s.technique,
    x: s.points.map(p => p.batch_size), y: s.points.map(p => p.tokens_per_s),
    text: s.points.map(p => `${num(p.tokens_per_s)} tok/s over ${p.steps} steps`),
    hovertemplate: "batch %{x}: %{text}",
  }));
  const more = {shapes: [], annotations: []};
  const el = $("goodput");
  delete el.dataset.marker;
  if (c && c.batch_size > 0) {
    const label = `crossover ${c.batch_size} (policy v${c.policy_version})`;
    el.dataset.marker = label;
    more.shapes.push({type: "line", xref: "x", yref: "paper", x0: c.batch_size, x1: c.batch_size,
                      y0: 0, y1: 1, line: {color: MARKER, width: 2, dash: "dash"}});
    more.annotations.push({xref: "x", yref: "paper", x: c.batch_size, y: 1, xanchor: "left",
                           yanchor: "top", showarrow: false, text: ` ${label}`,
                           font: {color: MARKER, size: 11}});
  } else {
    const note = c ? `policy v${c.policy_version} never speculates (crossover 0)`
                   : "no crossover in any policy yet";
    more.annotations.push({xref: "paper", yref: "paper", x: 1, y: 1, xanchor: "right",
                           yanchor: "top", showarrow: false, text: note,
                           font: {color: "#6b7280"}});
  }
  return plot("goodput", traces,
              layout("batch size (sequences per step)", "goodput (output tokens/s)", more));
}

function drawRetunes(r) {
  const root = $("retunes");
  if (!r.retunes.length) {
    root.innerHTML = '<div class="empty" data-chart="retunes" data-points="0">no retunes yet</div>';
    return;
  }
  const head = "<tr><th>started</th><th>trigger</th><th>status</th><th>trial</th>" +
               "<th>predicted tok/s</th><th>measured tok/s</th><th>policy</th><th>crossover</th>" +
               "<th>per tenant</th><th>policy body</th></tr>";
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
    `<td class="tenants">${tenantCell(t.tenants)}</td>` +
    `<td class="body" title="${esc(json)}"><code>${esc(json)}</code></td></tr>`;
}

// The per-tenant decision of a retune: each tenant's technique@depth (up to which batch) when
// its rules were chosen, and the predicted gain over the best single-rule policy either way.
function tenantCell(t) {
  if (!t) return "";
  const rule = r => `${esc(r.tenant)} ${r.depth ? `${esc(r.technique)}@${r.depth}` : "none"}` +
                    (r.max_batch < 2 ** 30 ? ` &le;${r.max_batch}` : "");
  const fill = (t.fill || []).length
    ? `<br><span data-fill="${t.fill.length}">where the window held none of their rows: ` +
      `${t.fill.map(rule).join(", ")}</span>` : "";
  if (t.method == null || t.method === "skipped") return fill.slice(4);
  const gain = t.gain == null ? "" : `${t.gain >= 0 ? "+" : ""}${(100 * t.gain).toFixed(1)}%`;
  const how = `${esc(t.method)}, ${t.seconds == null ? "?" : Number(t.seconds).toFixed(2)} s`;
  if (!t.chosen) {
    return `<span class="note" data-tenants="0">single rule kept (per tenant ${gain} predicted, ` +
           `margin ${Math.round(100 * (t.margin || 0))}%; ${how})</span>` + fill;
  }
  return `<span data-tenants="${t.rules.length}">${t.rules.map(rule).join("<br>")}</span>` +
         `<br><span class="note">${gain} predicted over the best single rule (${how})</span>` + fill;
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
