// Draws the per-step views from the embedded JSON. Names from the trace only ever reach the
// page through textContent, never as markup.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("fsdptrace-data").textContent);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PHASES = ["forward", "backward"];
  const MAX_GROUP_LANES = 64;
  const LABEL_W = 190, LANE_H = 48, AXIS_H = 22;
  // As wide as the panel it is drawn in, so the whole step is visible without scrolling.
  const WIDTH = Math.max(720, Math.min(1800, (document.getElementById("timeline").clientWidth || 1182) - 2));
  const $ = (id) => document.getElementById(id);
  const state = { step: null, mode: "ranks", filter: null, view: null, full: 1, drag: null, pending: false };

  function node(ns, tag, attrs, text) {
    const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => e.setAttribute(k, String(v)));
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const svg = (tag, attrs, text) => node(SVG_NS, tag, attrs, text);
  const html = (tag, attrs, text) => node(null, tag, attrs, text);
  // A unit as a person reads it: "3 (Block)" where the name alone is a position.
  const unit = (i) => (i >= 0 ? (DATA.labels || DATA.units)[i] : "?");
  const stepData = () => DATA.steps.find((s) => s.step === state.step);

  function parseRanks(text) {
    const out = new Set();
    for (const part of text.split(",")) {
      const m = part.trim().match(/^(\d+)(?:-(\d+))?$/);
      if (!m) continue;
      const a = Number(m[1]), b = m[2] === undefined ? a : Number(m[2]);
      for (let r = a; r <= Math.min(b, a + 100000); r++) out.add(r);
    }
    return out.size ? out : null;
  }

  function lanes(sd) {
    if (state.mode === "groups") {
      return sd.groups.slice(0, MAX_GROUP_LANES).map((g, i) => ({
        label: "ranks " + g.label + " (" + g.num_ranks + ")", group: g, gi: i, t: g.t, e: g.e,
        mem: [], skew: null, rank: null, quiet: null }));
    }
    return sd.lanes.filter((l) => !state.filter || state.filter.has(l.rank)).map((l) => ({
      label: "rank " + l.rank, group: sd.groups[l.group], gi: l.group, t: l.t, e: l.e,
      mem: l.mem, skew: l.skew, rank: l.rank, quiet: l.quiet || null }));
  }

  function laneNote(sd, shown) {
    const notes = [];
    if (state.mode === "groups") {
      notes.push(sd.groups.length + " order signature(s) (order + prefetch config) over " +
        sd.num_ranks + " rank(s)");
      if (sd.groups.length > MAX_GROUP_LANES) notes.push("first " + MAX_GROUP_LANES + " drawn");
    } else {
      notes.push(shown.length + " of " + sd.num_ranks + " rank(s) drawn");
      if (sd.lanes.length < sd.num_ranks) {
        notes.push("ranks with findings and one per order signature are embedded; switch to " +
          "'one per order signature' to see every rank");
      }
    }
    $("lane-note").textContent = notes.join("; ") + ". Each lane starts at its own rank's " +
      "step start; the time beside a rank is how much later than the earliest rank it started " +
      "(wall clock). Bars run from a unit's begin to its recorded end; a tick is a begin with " +
      "no recorded end. The line under each lane is the unsharded parameter bytes it held.";
  }

  function firstIndex(group, mark) {
    for (let i = 0; i < group.u.length; i++) {
      if (group.u[i] === mark.u && group.p[i] === mark.p && (mark.m === null || group.m[i] === mark.m)) return i;
    }
    return group.u.length - 1;
  }

  // --- the timeline: each lane from its rank's own step start, zoomable ----------------------
  const PLOT_L = LABEL_W, PLOT_R = WIDTH - 12, PLOT_W = PLOT_R - PLOT_L;
  const ROWS = [[4, 12], [18, 12]], MEM_TOP = 33, MEM_H = 11, NEAR_PX = 6, BAR_CHAR_W = 5.6;
  const COLORS = ["#1f6fd1", "#e07b00"];

  function extent(shown) {
    let t = 1;
    for (const l of shown) {
      for (let k = 0; k < l.t.length; k++) t = Math.max(t, l.t[k], l.e[k]);
      if (l.mem.length) t = Math.max(t, l.mem[l.mem.length - 1][0]);
      if (l.quiet) t = Math.max(t, l.quiet.to);
    }
    return t;
  }

  function ticks(t0, t1) {
    const raw = (t1 - t0) / 8, pow = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-3))));
    const step = [1, 2, 5, 10].map((f) => f * pow).find((s) => s >= raw);
    // Enough decimals that two ticks never print the same label.
    const decimals = Math.max(0, Math.ceil(-Math.log10(step / 1000)));
    const out = [];
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) out.push([t, (t / 1000).toFixed(decimals) + " ms"]);
    return out;
  }

  function drawTimeline(sd) {
    const shown = lanes(sd);
    laneNote(sd, shown);
    const full = extent(shown);
    if (!state.view) state.view = [0, full];
    const [t0, t1] = state.view, span = Math.max(1, t1 - t0);
    const x = (t) => PLOT_L + ((t - t0) / span) * PLOT_W;
    const height = AXIS_H + LANE_H * shown.length + 4;
    const root = svg("svg", { width: WIDTH, height: height, id: "timeline-svg", role: "img" });
    const defs = svg("defs"), clip = svg("clipPath", { id: "plot-clip" });
    clip.appendChild(svg("rect", { x: PLOT_L, y: 0, width: PLOT_W, height: height }));
    defs.appendChild(clip);
    const hatch = svg("pattern", { id: "quiet-hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" });
    hatch.appendChild(svg("rect", { width: 6, height: 6, fill: "#fdecea" }));
    hatch.appendChild(svg("path", { d: "M0 0V6", stroke: "#e8a39d", "stroke-width": 2 }));
    defs.appendChild(hatch);
    root.appendChild(defs);
    const memMax = Math.max(1, ...shown.flatMap((l) => l.mem.map((p) => p[1])));
    shown.forEach((lane, i) => root.appendChild(drawLane(lane, i, x, t0, t1, memMax)));
    const axis = svg("g", { class: "axis-ticks" });
    for (const [t, label] of ticks(t0, t1)) {
      axis.appendChild(svg("path", { d: "M" + x(t).toFixed(1) + " " + AXIS_H + "V" + (height - 4), stroke: "#dde1e7" }));
      const anchor = x(t) > PLOT_R - 30 ? "end" : x(t) < PLOT_L + 30 ? "start" : "middle";
      axis.appendChild(svg("text", { x: x(t), y: 14, class: "axis", "text-anchor": anchor }, label));
    }
    root.insertBefore(axis, root.children[1]);
    const marks = svg("g", { "clip-path": "url(#plot-clip)" });
    drawMarks(sd, shown, marks, x);
    root.appendChild(marks);
    attachTooltip(root, shown, x, t0, span);
    attachZoom(root, full);
    $("zoom-note").textContent = "showing " + (t0 / 1000).toFixed(1) + " to " + (t1 / 1000).toFixed(1) +
      " ms of " + (full / 1000).toFixed(1) + " ms";
    $("timeline").replaceChildren(root);
  }

  function drawLane(lane, i, x, t0, t1, memMax) {
    const y = AXIS_H + i * LANE_H, g = lane.group;
    const attrs = { class: "lane", transform: "translate(0," + y + ")" };
    if (lane.rank !== null) attrs["data-rank"] = lane.rank; else attrs["data-group"] = lane.gi;
    const el = svg("g", attrs);
    el.appendChild(svg("rect", { x: 0, y: 0, width: WIDTH, height: LANE_H, fill: i % 2 ? "#ffffff" : "#f3f5f8" }));
    el.appendChild(svg("text", { x: 6, y: 16, class: "lane-label" }, lane.label));
    if (lane.skew !== null) {
      el.appendChild(svg("text", { x: 6, y: 32, class: "skew" },
        lane.skew > 0 ? "+" + (lane.skew / 1000).toFixed(1) + " ms after the first" : "first to start"));
    }
    const plot = svg("g", { "clip-path": "url(#plot-clip)" });
    const order = lane.t.map((_, k) => k).filter((k) => (lane.e[k] < 0 ? lane.t[k] : lane.e[k]) >= t0 && lane.t[k] <= t1);
    order.sort((a, b) => (lane.e[b] - lane.t[b]) - (lane.e[a] - lane.t[a]));  // long spans under short ones
    const ticksPath = ["", ""];
    for (const k of order) {
      const [top, h] = ROWS[g.p[k]];
      if (lane.e[k] < 0) { ticksPath[g.p[k]] += "M" + x(lane.t[k]).toFixed(1) + " " + top + "v" + h; continue; }
      const a = x(lane.t[k]), w = Math.max(1, x(lane.e[k]) - a);
      // A span with others inside it (the root's backward) is drawn pale, under them.
      const outer = order.some((j) => j !== k && g.p[j] === g.p[k] && lane.t[j] > lane.t[k] && lane.t[j] < lane.e[k]);
      plot.appendChild(svg("rect", { class: "span", x: a.toFixed(1), y: top, width: w.toFixed(1), height: h,
        fill: COLORS[g.p[k]], "fill-opacity": outer ? 0.3 : 0.85, stroke: "#fff", "stroke-width": 1 }));
      // The unit's name on its bar where the bar is wide enough to hold it (no hover needed).
      const name = unit(g.u[k]);
      if (!outer && w >= name.length * BAR_CHAR_W + 6) {
        plot.appendChild(svg("text", { class: "bar-label", x: (a + 3).toFixed(1), y: top + h - 3 }, name));
      }
    }
    if (lane.quiet) plot.appendChild(drawQuiet(lane.quiet, x));
    ticksPath.forEach((d, p) => { if (d) plot.appendChild(svg("path", { class: "instant", d: d, stroke: COLORS[p], "stroke-width": 2 })); });
    let bounds = "";
    for (let k = 1; k < lane.t.length; k++) if (g.m[k] !== g.m[k - 1]) bounds += "M" + (x(lane.t[k]) - 1).toFixed(1) + " 0V" + LANE_H;
    if (bounds) plot.appendChild(svg("path", { d: bounds, stroke: "#c4c8cf", "stroke-dasharray": "2 2" }));
    if (lane.mem.length) plot.appendChild(memoryPath(lane.mem, x, memMax));
    el.appendChild(plot);
    return el;
  }

  // The silence before a rank's unclean end: from its last event to its ending, with its length.
  function drawQuiet(quiet, x) {
    const g = svg("g", { class: "quiet" });
    const a = x(quiet.from), w = Math.max(2, x(quiet.to) - a);
    g.appendChild(svg("rect", { x: a.toFixed(1), y: 2, width: w.toFixed(1), height: 28, fill: "url(#quiet-hatch)", stroke: "#b3261e", "stroke-dasharray": "3 2" }));
    const text = quiet.text.length > 90 ? quiet.text.slice(0, 89) + "…" : quiet.text;
    const label = svg("text", { class: "quiet-label", x: (a + 4).toFixed(1), y: 20 }, text);
    label.appendChild(svg("title", {}, quiet.text));
    g.appendChild(label);
    return g;
  }

  function memoryPath(points, x, memMax) {
    const yOf = (b) => (MEM_TOP + MEM_H - (b / memMax) * MEM_H).toFixed(1);
    let d = "M" + x(points[0][0]).toFixed(1) + " " + yOf(points[0][1]);
    for (let k = 1; k < points.length; k++) d += "H" + x(points[k][0]).toFixed(1) + "V" + yOf(points[k][1]);
    d += "H" + PLOT_R;
    return svg("path", { class: "mem", d: d, fill: "none", stroke: "#6a4fb3", "stroke-width": 1.5 });
  }

  function drawMarks(sd, shown, root, x) {
    for (const mark of sd.marks) {
      const i = shown.findIndex((l) => (l.rank !== null ? l.rank === mark.rank
        : l.gi === sd.group_of[String(mark.rank)]));
      if (i < 0 || !shown[i].t.length) continue;
      const lane = shown[i], k = firstIndex(lane.group, mark);
      const px = x(lane.t[k]), py = AXIS_H + i * LANE_H + (mark.p === 1 ? ROWS[1][0] : ROWS[0][0]);
      const tri = svg("path", { class: "mark", fill: "#d32f2f", stroke: "#fff", "stroke-width": 1,
        d: "M" + px.toFixed(1) + " " + (py - 2) + "l5 6.5l-5 6.5l-5 -6.5z" });
      tri.appendChild(svg("title", {}, mark.check + " (rank " + mark.rank + "): " + mark.message));
      root.appendChild(tri);
    }
  }

  const ms = (t) => (t / 1000).toFixed(3) + " ms";

  // What is under the pointer, or nothing: a span it is inside (the innermost), else a begin
  // within a few pixels. Never the nearest event wherever it is.
  function hit(lane, row, px, pt, x) {
    const g = lane.group;
    let best = -1, bestScore = Infinity;
    for (let k = 0; k < lane.t.length; k++) {
      if (g.p[k] !== row) continue;
      const inside = lane.e[k] >= 0 && lane.t[k] <= pt && pt <= lane.e[k];
      const near = Math.abs(x(lane.t[k]) - px) <= NEAR_PX;
      if (!inside && !near) continue;
      const score = inside ? lane.e[k] - lane.t[k] : 1e15 + Math.abs(x(lane.t[k]) - px);
      if (score < bestScore) { best = k; bestScore = score; }
    }
    if (best < 0) return null;
    const end = lane.e[best] < 0 ? "end: none recorded" : "end +" + ms(lane.e[best]) + " (" + ms(lane.e[best] - lane.t[best]) + ")";
    return lane.label + "\nmicro-step " + g.m[best] + " " + PHASES[g.p[best]] + "\n" + unit(g.u[best]) +
      "\nbegin +" + ms(lane.t[best]) + "\n" + end;
  }

  function heldAt(lane, pt) {
    if (!lane.mem.length || pt < lane.mem[0][0]) return null;
    let held = lane.mem[0][1];
    for (const [t, b] of lane.mem) { if (t > pt) break; held = b; }
    return lane.label + "\nunsharded parameters held: " + held.toLocaleString("en-US") + " bytes\nat +" + ms(pt);
  }

  function attachTooltip(root, shown, x, t0, span) {
    const tip = $("tooltip");
    root.addEventListener("mouseleave", () => { tip.hidden = true; });
    root.addEventListener("mousemove", (ev) => {
      const box = root.getBoundingClientRect(), px = ev.clientX - box.left, py = ev.clientY - box.top - AXIS_H;
      const lane = shown[Math.floor(py / LANE_H)], ry = py - Math.floor(py / LANE_H) * LANE_H;
      const pt = t0 + ((px - PLOT_L) / PLOT_W) * span;
      let text = null;
      if (lane && px >= PLOT_L && px <= PLOT_R && !state.drag) {
        text = ry >= MEM_TOP - 1 ? heldAt(lane, pt) : hit(lane, ry < ROWS[1][0] - 1 ? 0 : 1, px, pt, x);
      }
      if (!text) { tip.hidden = true; return; }
      tip.textContent = text;
      tip.style.left = ev.clientX + 12 + "px";
      tip.style.top = ev.clientY + 12 + "px";
      tip.hidden = false;
    });
  }

  function setView(t0, t1, full) {
    const span = Math.min(Math.max(t1 - t0, 10), full * 1.2);
    let a = t0 + (t1 - t0 - span) / 2;
    a = Math.max(-full * 0.1, Math.min(a, full * 1.1 - span));
    state.view = [a, a + span];
    drawTimeline(stepData());
  }

  function zoomAt(factor, pt, full) {
    const [t0, t1] = state.view;
    setView(pt - (pt - t0) * factor, pt + (t1 - pt) * factor, full);
  }

  function attachZoom(root, full) {
    state.full = full;
    root.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      const box = root.getBoundingClientRect(), [t0, t1] = state.view;
      const pt = t0 + ((ev.clientX - box.left - PLOT_L) / PLOT_W) * (t1 - t0);
      zoomAt(ev.deltaY > 0 ? 1.25 : 0.8, pt, full);
    }, { passive: false });
    root.addEventListener("mousedown", (ev) => {
      state.drag = { x: ev.clientX, view: state.view.slice() };
      ev.preventDefault();
    });
  }

  function initZoom() {
    const center = () => (state.view[0] + state.view[1]) / 2;
    $("zoom-in").addEventListener("click", () => zoomAt(0.5, center(), state.full));
    $("zoom-out").addEventListener("click", () => zoomAt(2, center(), state.full));
    $("zoom-reset").addEventListener("click", () => { state.view = null; drawTimeline(stepData()); });
    // A drag redraws once a frame, at the pointer's latest place; a release before that frame
    // draws it at once, so a quick drag is never lost.
    const dragTo = () => {
      const [a, b] = state.drag.view, shift = -((state.drag.to - state.drag.x) / PLOT_W) * (b - a);
      setView(a + shift, b + shift, state.full);
    };
    window.addEventListener("mousemove", (ev) => {
      if (!state.drag) return;
      state.drag.to = ev.clientX;
      if (state.pending) return;
      state.pending = true;
      requestAnimationFrame(() => { if (state.pending && state.drag) dragTo(); state.pending = false; });
    });
    window.addEventListener("mouseup", () => {
      if (state.drag && state.pending) dragTo();
      state.pending = false;
      state.drag = null;
    });
  }

  function fillEdgeControls(sd) {
    const groupSel = $("edge-group"), microSel = $("edge-micro");
    groupSel.replaceChildren(...sd.groups.slice(0, MAX_GROUP_LANES).map((g, i) =>
      html("option", { value: i }, g.label + " (" + g.num_ranks + ")")));
    const micros = [...new Set(sd.groups.flatMap((g) => g.m))].sort((a, b) => a - b);
    microSel.replaceChildren(...micros.map((m) => html("option", { value: m }, String(m))));
    const mark = sd.marks.find((mk) => mk.p >= 0 && mk.m !== null);
    if (mark) {
      groupSel.value = String(sd.group_of[String(mark.rank)] ?? 0);
      microSel.value = String(mark.m);
      $("edge-phase").value = PHASES[mark.p];
    }
  }

  function drawEdges(sd) {
    const g = sd.groups[Number($("edge-group").value) || 0];
    if (!g) { $("edges").replaceChildren(html("p", { class: "note" }, "Nothing recorded.")); return; }
    const micro = Number($("edge-micro").value), phase = PHASES.indexOf($("edge-phase").value);
    const order = [];
    g.u.forEach((u, k) => { if (g.p[k] === phase && g.m[k] === micro && !order.includes(u)) order.push(u); });
    const pos = new Map(order.map((u, i) => [u, i]));
    const edges = g.edges.filter((e) => e[1] === phase && pos.has(e[0]));
    const missing = edges.some((e) => !pos.has(e[2]));
    const n = order.length + (missing ? 1 : 0), bw = Math.max(22, Math.min(120, 1100 / Math.max(n, 1)));
    const vertical = bw < 80, boxH = vertical ? 120 : 26;
    const lift = (a, b) => Math.min(140, 16 + Math.abs(b - a) * 16);
    const spans = edges.map((e) => [pos.get(e[0]), pos.has(e[2]) ? pos.get(e[2]) : order.length]);
    const up = Math.max(30, ...spans.filter(([a, b]) => b > a && b < order.length).map(([a, b]) => lift(a, b) * 0.75 + 10));
    const down = Math.max(10, ...spans.filter(([a, b]) => !(b > a && b < order.length)).map(([a, b]) => lift(a, b) * 0.75 + 10));
    const top = up, bottom = top + boxH;
    const root = svg("svg", { width: Math.max(WIDTH, n * bw + 40), height: bottom + down, id: "edges-svg" });
    const cx = (i) => 20 + i * bw + bw / 2;
    order.forEach((u, i) => drawBox(root, cx(i), top, bw, boxH, "pos " + i + " · " + unit(u), vertical, false));
    if (missing) drawBox(root, cx(order.length), top, bw, boxH, "did not run", vertical, true);
    if (!edges.length) root.appendChild(svg("text", { x: 20, y: 16, class: "axis" }, "No prefetch edges configured for this phase."));
    edges.forEach(([src, , tgt], k) => {
      const [a, b] = spans[k], ok = pos.has(tgt) && b > a, h = lift(a, b);
      // Good edges arc above the order, bad ones below: two edges between the same pair of
      // units in opposite directions (a common mistake) never hide each other.
      const y = ok ? top : bottom, c = ok ? y - h : y + h;
      const path = svg("path", { class: ok ? "edge-ok" : "edge-bad", fill: "none", "stroke-width": 2,
        "marker-end": "url(#arrow-" + (ok ? "ok" : "bad") + ")",
        d: "M" + cx(a) + " " + y + "C" + cx(a) + " " + c + " " + cx(b) + " " + c + " " + cx(b) + " " + y });
      const why = !pos.has(tgt) ? "target did not run" : ok ? "target ran after its source" : "target ran first (positions " + a + "->" + b + ")";
      path.appendChild(svg("title", {}, unit(src) + " prefetches " + unit(tgt) + ": " + why));
      root.appendChild(path);
    });
    root.prepend(arrowDefs());
    $("edges").replaceChildren(root);
  }

  function drawBox(root, cx, top, bw, h, label, vertical, missing) {
    root.appendChild(svg("rect", { x: cx - bw / 2 + 2, y: top, width: bw - 4, height: h, rx: 3,
      fill: missing ? "#fde7e7" : "#eef3fb", stroke: missing ? "#d32f2f" : "#9db4d8" }));
    const text = svg("text", vertical
      ? { x: cx + 4, y: top + 6, class: "unit-label", transform: "rotate(90 " + (cx + 4) + " " + (top + 6) + ")" }
      : { x: cx, y: top + 17, class: "unit-label", "text-anchor": "middle" }, label.length > 18 ? label.slice(0, 17) + "…" : label);
    text.appendChild(svg("title", {}, label));
    root.appendChild(text);
  }

  function arrowDefs() {
    const defs = svg("defs");
    for (const [name, color] of [["ok", "#2e9d4b"], ["bad", "#d32f2f"]]) {
      const m = svg("marker", { id: "arrow-" + name, viewBox: "0 0 10 10", refX: 9, refY: 5,
        markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" });
      m.appendChild(svg("path", { d: "M0 0L10 5L0 10z", fill: color }));
      defs.appendChild(m);
    }
    return defs;
  }

  function drawCompare(sd) {
    const box = $("compare");
    box.replaceChildren();
    if (!sd.comparisons.length) return;
    box.appendChild(html("h3", {}, "Orders side by side (first difference highlighted)"));
    for (const cmp of sd.comparisons) {
      box.appendChild(html("p", { class: "compare-title" }, cmp.title));
      const row = html("div", { class: "orders", "data-check": cmp.check });
      const diffs = cmp.columns.filter((c) => !c.reference).map((c) => c.first_diff);
      const firstDiff = diffs.length ? Math.min(...diffs) : -1;
      for (const col of cmp.columns) {
        const table = html("table", { class: "order" });
        const head = html("tr");
        head.appendChild(html("th", { colspan: 2, class: col.reference ? "ref" : "" },
          (col.reference ? "reference: " : "") + col.label));
        table.appendChild(head);
        const names = html("tr", { class: "order-head" });
        names.appendChild(html("td", {}, "position"));
        names.appendChild(html("td", {}, col.order.length ? "unit" : "(no unit ran)"));
        table.appendChild(names);
        col.order.forEach((u, i) => {
          const tr = html("tr");
          tr.appendChild(html("td", {}, String(i)));
          const hit = col.reference ? i === firstDiff : i === col.first_diff;
          tr.appendChild(html("td", hit ? { class: "first-diff" } : {}, unit(u)));
          table.appendChild(tr);
        });
        if (!col.reference && col.first_diff === col.order.length) {
          const tr = html("tr");
          tr.appendChild(html("td", {}, String(col.order.length)));
          tr.appendChild(html("td", { class: "first-diff" }, "(ends here)"));
          table.appendChild(tr);
        }
        row.appendChild(table);
      }
      box.appendChild(row);
    }
  }

  function showStep(step) {
    state.step = step;
    state.view = null;
    $("step-select").value = String(step);
    const sd = stepData();
    if (!sd) return;
    fillEdgeControls(sd);
    redraw();
  }

  function redraw() {
    const sd = stepData();
    if (!sd) return;
    drawTimeline(sd);
    drawEdges(sd);
    drawCompare(sd);
  }

  function init() {
    const sel = $("step-select");
    if (!DATA.steps.length) {
      $("step-note").textContent = "No unit events recorded: nothing to draw.";
      return;
    }
    sel.replaceChildren(...DATA.steps.map((s) => html("option", { value: s.step },
      String(s.step) + (s.marks.length ? " (" + s.marks.length + " finding(s))" : ""))));
    sel.addEventListener("change", () => showStep(Number(sel.value)));
    state.mode = DATA.steps[0].lanes.length < DATA.num_ranks ? "groups" : "ranks";
    $("lane-mode").value = state.mode;
    $("lane-mode").addEventListener("change", (e) => { state.mode = e.target.value; state.view = null; redraw(); });
    initZoom();
    $("rank-filter").addEventListener("input", (e) => { state.filter = parseRanks(e.target.value); redraw(); });
    for (const id of ["edge-group", "edge-micro", "edge-phase"]) $(id).addEventListener("change", () => drawEdges(stepData()));
    document.querySelectorAll("tr.finding[data-step]").forEach((tr) => tr.addEventListener("click", () => {
      const step = Number(tr.dataset.step);
      if (DATA.steps.some((s) => s.step === step)) { showStep(step); $("step-view").scrollIntoView(); }
    }));
    showStep(DATA.default_step ?? DATA.steps[0].step);
  }

  init();
})();
