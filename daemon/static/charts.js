// Small hand-written SVG charts for the crossover dashboard (no libraries: the host is offline).
//   Charts.line(el, {series: [{name, points: [{x, y}]}], xFormat, yFormat, yMax, marker})
//   Charts.bars(el, {bars: [{label, value, color?}], yFormat})
// Each chart's <svg> carries data-chart, data-series and data-points, so tests can
// check what was drawn.
"use strict";

const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const H = 200, M = {left: 48, right: 14, top: 12, bottom: 28};
  let W = 600;  // set per chart from its container's width, so text is drawn at 1:1
  const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
                   "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

  function svgEl(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function scale(d0, d1, r0, r1) {
    const span = d1 - d0 || 1;
    return v => r0 + (v - d0) / span * (r1 - r0);
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function tickCount(yMax) {  // 4 steps for 2, 4, 20, ...; else 5 (0.2, 0.5, 1, 2 steps)
    const lead = yMax / Math.pow(10, Math.floor(Math.log10(yMax)));
    return Math.abs(lead - 2) < 1e-9 ? 4 : 5;
  }

  function frame(el, name, nSeries, nPoints) {
    el.replaceChildren();
    W = Math.max(320, Math.round(el.clientWidth || 600));
    const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "data-chart": name,
                              "data-series": nSeries, "data-points": nPoints});
    el.appendChild(svg);
    return svg;
  }

  function empty(el, name, text) {
    el.replaceChildren();
    const div = document.createElement("div");
    div.className = "empty";
    div.dataset.chart = name;
    div.dataset.points = "0";
    div.textContent = text || "no data in this window";
    el.appendChild(div);
  }

  function yAxis(svg, y, yMax, fmt) {
    const grid = svgEl("g", {class: "grid"}, svg);
    const axis = svgEl("g", {class: "axis"}, svg);
    const n = tickCount(yMax);
    for (let i = 0; i <= n; i++) {
      const v = yMax * i / n, py = y(v);
      svgEl("line", {x1: M.left, x2: W - M.right, y1: py, y2: py}, grid);
      const t = svgEl("text", {x: M.left - 6, y: py + 3, "text-anchor": "end"}, axis);
      t.textContent = fmt(v);
    }
    svgEl("line", {x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom}, axis);
    svgEl("line", {x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom}, axis);
  }

  function xTicks(svg, ticks) {
    const axis = svgEl("g", {class: "axis"}, svg);
    for (const {px, label} of ticks) {
      svgEl("line", {x1: px, x2: px, y1: H - M.bottom, y2: H - M.bottom + 4}, axis);
      const t = svgEl("text", {x: px, y: H - M.bottom + 15, "text-anchor": "middle"}, axis);
      t.textContent = label;
    }
  }

  function legend(el, names) {
    const div = document.createElement("div");
    div.className = "legend";
    names.forEach((name, i) => {
      const span = document.createElement("span");
      span.style.setProperty("--swatch", PALETTE[i % PALETTE.length]);
      span.textContent = name;
      div.appendChild(span);
    });
    el.appendChild(div);
  }

  function line(el, opts) {
    const series = opts.series.filter(s => s.points.length);
    const n = series.reduce((a, s) => a + s.points.length, 0);
    if (!n) return empty(el, opts.name);
    const xs = series.flatMap(s => s.points.map(p => p.x));
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (opts.marker != null) { x0 = Math.min(x0, opts.marker.x); x1 = Math.max(x1, opts.marker.x); }
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const yMax = opts.yMax || niceMax(Math.max(...series.flatMap(s => s.points.map(p => p.y))));
    const svg = frame(el, opts.name, series.length, n);
    const x = scale(x0, x1, M.left + 8, W - M.right - 8), y = scale(0, yMax, H - M.bottom, M.top);
    yAxis(svg, y, yMax, opts.yFormat || String);
    xTicks(svg, (opts.xTicks || defaultTicks)(x0, x1).map(v => ({px: x(v), label: opts.xFormat(v)})));
    if (opts.marker != null) drawMarker(svg, x(opts.marker.x), opts.marker.label);
    series.forEach((s, i) => drawSeries(svg, s, x, y, PALETTE[i % PALETTE.length]));
    legend(el, series.map(s => s.name));
  }

  function defaultTicks(x0, x1) {
    return [0, 1, 2, 3, 4].map(i => x0 + (x1 - x0) * i / 4);
  }

  function drawSeries(svg, s, x, y, color) {
    const g = svgEl("g", {class: "series", "data-name": s.name}, svg);
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${x(p.x).toFixed(1)},${y(p.y).toFixed(1)}`);
    svgEl("path", {d: d.join(""), fill: "none", stroke: color, "stroke-width": 2.5,
                   "stroke-linejoin": "round"}, g);
    for (const p of s.points) {
      const c = svgEl("circle", {cx: x(p.x), cy: y(p.y), r: 3.5, fill: color}, g);
      svgEl("title", {}, c).textContent = `${s.name}: ${p.title || p.y}`;
    }
  }

  function drawMarker(svg, px, label) {
    const g = svgEl("g", {class: "marker", "data-marker": label}, svg);
    svgEl("line", {x1: px, x2: px, y1: M.top, y2: H - M.bottom, stroke: "#e15759",
                   "stroke-width": 2, "stroke-dasharray": "6 4"}, g);
    const t = svgEl("text", {x: px + 5, y: M.top + 11, fill: "#e15759", "font-size": 11,
                             "font-weight": "bold"}, g);
    t.textContent = label;
  }

  function bars(el, opts) {
    const items = opts.bars;
    if (!items.length) return empty(el, opts.name);
    const yMax = niceMax(Math.max(...items.map(b => b.value)));
    const svg = frame(el, opts.name, 1, items.length);
    const y = scale(0, yMax, H - M.bottom, M.top);
    const slot = (W - M.left - M.right) / items.length;
    yAxis(svg, y, yMax, opts.yFormat || String);
    const every = Math.ceil(items.length / Math.max(4, Math.floor((W - M.left) / 44)));
    xTicks(svg, items.map((b, i) => ({px: M.left + slot * (i + 0.5), label: b.label}))
                     .filter((_, i) => i % every === 0));
    const g = svgEl("g", {class: "series"}, svg);
    items.forEach((b, i) => {
      const top = y(b.value), w = Math.max(2, slot * 0.72);
      const r = svgEl("rect", {x: M.left + slot * (i + 0.5) - w / 2, y: top, width: w,
                               height: H - M.bottom - top, rx: 2,
                               fill: b.color || PALETTE[0]}, g);
      svgEl("title", {}, r).textContent = `${b.label}: ${b.value}`;
    });
    if (opts.legend) legend(el, opts.legend);
  }

  return {line, bars, empty, PALETTE};
})();
