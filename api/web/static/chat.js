// The chat page: a conversation streamed through this server's /v1/chat/completions.
//
// The model picker lists what /v1/models lists, the base model first and then its LoRA
// adapters (the cards with a "parent"); it is read again each time the picker is opened
// (an adapter loaded since appears) and the choice is each request's "model".
//
// Each reply is one streamed request (stream_options.include_usage for the token counts).
// Stop aborts the fetch; the server sees the connection close and cancels the request, so
// its row and KV blocks return at once. A stopped reply keeps the text it had and stays in
// the conversation. Text is always set with textContent: nothing a model writes is parsed
// as HTML.
//
// A model taking images (its card's "image_input") gets an Image button: chosen or pasted
// images wait as thumbnails above the message box and go with the next message as
// "image_url" parts (data: URLs, read in the browser; nothing is fetched from elsewhere).
"use strict";

const $ = (id) => document.getElementById(id);

const chat = {
  model: null, // the id the picker chose: each request's "model"
  cards: [], // /v1/models' cards, the base model first
  history: [], // {role, content} of finished turns (a stopped reply included)
  controller: null, // the AbortController of the reply streaming now
  images: [], // data: URLs of the images waiting to go with the next message
};

// ---------------------------------------------------------------- the model card

// Reads /v1/models into the picker (the base model first, adapters after it, in the
// server's order) and keeps the current choice while it is still listed; returns the card
// chosen now.
async function loadModels() {
  const models = await ferrox.json("/v1/models");
  const cards = models.data.filter((c) => !c.parent).concat(models.data.filter((c) => c.parent));
  const picker = $("model-picker");
  const ids = cards.map((c) => c.id);
  if (ids.join("\n") !== chat.cards.map((c) => c.id).join("\n")) { // unchanged: leave an open list alone
    picker.replaceChildren(...cards.map((c) => {
      const option = ferrox.el("option", "", c.parent ? c.id + " (adapter of " + c.parent + ")" : c.id);
      option.value = c.id;
      return option;
    }));
  }
  chat.cards = cards;
  const card = cards.find((c) => c.id === chat.model) || cards[0];
  picker.value = card.id;
  return card;
}

async function loadModel() {
  ferrox.showHealth($("state"));
  try {
    await showCard(await loadModels());
  } catch (e) {
    $("model-name").textContent = "unavailable";
    $("card-list").replaceChildren(ferrox.el("dt", "", "error"), ferrox.el("dd", "error-text", e.message));
  }
}

async function showCard(card) {
  chat.model = card.id;
  $("model-name").textContent = card.id;
  $("attach").classList.toggle("hidden", !card.image_input);
  const health = await fetch("/health").then((r) => r.json()).catch(() => ({}));
  const info = health.model_info || {};
  const rows = [["model", card.id]];
  if (card.parent) rows.push(["adapter of", card.parent]);
  rows.push(
    ["architecture", card.architecture],
    ["context", card.max_model_len + " tokens"],
    ["dtype", card.dtype],
    ["quantization", card.quantization],
    ["KV cache", card.kv_cache_dtype + (info.kv_bytes ? " · " + ferrox.bytes(info.kv_bytes) : "")],
    ["weights", info.weights_bytes ? ferrox.bytes(info.weights_bytes) : "–"],
    ["version", health.version || "–"],
  );
  if (info.synthetic_weights) rows.push(["weights", "synthetic (random)"]);
  const list = $("card-list");
  list.replaceChildren();
  for (const [name, value] of rows) {
    list.append(ferrox.el("dt", "", name), ferrox.el("dd", "", value === undefined ? "–" : String(value)));
  }
}

// The picker opened (clicked, or reached with the keyboard): read the list again.
async function refreshModels() {
  try {
    const card = await loadModels();
    if (card.id !== chat.model) await showCard(card); // the chosen adapter was unloaded: back to the base model
  } catch (e) {
    // the list stays as it was; a send shows the server's error
  }
}

// ---------------------------------------------------------------- the request

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

// The request body for the conversation so far; throws with a message for a bad schema.
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = {
    model: chat.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: numberField("max_tokens") || 256,
  };
  const topK = numberField("top_k");
  if (topK) body.top_k = topK;
  const seed = numberField("seed");
  if (seed !== null) body.seed = seed;
  const repetition = numberField("repetition_penalty");
  if (repetition !== null && repetition !== 1) body.repetition_penalty = repetition;
  if ($("json-mode").checked) {
    let schema;
    try {
      schema = JSON.parse($("schema").value);
    } catch (e) {
      throw new Error("the JSON schema does not parse: " + e.message);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
  }
  return body;
}

// ---------------------------------------------------------------- the conversation view

function addMessage(role, text) {
  $("empty").classList.add("hidden");
  const node = ferrox.el("div", "msg " + role);
  node.append(ferrox.el("div", "who", role === "user" ? "you" : chat.model || "assistant"));
  const thinking = ferrox.el("div", "thinking hidden");
  const bubble = ferrox.el("div", "bubble", text);
  const meta = ferrox.el("div", "meta");
  node.append(thinking, bubble, meta);
  $("messages").append(node);
  scrollDown();
  return { node, thinking, bubble, meta };
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").classList.toggle("hidden", busy);
  $("stop").classList.toggle("hidden", !busy);
  document.body.dataset.streaming = busy ? "1" : "0";
}

// ---------------------------------------------------------------- streaming

