/* imp_jax's built-in chat page: talks to this server's API with fetch(), keeps conversations and settings in
   localStorage, streams replies over SSE from the fetch body reader. No framework, no build step. */
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const md = window.ImpMarkdown;
  const store = {
    get(key, dflt) {
      try { const v = localStorage.getItem("imp." + key); return v === null ? dflt : JSON.parse(v); } catch (e) { return dflt; }
    },
    set(key, value) {
      try { localStorage.setItem("imp." + key, JSON.stringify(value)); } catch (e) {
        toast("Not saved: the browser's storage is full (export and delete old conversations)");
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

  // ------------------------------------------------------------------------------------------ server facts
  function loadServer() {   // one at a time: the health poll and the start may both ask
    if (!state.loading) state.loading = fetchServer().finally(() => { state.loading = null; });
    return state.loading;
  }

  async function fetchServer() {
    try {
      const res = await api("/v1/models");
      if (!res.ok) throw new Error(await errorText(res));
      state.models = (await res.json()).data || [];
      const loaded = state.models.find((m) => m.loaded) || state.models[0];
      if (!state.model || !state.models.some((m) => m.id === state.model)) state.model = loaded ? loaded.id : null;
      if (loaded && loaded.max_model_len) state.nCtx = loaded.max_model_len;
      const sel = $("model");
      sel.replaceChildren(...state.models.map((m) => new Option(m.id, m.id, false, m.id === state.model)));
    } catch (e) { toast("Models: " + e.message); }
    try {
      const res = await api("/props");
      if (res.ok) {
        const props = await res.json(), gen = props.default_generation_settings || {};
        state.propsLoaded = true;
        state.nCtx = gen.n_ctx || state.nCtx;
        for (const [id, name] of KNOBS) {
          const v = name && gen.params ? gen.params[name] : null;
          $("k-" + id).placeholder = v === null || v === undefined ? "server default" : String(v);
        }
      }
    } catch (e) { /* the server may still be loading: the health poll tries again */ }
    try {
      const res = await api("/info");
      if (res.ok) { const info = await res.json(); $("about").textContent = `${info.router} ${info.version}`; }
    } catch (e) { /* nothing to show */ }
    $("ctx").textContent = state.nCtx ? `ctx ${state.nCtx}` : "";
    updateTokenCount();
  }

  async function pollHealth() {
    const el = $("health"), text = $("health-text");
    try {
      const res = await fetch("/health", { cache: "no-store" });
      const h = await res.json();
      const ready = h.status === "ok" && (h.state === undefined || h.state === "ready");
      el.dataset.state = ready ? "ok" : h.status === "ok" ? "busy" : "down";
      text.textContent = ready ? `${h.num_running || 0} running · ${h.num_waiting || 0} waiting` : (h.state || h.status);
      if (ready && !(state.model && state.propsLoaded) && !state.keyDismissed) loadServer();   // it was loading
    } catch (e) {
      el.dataset.state = "down";
      text.textContent = "offline";
    }
  }

  // [label, metric names summed over their labels]
  const METRICS = [["requests", ["imp_requests_total"]], ["prompt tokens", ["imp_prompt_tokens_total"]],
    ["generated tokens", ["imp_generated_tokens_total"]], ["cached prompt tokens", ["imp_tokens_cached_total"]],
    ["cancelled", ["imp_requests_cancelled_total"]], ["failed", ["imp_requests_failed_total"]],
    ["KV blocks used", ["imp_kv_blocks_used"]], ["KV blocks total", ["imp_kv_blocks_total"]]];

  async function loadMetrics() {
    const dl = $("metrics");
    try {
      const res = await api("/metrics");
      if (!res.ok) throw new Error(await errorText(res));
      const sums = {};
      for (const line of (await res.text()).split("\n")) {
        const m = /^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/.exec(line);
        if (m) sums[m[1]] = (sums[m[1]] || 0) + Number(m[2]);
      }
      dl.replaceChildren(...METRICS.filter(([, names]) => names.some((n) => n in sums)).flatMap(([label, names]) => {
        const dt = document.createElement("dt"), dd = document.createElement("dd");
        dt.textContent = label;
        dd.textContent = String(names.reduce((a, n) => a + (sums[n] || 0), 0));
        return [dt, dd];
      }));
    } catch (e) { dl.textContent = "unavailable: " + e.message; }
  }

  // ------------------------------------------------------------------------------------------ conversations
  function save() {
    store.set("conversations", state.convs);
    store.set("current", state.currentId);
  }
  const current = () => state.convs.find((c) => c.id === state.currentId) || null;

  function newConv() {
    const conv = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat",
      created: new Date().toISOString(), messages: [] };
    state.convs.unshift(conv);
    state.currentId = conv.id;
    save();
    return conv;
  }

  function renderSidebar() {
    const list = $("conv-list");
    list.replaceChildren(...state.convs.map((c) => {
      const li = document.createElement("li");
      li.className = "conv" + (c.id === state.currentId ? " active" : "");
      li.dataset.id = c.id;
      const title = document.createElement("button");
      title.className = "conv-title";
      title.textContent = c.title;
      title.title = c.title;
      title.onclick = () => { state.currentId = c.id; save(); renderAll(); closePanels(); };
      const ren = button("✎", "Rename", () => {
        const name = prompt("Rename conversation", c.title);
        if (name && name.trim()) { c.title = name.trim().slice(0, 200); save(); renderSidebar(); }
      }, "icon conv-rename");
      const del = button("✕", "Delete", () => {
        if (!confirm(`Delete "${c.title}"?`)) return;
        if (state.busy && state.busy.conv === c) stop();
        state.convs = state.convs.filter((x) => x !== c);
        if (state.currentId === c.id) state.currentId = state.convs.length ? state.convs[0].id : null;
        save();
        renderAll();
      }, "icon conv-delete");
      li.append(title, ren, del);
      return li;
    }));
  }

  function exportJson() {
    const blob = new Blob([JSON.stringify({ exported: new Date().toISOString(), conversations: state.convs }, null, 2)],
      { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = "imp_jax-conversations.json";
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  // ------------------------------------------------------------------------------------------ messages
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

  function renderAll() {
    renderSidebar();
    renderChat();
    updateTokenCount();
  }

  function renderChat() {
    const conv = current(), box = $("messages");
    $("title").textContent = conv ? conv.title : "New chat";
    if (!conv || !conv.messages.length) {
      const empty = document.createElement("div");
      empty.className = "empty";
      empty.textContent = "Send a message to start.";
      box.replaceChildren(empty);
      return;
    }
    box.replaceChildren(...conv.messages.map((m, i) => messageEl(conv, m, i)));
    box.scrollTop = box.scrollHeight;
  }

  function messageEl(conv, msg, index) {
    const el = document.createElement("div");
    el.className = "msg " + msg.role;
    el.dataset.index = index;
    const streaming = state.busy && state.busy.msg === msg;
    if (msg.role === "assistant") {
      const think = document.createElement("details");
      think.className = "think";
      think.hidden = !msg.reasoning;
      think.open = streaming && !msg.content;
      const summary = document.createElement("summary");
      const label = document.createElement("span");
      label.className = "think-label";
      label.textContent = streaming && !msg.content ? "Thinking…" : "Thoughts";
      summary.append(label);
      if (streaming && !msg.content) {
        summary.append(button("End thinking", "End the thinking now; the answer follows", (e) => {
          e.preventDefault();
          endThinking(e.target);
        }, "end-thinking"));
      }
      const tbody = document.createElement("div");
      tbody.className = "think-body";
      tbody.textContent = msg.reasoning || "";
      think.append(summary, tbody);
      el.append(think);
    }
    const body = document.createElement("div");
    body.className = "msg-body";
    if (msg.role === "assistant") body.innerHTML = md.render(msg.content || "");
    else body.textContent = msg.content;
    if (streaming) body.classList.add("streaming");
    el.append(body);
    if (msg.error) {
      const err = document.createElement("div");
      err.className = "msg-error";
      err.textContent = msg.error;
      el.append(err);
    }
    const meta = document.createElement("div");
    meta.className = "msg-meta";
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsText(msg);
    meta.append(stats);
    if (!streaming) {
      meta.append(button("Copy", "Copy the message", () => copyText(msg.content), "msg-copy"));
      if (msg.role === "user") meta.append(button("Edit", "Edit and resend", () => editMessage(conv, index, el), "msg-edit"));
      if (msg.role === "assistant") meta.append(button("Regenerate", "Answer again", () => regenerate(conv, index), "msg-regen"));
    }
    el.append(meta);
    return el;
  }

  function statsText(msg) {
    const s = msg.stats;
    const parts = [];
    if (s) {
      if (s.tokens !== undefined) parts.push(`${s.tokens} tokens`);
      if (s.tps) parts.push(`${s.tps.toFixed(1)} tok/s`);
      if (s.seconds !== undefined) parts.push(`${s.seconds.toFixed(1)} s`);
    }
    if (msg.finish && msg.finish !== "stop") parts.push(msg.finish);
    return parts.join(" · ");
  }

  function updateStreaming() {
    state.renderQueued = false;
    const b = state.busy;
    if (!b || b.conv !== current()) return;
    const box = $("messages"), el = box.querySelector(`.msg[data-index="${b.conv.messages.indexOf(b.msg)}"]`);
    if (!el) return;
    const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    const msg = b.msg, think = el.querySelector(".think");
    think.hidden = !msg.reasoning;
    el.querySelector(".think-body").textContent = msg.reasoning;
    if (msg.content && el.querySelector(".end-thinking")) {   // the answer began: fold the thoughts
      el.querySelector(".end-thinking").remove();
      el.querySelector(".think-label").textContent = "Thoughts";
      think.open = false;
    }
    el.querySelector(".msg-body").innerHTML = md.render(msg.content);
    el.querySelector(".stats").textContent = statsText(msg);
    if (stick) box.scrollTop = box.scrollHeight;
  }

  function scheduleRender() {
    if (!state.renderQueued) {
      state.renderQueued = true;
      requestAnimationFrame(updateStreaming);
    }
  }

  function editMessage(conv, index, el) {
    if (state.busy) return;
    const body = el.querySelector(".msg-body");
    const ta = document.createElement("textarea");
    ta.className = "edit-box";
    ta.value = conv.messages[index].content;
    const bar = document.createElement("div");
    bar.className = "edit-bar";
    bar.append(button("Send", "Send the edited message", () => {
      const text = ta.value.trim();
      if (!text) return;
      conv.messages = conv.messages.slice(0, index);
      conv.messages.push({ role: "user", content: text });
      save();
      renderChat();
      generate(conv);
    }, "primary edit-send"), button("Cancel", "Keep the message", () => renderChat(), "edit-cancel"));
    body.replaceWith(ta, bar);
    ta.focus();
  }

  function regenerate(conv, index) {
    if (state.busy) return;
    conv.messages = conv.messages.slice(0, index);
    save();
    renderChat();
    generate(conv);
  }

  // ------------------------------------------------------------------------------------------ generation
  function wireMessages(conv, draft) {
    const out = [];
    if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
    for (const m of conv ? conv.messages : []) {
      if (m.role === "assistant" && !m.content && !m.reasoning) continue;
      out.push({ role: m.role, content: m.content });
    }
    if (draft) out.push({ role: "user", content: draft });
    return out;
  }

  function requestBody(conv) {
    const body = { model: state.model, messages: wireMessages(conv), stream: true,
      stream_options: { include_usage: true } };
    for (const [id, , integer] of KNOBS) {
      const raw = state.settings.knobs[id];
      if (raw === undefined || raw === "") continue;
      const v = integer ? parseInt(raw, 10) : parseFloat(raw);
      if (!Number.isNaN(v)) body[id] = v;
    }
    return body;
  }

  async function send() {
    const input = $("input"), text = input.value.trim();
    if (!text || state.busy) return;
    const conv = current() || newConv();
    conv.messages.push({ role: "user", content: text });
    if (conv.title === "New chat") conv.title = text.replace(/\s+/g, " ").slice(0, 48);
    input.value = "";
    save();
    renderAll();
    await generate(conv);
  }

  async function generate(conv) {
    const body = requestBody(conv);
    const msg = { role: "assistant", content: "", reasoning: "" };
    conv.messages.push(msg);
    const busy = { controller: new AbortController(), requestId: null, conv, msg };
    state.busy = busy;
    setBusy(true);
    renderChat();
    const t0 = performance.now();
    let tFirst = null, tokens = 0, usage = null;
    try {
      if (!state.model) throw new Error("no model is loaded yet");
      const res = await api("/v1/chat/completions", body, busy.controller.signal);
      if (!res.ok) throw new Error(await errorText(res));
      busy.requestId = res.headers.get("X-Request-Id");
      const reader = res.body.getReader(), decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
          if (!data || data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
          busy.requestId = busy.requestId || chunk.id;
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          const d = choice.delta || {};
          if (d.reasoning_content) msg.reasoning += d.reasoning_content;
          if (d.content) msg.content += d.content;
          if (d.reasoning_content || d.content) {
            tokens++;
            if (tFirst === null) tFirst = performance.now();
            const secs = (performance.now() - tFirst) / 1000;
            msg.stats = { tokens, tps: secs > 0 ? (tokens - 1) / secs : null };
          }
          if (choice.finish_reason) msg.finish = choice.finish_reason;
          scheduleRender();
        }
      }
    } catch (e) {
      if (e.name === "AbortError") msg.finish = "stopped";
      else msg.error = e.message;
    } finally {
      const t1 = performance.now();
      const n = usage ? usage.completion_tokens : tokens;
      msg.stats = { tokens: n, seconds: (t1 - t0) / 1000,
        tps: tFirst !== null && n > 1 && t1 > tFirst ? (n - 1) / ((t1 - tFirst) / 1000) : null };
      if (usage) msg.usage = usage;
      state.busy = null;
      setBusy(false);
      save();
      if (conv === current()) renderChat();
      updateTokenCount();
      pollHealth();
    }
  }

  function stop() {
    if (state.busy) state.busy.controller.abort();
  }

  async function endThinking(btn) {
    const b = state.busy;
    if (!b || !b.requestId) return;
    btn.disabled = true;
    try {
      const res = await api(`/v1/requests/${encodeURIComponent(b.requestId)}/end_thinking`, {});
      if (!res.ok) toast("End thinking: " + await errorText(res));
    } catch (e) { toast("End thinking: " + e.message); }
  }

  function setBusy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    document.body.classList.toggle("busy", on);
  }

  // ------------------------------------------------------------------------------------------ token count
  function updateTokenCount() {
    clearTimeout(updateTokenCount.timer);
    updateTokenCount.timer = setTimeout(countTokens, 300);
  }

  async function countTokens() {
    const el = $("token-count");
    const messages = wireMessages(current(), $("input").value);
    if (!messages.length || !state.model) { el.textContent = state.nCtx ? `0 / ${state.nCtx} tokens` : ""; return; }
    if (countTokens.controller) countTokens.controller.abort();
    const controller = countTokens.controller = new AbortController();
    try {
      const res = await api("/tokenize", { model: state.model, messages, add_generation_prompt: true }, controller.signal);
      if (!res.ok) { el.textContent = ""; return; }
      const j = await res.json();
      el.textContent = `${j.count} / ${j.max_model_len || state.nCtx} tokens`;
      el.classList.toggle("over", j.max_model_len && j.count >= j.max_model_len);
    } catch (e) { /* superseded or offline */ }
  }

  // ------------------------------------------------------------------------------------------ settings, theme
  function loadSettings() {
    $("system").value = state.settings.system;
    for (const [id] of KNOBS) $("k-" + id).value = state.settings.knobs[id] ?? "";
  }

  function saveSettings() {
    state.settings.system = $("system").value;
    for (const [id] of KNOBS) state.settings.knobs[id] = $("k-" + id).value;
    store.set("settings", state.settings);
  }

  function applyTheme() {
    const dark = window.matchMedia && matchMedia("(prefers-color-scheme: dark)").matches;
    document.documentElement.dataset.theme = store.get("theme", dark ? "dark" : "light");
  }

  function closePanels() {
    document.body.classList.remove("show-sidebar", "show-settings");
  }

  // ------------------------------------------------------------------------------------------ wiring
  function bind() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    $("input").addEventListener("input", updateTokenCount);
    document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.busy) { e.preventDefault(); stop(); } });
    $("stop").onclick = stop;
    $("key-cancel").onclick = () => { $("key-input").value = ""; };
    $("new-chat").onclick = () => { if (!current() || current().messages.length) newConv(); renderAll(); closePanels(); $("input").focus(); };
    $("export").onclick = exportJson;
    $("model").onchange = (e) => { state.model = e.target.value; updateTokenCount(); };
    $("theme").onclick = () => {
      const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
      store.set("theme", next);
      document.documentElement.dataset.theme = next;
    };
    $("open-sidebar").onclick = () => document.body.classList.toggle("show-sidebar");
    $("open-settings").onclick = () => document.body.classList.toggle("show-settings");
    for (const id of ["close-sidebar", "close-settings", "scrim"]) $(id).onclick = closePanels;
    $("settings").addEventListener("input", () => { saveSettings(); updateTokenCount(); });
    $("reset-knobs").onclick = () => { state.settings.knobs = {}; store.set("settings", state.settings); loadSettings(); };
    $("change-key").onclick = () => {
      state.keyDismissed = false;
      askKey("Enter the server's API key (empty: none).").then(loadServer);
    };
    window.addEventListener("storage", (e) => {   // another tab of this page changed the conversations
      if (e.key !== "imp.conversations" || state.busy) return;
      state.convs = store.get("conversations", []);
      if (!current()) state.currentId = state.convs.length ? state.convs[0].id : null;
      renderAll();
    });
    $("server-stats").addEventListener("toggle", (e) => { if (e.target.open) loadMetrics(); });
    $("messages").addEventListener("click", (e) => {
      const b = e.target.closest(".copy-code");
      if (b) copyText(b.closest(".code-block").querySelector("code").textContent);
    });
  }

  applyTheme();
  loadSettings();
  bind();
  renderAll();
  pollHealth();
  setInterval(pollHealth, 5000);
  loadServer();
})();
