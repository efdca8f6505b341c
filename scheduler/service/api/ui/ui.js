// silod web view: read-only. Polls GET /v1/overview with the token the user gave (kept in
// sessionStorage, this tab only) and renders it. No framework, no CDN, no build step: the page
// must work on an air-gapped cluster. Every value is written with textContent (never HTML), so
// job and dataset names cannot inject markup.
"use strict";

const TOKEN_KEY = "silod-token";
const POLL_MS = 2000;
let timer = null;

function $(id) { return document.getElementById(id); }

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB", "PB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}
function rate(n) { return n === null || n === undefined ? "–" : bytes(n) + "/s"; }
function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(0) + "%"; }

function row(cells, attrs) {
  const tr = document.createElement("tr");
  for (const [k, v] of Object.entries(attrs || {})) tr.setAttribute(k, v);
  for (const c of cells) {
    const td = document.createElement("td");
    td.textContent = c;
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows, empty) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren();
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = $(tableId).querySelectorAll("th").length;
    td.className = "empty";
    td.textContent = empty;
    tr.appendChild(td);
    body.appendChild(tr);
  }
  for (const r of rows) body.appendChild(r);
}

const SVG = "http://www.w3.org/2000/svg";
// The chart's frame: the plot area leaves room for the share labels (left) and times (below).
const W = 640, H = 160, L = 44, R = 12, T = 8, B = 24;

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", second: "2-digit"}); }

