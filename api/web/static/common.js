// What both pages share: the API key, fetching from the server, number formats.
//
// The pages load without the key; every API route they read is behind it when the server
// has one. A 401 opens the key dialog (#key-dialog, in both pages), the key is kept in
// localStorage and sent as "Authorization: Bearer <key>" from then on. The key controls
// (".key-control": "Forget key") show only where a key matters: the server asked for one
// or one is stored; a server without a key never offers them.
"use strict";

const KEY_STORE = "ferrox.apiKey";

const ferrox = {
  keyAsked: false, // a read answered 401 on this page

  key() {
    return localStorage.getItem(KEY_STORE) || "";
  },

  showKeyControls() {
    const show = ferrox.keyAsked || Boolean(ferrox.key());
    for (const node of document.querySelectorAll(".key-control")) node.classList.toggle("hidden", !show);
  },

  headers(extra) {
    const headers = Object.assign({}, extra || {});
    const key = ferrox.key();
    if (key) headers.Authorization = "Bearer " + key;
    return headers;
  },

  // fetch() with the key; on 401 asks for a key (again, while it is refused) and retries.
  async api(path, options) {
    const opts = Object.assign({}, options || {});
    for (;;) {
      opts.headers = ferrox.headers((options || {}).headers);
      const response = await fetch(path, opts);
      if (response.status !== 401) return response;
      ferrox.keyAsked = true;
      ferrox.showKeyControls();
      await ferrox.askKey(ferrox.key() ? "That key was refused. " : "");
    }
  },

  async json(path, options) {
    const response = await ferrox.api(path, options);
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new Error(ferrox.errorMessage(body, response));
    return body;
  },

  errorMessage(body, response) {
    const err = body && (body.error || body);
    const message = err && (err.message || (typeof err === "string" ? err : null));
    return message || (response ? "HTTP " + response.status : "request failed");
  },

  // The key dialog (one per page, made on first use).
  keyDialog() {
    let dialog = document.getElementById("key-dialog");
    if (dialog) return dialog;
    dialog = ferrox.el("dialog", "key");
    dialog.id = "key-dialog";
    const note = ferrox.el("p");
    note.id = "key-note";
    const form = ferrox.el("form");
    form.id = "key-form";
    const input = ferrox.el("input");
    Object.assign(input, { id: "key-input", type: "password", autocomplete: "off", placeholder: "key" });
    form.append(input);
    const actions = ferrox.el("div", "actions");
    const save = ferrox.el("button", "btn primary", "Use key");
    Object.assign(save, { id: "key-save", type: "button" });
    actions.append(save);
    dialog.append(ferrox.el("h2", "", "API key"), note, form, actions);
    document.body.append(dialog);
    return dialog;
  },

  // Opens the key dialog; resolves when a key was saved.
  askKey(prefix) {
    const dialog = ferrox.keyDialog();
    const input = document.getElementById("key-input");
    const note = document.getElementById("key-note");
    note.textContent = (prefix || "") + "This server needs an API key (its --api-key / FERROX_API_KEY).";
    input.value = "";
    if (!dialog.open) dialog.showModal();
    input.focus();
    return new Promise((resolve) => {
      const save = () => {
        if (!input.value.trim()) return;
        localStorage.setItem(KEY_STORE, input.value.trim());
        ferrox.showKeyControls();
        cleanup();
        dialog.close();
        resolve();
      };
      const onKey = (e) => { if (e.key === "Enter") { e.preventDefault(); save(); } };
      const saveButton = document.getElementById("key-save");
      const cleanup = () => {
        saveButton.removeEventListener("click", save);
        input.removeEventListener("keydown", onKey);
      };
      saveButton.addEventListener("click", save);
      input.addEventListener("keydown", onKey);
      document.getElementById("key-form").onsubmit = (e) => { e.preventDefault(); save(); };
    });
  },

  forgetKey() {
    localStorage.removeItem(KEY_STORE);
    ferrox.showKeyControls();
  },

  // The server's state as /health says it, for the dot in the top bar.
  async showHealth(element) {
    try {
      const response = await fetch("/health");
      const body = await response.json();
      element.textContent = body.state;
      element.className = "state " + (body.state === "ready" ? "ready"
        : (body.state === "loading" || body.state === "draining") ? body.state : "down");
      return body;
    } catch (e) {
      element.textContent = "unreachable";
      element.className = "state down";
      return null;
    }
  },

  bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 2 : 1) : String(n)) + " " + units[i];
  },

  // A compact number: 3 significant digits, k/M above a thousand.
  num(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const d = digits === undefined ? 3 : digits;
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toPrecision(d) + "M";
    if (a >= 1e4) return (v / 1e3).toPrecision(d) + "k";
    if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
    return v.toPrecision(d);
  },

  el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  },
};

window.ferrox = ferrox;
document.addEventListener("DOMContentLoaded", () => ferrox.showKeyControls());
