// app.js - the page's core: the API key, requests, tabs. Each view lives in
// its own module (playground.js, cachemap.js, server.js) and is started
// once the server has accepted the key; until then the page shows only the
// key prompt and fetches no data.
import { startPlayground } from "./playground.js";
import { startCacheMap } from "./cachemap.js";
import { startServerView } from "./server.js";

const KEY_STORE = "kvd-api-key"; // sessionStorage: this tab only

export const $ = (id) => document.getElementById(id);

let apiKey = sessionStorage.getItem(KEY_STORE) || "";

// A request to the server with the key; rejects with the server's error
// message (OpenAI-shaped JSON) on a status other than 2xx.
export async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
  const res = await fetch(path, Object.assign({}, options, { headers }));
  if (res.status === 401) {
    showAuth("The server refused the key.");
    throw new Error("the server refused the key");
  }
  if (!res.ok) {
    let msg = res.status + " " + res.statusText;
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) msg = body.error.message;
    } catch (e) { /* not JSON */ }
    const err = new Error(msg);
    err.status = res.status;
    throw err;
  }
  return res;
}

export function setStatus(text) {
  $("status").textContent = text || "";
}

// Sessions this tab has talked to, offered by the cache map.
const knownSessions = new Set();
export function noteSession(id) {
  if (knownSessions.has(id)) return;
  knownSessions.add(id);
  const opt = document.createElement("option");
  opt.value = id;
  $("map-sessions").appendChild(opt);
}

// --- views -------------------------------------------------------------
const views = {
  playground: { tab: "tab-playground", panel: "view-playground" },
  map: { tab: "tab-map", panel: "view-map" },
  server: { tab: "tab-server", panel: "view-server" },
};
const listeners = [];
export function onViewChange(fn) { listeners.push(fn); }
export let currentView = "playground";

function selectView(name, focus) {
  if (name !== currentView) setStatus(""); // a message belongs to the view that said it
  currentView = name;
  for (const [k, v] of Object.entries(views)) {
    const on = k === name;
    const tab = $(v.tab);
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(v.panel).hidden = !on;
    if (on && focus) tab.focus();
  }
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
  for (const fn of listeners) fn(name);
}

function wireTabs() {
  const names = Object.keys(views);
  for (const name of names) {
    const tab = $(views[name].tab);
    tab.addEventListener("click", () => selectView(name, false));
    tab.addEventListener("keydown", (e) => {
      const i = names.indexOf(name);
      let j = -1;
      if (e.key === "ArrowRight") j = (i + 1) % names.length;
      else if (e.key === "ArrowLeft") j = (i + names.length - 1) % names.length;
      else if (e.key === "Home") j = 0;
      else if (e.key === "End") j = names.length - 1;
      if (j >= 0) { e.preventDefault(); selectView(names[j], true); }
    });
  }
}

// --- the key -------------------------------------------------------------
function showAuth(error) {
  document.body.classList.add("locked");
  $("auth").hidden = false;
  $("tabs").hidden = true;
  $("forget-key").hidden = true;
  for (const v of Object.values(views)) $(v.panel).hidden = true;
  $("auth-error").textContent = error || "";
  $("auth-key").focus();
}

let started = false;
function showApp(models) {
  document.body.classList.remove("locked");
  $("auth").hidden = true;
  $("tabs").hidden = false;
  $("forget-key").hidden = !apiKey;
  const m = models && models.data && models.data[0];
  $("model-name").textContent = m ? m.id + " · " + m.meta.arch + " · " + m.meta.positions : "";
  if (!started) {
    started = true;
    startPlayground();
    startCacheMap();
    startServerView();
  }
  const want = location.hash.slice(1);
  selectView(views[want] ? want : "playground", false);
}

// Ask /v1/models with the key we have (or none): 200 opens the page, 401
// asks for the key.
async function probe() {
  const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
  let res;
  try {
    res = await fetch("/v1/models", { headers });
  } catch (e) {
    showAuth("Cannot reach the server: " + e.message);
    return false;
  }
  if (res.status === 401) {
    if (apiKey) sessionStorage.removeItem(KEY_STORE);
    showAuth(apiKey ? "The server refused the key." : "");
    apiKey = "";
    return false;
  }
  showApp(await res.json().catch(() => null));
  return true;
}

function wireAuth() {
  $("auth-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    apiKey = $("auth-key").value.trim();
    $("auth-key").value = "";
    if (await probe()) sessionStorage.setItem(KEY_STORE, apiKey);
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    location.reload();
  });
}

wireTabs();
wireAuth();
probe();
