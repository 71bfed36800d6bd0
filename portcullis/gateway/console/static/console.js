// The Portcullis console: reads the gateway's console JSON API (same origin, the browser's own
// credentials) and draws it. No framework, no inline script, nothing fetched from elsewhere.
"use strict";

const PREFIX = document.querySelector('meta[name="portcullis-console"]').content;
const API = PREFIX + "/api/";

async function get(endpoint, params) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params || {})) if (value !== "") query.set(key, value);
  const response = await fetch(API + endpoint + (query.toString() ? "?" + query : ""),
                               {credentials: "same-origin", headers: {accept: "application/json"}});
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

// A long file path or socket URL as its last part; the whole is in the cell's title.
function fileName(path) {
  return "…/" + String(path).split("/").pop();
}

function pathCell(path) {
  const span = document.createElement("span");
  span.textContent = path.startsWith("unix:") ? "unix:" + fileName(path) : path;
  span.title = path;
  return span;
}

// "2026-12-06T22:47:04.277169Z" as "2026-12-06 22:47:04" (UTC, as the log writes it).
function when(stamp) {
  return stamp ? String(stamp).slice(0, 19).replace("T", " ") : "";
}

function showError(error) {
  const box = document.getElementById("error");
  box.textContent = error ? String(error.message || error) : "";
  box.hidden = !error;
}

function cell(row, content) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content);
  else td.textContent = content === null || content === undefined ? "" : String(content);
  row.appendChild(td);
}

function fill(tableId, items, columns, onClick) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren();
  for (const item of items) {
    const row = document.createElement("tr");
    for (const column of columns) cell(row, typeof column === "function" ? column(item) : item[column]);
    if (item.decision === "denied") row.classList.add("denied");
    if (onClick) row.addEventListener("click", () => onClick(item));
    body.appendChild(row);
  }
}

async function loadChain() {
  const badge = document.getElementById("chain-status");
  try {
    const chain = await get("verify");
    badge.textContent = chain.status + " · " + chain.lines + " lines";
    badge.className = "badge " + chain.status;
    badge.dataset.status = chain.status;
    badge.title = chain.first_bad ? "first problem at " + chain.first_bad : "checked at " + chain.checked_at;
  } catch (error) {
    badge.textContent = "unknown";
    showError(error);
  }
}

function exportLinks(params) {
  for (const format of ["jsonl", "csv"]) {
    const query = new URLSearchParams({format: format});
    for (const [key, value] of Object.entries(params)) if (value !== "" && key !== "limit") query.set(key, value);
    document.getElementById("export-" + format).href = API + "export?" + query;
  }
}

async function loadAudit(form) {
  const params = Object.fromEntries(new FormData(form));
  delete params.live;
  exportLinks(params);
  const result = await get("audit", params);
  document.getElementById("audit-summary").textContent =
    result.matched + " matching records" + (result.matched > result.records.length ? ", newest " + result.records.length + " shown" : "");
  document.getElementById("audit-detail").textContent = "";
  fill("audit-table", result.records,
       [(r) => when(r.time), "principal", "tenant", "route", "model", "status", "decision", "reason",
        (r) => (r.prompt_tokens || 0) + (r.completion_tokens || 0)],
       (record) => { document.getElementById("audit-detail").textContent = JSON.stringify(record, null, 2); });
}

function drawUsage(rows, by) {
  const chart = document.getElementById("usage-chart");
  const ns = "http://www.w3.org/2000/svg";
  chart.replaceChildren();
  const height = 22, most = Math.max(1, ...rows.map((r) => r.total_tokens));
  chart.setAttribute("height", String(Math.max(40, rows.length * height + 8)));
  rows.forEach((row, i) => {
    const label = by.map((name) => row[name]).join(" · ");
    const bar = document.createElementNS(ns, "rect");
    bar.setAttribute("x", "200");
    bar.setAttribute("y", String(i * height + 4));
    bar.setAttribute("height", String(height - 6));
    bar.setAttribute("width", String(Math.round(480 * row.total_tokens / most)));
    bar.dataset.label = label;
    bar.dataset.total = String(row.total_tokens);
    const text = document.createElementNS(ns, "text");
    text.setAttribute("x", "0");
    text.setAttribute("y", String(i * height + 18));
    text.textContent = label + ": " + row.total_tokens;
    chart.append(bar, text);
  });
}

