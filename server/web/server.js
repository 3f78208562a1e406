// server.js - the server view: live charts from GET /metrics (polled every
// second while the view is open; rates and latency percentiles over the
// last WINDOW seconds, from counter and histogram-bucket differences) and
// the effective configuration from GET /v1/config, each key with its
// origin as `kvd check-config` prints it.
import { $, api, currentView, onViewChange, setStatus } from "./app.js";
import { Chart } from "./chart.js";

const POLL_MS = 1000;
const WINDOW_S = 10;

let charts = null;
let samples = []; // [{t, m}] scrapes within the window
let timer = null;

// Prometheus text: name{labels} -> value, and per histogram its buckets.
export function parseMetrics(text) {
  const m = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const sp = line.lastIndexOf(" ");
    m.set(line.slice(0, sp), Number(line.slice(sp + 1)));
  }
  return m;
}

function buckets(m, name) {
  const out = [];
  const pre = name + '_bucket{le="';
  for (const [k, v] of m) {
    if (!k.startsWith(pre)) continue;
    const le = k.slice(pre.length, -2);
    out.push([le === "+Inf" ? Infinity : Number(le), v]);
  }
  return out.sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two scrapes, from the
// difference of their cumulative buckets (linear inside a bucket, as
// Prometheus's histogram_quantile does); null with no new observations.
function quantile(a, b, name, q) {
  const nb = buckets(b, name), na = new Map(buckets(a, name));
  const d = nb.map(([le, v]) => [le, v - (na.get(le) || 0)]);
  const total = d.length ? d[d.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lo = 0, prevCount = 0;
  for (const [le, c] of d) {
    if (c >= rank) {
      if (le === Infinity) return lo;
      return lo + (le - lo) * ((rank - prevCount) / Math.max(1e-9, c - prevCount));
    }
    lo = le;
    prevCount = c;
  }
  return lo;
}

function rate(a, b, key, dt) {
  const d = (b.get(key) || 0) - (a.get(key) || 0);
  return dt > 0 ? Math.max(0, d) / dt : null;
}

function makeCharts() {
  const p = $("charts");
  return {
    tokens: new Chart(p, "chart-tokens", "Tokens per second",
      [{ name: "generated" }, { name: "prompt" }]),
    ttft: new Chart(p, "chart-ttft", "Time to first token",
      [{ name: "p50", unit: " ms" }, { name: "p95", unit: " ms" }]),
    itl: new Chart(p, "chart-itl", "Inter-token latency",
      [{ name: "p50", unit: " ms" }, { name: "p95", unit: " ms" }]),
    queue: new Chart(p, "chart-queue", "Queue and running",
      [{ name: "queued" }, { name: "running" }]),
    pages: new Chart(p, "chart-pages", "KV pages",
      [{ name: "used" }, { name: "free" }]),
    evictions: new Chart(p, "chart-evictions", "Evictions per second",
      [{ name: "evictions" }, { name: "tokens" }]),
    sessions: new Chart(p, "chart-sessions", "Sessions", [{ name: "sessions" }]),
  };
}

async function scrape() {
  if (document.body.classList.contains("locked")) return;
  let text;
  try {
    text = await (await api("/metrics")).text();
  } catch (e) {
    setStatus("Metrics: " + e.message);
    return;
  }
  const now = performance.now() / 1000, m = parseMetrics(text);
  samples.push({ t: now, m });
  while (samples.length > 2 && now - samples[1].t >= WINDOW_S) samples.shift();
  const a = samples[0], b = samples[samples.length - 1];
  const dt = b.t - a.t, ms = (v) => (v === null ? null : v * 1000);
  const g = (k) => m.get(k) ?? null;
  const first = samples.length < 2;
  charts.tokens.push(first ? [null, null] : [rate(a.m, m, "kvd_generated_tokens_total", dt),
    rate(a.m, m, "kvd_prompt_tokens_total", dt)]);
  charts.ttft.push([ms(quantile(a.m, m, "kvd_time_to_first_token_seconds", 0.5)),
    ms(quantile(a.m, m, "kvd_time_to_first_token_seconds", 0.95))]);
  charts.itl.push([ms(quantile(a.m, m, "kvd_inter_token_latency_seconds", 0.5)),
    ms(quantile(a.m, m, "kvd_inter_token_latency_seconds", 0.95))]);
  charts.queue.push([g("kvd_queue_depth"), g("kvd_running_sequences")]);
  charts.pages.push([g("kvd_kv_pages_used"), g("kvd_kv_pages_free")]);
  charts.evictions.push(first ? [null, null] : [rate(a.m, m, "kvd_kv_evictions_total", dt),
    rate(a.m, m, "kvd_kv_evicted_tokens_total", dt)]);
  charts.sessions.push([g("kvd_sessions")]);
}

async function loadConfig() {
  let cfg;
  try {
    cfg = await (await api("/v1/config")).json();
  } catch (e) {
    $("config-file").textContent = "Configuration: " + e.message;
    return;
  }
  $("config-file").textContent = (cfg.file ? "From " + cfg.file : "Built-in defaults") +
    "; eviction window in effect: " + cfg.eviction_window.tokens + " tokens" +
    (cfg.eviction_window.automatic ? " (window_tokens = 0: the rest of the budget)" : "") + ".";
  const tb = $("config-table").tBodies[0];
  tb.textContent = "";
  for (const k of cfg.keys) {
    const tr = tb.insertRow();
    const name = tr.insertCell();
    name.textContent = k.section + "." + k.key;
    name.title = k.doc;
    tr.insertCell().textContent = k.value;
    const o = tr.insertCell();
    o.textContent = k.origin;
    o.className = "origin-" + (k.origin === "default" ? "default" : k.origin === "command line" ? "cmdline" : "file");
    tr.insertCell().textContent = k.live ? "live" : "restart";
  }
  $("config-text").textContent = cfg.text;
}

function schedule() {
  clearTimeout(timer);
  timer = null;
  if (currentView !== "server") return;
  timer = setTimeout(async () => { await scrape(); schedule(); }, POLL_MS);
}

export function startServerView() {
  charts = makeCharts();
  onViewChange((v) => {
    if (v !== "server") { clearTimeout(timer); return; }
    loadConfig();
    scrape().then(schedule);
  });
}
