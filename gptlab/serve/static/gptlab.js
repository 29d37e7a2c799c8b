// gptlab's page: a chat playground streaming through /v1/chat/completions, an attention explorer reading
// /ui/attention (with every head of the layer as a grid) and /ui/lens, and activation patching reading /ui/patch.
// No framework, no build step, no request outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, history: [], tokens: [], weights: null, heads: null, lens: null, focus: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("gptlab-key");
  // a header value is bytes as Latin-1 characters: send the key's UTF-8 bytes, which the server compares
  if (key) h.Authorization = "Bearer " + String.fromCharCode(...new TextEncoder().encode(key));
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
  const asked = addMessage("user", content);
  const out = addMessage("assistant", "");
  $("send").disabled = true;
  try {
    state.history.push({ role: "assistant", content: await streamChat(out) });
  } catch (e) {
    // the turn is not in the conversation: nor on the page, and its text goes back to the input to edit
    state.history.pop();
    asked.remove();
    out.remove();
    if (!$("chat-input").value) $("chat-input").value = content;  // unless the next one is being typed
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
    heads: true,
  });
  const data = await res.json();
  state.tokens = data.tokens;
  state.weights = data.weights;
  state.heads = data.heads;
}

// A weight in [0, 1] as white to the page's orange (217, 72, 15), one canvas pixel per (query, key).
function weightColour(w) {
  const c = Math.min(1, Math.max(0, w));
  return [255 - 38 * c, 255 - 183 * c, 255 - 240 * c].map(Math.round);
}

function paintWeights(canvas, weights) {
  const n = weights.length;
  canvas.width = n;
  canvas.height = n;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(n, n);
  weights.forEach((row, i) => row.forEach((w, j) => {
    const [r, g, b] = weightColour(w);
    image.data.set([r, g, b, 255], 4 * (i * n + j));
  }));
  ctx.putImageData(image, 0, 0);
}

// Small multiples: one small heat map per (query) head of the layer; a click opens it large.
function drawHeadGrid() {
  const grid = $("head-grid");
  grid.innerHTML = "";
  state.heads.forEach((weights, h) => {
    const cell = document.createElement("div");
    cell.className = "head-cell";
    cell.dataset.head = String(h);
    const canvas = document.createElement("canvas");
    canvas.style.width = canvas.style.height = "88px";
    paintWeights(canvas, weights);
    cell.append(canvas, "head " + h);
    cell.addEventListener("click", () => openHead(h));
    grid.appendChild(cell);
  });
  const open = Number($("head-large-box").dataset.head);
  if (!$("head-large-box").hidden && open < state.heads.length) openHead(open);
}

function openHead(h) {
  const box = $("head-large-box");
  box.hidden = false;
  box.dataset.head = String(h);
  document.querySelectorAll(".head-cell").forEach((c, i) => c.classList.toggle("open", i === h));
  $("head-large-title").textContent = "layer " + $("layer").value + ", head " + h;
  paintWeights($("head-large"), state.heads[h]);
  $("head-readout").textContent = "";
}

function readHead(event) {
  const canvas = $("head-large");
  const h = Number($("head-large-box").dataset.head);
  const n = state.heads[h].length;
  const i = Math.min(n - 1, Math.floor(event.offsetY * n / canvas.clientHeight));
  const j = Math.min(n - 1, Math.floor(event.offsetX * n / canvas.clientWidth));
  $("head-readout").textContent = "\"" + label(state.tokens[i]) + "\" (" + i + ") attends to \""
    + label(state.tokens[j]) + "\" (" + j + "): " + state.heads[h][i][j].toFixed(4);
}

// --- activation patching --------------------------------------------------------------------------------------------
// A value as blue (negative) - white - red (positive), scaled by the map's largest magnitude.
function divergingColour(v, scale) {
  const t = scale > 0 ? Math.max(-1, Math.min(1, v / scale)) : 0;
  const [r, g, b] = t >= 0 ? [178, 24, 43] : [33, 102, 172];
  const a = Math.abs(t);
  return "rgb(" + [r, g, b].map((c) => Math.round(255 + (c - 255) * a)).join(", ") + ")";
}

async function onPatch(event) {
  event.preventDefault();
  showError("");
  const optional = (id) => $(id).value === "" ? null : $(id).value;
  $("patch-run").disabled = true;
  try {
    const res = await api("/ui/patch", {
      clean: $("patch-clean").value, corrupt: $("patch-corrupt").value, point: $("patch-point").value,
      answer: optional("patch-answer"), wrong: optional("patch-wrong"),
    });
    drawPatching(await res.json());
  } catch (e) {
    showError(e.message);
  } finally {
    $("patch-run").disabled = false;
  }
}

function drawPatching(data) {
  const byHead = data.axes[1] === "head";
  const columns = byHead ? data.values[0].map((_, h) => "head " + h) : data.tokens.map(label);
  const scale = Math.max(...data.values.flat().map(Math.abs));
  $("patch-summary").textContent = "logit \"" + label(data.answer) + "\" - logit \"" + label(data.wrong)
    + "\": clean " + data.clean.toFixed(3) + ", corrupted " + data.corrupt.toFixed(3);
  $("patch-scale").innerHTML = "";
  const bar = document.createElement("span");
  bar.className = "bar";
  $("patch-scale").append(String(-scale.toFixed(3)), bar, String(scale.toFixed(3)));
  const table = $("patch-map");
  table.innerHTML = "";
  const head = table.createTHead().insertRow();
  head.appendChild(document.createElement("th")).textContent = "layer";
  columns.forEach((c) => { head.appendChild(document.createElement("th")).textContent = c; });
  const body = table.createTBody();
  data.values.forEach((row, layer) => {
    const tr = body.insertRow();
    tr.appendChild(document.createElement("th")).textContent = String(layer);
    row.forEach((v, k) => {
      const td = tr.insertCell();
      td.dataset.value = String(v);
      td.style.background = divergingColour(v, scale);
      td.title = "layer " + layer + ", " + (byHead ? columns[k] : "position " + k + " \"" + columns[k] + "\"")
        + ": " + v.toFixed(4);
    });
  });
  table.dataset.ready = "true";
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
    drawHeadGrid();
    $("tokens").dataset.ready = "true";
  } catch (e) {
    showError(e.message);
  }
}

// --- start ------------------------------------------------------------------------------------------------------
async function start() {
  $("chat-form").addEventListener("submit", onSend);
  $("clear").addEventListener("click", () => { state.history = []; $("messages").innerHTML = ""; });
  $("explore-form").addEventListener("submit", onAnalyze);
  // the lens too: the text may have changed since the last look, and tokens and lens must be of one text
  $("layer").addEventListener("change", onAnalyze);
  $("head").addEventListener("change", onAnalyze);
  $("head-large").addEventListener("mousemove", readHead);
  $("patch-form").addEventListener("submit", onPatch);
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