// Yields the JSON payloads of an SSE body ("[DONE]" ends it).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function describe(stats) {
  const parts = [];
  if (stats.tokens !== null) parts.push(stats.tokens + " tokens");
  if (stats.tokensPerS) parts.push(stats.tokensPerS.toFixed(1) + " tok/s");
  if (stats.ttftMs !== null) parts.push("TTFT " + Math.round(stats.ttftMs) + " ms");
  if (stats.cached) parts.push(stats.cached + " prompt tokens cached");
  if (stats.finish) parts.push("finish: " + stats.finish);
  return parts.join(" · ");
}

// ---------------------------------------------------------------- images waiting to be sent

function addImageFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { chat.images.push(reader.result); showAttachments(); };
    reader.readAsDataURL(file);
  }
}

function showAttachments() {
  const box = $("attachments");
  box.replaceChildren(...chat.images.map((url, i) => {
    const img = ferrox.el("img", "thumb");
    img.src = url;
    img.title = "click to remove";
    img.addEventListener("click", () => { chat.images.splice(i, 1); showAttachments(); });
    return img;
  }));
  box.classList.toggle("hidden", chat.images.length === 0);
}

function thumbnails(urls) {
  return urls.map((url) => { const img = ferrox.el("img", "thumb"); img.src = url; return img; });
}

async function send() {
  const text = $("input").value.trim();
  const images = chat.images;
  if ((!text && !images.length) || chat.controller) return;
  let body;
  try {
    const content = images.length
      ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }]
      : text;
    chat.history.push({ role: "user", content });
    body = requestBody();
  } catch (e) {
    chat.history.pop();
    $("schema-error").textContent = e.message;
    return;
  }
  $("schema-error").textContent = "";
  $("input").value = "";
  chat.images = [];
  showAttachments();
  const sent = addMessage("user", text);
  if (images.length) sent.bubble.prepend(...thumbnails(images));
  const reply = addMessage("assistant", "");
  reply.node.classList.add("streaming");
  if (body.response_format) reply.node.classList.add("json");
  reply.node.dataset.state = "streaming";
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const stats = { tokens: null, tokensPerS: null, ttftMs: null, cached: 0, finish: null };
  const started = performance.now();
  let firstAt = null;
  let content = "";
  let reasoning = "";
  try {
    const response = await ferrox.api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    reply.node.dataset.requestId = response.headers.get("X-Request-Id") || "";
    if (!response.ok) {
      const err = await response.json().catch(() => null);
      throw new Error(ferrox.errorMessage(err, response));
    }
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.usage) {
        stats.tokens = chunk.usage.completion_tokens;
        stats.cached = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
      }
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content) {
        if (firstAt === null) { firstAt = performance.now(); stats.ttftMs = firstAt - started; }
      }
      if (delta.reasoning_content) {
        reasoning += delta.reasoning_content;
        reply.thinking.textContent = reasoning;
        reply.thinking.classList.remove("hidden");
      }
      if (delta.content) {
        content += delta.content;
        reply.node.dataset.chunks = String(Number(reply.node.dataset.chunks || 0) + 1);
        reply.bubble.textContent = content;
        scrollDown();
      }
      if (choice.finish_reason) stats.finish = choice.finish_reason;
    }
    const decodeS = firstAt === null ? 0 : (performance.now() - firstAt) / 1000;
    if (stats.tokens && decodeS > 0 && stats.tokens > 1) stats.tokensPerS = (stats.tokens - 1) / decodeS;
    reply.meta.textContent = describe(stats);
    reply.node.dataset.state = "done";
  } catch (e) {
    const stopped = e.name === "AbortError";
    reply.node.dataset.state = stopped ? "stopped" : "error";
    reply.meta.replaceChildren(ferrox.el("span", stopped ? "stopped" : "failed",
      stopped ? "stopped" : "error: " + e.message));
    if (!content && !stopped) reply.bubble.textContent = "—";
  } finally {
    reply.node.classList.remove("streaming");
    chat.history.push({ role: "assistant", content });
    chat.controller = null;
    setBusy(false);
    $("input").focus();
  }
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

// ---------------------------------------------------------------- wiring

function wire() {
  for (const id of ["temperature", "top_p"]) {
    const show = () => { $(id + "-value").textContent = $(id).value; };
    $(id).addEventListener("input", show);
    show();
  }
  $("json-mode").addEventListener("change", () => $("schema").classList.toggle("hidden", !$("json-mode").checked));
  $("send").addEventListener("click", send);
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", () => { addImageFiles($("image-file").files); $("image-file").value = ""; });
  $("input").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData || {}).items || []].filter((i) => i.kind === "file").map((i) => i.getAsFile());
    if (files.some((f) => f && f.type.startsWith("image/"))) { e.preventDefault(); addImageFiles(files.filter(Boolean)); }
  });
  $("stop").addEventListener("click", stop);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("new-chat").addEventListener("click", () => {
    stop();
    chat.history = [];
    chat.images = [];
    showAttachments();
    $("messages").replaceChildren($("empty"));
    $("empty").classList.remove("hidden");
  });
  $("forget-key").addEventListener("click", () => { ferrox.forgetKey(); loadModel(); });
  $("model-picker").addEventListener("focus", refreshModels);
  $("model-picker").addEventListener("mousedown", refreshModels);
  $("model-picker").addEventListener("change", () => {
    const card = chat.cards.find((c) => c.id === $("model-picker").value);
    if (card) showCard(card);
  });
  setBusy(false);
  loadModel();
  setInterval(() => ferrox.showHealth($("state")), 5000);
}

document.addEventListener("DOMContentLoaded", wire);
