/* Conversations, messages and replies: the sidebar, the chat, streaming a reply (SSE from the fetch body),
   stop, end thinking, regenerate, edit, and the live token count. Shared as window.Imp.chat. */
(function () {
  "use strict";
  const { $, store, KNOBS, state, api, errorText, toast, button, copyText, closePanels } = window.Imp;
  const md = window.ImpMarkdown;

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
      window.Imp.pollHealth();
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

  window.Imp.chat = { current, newConv, renderAll, renderChat, exportJson, send, stop, updateTokenCount };
})();
