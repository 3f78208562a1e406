// browser.cjs - the web page in a real browser: Debian's chromium, headless,
// driven by puppeteer-core (no browser download), against a live kvd serve.
//
//   node browser.cjs   with KVD_URL, KVD_KEY, KVD_BIN, CHROMIUM, ARTEFACTS set
//
// Each check prints one line, "ok NAME" or "not ok NAME: why" (test_web.c
// reads them); screenshots go to ARTEFACTS. Exits 1 if a check failed.
"use strict";
const puppeteer = require("puppeteer-core");
const { spawn } = require("child_process");
const path = require("path");

const URL0 = process.env.KVD_URL, KEY = process.env.KVD_KEY;
const OUT = process.env.ARTEFACTS || ".";
const origin = new URL(URL0).origin;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
let failed = 0;

async function check(name, fn) {
  try {
    await fn();
    console.log("ok " + name);
  } catch (e) {
    failed++;
    console.log("not ok " + name + ": " + String(e && e.stack || e).split("\n").slice(0, 3).join(" | "));
  }
}

function assert(cond, msg) {
  if (!cond) throw new Error(msg);
}

async function apiJson(p, init = {}) {
  const headers = Object.assign({ Authorization: "Bearer " + KEY }, init.headers || {});
  const res = await fetch(origin + p, Object.assign({}, init, { headers }));
  const body = await res.json();
  if (!res.ok) throw new Error(p + ": " + res.status + " " + JSON.stringify(body));
  return body;
}

// Append text to a session through /v1/completions (the prompt repeats
// what the session holds, so only the new part is prefilled).
const FILLER = "The little dog ran to the park and found a red ball under the big tree. ";
async function grow(session, prompt) {
  const r = await apiJson("/v1/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt, max_tokens: 1, temperature: 0, session }),
  });
  return prompt + r.choices[0].text;
}

async function newPage(browser, requests) {
  const page = await browser.newPage();
  page.on("request", (r) => requests.push(r.url()));
  page.on("pageerror", (e) => requests.push("pageerror: " + e.message));
  await page.setViewport({ width: 1280, height: 860 });
  return page;
}

async function login(page) {
  await page.goto(URL0, { waitUntil: "networkidle0" });
  await page.waitForSelector("#auth:not([hidden])");
  await page.type("#auth-key", KEY);
  await page.click("#auth-form button[type=submit]");
  await page.waitForSelector("#view-playground:not([hidden])", { timeout: 10000 });
}

