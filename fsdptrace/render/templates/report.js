// Draws the per-step views from the embedded JSON. Names from the trace only ever reach the
// page through textContent, never as markup.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("fsdptrace-data").textContent);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PHASES = ["forward", "backward"];
  const MAX_GROUP_LANES = 64;
  const LABEL_W = 190, LANE_H = 26, AXIS_H = 22, WIDTH = 1180;
  const $ = (id) => document.getElementById(id);
  const state = { step: null, mode: "ranks", filter: null };

  function node(ns, tag, attrs, text) {
    const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => e.setAttribute(k, String(v)));
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const svg = (tag, attrs, text) => node(SVG_NS, tag, attrs, text);
  const html = (tag, attrs, text) => node(null, tag, attrs, text);
  const unit = (i) => (i >= 0 ? DATA.units[i] : "?");
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
        label: "ranks " + g.label + " (" + g.num_ranks + ")", group: g, gi: i, t: g.t,
        rank: null }));
    }
    return sd.lanes.filter((l) => !state.filter || state.filter.has(l.rank)).map((l) => ({
      label: "rank " + l.rank, group: sd.groups[l.group], gi: l.group, t: l.t, rank: l.rank }));
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
    $("lane-note").textContent = notes.join("; ") + ". Time axis: recorded clock (t_ns).";
  }

  function firstIndex(group, mark) {
    for (let i = 0; i < group.u.length; i++) {
      if (group.u[i] === mark.u && group.p[i] === mark.p && (mark.m === null || group.m[i] === mark.m)) return i;
    }
    return group.u.length - 1;
  }

  function drawTimeline(sd) {
    const shown = lanes(sd);
    laneNote(sd, shown);
    const tmax = Math.max(1, ...shown.map((l) => (l.t.length ? l.t[l.t.length - 1] : 0)));
    const x = (t) => LABEL_W + (t / tmax) * (WIDTH - LABEL_W - 12);
    const root = svg("svg", { width: WIDTH, height: AXIS_H + LANE_H * shown.length + 4,
      id: "timeline-svg", role: "img" });
    for (let k = 0; k <= 5; k++) {
      const t = (tmax * k) / 5;
      root.appendChild(svg("text", { x: x(t), y: 14, class: "axis",
        "text-anchor": k === 0 ? "start" : k === 5 ? "end" : "middle" },
        "+" + (t / 1000).toFixed(1) + " ms"));
    }
    shown.forEach((lane, i) => root.appendChild(drawLane(lane, i, x)));
    drawMarks(sd, shown, root, x);
    attachTooltip(root, shown, x);
    $("timeline").replaceChildren(root);
  }

  function drawLane(lane, i, x) {
    const y = AXIS_H + i * LANE_H, g = lane.group;
    const attrs = { class: "lane", transform: "translate(0," + y + ")" };
    if (lane.rank !== null) attrs["data-rank"] = lane.rank; else attrs["data-group"] = lane.gi;
    const el = svg("g", attrs);
    el.appendChild(svg("rect", { x: 0, y: 0, width: WIDTH, height: LANE_H,
      fill: i % 2 ? "#ffffff" : "#f3f5f8" }));
    el.appendChild(svg("text", { x: 6, y: 17, class: "lane-label" }, lane.label));
    const d = ["", ""];
    let boundaries = "";
    for (let k = 0; k < lane.t.length; k++) {
      const px = x(lane.t[k]).toFixed(1);
      d[g.p[k]] += g.p[k] === 0 ? "M" + px + " 3V12" : "M" + px + " 14V23";
      if (k > 0 && g.m[k] !== g.m[k - 1]) boundaries += "M" + (x(lane.t[k]) - 1).toFixed(1) + " 0V" + LANE_H;
    }
    if (boundaries) el.appendChild(svg("path", { d: boundaries, stroke: "#c4c8cf", "stroke-dasharray": "2 2" }));
    el.appendChild(svg("path", { d: d[0] || "M0 0", stroke: "#1f6fd1", "stroke-width": 2 }));
    el.appendChild(svg("path", { d: d[1] || "M0 0", stroke: "#e07b00", "stroke-width": 2 }));
    return el;
  }

  function drawMarks(sd, shown, root, x) {
    for (const mark of sd.marks) {
      const i = shown.findIndex((l) => (l.rank !== null ? l.rank === mark.rank
        : l.gi === sd.group_of[String(mark.rank)]));
      if (i < 0 || !shown[i].t.length) continue;
      const lane = shown[i], k = firstIndex(lane.group, mark);
      const px = x(lane.t[k]), py = AXIS_H + i * LANE_H + (mark.p === 1 ? 14 : 3);
      const tri = svg("path", { class: "mark", fill: "#d32f2f", stroke: "#fff", "stroke-width": 1,
        d: "M" + px.toFixed(1) + " " + (py - 2) + "l5 6.5l-5 6.5l-5 -6.5z" });
      tri.appendChild(svg("title", {}, mark.check + " (rank " + mark.rank + "): " + mark.message));
      root.appendChild(tri);
    }
  }

  function attachTooltip(root, shown, x) {
    const tip = $("tooltip");
    root.addEventListener("mouseleave", () => { tip.hidden = true; });
    root.addEventListener("mousemove", (ev) => {
      const box = root.getBoundingClientRect();
      const i = Math.floor((ev.clientY - box.top - AXIS_H) / LANE_H);
      const lane = shown[i];
      if (!lane || !lane.t.length || ev.clientX - box.left < LABEL_W) { tip.hidden = true; return; }
      let best = 0;
      lane.t.forEach((t, k) => { if (Math.abs(x(t) - (ev.clientX - box.left)) < Math.abs(x(lane.t[best]) - (ev.clientX - box.left))) best = k; });
      const g = lane.group;
      tip.textContent = lane.label + "\nmicro-step " + g.m[best] + " " + PHASES[g.p[best]] +
        "\n" + unit(g.u[best]) + "\n+" + (lane.t[best] / 1000).toFixed(3) + " ms";
      tip.style.left = ev.clientX + 12 + "px";
      tip.style.top = ev.clientY + 12 + "px";
      tip.hidden = false;
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
    order.forEach((u, i) => drawBox(root, cx(i), top, bw, boxH, i + ": " + unit(u), vertical, false));
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

  function drawDivergence(sd) {
    const box = $("divergence");
    box.replaceChildren();
    if (!sd.divergences.length) return;
    box.appendChild(html("h3", {}, "Diverging orders (first difference highlighted)"));
    for (const div of sd.divergences) {
      box.appendChild(html("p", {}, "micro-step " + div.micro + ", " + div.phase));
      const row = html("div", { class: "orders" });
      const firstDiff = Math.min(...div.columns.filter((c) => !c.reference).map((c) => c.first_diff));
      for (const col of div.columns.slice(0, 8)) {
        const table = html("table", { class: "order" });
        const head = html("tr");
        head.appendChild(html("th", { colspan: 2, class: col.reference ? "ref" : "" },
          (col.reference ? "reference: ranks " : "ranks ") + col.label));
        table.appendChild(head);
        col.order.forEach((u, i) => {
          const tr = html("tr");
          tr.appendChild(html("td", {}, String(i)));
          const hit = col.reference ? i === firstDiff : i === col.first_diff;
          tr.appendChild(html("td", hit ? { class: "first-diff" } : {}, unit(u)));
          table.appendChild(tr);
        });
        row.appendChild(table);
      }
      box.appendChild(row);
    }
  }

  function showStep(step) {
    state.step = step;
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
    drawDivergence(sd);
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
    $("lane-mode").addEventListener("change", (e) => { state.mode = e.target.value; redraw(); });
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
