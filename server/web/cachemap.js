// cachemap.js - a session's cache, drawn from GET /v1/sessions/{id}/map
// and polled while the view is open.
//
// Top strip: the history, token 0 to now, in original positions, cut into
// the ranges the server reports (sink, retained, heavy, window, evicted).
// Bottom strip: the cache slot by slot (its budget wide), where each
// retained range sits now, with the position numbers it carries; grid lines
// are pages. Bands join a retained range's place in the history to its
// place in the cache. After an eviction the history's scale slides to its
// new length and the newly evicted tokens flash (no motion when the
// browser asks for reduced motion).
import { $, api, setStatus, currentView, onViewChange } from "./app.js";

const SVG = "http://www.w3.org/2000/svg";
const TOP = 22, BAR = 30, BOTTOM = 112, HEIGHT = 170;
const POLL_MS = 1000;

let prev = null; // the last map drawn
let timer = null;
let anim = null;

function svgEl(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function describe(r) {
  let s = r.kind + ": history " + r.start + "–" + (r.end - 1) + " (" + (r.end - r.start) + " tokens)";
  if (r.positions) s += ", positions now " + r.positions[0] + "–" + r.positions[1];
  if (r.pages) s += ", pages " + r.pages[0] + "–" + r.pages[1];
  if (r.kind === "mixed") s += ", " + r.retained + " retained";
  return s;
}

function showTip(r, x, y) {
  const tip = $("map-tip");
  tip.textContent = "";
  const head = document.createElement("strong");
  head.textContent = describe(r);
  tip.appendChild(head);
  const body = document.createElement("p");
  body.textContent = r.text === null ? "(text not included)" : r.text || "(empty)";
  if (r.text_elided) body.title = "the middle of this range is left out";
  tip.appendChild(body);
  tip.hidden = false;
  const box = $("map-svg").getBoundingClientRect();
  tip.style.left = Math.max(0, Math.min(x - box.left, box.width - 320)) + "px";
  tip.style.top = (y - box.top + 16) + "px";
}

function hideTip() { $("map-tip").hidden = true; }

function summary(m) {
  const dl = $("map-summary");
  dl.textContent = "";
  const e = m.eviction;
  const items = [
    ["tokens", m.tokens], ["retained", m.retained_tokens], ["evicted", m.evicted_tokens],
    ["pages", m.pages.count + " × " + m.pages.page_tokens], ["positions", m.positions],
    ["next position", m.next_position],
    ["policy", e.policy + (e.policy === "none" ? "" : " (sinks " + m.sinks + ", window " + m.window +
      (e.heavy_tokens && e.policy !== "sink-window" ? ", heavy " + e.heavy_tokens : "") + ")")],
    ["budget", e.max_cache_tokens + " tokens"],
  ];
  if (m.busy) items.push(["state", "generating"]);
  if (m.dropped) items.push(["state", "dropped by LRU"]);
  if (m.coalesced) items.push(["grain", m.runs + " runs shown as " + m.ranges.length + " slices"]);
  for (const [k, v] of items) {
    const div = document.createElement("div");
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = String(v);
    dd.dataset.field = k;
    div.append(dt, dd);
    dl.append(div);
  }
}

function table(m) {
  const tb = $("map-table").tBodies[0];
  tb.textContent = "";
  for (const r of m.ranges) {
    const tr = tb.insertRow();
    tr.dataset.kind = r.kind;
    const cells = [r.start + "–" + (r.end - 1), r.kind, r.retained,
      r.positions ? r.positions[0] + "–" + r.positions[1] : "",
      r.pages ? r.pages[0] + "–" + r.pages[1] : "", r.text ?? ""];
    for (const c of cells) tr.insertCell().textContent = String(c);
  }
}

// Draw map m with the history scaled to `hist` tokens (animated between
// the old and the new length).
function draw(m, hist, fresh) {
  const svg = $("map-svg");
  const W = Math.max(200, svg.clientWidth || 1000);
  svg.setAttribute("viewBox", "0 0 " + W + " " + HEIGHT);
  svg.textContent = "";
  const H = Math.max(1, hist);
  const C = Math.max(1, m.eviction.max_cache_tokens, m.retained_tokens);
  const hx = (t) => (t / H) * W;
  const cx = (i) => (i / C) * W;
  svgEl("text", { x: 0, y: TOP - 6, class: "axis" }, svg).textContent = "history · 0";
  svgEl("text", { x: W, y: TOP - 6, class: "axis end" }, svg).textContent = String(m.tokens);
  svgEl("text", { x: 0, y: BOTTOM + BAR + 16, class: "axis" }, svg).textContent = "cache · slot 0";
  svgEl("text", { x: W, y: BOTTOM + BAR + 16, class: "axis end" }, svg).textContent =
    "budget " + m.eviction.max_cache_tokens;
  svgEl("rect", { x: 0, y: BOTTOM, width: W, height: BAR, class: "slots" }, svg);
  for (const r of m.ranges) {
    const g = svgEl("g", { role: "listitem", tabindex: 0, class: "range k-" + r.kind,
      "aria-label": describe(r) }, svg);
    const x = hx(r.start), w = Math.max(hx(r.end) - x, 1);
    const top = svgEl("rect", { x, y: TOP, width: w, height: BAR, class: "hist",
      "data-kind": r.kind, "data-start": r.start, "data-end": r.end }, g);
    if (fresh && r.kind === "evicted" && r.end > fresh.start && r.start < fresh.end)
      top.classList.add("fresh");
    if (r.cache) {
      const a = cx(r.cache[0]), b = Math.max(cx(r.cache[1] + 1), a + 1);
      svgEl("polygon", { points: `${x},${TOP + BAR} ${x + w},${TOP + BAR} ${b},${BOTTOM} ${a},${BOTTOM}`,
        class: "band" }, g);
      svgEl("rect", { x: a, y: BOTTOM, width: b - a, height: BAR, class: "slot",
        "data-kind": r.kind, "data-first": r.cache[0], "data-last": r.cache[1],
        "data-pos-first": r.positions[0], "data-pos-last": r.positions[1] }, g);
      if (b - a > 44)
        svgEl("text", { x: a + 3, y: BOTTOM + BAR - 9, class: "pos" }, g).textContent =
          "pos " + r.positions[0];
    }
    if (w > 44)
      svgEl("text", { x: x + 3, y: TOP + BAR - 9, class: "pos" }, g).textContent = String(r.start);
    const over = (e) => showTip(r, e.clientX, e.clientY);
    g.addEventListener("pointerenter", over);
    g.addEventListener("pointermove", over);
    g.addEventListener("pointerleave", hideTip);
    g.addEventListener("focus", () => {
      const bb = top.getBoundingClientRect();
      showTip(r, bb.left + 4, bb.bottom);
    });
    g.addEventListener("blur", hideTip);
  }
  // Pages: a grid line at each page boundary of the cache (when legible).
  const pt = m.pages.page_tokens;
  if (pt > 0 && (C / pt) < W / 4)
    for (let p = 1; p * pt < C; p++)
      svgEl("line", { x1: cx(p * pt), x2: cx(p * pt), y1: BOTTOM, y2: BOTTOM + BAR, class: "page" }, svg);
}

function animateTo(m, from, fresh) {
  const reduce = matchMedia("(prefers-reduced-motion: reduce)").matches;
  if (anim) cancelAnimationFrame(anim);
  if (reduce || from === m.tokens) { draw(m, m.tokens, fresh); return; }
  const t0 = performance.now(), D = 700;
  const step = (t) => {
    const k = Math.min(1, (t - t0) / D), e = 1 - Math.pow(1 - k, 3);
    draw(m, from + (m.tokens - from) * e, fresh);
    anim = k < 1 ? requestAnimationFrame(step) : null;
  };
  anim = requestAnimationFrame(step);
}

async function refresh() {
  const id = $("map-session").value.trim();
  if (!id || document.body.classList.contains("locked")) return;
  let m;
  try {
    const res = await api("/v1/sessions/" + encodeURIComponent(id) + "/map");
    m = await res.json();
  } catch (e) {
    if (currentView !== "map") return;
    setStatus(e.status === 404 ? "No session '" + id + "' yet: chat in the playground first." :
      "Cache map: " + e.message);
    return;
  }
  // Unchanged since the last poll: leave the drawing (and a hovered range) alone.
  const same = prev && prev.id === m.id && JSON.stringify(prev) === JSON.stringify(m);
  $("map-svg").dataset.updated = String(Date.now());
  if (same) {
    if (currentView === "map" && /^Evicted/.test($("status").textContent)) setStatus("");
    return;
  }
  let fresh = null;
  if (prev && prev.id === m.id && m.evicted_tokens > prev.evicted_tokens) {
    fresh = { start: 0, end: m.tokens };
    const old = prev.ranges.filter((r) => r.kind === "evicted");
    if (old.length) fresh.start = Math.max(...old.map((r) => r.end));
    setStatus("Evicted " + (m.evicted_tokens - prev.evicted_tokens) + " tokens from '" + id + "'.");
  } else if (currentView === "map") {
    setStatus("");
  }
  summary(m);
  table(m);
  animateTo(m, prev && prev.id === m.id ? prev.tokens : m.tokens, fresh);
  prev = m;
  $("map-svg").dataset.tokens = m.tokens;
}

function schedule() {
  clearTimeout(timer);
  timer = null;
  if (currentView !== "map" || !$("map-follow").checked) return;
  timer = setTimeout(async () => { await refresh(); schedule(); }, POLL_MS);
}

export function startCacheMap() {
  $("map-form").addEventListener("submit", (e) => {
    e.preventDefault();
    prev = null;
    refresh().then(schedule);
  });
  $("map-follow").addEventListener("change", schedule);
  onViewChange((v) => { if (v === "map") refresh().then(schedule); else clearTimeout(timer); });
  addEventListener("resize", () => prev && draw(prev, prev.tokens, null));
}
