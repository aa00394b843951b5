"""``ckptio report --html``: one self-contained page of a run's checkpoints (no network: data and charts inline).

The record's numbers go into the page as JSON inside a ``<script type="application/json">`` (``<`` escaped, so no
text of the record can close it), and the page's own script draws the charts as SVG, putting every text in with
``textContent``: nothing of the record is ever parsed as markup. Once drawn, ``<body>`` carries
``data-charts="N"``; an error in the script sets ``data-error`` instead (what the browser test reads).
"""

from __future__ import annotations

import html
import json
import time
from typing import Any

from .audit import describe
from .summary import Summary

__all__ = ["render"]


def page_data(summary: Summary, where: str, storage_rate: float | None) -> dict[str, Any]:
    """What the page draws, as plain numbers (times relative to the run's first event)."""
    t0 = summary.processes[0].start if summary.processes else 0.0
    processes = []
    for p in summary.processes:
        points = [[e["time"] - t0, e["step"]] for e in p.events
                  if e["kind"] in ("save", "progress", "restore") and "step" in e]
        processes.append({"start": p.start - t0, "last": p.last - t0, "clean": p.clean, "points": points})
    keep = ("time", "step", "tier", "blocked_s", "total_s", "bytes", "files", "steps_lost", "restore_s", "startup_s")

    def rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: (e[k] - t0 if k == "time" else e[k]) for k in keep if k in e} for e in events]

    return {"where": where, "processes": processes, "durable": rows(summary.saves["durable"]),
            "memory": rows(summary.saves["memory"]), "restores": rows(summary.restores),
            "removes": rows(summary.removes), "failed_saves": rows(summary.failed_saves), "storage_rate": storage_rate, "goodput": summary.goodput,
            "wall_s": summary.wall_s, "blocked_s": summary.blocked_s, "redone_s": summary.redone_s,
            "restarting_s": summary.restarting_s, "setup_s": summary.setup_s, "unseen_s": summary.unseen_s,
            "unseen_steps": summary.unseen_steps, "unknown_lost": summary.unknown_lost, "failures": summary.failures, "mtbf_s": summary.mtbf_s,
            "step_s": summary.step_s, "newest_step": summary.newest_step,
            "audits": [{"verdict": e.get("verdict"), "text": describe(e)} for e in summary.audits]}


def render(summary: Summary, where: str, storage_rate: float | None = None) -> str:
    """The page for ``summary`` (of the record at ``where``); ``storage_rate``: the storage's measured write limit in
    bytes a second, drawn against each save (``None``: not measured)."""
    data = json.dumps(page_data(summary, where, storage_rate), allow_nan=False).replace("<", "\\u003c")
    made = time.strftime("%Y-%m-%d %H:%M:%S")
    return (_PAGE.replace("@TITLE@", html.escape(f"ckptio report: {where}"))
            .replace("@MADE@", html.escape(made)).replace("@DATA@", data).replace("@SCRIPT@", _SCRIPT))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline';
 style-src 'unsafe-inline'; img-src data:">
