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

function chart(history, o) {
  const svg = $("chart");
  svg.replaceChildren();
  if (history.length < 2) return;
  const t0 = history[0].time, t1 = history[history.length - 1].time, span = Math.max(t1 - t0, 1);
  const series = [
    ["gpu", "#1565c0", h => h.gpus_used / Math.max(o.gpus_total, 1)],
    ["io", "#c62828", h => h.remote_io_allocated / Math.max(o.remote_io_total, 1)],
    ["cache", "#2e7d32", h => h.cache_allocated / Math.max(o.cache_total, 1)],
  ];
  for (const [name, color, f] of series) {
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    const pts = history.map(h => ((h.time - t0) / span * 600).toFixed(1) + "," + (118 - Math.min(f(h), 1) * 116).toFixed(1));
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("stroke", color);
    line.setAttribute("data-series", name);
    svg.appendChild(line);
  }
}

function render(o) {
  $("summary").textContent = `policy ${o.policy} · ${o.running_total} running, ${o.queued_total} waiting · updated ` +
    new Date(o.time * 1000).toLocaleTimeString();
  $("usage").textContent = `GPUs ${o.gpus_used} / ${o.gpus_total} · cache allocated ${bytes(o.cache_allocated)} / ` +
    `${bytes(o.cache_total)} · remote IO allocated ${rate(o.remote_io_allocated)} / ${rate(o.remote_io_total)}`;
  fill("running", o.running.map(j => row(
    [j.id, j.name, j.owner, j.gpus, j.dataset, bytes(j.cache_bytes), rate(j.remote_io), pct(j.hit_ratio),
     rate(j.throughput), rate(j.ideal_throughput), pct(j.progress), j.bound],
    {"data-job-id": j.id})), "no running jobs");
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
  poll();
});
