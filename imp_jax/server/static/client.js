/* The chat page's plumbing: localStorage, the API client (asks for a key on 401), small DOM helpers.
   Shared with chat.js and app.js as window.Imp. */
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const store = {
    get(key, dflt) {
      try { const v = localStorage.getItem("imp." + key); return v === null ? dflt : JSON.parse(v); } catch (e) { return dflt; }
    },
    set(key, value, quiet) {   // true when kept; `quiet`: no toast when the storage is full
      try { localStorage.setItem("imp." + key, JSON.stringify(value)); return true; } catch (e) {
        if (!quiet) toast("Not saved: the browser's storage is full (export and delete old conversations)");
        return false;
      }
    },
  };
  // [input id and request field, the /props params name (its default is the placeholder), integer?]
  const KNOBS = [["temperature", "temperature", false], ["top_p", "top_p", false], ["top_k", "top_k", true],
    ["min_p", "min_p", false], ["max_tokens", null, true], ["seed", null, true],
    ["repetition_penalty", "repeat_penalty", false]];

  const state = {
    models: [], model: null, nCtx: null,
    convs: store.get("conversations", []),
    currentId: store.get("current", null),
    settings: Object.assign({ system: "", knobs: {} }, store.get("settings", {})),
    apiKey: store.get("apiKey", ""),
    busy: null,   // the streaming reply: {controller, requestId, conv, msg}
    pending: [],   // images attached to the message being written: {name, url (a data: URL)}
    keyPrompt: null,
  };

  // ------------------------------------------------------------------------------------------ API
  async function api(path, body, signal) {
    const headers = {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (state.apiKey) headers["Authorization"] = "Bearer " + state.apiKey;
    const res = await fetch(path, { method: body === undefined ? "GET" : "POST", headers, signal,
      body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store" });
    if (res.status === 401 && !state.keyDismissed) {
      await askKey(state.apiKey ? "The server refused this API key." : "This server needs an API key.");
      if (!state.apiKey) {   // dismissed: this call and later ones fail with their 401 until "API key…"
        state.keyDismissed = true;
        return res;
      }
      return api(path, body, signal);
    }
    return res;
  }

  async function errorText(res) {
    try { const j = await res.json(); return (j.error && (j.error.message || j.error)) || res.statusText; } catch (e) { return `HTTP ${res.status}`; }
  }

  function askKey(why) {
    if (!state.keyPrompt) {
      state.keyPrompt = new Promise((resolve) => {
        const dlg = $("key-dialog");
        $("key-why").textContent = why;
        $("key-input").value = "";
        dlg.onclose = () => {
          state.apiKey = $("key-input").value.trim();
          store.set("apiKey", state.apiKey);
          state.keyPrompt = null;
          resolve();
        };
        dlg.showModal();
      });
    }
    return state.keyPrompt;
  }

  function toast(text) {
    const t = $("toast");
    t.textContent = text;
    t.hidden = false;
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { t.hidden = true; }, 6000);
  }


  function button(label, title, onclick, cls) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.title = title;
    b.setAttribute("aria-label", title);
    b.className = cls || "";
    b.onclick = onclick;
    return b;
  }

  async function copyText(text) {
    try { await navigator.clipboard.writeText(text); } catch (e) {
      const ta = document.createElement("textarea");
      ta.value = text;
      document.body.append(ta);
      ta.select();
      document.execCommand("copy");
      ta.remove();
    }
    toast("Copied");
  }

  function closePanels() {
    document.body.classList.remove("show-sidebar", "show-settings");
  }

  window.Imp = { $, store, KNOBS, state, api, errorText, askKey, toast, button, copyText, closePanels };
})();
