// Rollout Recorder dashboard: polls the JSON API once a second and draws with canvas.
// No libraries. What the page shows is also in window.rrDashboard (tests read it there).
"use strict";

(function () {
  const POLL_MS = 1000;
  const ARCHIVE_MS = 2000;
  const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"];

  const query = new URLSearchParams(window.location.search);
  const state = {
    selected: null,      // session name
    wanted: query.get("session"),  // the session the URL names (a deep link)
    xAxis: query.get("x") === "time" ? "time" : "env_steps",  // the line charts' x axis
    charts: {},          // canvas id -> what its x axis spans: {axis, from, to}
    sessions: [],        // /api/sessions rows
    detail: null,        // /api/sessions/NAME
    archive: null,       // /api/sessions/NAME/archive?x=FIELD&y=FIELD: one bin per (x, y)
    archiveAt: 0,
    heatmap: null,       // what the heatmap drew: {x, y, colour, bins: [{x, y, value, ...}]}
    polls: 0,
  };
  window.rrDashboard = state;

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ formatting
  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (digits === undefined) {
      const a = Math.abs(v);
      digits = a >= 100 || Number.isInteger(v) ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : 3;
    }
    return v.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }
  const mb = (bytes) => (bytes === null || bytes === undefined ? null : bytes / 1e6);
  function fmtBytes(v) {
    const a = Math.abs(v);
    return a >= 1e9 ? `${fmt(v / 1e9, 2)} GB` : a >= 1e6 ? `${fmt(v / 1e6, 1)} MB` : a >= 1e3 ? `${fmt(v / 1e3, 1)} kB` : `${fmt(v, 0)} B`;
  }
  function ago(unix) {
    if (!unix) return "–";
    const s = Date.now() / 1000 - unix;
    return s < 90 ? `${fmt(s, 0)} s ago` : s < 5400 ? `${fmt(s / 60, 0)} min ago` : `${fmt(s / 3600, 1)} h ago`;
  }
  function el(tag, text, attrs) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }

  // ------------------------------------------------------------------ fetching
  async function get(url) {
    const r = await fetch(url, { credentials: "same-origin", cache: "no-store" });
    if (r.status === 401) {
      window.location.href = `login${window.location.search}`;  // keeps the deep link
      throw new Error("401");
    }
    if (!r.ok) return null;
    return r.json();
  }

  async function poll() {
    try {
      const list = await get("api/sessions");
      if (list) {
        state.sessions = list.sessions;
        $("logout").hidden = !list.token_required;
        const has = (name) => name && list.sessions.some((s) => s.name === name);
        const pick = has(state.wanted) ? state.wanted
          : has(state.selected) ? state.selected
          : list.sessions.length ? list.sessions[0].name : null;
        if (pick !== state.selected) select(pick);
        $("missing").hidden = !state.wanted || has(state.wanted);
        $("missing").textContent = `No session ${state.wanted} (the link's); showing ${pick || "none"}.`;
        renderSessions();
        if (state.selected) {
          const name = encodeURIComponent(state.selected);
          state.detail = await get(`api/sessions/${name}`);
          if (state.detail && state.detail.store_info) {
            setupSelects(state.detail.store_info);  // the fields the archive is binned over
            if (Date.now() - state.archiveAt >= ARCHIVE_MS) await fetchArchive();
          } else {
            state.archive = null;
          }
        } else {
          state.detail = null;
        }
        renderSession();
        state.polls += 1;
        $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
      }
    } catch (err) {
      $("updated").textContent = `not reachable (${err.message}); retrying`;
    }
    setTimeout(poll, POLL_MS);
  }

  async function fetchArchive() {
    state.archiveAt = Date.now();
    const q = new URLSearchParams({ x: $("field-x").value, y: $("field-y").value });
    state.archive = await get(`api/sessions/${encodeURIComponent(state.selected)}/archive?${q}`);
  }

  // The selected session and the x axis live in the URL, so a link opens the same view.
  function updateUrl() {
    const q = new URLSearchParams();
    if (state.wanted) q.set("session", state.wanted);
    if (state.xAxis === "time") q.set("x", "time");
    const search = q.toString() ? `?${q}` : "";
    if (search !== window.location.search) {
      window.history.replaceState(null, "", `${window.location.pathname}${search}`);
    }
  }

  function select(name) {
    state.selected = name;
    state.archive = null;
    state.archiveAt = 0;
    state.heatmap = null;
  }

  // ------------------------------------------------------------------ sessions table
  function renderSessions() {
    const body = $("sessions").tBodies[0];
    body.replaceChildren();
    $("no-sessions").hidden = state.sessions.length > 0;
    for (const s of state.sessions) {
      const tr = el("tr", undefined, { "data-session": s.name });
      if (s.name === state.selected) tr.className = "selected";
      const cells = [
        [s.name, "name"], [`${s.active_workers}/${s.workers}`, "workers"],
        [fmt(s.env_steps), "env_steps"], [fmt(s.episodes), "episodes"], [fmt(s.chunks), "chunks"],
        [fmt(s.chunks_dropped + s.sequences_lost), "dropped"], [fmt(mb(s.raw_bytes), 1), "raw_mb"],
        [fmt(s.raw_mb_s), "raw_mb_s"], [fmt(s.env_steps_s, 0), "env_steps_s"],
        [s.store ? "yes" : "no", "store"], [s.is_full ? "yes" : "no", "full"],
      ];
      for (const [text, field] of cells) tr.appendChild(el("td", text, { "data-field": field }));
      tr.addEventListener("click", () => {
        state.wanted = s.name;
        updateUrl();
        select(s.name);
      });
      body.appendChild(tr);
    }
  }

  // ------------------------------------------------------------------ one session
  function renderSession() {
    const d = state.detail;
    $("session").hidden = !d;
    if (!d) return;
    $("session-name").textContent = d.name;
    const recent = d.recent;
    $("recent-label").textContent = recent
      ? `mean return, last ${fmt(recent.episodes)} episode${recent.episodes === 1 ? "" : "s"}`
      : "mean return, recent episodes";
    const counters = {
      env_steps: d.env_steps, episodes: d.episodes, chunks: d.chunks, raw_mb: mb(d.raw_bytes),
      raw_mb_s: d.raw_mb_s, env_steps_s: d.env_steps_s,
      recent_return_mean: recent ? recent.return_mean : null,
      return_mean: d.episode_totals ? d.episode_totals.return_mean : null,
    };
    for (const [field, value] of Object.entries(counters)) {
      const span = document.querySelector(`#counters [data-field="${field}"]`);
      span.textContent = fmt(value, field === "raw_mb" ? 2 : undefined);
      span.dataset.value = value === null || value === undefined ? "" : String(value);
    }
    const h = d.history;
    lineChart($("chart-mb"), h, [
      { label: "raw", values: h.raw_mb_s }, { label: "wire", values: h.wire_mb_s },
    ]);
    lineChart($("chart-steps"), h, [{ label: "env steps/s", values: h.env_steps_s }]);
    lineChart($("chart-return"), h, [{ label: "return", values: h.return_mean }]);
    lineChart($("chart-length"), h, [{ label: "length", values: h.length_mean }]);
    const hist = d.histograms || {};
    for (const span of document.querySelectorAll(".hist-window")) {
      span.textContent = hist.window ? `(last ${fmt(hist.window)} episodes)` : "";
    }
    barChart($("hist-return"), hist.return);
    barChart($("hist-length"), hist.length);
    renderDataset(d.dataset);
    renderWorkers(d.worker_table);
    renderStore(d);
  }

  // The dataset sink's progress and lag (the section is hidden without a sink).
  function renderDataset(ds) {
    $("dataset").hidden = !ds;
    if (!ds) return;
    $("dataset-uri").textContent = ds.uri;
    const values = {
      episodes_written: ds.episodes_written, episodes_waiting: ds.episodes_waiting,
      lag_seconds: ds.lag_seconds, mb_written: mb(ds.bytes_written),
      write_failures: ds.write_failures,
    };
    for (const [field, value] of Object.entries(values)) {
      const span = document.querySelector(`#dataset [data-field="${field}"]`);
      span.textContent = fmt(value, field === "lag_seconds" ? 1 : field === "mb_written" ? 2 : undefined);
      span.dataset.value = value === null || value === undefined ? "" : String(value);
    }
  }

  function renderWorkers(workers) {
    const body = $("workers").tBodies[0];
    body.replaceChildren();
    for (const w of workers) {
      const tr = el("tr", undefined, { "data-worker": w.worker_id });
      const cells = [
        w.index, w.worker_id, w.active ? "yes" : "left", ago(w.joined), `${fmt(w.lag_s, 1)} s`,
        w.ack_latency_s === null ? "–" : `${fmt(w.ack_latency_s * 1e3, 1)} ms`,
        fmt(w.chunks), fmt(w.chunks_dropped), fmt(w.sequences_lost), fmt(w.env_steps),
        fmt(w.episodes), fmt(mb(w.raw_bytes), 1),
      ];
      for (const text of cells) tr.appendChild(el("td", String(text)));
      body.appendChild(tr);
    }
  }

  // ------------------------------------------------------------------ store
  function setOptions(select, values, preferred) {
    const have = Array.from(select.options).map((o) => o.value);
    if (have.join("\n") !== values.join("\n")) {
      const keep = select.value;
      select.replaceChildren(...values.map((v) => el("option", v, { value: v })));
      select.value = values.includes(keep) ? keep : preferred;
    }
  }

  function setupSelects(info) {
    const fields = info.cell_fields;
    setOptions($("field-x"), fields, fields[0]);
    setOptions($("field-y"), fields, fields[Math.min(1, fields.length - 1)]);
    const colours = ["visits", "best_return", "selection_probability", "times_chosen",
      "midpoint_starts", ...info.utilities.map((u) => `utility:${u}`)];
    setOptions($("colour"), colours, "visits");
  }

  function renderStore(d) {
    const info = d.store_info;
    $("store").hidden = !info;
    if (!info) return;
    setupSelects(info);
    const h = d.history;
    lineChart($("chart-cells"), h, [{ label: "cells", values: h.cells }]);
    lineChart($("chart-repo"), h, [
      { label: "bytes", values: h.repository_bytes },
      { label: "cap", values: h.repository_capacity_bytes, dash: [6, 4] },
    ], { format: fmtBytes });
    lineChart($("chart-midpoint"), h, [{ label: "midpoint starts", values: h.midpoint_starts }]);
    drawHeatmap();
  }

  // The server's bins (columns) as one object per bin.
  function binsOf(archive) {
    const cols = archive.columns, names = Object.keys(cols);
    const out = [];
    for (let i = 0; i < archive.bins; i++) {
      const b = {};
      for (const n of names) b[n] = cols[n][i];
      out.push(b);
    }
    return out;
  }

  // Sequential colour scale (viridis-like stops).
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function colourOf(t) {
    t = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i;
    const c = STOPS[i].map((a, k) => Math.round(a + (STOPS[i + 1][k] - a) * f));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function drawHeatmap() {
    const canvas = $("heatmap");
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const a = state.archive;
    if (!a || !a.cells) {
      state.heatmap = { x: null, y: null, colour: null, bins: [] };
      $("archive-count").textContent = a ? "(empty)" : "";
      ctx.fillStyle = "#6b7280";
      ctx.fillText(a ? "No cells yet." : "Loading…", 20, 24);
      return;
    }
    const fx = a.x, fy = a.y, colour = $("colour").value;
    const bins = binsOf(a);
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity, v0 = Infinity, v1 = -Infinity;
    for (const b of bins) {
      x0 = Math.min(x0, b.x); x1 = Math.max(x1, b.x); y0 = Math.min(y0, b.y); y1 = Math.max(y1, b.y);
      const v = b[colour];
      if (v !== null && v !== undefined) { v0 = Math.min(v0, v); v1 = Math.max(v1, v); }
    }
    const pad = { l: 44, b: 30, t: 8, r: 8 };
    const nx = x1 - x0 + 1, ny = y1 - y0 + 1;
    const cw = (canvas.width - pad.l - pad.r) / nx, ch = (canvas.height - pad.t - pad.b) / ny;
    const size = Math.min(cw, ch);
    const side = Math.max(size > 4 ? size - 1 : size, 1);
    ctx.fillStyle = "#eef0f3";
    ctx.fillRect(pad.l, pad.t, size * nx, size * ny);
    for (const b of bins) {
      const v = b[colour];
      const t = v === null || v === undefined ? 0 : v1 > v0 ? (v - v0) / (v1 - v0) : 1;
      ctx.fillStyle = v === null || v === undefined ? "#9ca3af" : colourOf(t);
      // y grows upwards, as on a map.
      ctx.fillRect(pad.l + (b.x - x0) * size, pad.t + (y1 - b.y) * size, side, side);
    }
    ctx.fillStyle = "#1d2330";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "center";
    ctx.fillText(`${fx}: ${x0} … ${x1}`, pad.l + (size * nx) / 2, pad.t + size * ny + 18);
    ctx.save();
    ctx.translate(12, pad.t + (size * ny) / 2);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(`${fy}: ${y0} … ${y1}`, 0, 0);
    ctx.restore();
    $("archive-count").textContent = `(${fmt(a.cells)} cells, ${fmt(bins.length)} shown as ${fx} × ${fy})`;
    $("scale").textContent = `${colour}: ${fmt(v0 === Infinity ? null : v0)} (dark) … ${fmt(v1 === -Infinity ? null : v1)} (bright)`;
    state.heatmap = { x: fx, y: fy, colour, bins, x0, y0, x1, y1, size, pad };
    canvas.dataset.cells = String(bins.length);
  }

  function heatmapBinAt(px, py) {
    const h = state.heatmap;
    if (!h || !h.bins.length) return null;
    const x = h.x0 + Math.floor((px - h.pad.l) / h.size);
    const y = h.y1 - Math.floor((py - h.pad.t) / h.size);
    return h.bins.find((b) => b.x === x && b.y === y) || null;
  }
  state.binAt = (x, y) => (state.heatmap ? state.heatmap.bins.find((b) => b.x === x && b.y === y) || null : null);

  function onHover(ev) {
    const canvas = $("heatmap"), tip = $("tooltip");
    const r = canvas.getBoundingClientRect();
    const px = ((ev.clientX - r.left) * canvas.width) / r.width;
    const py = ((ev.clientY - r.top) * canvas.height) / r.height;
    const b = heatmapBinAt(px, py);
    if (!b) { tip.hidden = true; return; }
    const h = state.heatmap;
    const lines = [`${h.x} = ${b.x}, ${h.y} = ${b.y}`, `cells: ${b.cells}`];
    for (const [k, v] of Object.entries(b)) {
      if (["x", "y", "cells"].includes(k)) continue;
      lines.push(`${k}: ${fmt(v)}`);
    }
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    tip.style.left = `${ev.clientX - r.left + 16}px`;
    tip.style.top = `${ev.clientY - r.top + 8}px`;
  }

  // ------------------------------------------------------------------ charts
  function prepare(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 400, h = canvas.clientHeight || 180;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "left";
    ctx.setLineDash([]);
    return { ctx, w, h };
  }

  // One chart over the history `h`: x is env steps or wall time, as the page's toggle says.
  // On env steps, only the points since the latest reset at which env steps
  // moved: a second without a new env step has no place of its own on that axis.
  function lineChart(canvas, h, series, opts) {
    opts = opts || {};
    const axis = state.xAxis;
    const xs = axis === "time" ? h.time : h.env_steps;
    let from = 0;
    if (axis !== "time") for (let i = 1; i < xs.length; i++) if (xs[i] < xs[i - 1]) from = i;
    const keep = (i) => i >= from && (axis === "time" || i === from || xs[i] > xs[i - 1]);
    const format = opts.format || ((v) => fmt(v));
    const { ctx, w, h: height } = prepare(canvas);
    const pad = { l: 64, r: 10, t: 18, b: 18 };
    let lo = Infinity, hi = -Infinity;
    for (const s of series) {
      s.values.forEach((v, i) => {
        if (keep(i) && v !== null && v !== undefined) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
      });
    }
    ctx.fillStyle = "#6b7280";
    if (!xs.length || lo === Infinity) {
      state.charts[canvas.id] = { axis, from: null, to: null };
      ctx.fillText("no data yet", pad.l, height / 2);
      return;
    }
    if (lo > 0) lo = 0; // rates and counts read from zero
    if (hi === lo) hi = lo + 1;
    const shown = xs.filter((x, i) => keep(i));
    const x0 = Math.min(...shown), x1 = Math.max(Math.max(...shown), x0 + 1);
    state.charts[canvas.id] = { axis, from: x0, to: x1 };
    const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (w - pad.l - pad.r);
    const Y = (v) => height - pad.b - ((v - lo) / (hi - lo)) * (height - pad.t - pad.b);
    ctx.strokeStyle = "#e5e7eb";
    ctx.textAlign = "right";
    for (let i = 0; i <= 3; i++) {
      const v = lo + ((hi - lo) * i) / 3;
      ctx.beginPath(); ctx.moveTo(pad.l, Y(v)); ctx.lineTo(w - pad.r, Y(v)); ctx.stroke();
      ctx.fillText(format(v), pad.l - 4, Y(v) + 4);
    }
    ctx.fillText(axis === "time" ? `last ${fmt(x1 - x0, 0)} s` : `env steps ${fmt(x0)} … ${fmt(x1)}`, w - pad.r, height - 4);
    ctx.textAlign = "left";
    series.forEach((s, k) => {
      ctx.strokeStyle = COLOURS[k % COLOURS.length];
      ctx.setLineDash(s.dash || []);
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let down = false;
      s.values.forEach((v, i) => {
        if (!keep(i)) return;
        if (v === null || v === undefined) { down = false; return; }
        if (down) ctx.lineTo(X(xs[i]), Y(v)); else ctx.moveTo(X(xs[i]), Y(v));
        down = true;
      });
      ctx.stroke();
      ctx.setLineDash([]);
      const last = s.values.filter((v, i) => keep(i)).reverse().find((v) => v !== null && v !== undefined);
      ctx.fillStyle = COLOURS[k % COLOURS.length];
      ctx.fillText(`${s.label}: ${last === undefined ? "–" : format(last)}`, pad.l + 4 + k * 150, 12);
    });
  }

  // A histogram whose buckets follow the episodes' range: bucket i is [edges[i], edges[i+1]).
  function barChart(canvas, hist) {
    const { ctx, w, h } = prepare(canvas);
    ctx.fillStyle = "#6b7280";
    if (!hist || !hist.count) { ctx.fillText("no episodes yet", 64, h / 2); return; }
    const pad = { l: 40, r: 10, t: 16, b: 30 };
    const n = hist.counts.length, top = Math.max(...hist.counts, 1);
    const bw = (w - pad.l - pad.r) / Math.max(n, 1);
    const finite = hist.count - hist.nonfinite;
    const extra = hist.nonfinite ? ` (${fmt(hist.nonfinite)} not finite)` : "";
    ctx.fillText(`${fmt(hist.count)} episodes, mean ${fmt(finite ? hist.sum / finite : null)}${extra}`, pad.l, 11);
    ctx.textAlign = "center";
    const every = Math.ceil((n + 1) / 8);
    hist.counts.forEach((c, i) => {
      const bh = (c / top) * (h - pad.t - pad.b);
      ctx.fillStyle = COLOURS[0];
      ctx.fillRect(pad.l + i * bw + 1, h - pad.b - bh, Math.max(bw - 2, 1), bh);
    });
    ctx.fillStyle = "#6b7280";
    hist.edges.forEach((e, i) => {
      if (i % every === 0 || i === n) ctx.fillText(fmt(e), pad.l + i * bw, h - pad.b + 12);
    });
    ctx.textAlign = "right";
    ctx.fillText(fmt(top), pad.l - 4, pad.t + 8);
  }

  // ------------------------------------------------------------------ start
  document.addEventListener("DOMContentLoaded", () => {
    $("colour").addEventListener("change", drawHeatmap);
    for (const id of ["field-x", "field-y"]) {
      $(id).addEventListener("change", async () => { await fetchArchive(); drawHeatmap(); });
    }
    $("x-axis").value = state.xAxis;
    $("x-axis").addEventListener("change", () => {
      state.xAxis = $("x-axis").value;
      updateUrl();
      renderSession();
    });
    $("heatmap").addEventListener("mousemove", onHover);
    $("heatmap").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
    poll();
  });
})();
