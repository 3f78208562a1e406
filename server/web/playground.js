// playground.js - chat with the model through POST /v1/chat/completions,
// streamed: the answer's text appears as the server sends it (fetch's
// ReadableStream, Server-Sent Events), and each answer ends with its usage,
// including what the session's cache reused and evicted.
import { $, api, setStatus, noteSession } from "./app.js";

let messages = []; // the conversation sent with every turn
let controller = null; // aborts the running stream

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function addMessage(role, text) {
  const li = el("li", "msg msg-" + role);
  li.appendChild(el("span", "role", role));
  const body = el("div", "text", text);
  li.appendChild(body);
  $("chat-log").appendChild(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

function usageText(u, ms, n) {
  if (!u) return n + " tokens";
  const k = u.kvd || {};
  const parts = [
    "prompt " + u.prompt_tokens,
    "cached " + (k.cached_tokens ?? 0),
    "evicted " + (k.evicted_tokens ?? 0),
    "retained " + (k.retained_tokens ?? 0),
    "completion " + u.completion_tokens,
  ];
  if (k.evicted_messages) parts.push("messages left out " + k.evicted_messages);
  if (ms > 0) parts.push((u.completion_tokens / (ms / 1000)).toFixed(1) + " tok/s");
  return parts.join(" · ");
}

// Each complete "data: ..." event of an SSE body, as parsed JSON or the
// string "[DONE]".
async function* sseEvents(res) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  }
}

function settings() {
  const num = (id) => Number($(id).value);
  return {
    session: $("chat-session").value.trim(),
    max_tokens: num("chat-max"),
    temperature: num("chat-temp"),
    top_p: num("chat-top-p"),
    system: $("chat-system").value.trim(),
  };
}

async function send(text) {
  const s = settings();
  messages.push({ role: "user", content: text });
  addMessage("user", text);
  const li = addMessage("assistant", "");
  li.classList.add("streaming");
  li.setAttribute("aria-busy", "true");
  const body = li.querySelector(".text");
  const usage = el("p", "usage");
  li.appendChild(usage);
  const convo = s.system ? [{ role: "system", content: s.system }, ...messages] : messages;
  controller = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  noteSession(s.session);
  let tFirst = 0, answer = "", u = null, finish = null;
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        messages: convo, stream: true, stream_options: { include_usage: true },
        session: s.session, max_tokens: s.max_tokens, temperature: s.temperature, top_p: s.top_p,
      }),
      signal: controller.signal,
    });
    for await (const ev of sseEvents(res)) {
      if (ev === "[DONE]") break;
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) u = ev.usage;
      const c = ev.choices && ev.choices[0];
      if (!c) continue;
      if (c.delta && c.delta.content) {
        if (!tFirst) tFirst = performance.now();
        answer += c.delta.content;
        body.textContent = answer;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
    messages.push({ role: "assistant", content: answer });
    usage.textContent = usageText(u, tFirst ? performance.now() - tFirst : 0, 0) +
      (finish ? " · " + finish : "");
    setStatus("");
  } catch (e) {
    if (e.name === "AbortError") {
      usage.textContent = "stopped";
      if (answer) messages.push({ role: "assistant", content: answer });
    } else {
      usage.textContent = "error: " + e.message;
      usage.classList.add("error");
      messages.pop(); // the turn failed: do not send it again
    }
  } finally {
    li.classList.remove("streaming");
    li.removeAttribute("aria-busy");
    controller = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

export function startPlayground() {
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || controller) return;
    if (!$("chat-settings").reportValidity()) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => controller && controller.abort());
  $("chat-reset").addEventListener("click", () => {
    messages = [];
    $("chat-log").textContent = "";
  });
}