function chart(history, o) {
  const svg = $("chart");
  svg.replaceChildren();
  if (history.length < 2) {
    svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis"}, "collecting samples…"));
    return;
  }
  const t0 = history[0].time, t1 = history[history.length - 1].time, span = Math.max(t1 - t0, 1);
  const x = t => L + (t - t0) / span * (W - L - R);
  const y = v => T + (1 - Math.min(Math.max(v, 0), 1)) * (H - T - B);
  // Share axis: 0, 50 and 100% of the cluster, with grid lines.
  for (const v of [0, 0.5, 1]) {
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid"}));
    svg.appendChild(svgEl("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "axis"}, (100 * v) + "%"));
  }
  // Time axis: the first, middle and last sample's clock time.
  for (const [t, anchor] of [[t0, "start"], [(t0 + t1) / 2, "middle"], [t1, "end"]]) {
    svg.appendChild(svgEl("line", {x1: x(t), x2: x(t), y1: H - B, y2: H - B + 4, class: "grid"}));
    svg.appendChild(svgEl("text", {x: x(t), y: H - 6, "text-anchor": anchor, class: "axis"}, clock(t)));
  }
  // Drawn bottom to top: the cache line (dashed) and the IO line never hide the GPU line, which
  // is drawn last and widest (a 100% cache line used to cover a 100% GPU line).
  const series = [
    ["cache", "#2e7d32", h => h.cache_allocated / Math.max(o.cache_total, 1), "6 4", 2],
    ["io", "#c62828", h => h.remote_io_allocated / Math.max(o.remote_io_total, 1), "2 3", 2],
    ["gpu", "#1565c0", h => h.gpus_used / Math.max(o.gpus_total, 1), "", 3],
  ];
  for (const [name, color, f, dash, width] of series) {
    const pts = history.map(h => x(h.time).toFixed(1) + "," + y(f(h)).toFixed(1));
    const attrs = {points: pts.join(" "), stroke: color, "stroke-width": width, "data-series": name};
    if (dash) attrs["stroke-dasharray"] = dash;
    svg.appendChild(svgEl("polyline", attrs));
  }
}

// A remote-IO cap of 0 is not a starved job when its reads are served from the cache: say so.
function ioCap(j) {
  if (j.remote_io === null || j.remote_io === undefined) return "not managed";
  if (j.remote_io > 0) return rate(j.remote_io);
  const cachedAll = j.cache_bytes !== null && j.cache_bytes >= j.dataset_bytes;
  return cachedAll ? "0 B/s (dataset cached)" : "0 B/s (cached items only)";
}

const PAGE = 10;  // history rows per page
let page = 0;
let lastOverview = null;
let pendingDetail = null;  // a job id from the link (#job=ID): its detail opens once the view shows

async function api(path) {
  const reply = await fetch(path, {headers: {"Authorization": "Bearer " + sessionStorage.getItem(TOKEN_KEY)}, cache: "no-store"});
  if (!reply.ok) throw new Error(`${path}: the server answered ${reply.status}`);
  return reply.json();
}

function duration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 90) return s.toFixed(0) + " s";
  if (s < 5400) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

// What bound an ended job: the model's diagnosis of the last round it ran in (the one every view
// reads, stored by each round), else the data plane's last measured interval
// (docs/input-pipeline.md); a job never diagnosed nor measured (it never ran) says so.
function endedBound(j) {
  if (j.last_bound) return j.last_bound + " (model)";
  const m = j.measured_parameters;
  return m && m.bound && m.bound !== "unknown" ? m.bound + " (measured)" : "not diagnosed";
}

function clickable(tr, id) {  // styled by ui.css (#running and #history rows)
  tr.addEventListener("click", () => detail(id).catch(e => { $("error").textContent = e.message; }));
  return tr;
}

async function loadHistory() {
  // One more than a page: whether there is an older page.
  const jobs = await api(`/v1/jobs?state=ended&limit=${PAGE + 1}&offset=${page * PAGE}`);
  fill("history", jobs.slice(0, PAGE).map(j => clickable(row(
    [j.id, j.name, j.owner, j.state, j.gpus, j.dataset,
     j.start_time === null ? "never started" : duration(j.start_time - j.submit_time),
     j.finish_time === null ? "–" : duration(j.finish_time - j.submit_time), endedBound(j),
     j.finish_time === null ? "–" : clock(j.finish_time)],
    {"data-job-id": j.id}), j.id)), page ? "no older jobs" : "no ended jobs yet");
  $("older").disabled = jobs.length <= PAGE;
  $("newer").disabled = page === 0;
  $("page").textContent = `page ${page + 1}`;
}

// One value of a job's allocation change (GET /v1/jobs/{id}/allocations), in the resource's unit.
function allocationValue(resource, v) {
  if (resource === "remote_io") return v === null ? "not managed" : rate(v);
  if (v === null) return "–";
  if (resource === "gpu_share") return pct(v);
  if (resource === "running") return v ? "running" : "stopped";
  if (resource === "cpu") return v.toFixed(1) + " cores";
  return String(v);
}

async function detail(id) {
  const j = await api(`/v1/jobs/${encodeURIComponent(id)}`);
  const changes = await api(`/v1/jobs/${encodeURIComponent(id)}/allocations?limit=50`);
  fill("detail-allocations", changes.map(c => row(
    [clock(c.time), c.round_id === null ? "–" : String(c.round_id), c.resource, allocationValue(c.resource, c.old_value),
     allocationValue(c.resource, c.new_value)], {"data-resource": c.resource})), "no allocation yet");
  const m = j.measured_parameters, b = j.bottleneck;
  const live = lastOverview && lastOverview.running.find(r => r.id === j.id);
  const speedups = b ? `GPU ×${b.speedup_gpu.toFixed(2)}, core ×${b.speedup_cpu.toFixed(2)}, ` +
    `cache +10% ×${b.speedup_cache.toFixed(2)}, remote IO +10% ×${b.speedup_remote_io.toFixed(2)}` : "–";
  const items = [
    ["state", j.state + (j.message ? ` (${j.message})` : "")],
    ["GPUs held", `${j.allocated_gpus} of ${j.gpus}` + (j.gpu_share ? `, share ${pct(j.gpu_share)}` : "")],
    ["remote IO cap", j.remote_io === null ? "not managed" : rate(j.remote_io)],
    ["cores", j.allocated_cpus === null ? "not modelled" : j.allocated_cpus.toFixed(1)],
    ["cache of its dataset", live ? bytes(live.cache_bytes) + " of " + bytes(live.dataset_bytes) : "–"],
    ["hit ratio (measured)", live ? pct(live.hit_ratio) : "–"],
    ["read throughput (measured)", live ? rate(live.throughput) : (m ? rate(m.observed_throughput) : "–")],
    ["f* declared / planned", rate(j.ideal_throughput) + " / " + rate(m ? m.ideal_throughput : j.ideal_throughput)],
    ["predicted throughput", b ? rate(b.throughput) : (j.last_predicted_throughput !== null ?
      rate(j.last_predicted_throughput) + " (last round it ran)" : "–")],
    ["bound by", b ? b.bound + " (model, now)" : (j.last_bound ? j.last_bound + " (model, last round it ran)" :
      endedBound(j))],
    ["speed-up of one more", speedups],
    ["progress", j.total_bytes ? pct(j.consumed_bytes / j.total_bytes) + " of " + bytes(j.total_bytes) : "–"],
    ["waited", j.start_time === null ? "not started" : duration(j.start_time - j.submit_time)],
    ["JCT", j.finish_time === null ? j.state : duration(j.finish_time - j.submit_time)],
  ];
  const body = $("detail-table").querySelector("tbody");
  body.replaceChildren(...items.map(([k, v]) => row([k, v], {"data-field": k})));
  $("detail-id").textContent = `${j.id} · ${j.name}`;
  $("detail").hidden = false;
}

function render(o) {
  lastOverview = o;
  $("summary").textContent = `policy ${o.policy} · ${o.running_total} running, ${o.queued_total} waiting · updated ` +
    new Date(o.time * 1000).toLocaleTimeString();
  $("usage").textContent = `GPUs ${o.gpus_used} / ${o.gpus_total} · cache allocated ${bytes(o.cache_allocated)} / ` +
    `${bytes(o.cache_total)} · remote IO allocated ${rate(o.remote_io_allocated)} / ${rate(o.remote_io_total)}`;
  fill("running", o.running.map(j => clickable(row(
    [j.id, j.name, j.owner, j.gpus, j.dataset, bytes(j.cache_bytes), ioCap(j), pct(j.hit_ratio),
     rate(j.throughput), rate(j.ideal_throughput), pct(j.progress), j.bound],
    {"data-job-id": j.id}), j.id)), "no running jobs");
  fill("queue", o.queue.map(j => row(
    [j.position, j.id, j.name, j.owner, j.gpus, j.dataset, j.reason], {"data-job-id": j.id})), "nothing waiting");
  fill("datasets", o.datasets.map(d => row(
    [d.name, d.owner, bytes(d.size), bytes(d.allocated), bytes(d.cached)], {"data-dataset": d.name})), "no datasets");
  chart(o.history, o);
}

async function poll() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) return showLogin("");
  let reply;
  try {
    reply = await fetch("/v1/overview", {headers: {"Authorization": "Bearer " + token}, cache: "no-store"});
  } catch (e) {
    $("error").textContent = "cannot reach the server: " + e.message;
    return schedule();
  }
  if (reply.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    return showLogin("the server did not accept that token");
  }
  if (!reply.ok) {
    $("error").textContent = `the server answered ${reply.status}`;
    return schedule();
  }
  $("error").textContent = "";
  showView();
  render(await reply.json());
  try {
    await loadHistory();
    if (pendingDetail !== null) {
      const id = pendingDetail;
      pendingDetail = null;
      await detail(id);
    }
  } catch (e) {
    $("error").textContent = e.message;
  }
  schedule();
}

