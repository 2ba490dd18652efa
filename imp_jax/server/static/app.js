/* imp_jax's built-in chat page: talks to this server's API with fetch(), keeps conversations and settings in
   localStorage. This file: the server's facts, health and counters, settings, theme, and the page's wiring. */
(function () {
  "use strict";
  const { $, store, KNOBS, state, api, errorText, askKey, toast, copyText, closePanels } = window.Imp;
  const { current, newConv, renderAll, exportJson, send, stop, updateTokenCount, addImages } = window.Imp.chat;

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
        state.vision = props.modalities ? props.modalities.vision !== false : null;   // null: not said
        if (props.image_limits) state.imageLimits = props.image_limits;
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
      const res = await api("/health");   // with the key: a keyed server shows its counters to key holders only
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

  // ------------------------------------------------------------------------------------------ wiring
  function bind() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    });
    $("input").addEventListener("input", updateTokenCount);
    $("attach").onclick = () => $("file").click();
    $("file").onchange = (e) => { addImages([...e.target.files]); e.target.value = ""; };
    document.addEventListener("paste", (e) => {   // an image pasted anywhere but the settings' fields
      const files = e.clipboardData ? [...e.clipboardData.files] : [];
      if (!files.length || (e.target.closest && e.target.closest("#settings, dialog"))) return;
      if (!e.clipboardData.types.includes("text/plain")) e.preventDefault();   // a copied page image has both
      addImages(files);
    });
    $("composer").addEventListener("dragover", (e) => {
      if (e.dataTransfer.types.includes("Files")) e.preventDefault();   // lets the drop come
    });
    $("composer").addEventListener("drop", (e) => {
      if (!e.dataTransfer.files.length) return;
      e.preventDefault();
      addImages([...e.dataTransfer.files]);
    });
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

  window.Imp.pollHealth = pollHealth;   // chat.js asks for fresh counts when a reply ends
  applyTheme();
  loadSettings();
  bind();
  renderAll();
  pollHealth();
  setInterval(pollHealth, 5000);
  loadServer();
})();
