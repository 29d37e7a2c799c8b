// gptlab's page: a chat playground streaming through /v1/chat/completions, and an attention explorer reading
// /ui/attention and /ui/lens. No framework, no build step, no request outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, history: [], tokens: [], weights: null, lens: null, focus: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("gptlab-key");
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function showError(text) { $("error").textContent = text || ""; }

// A JSON request to this server; a 401 shows the key form, any error its OpenAI-style message.
async function api(path, body) {
  const res = await fetch(path, body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (res.ok) return res;
  let message = res.status + " " + res.statusText;
  try { message = (await res.json()).error.message; } catch (e) { /* not JSON */ }
  if (res.status === 401) $("key-form").hidden = false;
  throw new Error(message);
}

function label(token) { return JSON.stringify(token).slice(1, -1) || " "; }

// --- chat ----------------------------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

// Server-sent events: "data: {...}" lines separated by blank lines, ending with "data: [DONE]".
async function streamChat(out) {
  const res = await api("/v1/chat/completions", {
    messages: state.history, stream: true,
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  });
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        text += chunk.choices[0].delta.content || "";
        out.textContent = text;
      }
    }
  }
  out.dataset.done = "true";
  return text;
}

async function onSend(event) {
  event.preventDefault();
  const content = $("chat-input").value;
  if (!content.trim()) return;
  showError("");
  $("chat-input").value = "";
  state.history.push({ role: "user", content });
  addMessage("user", content);
  const out = addMessage("assistant", "");
  $("send").disabled = true;
  try {
    state.history.push({ role: "assistant", content: await streamChat(out) });
  } catch (e) {
    state.history.pop();
    out.remove();
    showError(e.message);
  } finally {
    $("send").disabled = false;
  }
}

// --- attention explorer ----------------------------------------------------------------------------------------
function fillSelect(select, count, first) {
  select.innerHTML = "";
  if (first) select.add(new Option(first, ""));
  for (let i = 0; i < count; i++) select.add(new Option(String(i), String(i)));
}

async function loadAttention() {
  const head = $("head").value;
  const res = await api("/ui/attention", {
    text: $("explore-input").value, layer: Number($("layer").value), head: head === "" ? null : Number(head),
  });
  const data = await res.json();
  state.tokens = data.tokens;
  state.weights = data.weights;
}

async function loadLens() {
  const res = await api("/ui/lens", { text: $("explore-input").value, top_k: 3 });
  state.lens = await res.json();
}

function drawTokens() {
  const box = $("tokens");
  box.innerHTML = "";
  state.tokens.forEach((token, i) => {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = label(token);
    span.dataset.index = String(i);
    span.addEventListener("mouseenter", () => focusToken(i));
    box.appendChild(span);
  });
  if (state.focus !== null && state.focus < state.tokens.length) focusToken(state.focus);
}

// Token i's row: how much it attends to each token up to itself, as background strength and data-weight.
function focusToken(i) {
  state.focus = i;
  const row = state.weights[i];
  document.querySelectorAll("#tokens .tok").forEach((span, j) => {
    span.classList.toggle("focus", j === i);
    if (j <= i) {
      span.dataset.weight = String(row[j]);
      span.title = "weight " + row[j].toFixed(3);
      span.style.background = "rgba(217, 72, 15, " + Math.min(1, row[j]).toFixed(3) + ")";
    } else {
      delete span.dataset.weight;
      span.title = "";
      span.style.background = "";
    }
  });
  const head = $("head").value === "" ? "mean of the heads" : "head " + $("head").value;
  $("explain").textContent = "token " + i + " \"" + label(state.tokens[i]) + "\" attends (layer "
    + $("layer").value + ", " + head + "); the logit lens after it:";
  drawLens(i);
}

function drawLens(i) {
  const table = $("lens");
  table.innerHTML = "";
  if (!state.lens) return;
  const header = table.insertRow();
  ["stage", "next-token guesses"].forEach((t) => {
    const th = document.createElement("th");
    th.textContent = t;
    header.appendChild(th);
  });
  state.lens.layers.forEach((name, s) => {
    const tr = table.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = state.lens.top[s][i]
      .map((g) => "\"" + label(g.token) + "\" " + g.prob.toFixed(2)).join("   ");
  });
}

async function onAnalyze(event) {
  if (event) event.preventDefault();
  showError("");
  try {
    await Promise.all([loadAttention(), loadLens()]);
    drawTokens();
    $("tokens").dataset.ready = "true";
  } catch (e) {
    showError(e.message);
  }
}

async function onSelect() {
  showError("");
  try {
    await loadAttention();
    drawTokens();
  } catch (e) {
    showError(e.message);
  }
}

// --- start ------------------------------------------------------------------------------------------------------
async function start() {
  $("chat-form").addEventListener("submit", onSend);
  $("clear").addEventListener("click", () => { state.history = []; $("messages").innerHTML = ""; });
  $("explore-form").addEventListener("submit", onAnalyze);
  $("layer").addEventListener("change", onSelect);
  $("head").addEventListener("change", onSelect);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("gptlab-key", $("key").value);
    $("key-form").hidden = true;
    loadInfo();
  });
  loadInfo();
}

async function loadInfo() {
  showError("");
  try {
    state.info = await (await api("/ui/info")).json();
  } catch (e) {
    showError(e.message);
    return;
  }
  const info = state.info;
  $("model-name").textContent = info.model;
  $("model-shape").textContent = info.n_layer + " layers, " + info.n_head + " heads ("
    + info.n_kv_head + " key/value), context " + info.block_size;
  fillSelect($("layer"), info.n_layer, null);
  fillSelect($("head"), info.n_head, "mean");
  document.body.dataset.ready = "true";
}

start();