// Chromium's first start on a busy machine (the sanitizer build's tests
// running beside it) has taken longer than puppeteer's 30 s default to
// print its endpoint; give it two minutes, and a second try, before the
// pages are reported as never checked.
async function launch() {
  const options = {
    executablePath: process.env.CHROMIUM,
    headless: true,
    timeout: 120000,
    // as root (CI) chromium refuses to start without --no-sandbox
    args: (process.getuid && process.getuid() === 0 ? ["--no-sandbox"] : [])
      .concat(["--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]),
  };
  try {
    return await puppeteer.launch(options);
  } catch (e) {
    console.log("# chromium did not start (" + e.message + "); trying once more");
    return await puppeteer.launch(options);
  }
}

async function main() {
  const browser = await launch();
  const requests = [];
  const page = await newPage(browser, requests);

  await check("auth_prompt_without_key", async () => {
    await page.goto(URL0, { waitUntil: "networkidle0" });
    await page.waitForSelector("#auth:not([hidden])");
    const state = await page.evaluate(() => ({
      tabs: document.getElementById("tabs").hidden,
      views: [...document.querySelectorAll(".view")].every((v) => v.hidden),
      model: document.getElementById("model-name").textContent,
      focus: document.activeElement && document.activeElement.id,
    }));
    assert(state.tabs && state.views, "views or tabs visible without the key");
    assert(state.model === "", "model name shown without the key: " + state.model);
    assert(state.focus === "auth-key", "the key field is not focused");
    const data = requests.filter((u) => u.startsWith(origin) &&
      !/^\/($|web\/|v1\/models$)/.test(new URL(u).pathname));
    assert(data.length === 0, "data fetched without the key: " + data.join(", "));
    await page.screenshot({ path: path.join(OUT, "web-auth.png") });
    await page.type("#auth-key", "wrong-" + KEY);
    await page.click("#auth-form button[type=submit]");
    await page.waitForFunction(() => /refused/.test(document.getElementById("auth-error").textContent));
    assert(await page.evaluate(() => document.getElementById("tabs").hidden), "a wrong key opened the page");
    assert(await page.evaluate(() => sessionStorage.length === 0), "a wrong key was kept");
  });

  await check("chat_streams", async () => {
    await page.type("#auth-key", KEY);
    await page.click("#auth-form button[type=submit]");
    await page.waitForSelector("#view-playground:not([hidden])");
    assert(await page.evaluate(() => sessionStorage.getItem("kvd-api-key")) === KEY, "key not kept in the tab");
    await page.evaluate(() => {
      document.getElementById("chat-max").value = "48";
      document.getElementById("chat-session").value = "web-chat";
      // every change of the answer's text, as the stream delivers it
      window.__updates = [];
      new MutationObserver(() => {
        const t = document.querySelector(".msg-assistant:last-child .text");
        if (t) window.__updates.push(t.textContent.length);
      }).observe(document.getElementById("chat-log"), { subtree: true, childList: true, characterData: true });
    });
    // A slow link, so the stream is seen (and photographed) half way.
    const cdp = await page.target().createCDPSession();
    await cdp.send("Network.enable");
    await cdp.send("Network.emulateNetworkConditions",
      { offline: false, latency: 0, downloadThroughput: 1500, uploadThroughput: 1e6 });
    await page.type("#chat-input", "Once upon a time there was a little dog.");
    await page.click("#chat-send");
    await page.waitForFunction(() => {
      const t = document.querySelector(".msg-assistant.streaming .text");
      return t && t.textContent.length > 20;
    }, { timeout: 30000 });
    await page.screenshot({ path: path.join(OUT, "web-playground-streaming.png") });
    await page.waitForFunction(() => !document.querySelector(".msg.streaming"), { timeout: 60000 });
    await cdp.send("Network.emulateNetworkConditions",
      { offline: false, latency: 0, downloadThroughput: -1, uploadThroughput: -1 });
    const r = await page.evaluate(() => ({
      text: document.querySelector(".msg-assistant:last-child .text").textContent,
      usage: document.querySelector(".msg-assistant:last-child .usage").textContent,
      updates: window.__updates,
    }));
    const distinct = new Set(r.updates.filter((n) => n > 0));
    assert(r.text.length > 0, "no answer text");
    assert(distinct.size >= 3, "the text did not arrive in pieces: " + JSON.stringify(r.updates));
    assert(/prompt \d+ · cached \d+ · evicted \d+ · retained \d+ · completion \d+/.test(r.usage),
      "no usage line: " + r.usage);
    // the session now exists, with what the usage says
    const s = await apiJson("/v1/sessions/web-chat");
    const retained = Number(/retained (\d+)/.exec(r.usage)[1]);
    assert(s.retained_tokens === retained, "usage says retained " + retained + ", session " + s.retained_tokens);
  });

  await check("cache_map_after_eviction", async () => {
    let prompt = "";
    for (let i = 0; i < 40; i++) prompt += FILLER;
    prompt = await grow("web-map", prompt);
    const s = await apiJson("/v1/sessions/web-map");
    assert(s.evicted_tokens > 0, "the session was not pushed past its budget: " + JSON.stringify(s));
    await page.click("#tab-map");
    await page.evaluate(() => { document.getElementById("map-session").value = "web-map"; });
    await page.click("#map-form button[type=submit]");
    await page.waitForFunction((n) => document.getElementById("map-svg").dataset.tokens === String(n),
      { timeout: 10000 }, s.tokens);
    await sleep(900); // the strip's animation
    const drawn = await page.evaluate(() => {
      const svg = document.getElementById("map-svg");
      const W = svg.viewBox.baseVal.width;
      return { W, rects: [...svg.querySelectorAll("rect.hist")].map((r) => ({
        kind: r.dataset.kind, start: +r.dataset.start, end: +r.dataset.end,
        x: +r.getAttribute("x"), w: +r.getAttribute("width") })) };
    });
    const ev = drawn.rects.filter((r) => r.kind === "evicted");
    const sinkEnd = Math.ceil(s.eviction.sink_tokens / 16) * 16; // sinks are whole 16-token pages
    assert(ev.length === 1, "expected one evicted range, drew " + JSON.stringify(ev));
    assert(ev[0].start === sinkEnd && ev[0].end === sinkEnd + s.evicted_tokens,
      "evicted range drawn at " + ev[0].start + ".." + ev[0].end + ", the session says " +
      sinkEnd + ".." + (sinkEnd + s.evicted_tokens));
    const px = (t) => (t / s.tokens) * drawn.W;
    assert(Math.abs(ev[0].x - px(ev[0].start)) < 1 && Math.abs(ev[0].w - (px(ev[0].end) - px(ev[0].start))) < 1,
      "evicted rect at x " + ev[0].x + " width " + ev[0].w + ", expected " + px(ev[0].start));
    const last = drawn.rects[drawn.rects.length - 1];
    assert(last.kind === "window" && last.end === s.tokens, "the window is not last");
    // hover: the tooltip shows the range's text as the map route gives it
    const map = await apiJson("/v1/sessions/web-map/map");
    const idx = map.ranges.findIndex((r) => r.kind === "evicted");
    const g = (await page.$$("#map-svg g.range"))[idx];
    await g.hover();
    const tip = await page.$eval("#map-tip", (t) => ({ hidden: t.hidden, text: t.textContent }));
    assert(!tip.hidden && tip.text.includes(map.ranges[idx].text.slice(0, 30)), "tooltip: " + tip.text);
    // keep talking: the page follows the session and animates the eviction
    prompt = await grow("web-map", prompt + FILLER.repeat(6));
    await page.waitForFunction(() => /Evicted \d+ tokens/.test(document.getElementById("status").textContent),
      { timeout: 10000 });
    await sleep(250);
    const fresh = await page.$$eval("#map-svg rect.fresh", (r) => r.length);
    assert(fresh > 0, "no newly evicted range marked");
    await page.mouse.move(5, 5);
    await page.screenshot({ path: path.join(OUT, "web-cache-map.png") });
    const s2 = await apiJson("/v1/sessions/web-map");
    await sleep(1200);
    const ev2 = await page.$$eval("#map-svg rect.hist[data-kind=evicted]",
      (r) => r.map((e) => +e.dataset.end - +e.dataset.start));
    assert(ev2.reduce((a, b) => a + b, 0) === s2.evicted_tokens, "after the eviction the strip shows " +
      ev2 + ", the session says " + s2.evicted_tokens);
  });

  await check("server_view_charts_update", async () => {
    await page.click("#tab-server");
    await page.waitForFunction(() => document.querySelectorAll("#config-table tbody tr").length > 30);
    const origin0 = await page.$$eval("#config-table tbody tr", (rows) => rows
      .map((r) => [...r.cells].map((c) => c.textContent))
      .find((c) => c[0] === "eviction.max_cache_tokens"));
    assert(origin0 && origin0[1] === "256" && origin0[2] === "command line", "config row " + origin0);
    const key = await page.$$eval("#config-table tbody tr", (rows) => rows
      .map((r) => [...r.cells].map((c) => c.textContent)).find((c) => c[0] === "auth.api_key"));
    assert(key[1] === "(set, hidden)", "the key shows as " + key[1]);
    // paced prompts longer than the budget: tokens, latency and evictions for 40 s
    const load = spawn(process.env.KVD_BIN, ["load", "--url", URL0.replace(/\/$/, ""), "--api-key", KEY,
      "--scenario", "fixed", "--prompt-tokens", "400", "--concurrency", "2", "--rate", "6",
      "--requests", "240", "--max-tokens", "16", "--duration", "40"], { stdio: "ignore" });
    let loadEnded = false;
    load.on("exit", () => { loadEnded = true; });
    try {
      const samples0 = await page.$eval("#chart-tokens", (f) => +f.dataset.samples);
      await page.waitForFunction(() => {
        const last = (id) => JSON.parse(document.getElementById(id).dataset.last || "[]");
        return last("chart-tokens")[0] > 0 && last("chart-itl")[0] > 0 && last("chart-ttft")[0] > 0;
      }, { timeout: 20000, polling: 250 });
      await page.waitForFunction(() => JSON.parse(document.getElementById("chart-evictions").dataset.last)[1] > 0,
        { timeout: 20000, polling: 250 });
      await page.waitForFunction((n) => +document.getElementById("chart-tokens").dataset.samples >= n,
        { timeout: 20000 }, samples0 + 10);
      const samples1 = await page.$eval("#chart-tokens", (f) => +f.dataset.samples);
      assert(samples1 >= samples0 + 10, "the charts did not take new samples: " + samples0 + " -> " + samples1);
      const pts = await page.$eval("#chart-tokens polyline.s0", (p) => p.getAttribute("points").split(" ").length);
      assert(pts >= 10, "the tokens/s line has " + pts + " points");
      assert(!loadEnded, "kvd load ended before the charts were photographed under it");
      await page.screenshot({ path: path.join(OUT, "web-server.png"), fullPage: false });
    } finally {
      load.kill("SIGTERM");
    }
  });

  await check("phone_layout", async () => {
    const phone = await newPage(browser, requests);
    await phone.setViewport({ width: 390, height: 844, isMobile: true, hasTouch: true, deviceScaleFactor: 2 });
    await login(phone);
    for (const tab of ["#tab-playground", "#tab-map", "#tab-server"]) {
      await phone.click(tab);
      await sleep(300);
      const over = await phone.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
      assert(over <= 0, tab + " is wider than the phone by " + over + " px");
    }
    await phone.click("#tab-playground");
    await phone.screenshot({ path: path.join(OUT, "web-phone.png") });
    await phone.close();
  });

  await check("accessible_names_and_keys", async () => {
    // every control the accessibility tree exposes has a name, in each view
    for (const tab of ["#tab-playground", "#tab-map", "#tab-server"]) {
      await page.click(tab);
      await sleep(200);
      const tree = await page.accessibility.snapshot({ interestingOnly: true });
      const unnamed = [];
      const walk = (n) => {
        if (["button", "textbox", "spinbutton", "checkbox", "tab", "combobox"].includes(n.role) && !(n.name || "").trim())
          unnamed.push(n.role);
        (n.children || []).forEach(walk);
      };
      walk(tree);
      assert(unnamed.length === 0, tab + ": controls without a name: " + unnamed.join(", "));
    }
    // the tabs follow the arrow keys; a range of the map takes the focus and shows its text
    await page.focus("#tab-server");
    await page.keyboard.press("ArrowRight");
    assert(await page.evaluate(() => document.activeElement.id) === "tab-playground", "ArrowRight from the last tab");
    await page.keyboard.press("ArrowRight");
    assert(await page.evaluate(() => !document.getElementById("view-map").hidden), "ArrowRight did not open the map");
    await page.waitForSelector("#map-svg g.range");
    await page.focus("#map-form button[type=submit]");
    await page.keyboard.press("Tab");
    assert(await page.evaluate(() => document.activeElement.classList.contains("range")), "Tab does not reach the map");
    assert(await page.$eval("#map-tip", (t) => !t.hidden && t.textContent.length > 0), "focus shows no text");
  });

  await check("same_origin_only", async () => {
    const other = requests.filter((u) => !u.startsWith(origin) && !u.startsWith("data:"));
    assert(other.length === 0, "requests elsewhere or page errors: " + other.join(", "));
  });

  await browser.close();
  process.exit(failed ? 1 : 0);
}

main().catch((e) => {
  console.log("not ok browser: " + (e && e.stack || e));
  process.exit(1);
});