function drawSeries(series) {
  const chart = document.getElementById("usage-series");
  const ns = "http://www.w3.org/2000/svg";
  chart.replaceChildren();
  const width = 720, height = 140, most = Math.max(1, ...series.map((b) => b.tokens));
  const step = width / Math.max(1, series.length);
  series.forEach((bucket, i) => {
    const bar = document.createElementNS(ns, "rect");
    const h = Math.round(height * bucket.tokens / most);
    bar.setAttribute("x", String(Math.round(i * step) + 1));
    bar.setAttribute("y", String(height - h));
    bar.setAttribute("width", String(Math.max(1, Math.floor(step) - 2)));
    bar.setAttribute("height", String(h));
    bar.dataset.start = bucket.start;
    bar.dataset.tokens = String(bucket.tokens);
    bar.dataset.requests = String(bucket.requests);
    const tip = document.createElementNS(ns, "title");
    tip.textContent = bucket.start + ": " + bucket.tokens + " tokens, " + bucket.requests + " requests, " + bucket.denied + " refused";
    bar.appendChild(tip);
    chart.appendChild(bar);
  });
  const axis = document.createElementNS(ns, "text");
  axis.setAttribute("x", "0");
  axis.setAttribute("y", "156");
  axis.textContent = series.length ? series[0].start.slice(0, 16) + " … (peak " + most + " tokens)" : "";
  chart.appendChild(axis);
}

// How much of a budget is gone, as a bar (red from 90 %).
function burnBar(budget) {
  const bar = document.createElement("meter");
  bar.min = 0;
  bar.max = 1;
  bar.high = 0.9;
  bar.value = Math.min(1, budget.share);
  bar.title = budget.used + " of " + budget.limit + " " + budget.unit;
  return bar;
}

async function loadUsage(form) {
  const params = Object.fromEntries(new FormData(form));
  const [result, spent] = await Promise.all([get("usage", params), get("budgets")]);
  drawSeries(result.series);
  drawUsage(result.rows, result.by);
  fill("refusals-table", Object.entries(result.refusals_by_reason).map(([reason, count]) => ({reason, count})),
       ["reason", "count"]);
  fill("budgets-table", spent.budgets, ["scope", "name", "tenant", "period", "unit", "used", "limit",
                                        (b) => Math.round(100 * b.share) + " %", burnBar]);
  fill("usage-table", result.rows,
       [(r) => result.by.map((name) => r[name]).join(" · "), "requests", "denied", "failed",
        "prompt_tokens", "completion_tokens", "total_tokens"]);
}