// What a #token=... fragment does to the tab's token (issue 47): taken when the tab holds none
// (the documented way to open the view from a link), never silently replacing one it holds (a
// link someone sent would otherwise switch the tab to their tenant's view). Pure, for the tests.
function tokenFromFragment(hash, held) {
  const m = /(?:^|[#&])token=([^&]+)/.exec(hash || "");
  if (!m) return {token: held, notice: ""};
  let given;
  try { given = decodeURIComponent(m[1]); } catch (e) { return {token: held, notice: "the link's token is not valid"}; }
  if (!held || held === given) return {token: given, notice: ""};
  return {token: held, notice: "the link carried another token than the one this tab uses; it was not used" +
    " (press \"forget token\" first to switch)"};
}

function schedule() { clearTimeout(timer); timer = setTimeout(poll, POLL_MS); }

function showLogin(message) {
  clearTimeout(timer);
  $("view").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("summary").textContent = "not connected";
}

function showView() { $("login").hidden = true; $("view").hidden = false; $("forget").hidden = false; }

document.addEventListener("DOMContentLoaded", () => {
  // A token in the URL fragment (#token=...) is read once and removed from the address bar
  // (fragments are never sent to the server); it never replaces the tab's own token.
  const r = tokenFromFragment(location.hash, sessionStorage.getItem(TOKEN_KEY));
  const jobLink = /(?:^|[#&])job=(\d+)/.exec(location.hash || "");
  if (jobLink) pendingDetail = jobLink[1];
  if (location.hash) history.replaceState(null, "", location.pathname);
  if (r.token) sessionStorage.setItem(TOKEN_KEY, r.token);
  $("notice").textContent = r.notice;
  $("token-form").addEventListener("submit", ev => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    poll();
  });
  $("forget").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showLogin(""); });
  $("older").addEventListener("click", () => { page += 1; loadHistory().catch(e => { $("error").textContent = e.message; }); });
  $("newer").addEventListener("click", () => { page = Math.max(page - 1, 0); loadHistory().catch(e => { $("error").textContent = e.message; }); });
  $("detail-close").addEventListener("click", () => { $("detail").hidden = true; });
  poll();
});