<title>@TITLE@</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#1d232b;padding:0 16px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 6px} .sub{color:#5b6573;margin:0 0 16px}
.cards{display:flex;flex-wrap:wrap;gap:10px} .card{border:1px solid #d8dde4;border-radius:6px;padding:8px 12px;
min-width:120px} .card b{display:block;font-size:20px} .card span{color:#5b6573;font-size:12px}
svg{background:#fbfcfd;border:1px solid #e3e7ec;border-radius:4px} .axis{stroke:#8a94a3;stroke-width:1}
.grid{stroke:#eceff3} text{font-size:11px;fill:#3c4550} .legend{font-size:12px;color:#3c4550;margin:4px 0}
.legend i{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px;border-radius:2px}
table{border-collapse:collapse;margin-top:6px} td,th{border-bottom:1px solid #e3e7ec;padding:3px 10px;
text-align:right} th{color:#5b6573;font-weight:600} .none{color:#5b6573}
</style></head>
<body data-charts="0">
<h1>Checkpoints of the run</h1><p class="sub" id="where"></p>
<div class="cards" id="cards"></div>
<h2>Steps over time</h2>
<div class="legend"><i style="background:#3566c4"></i>training (one line per process)<i style="background:#1f9d55"></i>
durable save<i style="background:#9ad0ae"></i>memory save<i style="background:#e07b00"></i>restore
<i style="background:#d7263d"></i>failure<i style="border:1.5px solid #d7263d;border-radius:6px"></i>failed save
<i style="background:#9aa3ad"></i>removed by retention</div>
<div id="timeline"></div>
<h2>Time of each durable save</h2>
<div class="legend"><i style="background:#28527a"></i>training loop blocked<i style="background:#a8c5e2"></i>
whole save<i style="background:#d7263d"></i>the storage's measured limit for its bytes</div>
<div id="times"></div>
<h2>Bytes of each durable save</h2><div id="bytes"></div>
<h2>Memory-tier snapshots: training loop blocked</h2><div id="memory"></div>
<h2>Restores</h2><div id="restores"></div>
<h2>Resume audits</h2><div id="audits"></div>
<p class="sub">Made by ckptio report on @MADE@. Goodput: the share of wall time left once the time the saves blocked,
the steps redone after failures and the restarts are taken out (an estimate from the record).</p>
<script type="application/json" id="data">@DATA@</script>
<script>@SCRIPT@</script>
</body></html>
"""

_SCRIPT = r"""
"use strict";
window.onerror = function (msg) { document.body.dataset.error = String(msg); };
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
let charts = 0;
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function fmtS(s) {
  if (s === null || s === undefined) return "-";
  if (s >= 86400) return (s / 86400).toPrecision(3) + " d";
  if (s >= 3600) return (s / 3600).toPrecision(3) + " h";
  if (s >= 60) return (s / 60).toPrecision(3) + " min";
  return s.toPrecision(3) + " s";
}
function fmtB(b) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toPrecision(3) + " " + u[i];
}
function none(id, text) {
  const p = document.createElement("p"); p.className = "none"; p.textContent = text;
  document.getElementById(id).appendChild(p);
}
function frame(id, xmax, ymax, xlabel, ylabel, fx, fy) {
  const W = 1060, H = 260, L = 84, R = 34, T = 12, B = 38;
  const svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": "chart"});
  document.getElementById(id).appendChild(svg);
  const X = v => L + (W - L - R) * (xmax > 0 ? v / xmax : 0);
  const Y = v => H - B - (H - T - B) * (ymax > 0 ? v / ymax : 0);
  for (let i = 0; i <= 4; i++) {
    const yv = ymax * i / 4, xv = xmax * i / 4;
    el("line", {x1: L, x2: W - R, y1: Y(yv), y2: Y(yv), "class": "grid"}, svg);
    el("text", {x: L - 6, y: Y(yv) + 4, "text-anchor": "end"}, svg, fy(yv));
    if (fx) el("text", {x: X(xv), y: H - B + 16, "text-anchor": "middle"}, svg, fx(xv));
  }
  el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "axis"}, svg);
  el("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "axis"}, svg);
  el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"}, svg, xlabel);
  el("text", {x: 12, y: (T + H - B) / 2, transform: "rotate(-90 12 " + (T + H - B) / 2 + ")",
              "text-anchor": "middle"}, svg, ylabel);
  charts++;
  return {svg: svg, X: X, Y: Y, W: W, H: H, L: L, R: R, B: B};
}
function timeline() {
  const ps = D.processes;
  if (!ps.length) return none("timeline", "Nothing recorded yet.");
  const xmax = Math.max(1e-9, ...ps.map(p => p.last));
  const ymax = Math.max(1, D.newest_step || 0);
  const f = frame("timeline", xmax, ymax, "wall time since the run's first start", "step", fmtS, v => v.toFixed(0));
  ps.forEach((p, i) => {
    if (p.points.length > 1)
      el("polyline", {points: p.points.map(q => f.X(q[0]) + "," + f.Y(q[1])).join(" "), fill: "none",
                      stroke: "#3566c4", "stroke-width": 1.6}, f.svg);
    if (!p.clean && i < ps.length - 1)
      el("line", {x1: f.X(p.last), x2: f.X(p.last), y1: 12, y2: f.H - f.B, stroke: "#d7263d",
                  "stroke-dasharray": "4 3"}, f.svg);
  });
  const dot = (rows, color, r) => rows.forEach(e => { if (e.step !== undefined)
    el("circle", {cx: f.X(e.time), cy: f.Y(e.step), r: r, fill: color}, f.svg); });
  dot(D.memory, "#9ad0ae", 2.5); dot(D.durable, "#1f9d55", 3.5); dot(D.restores, "#e07b00", 5);
  D.removes.forEach(e => { if (e.step !== undefined) {
    const x = f.X(e.time), y = f.Y(e.step);
    el("path", {d: "M" + (x - 3) + "," + (y - 3) + "l6,6m0,-6l-6,6", stroke: "#9aa3ad", "stroke-width": 1.5},
       f.svg); } });
  D.failed_saves.forEach(e => { if (e.step !== undefined)
    el("circle", {cx: f.X(e.time), cy: f.Y(e.step), r: 5, fill: "none", stroke: "#d7263d", "stroke-width": 1.5},
       f.svg); });
}
function bars(id, rows, series, fy, ylabel, limit) {
  if (!rows.length) return none(id, "No saves recorded.");
  let ymax = 0;
  rows.forEach(e => series.forEach(s => { ymax = Math.max(ymax, e[s.key] || 0); }));
  if (limit) rows.forEach(e => { ymax = Math.max(ymax, limit(e) || 0); });
  const n = rows.length;
  const f = frame(id, n, ymax * 1.05 || 1, "save (by step)", ylabel, null, fy);
  const w = (f.W - f.L - f.R) / n, every = Math.ceil(n / 16);
  rows.forEach((e, i) => {
    if (i % every === 0 && e.step !== undefined)
      el("text", {x: f.X(i) + w / 2, y: f.H - f.B + 16, "text-anchor": "middle"}, f.svg, String(e.step));
    series.forEach(s => { if (e[s.key] !== undefined) {
      const y = f.Y(e[s.key]);
      el("rect", {x: f.X(i) + w * 0.12, y: y, width: Math.max(1, w * 0.76), height: f.H - f.B - y, fill: s.color},
         f.svg, undefined);
    } });
    const lim = limit ? limit(e) : null;
    if (lim) el("line", {x1: f.X(i), x2: f.X(i) + w, y1: f.Y(lim), y2: f.Y(lim), stroke: "#d7263d",
                        "stroke-width": 2}, f.svg);
  });
}
function restores() {
  if (!D.restores.length) return none("restores", "No restore recorded.");
  const t = document.createElement("table");
  const head = t.insertRow();
  ["when", "from step", "tier", "steps lost", "restore", "start to first step"].forEach(h => {
    const c = document.createElement("th"); c.textContent = h; head.appendChild(c); });
  D.restores.forEach(e => {
    const r = t.insertRow();
    [fmtS(e.time), e.step, e.tier || "-", e.steps_lost ?? "-", fmtS(e.restore_s), fmtS(e.startup_s)]
      .forEach(v => { r.insertCell().textContent = String(v); });
  });
  document.getElementById("restores").appendChild(t);
}
function audits() {
  if (!D.audits.length) return none("audits", "No resume audited (maybe_save(metrics=...) gives it the loss).");
  D.audits.forEach(a => {
    const p = document.createElement("p"); p.textContent = a.text;
    if (a.verdict === "diverged") p.style.color = "#d7263d";
    document.getElementById("audits").appendChild(p);
  });
}
function cards() {
  const add = (value, label) => {
    const c = document.createElement("div"); c.className = "card";
    const b = document.createElement("b"); b.textContent = value;
    const s = document.createElement("span"); s.textContent = label;
    c.append(b, s); document.getElementById("cards").appendChild(c);
  };
  add(D.goodput === null ? "-" : (100 * D.goodput).toFixed(1) + " %", "goodput (estimated)");
  add(fmtS(D.wall_s), "wall time recorded");
  add(String(D.durable.length) + " / " + String(D.memory.length), "durable / memory saves");
  add(fmtS(D.blocked_s), "training loop blocked by saves");
  add(String(D.failures), "failures");
  if (D.failed_saves.length) add(String(D.failed_saves.length), "failed saves (training went on)");
  add(D.mtbf_s === null ? "-" : fmtS(D.mtbf_s), "mean time between failures");
  add(fmtS(D.redone_s) + (D.unseen_s ? " (+ up to " + (D.unseen_steps === null ? "?" : D.unseen_steps) +
      " steps unseen)" : "") + (D.unknown_lost ? " (" + D.unknown_lost + " restore(s) unknown)" : ""),
      "steps redone after failures");
  add(fmtS(D.restarting_s), "restarting");
  add(D.storage_rate ? fmtB(D.storage_rate) + "/s" : "not measured", "storage's write limit");
}
document.getElementById("where").textContent = D.where;
cards();
timeline();
bars("times", D.durable, [{key: "total_s", color: "#a8c5e2"}, {key: "blocked_s", color: "#28527a"}], fmtS,
     "seconds", D.storage_rate ? (e => e.bytes / D.storage_rate) : null);
bars("bytes", D.durable, [{key: "bytes", color: "#6c8ebf"}], fmtB, "bytes", null);
bars("memory", D.memory, [{key: "blocked_s", color: "#9ad0ae"}], fmtS, "seconds", null);
restores();
audits();
document.body.dataset.charts = String(charts);
"""