// Every write carries the console's header: another site cannot send it without a CORS grant.
async function post(endpoint, payload) {
  const response = await fetch(API + endpoint, {
    method: "POST", credentials: "same-origin",
    headers: {"x-portcullis-console": "1", "content-type": "application/json"},
    body: JSON.stringify(payload || {}),
  });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

function revoke(id) {
  return post("keys/" + encodeURIComponent(id) + "/revoke");
}

// A revoke button per active key when the policy lets the console write: the first click arms
// it, the second revokes (no dialog to dismiss by accident).
function revokeButton(key, writable) {
  if (!writable || key.state !== "active") return "";
  const button = document.createElement("button");
  button.type = "button";
  button.className = "revoke";
  button.dataset.key = key.id;
  button.textContent = "Revoke";
  button.addEventListener("click", async (event) => {
    event.stopPropagation();
    if (button.dataset.armed !== "1") {
      button.dataset.armed = "1";
      button.textContent = "Confirm revoke";
      return;
    }
    try {
      await revoke(key.id);
      await show("keys");
    } catch (error) {
      showError(error);
    }
  });
  return button;
}

async function loadKeys() {
  const [result, policy] = await Promise.all([get("keys"), get("policy")]);
  const writable = Boolean(policy.console_write_scope);
  document.getElementById("key-create").hidden = !writable;
  const limits = (k) => Object.entries(k.limits).map(([name, value]) =>
    name + " " + (typeof value === "object" ? JSON.stringify(value) : value)).join(", ");
  fill("keys-table", result.keys, ["id", "principal", "tenant", (k) => k.scopes.join(", "), (k) => when(k.created_at),
                                    (k) => when(k.expires_at), "state", (k) => when(k.last_used), limits, "note",
                                    (k) => revokeButton(k, writable)]);
}

async function createKey(form) {
  const fields = Object.fromEntries(new FormData(form));
  const created = await post("keys", {
    principal: fields.principal, tenant: fields.tenant, note: fields.note,
    scopes: fields.scopes.split(",").map((s) => s.trim()).filter(Boolean),
    expires_in_days: fields.expires_in_days ? Number(fields.expires_in_days) : null,
  });
  const box = document.getElementById("key-token");
  box.textContent = "New key " + created.id + " for " + created.principal + ", shown only this once: " + created.token;
  box.dataset.token = created.token;
  box.hidden = false;
  form.reset();
  await loadKeys();
}

async function loadPolicyText() {
  const current = await get("policy/text");
  const form = document.getElementById("policy-edit");
  form.text.value = current.text;
  form.dataset.generation = String(current.generation);
}

async function checkPolicy(save) {
  const form = document.getElementById("policy-edit");
  const result = document.getElementById("policy-result");
  if (save) {
    const saved = await post("policy", {text: form.text.value, base_generation: Number(form.dataset.generation)});
    result.textContent = saved.saved ? "saved: generation " + saved.generation + " serves" : "no change";
    result.dataset.state = saved.saved ? "saved" : "unchanged";
    await loadPolicy();
    return;
  }
  const checked = await post("policy/check", {text: form.text.value});
  result.textContent = checked.valid ? "valid" : checked.error;
  result.dataset.state = checked.valid ? "valid" : "invalid";
}

async function loadPolicy() {
  const policy = await get("policy");
  const form = document.getElementById("policy-edit");
  form.hidden = !policy.console_write_scope;
  if (!form.hidden) await loadPolicyText();
  document.getElementById("policy-generation").textContent = "policy generation " + policy.generation;
  const facts = document.getElementById("policy-facts");
  facts.replaceChildren();
  for (const [name, value] of Object.entries(policy)) {
    const term = document.createElement("dt");
    const detail = document.createElement("dd");
    term.textContent = name;
    detail.textContent = value === null ? "—" : name === "path" ? fileName(value) : String(value);
    if (name === "path") detail.title = value;
    facts.append(term, detail);
  }
}

async function loadFleet() {
  const fleet = await get("fleet");
  fill("fleet-table", fleet.replicas, ["name", (r) => pathCell(r.url), "healthy", (r) => (r.models || ["every model"]).join(", "),
                                       "in_flight", "running", "waiting", "kv_cache_usage",
                                       (r) => r.prefix_cache_hit_rate === null ? "—" : Math.round(100 * r.prefix_cache_hit_rate) + " %"]);
}

const LOADERS = {
  audit: () => loadAudit(document.getElementById("audit-filter")),
  usage: () => loadUsage(document.getElementById("usage-filter")),
  keys: loadKeys, policy: loadPolicy, fleet: loadFleet,
};

async function show(page) {
  if (!LOADERS[page]) page = "audit";
  for (const section of document.querySelectorAll(".page")) section.classList.toggle("shown", section.id === "page-" + page);
  for (const button of document.querySelectorAll("nav button")) button.classList.toggle("active", button.dataset.page === page);
  showError(null);
  try {
    await LOADERS[page]();
    document.body.dataset.loaded = page;
  } catch (error) {
    showError(error);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const button of document.querySelectorAll("nav button")) {
    button.addEventListener("click", () => { location.hash = button.dataset.page; });
  }
  for (const id of ["audit-filter", "usage-filter"]) {
    document.getElementById(id).addEventListener("submit", (event) => {
      event.preventDefault();
      show(id.split("-")[0]);
    });
  }
  document.getElementById("key-create").addEventListener("submit", (event) => {
    event.preventDefault();
    createKey(event.target).catch(showError);
  });
  document.getElementById("policy-check").addEventListener("click", () => checkPolicy(false).catch(showError));
  document.getElementById("policy-edit").addEventListener("submit", (event) => {
    event.preventDefault();
    checkPolicy(true).catch(showError);
  });
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  // Live: new lines appear as they are written (the search runs again every 5 s).
  setInterval(() => {
    const live = document.getElementById("audit-live");
    if (live.checked && document.getElementById("page-audit").classList.contains("shown")) {
      loadAudit(document.getElementById("audit-filter")).catch(showError);
      loadChain();
    }
  }, 5000);
  loadChain();
  loadPolicy().catch(showError);
  show(location.hash.slice(1));
});
