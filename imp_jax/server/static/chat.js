/* Conversations, messages and replies: the sidebar, the chat, images attached to a message, streaming a reply
   (SSE from the fetch body), stop, end thinking, regenerate, edit, and the live token count. Shared as
   window.Imp.chat. */
(function () {
  "use strict";
  const { $, store, KNOBS, state, api, errorText, toast, button, copyText, closePanels } = window.Imp;
  const md = window.ImpMarkdown;

  // ------------------------------------------------------------------------------------------ conversations
  function save() {
    if (!store.set("conversations", state.convs, true)) {   // too big with its images: keep the text at least
      store.set("conversations", state.convs.map(withoutImages));
      if (!save.warned) toast("Images are not kept across a reload: the browser's storage is full");
      save.warned = true;
    }
    store.set("current", state.currentId);
  }
  const withoutImages = (c) => ({ ...c,   // each image becomes "" (shown as "image not kept", never sent)
    messages: c.messages.map((m) => (m.images ? { ...m, images: m.images.map(() => "") } : m)) });
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
    if (msg.images && msg.images.length) {
      const pics = document.createElement("div");
      pics.className = "thumbs msg-images";
      pics.append(...thumbs(msg.images));
      pics.onclick = (e) => { if (e.target.tagName === "IMG") e.target.parentNode.classList.toggle("full"); };
      el.append(pics);
    }
    const body = document.createElement("div");
    body.className = "msg-body";
    if (msg.role === "assistant") body.innerHTML = md.render(msg.content || "");
    else body.textContent = msg.content;
    body.hidden = msg.role === "user" && !msg.content;   // an image alone
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
    const kept = (conv.messages[index].images || []).slice();   // the images go with the edit unless removed
    const pics = el.querySelector(".msg-images");
    const drawPics = () => pics.replaceChildren(...thumbs(kept, (i) => { kept.splice(i, 1); drawPics(); }));
    if (pics) { pics.onclick = null; pics.classList.add("editing"); drawPics(); }
    const bar = document.createElement("div");
    bar.className = "edit-bar";
    bar.append(button("Send", "Send the edited message", () => {
      const text = ta.value.trim();
      if (!text && !kept.length) return;
      conv.messages = conv.messages.slice(0, index);
      conv.messages.push(kept.length ? { role: "user", content: text, images: kept } : { role: "user", content: text });
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

  // ------------------------------------------------------------------------------------------ images
  // The types the server decodes, told by the file's first bytes (a name can lie); the caps are the server's
  // (/props image_limits: --max-image-bytes, raw bytes of one image; --max-images-per-request), its defaults
  // until /props has answered.
  const limit = (name, fallback) => (state.imageLimits && state.imageLimits[name]) || fallback;

  async function sniff(file) {
    const b = new Uint8Array(await file.slice(0, 12).arrayBuffer());
    const at = (offset, text) => [...text].every((ch, i) => b[offset + i] === ch.charCodeAt(0));
    if (at(0, "\x89PNG")) return "image/png";
    if (at(0, "\xff\xd8\xff")) return "image/jpeg";
    if (at(0, "GIF8")) return "image/gif";
    if (at(0, "RIFF") && at(8, "WEBP")) return "image/webp";
    return null;
  }

  function dataUrl(blob) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(blob);
    });
  }

  async function addImages(files) {   // from the file picker, a paste or a drop
    const refused = [];
    const MAX_IMAGE_BYTES = limit("max_image_bytes", 20 << 20), MAX_IMAGES = limit("max_images_per_request", 16);
    for (const file of files) {
      const name = file.name || "the pasted file";
      const sent = current() ? current().messages.reduce((n, m) => n + (m.images || []).length, 0) : 0;
      let type = null;
      try { type = await sniff(file); } catch (e) { /* unreadable: refused below */ }
      if (!type) refused.push(`${name}: not a PNG, JPEG, WebP or GIF image`);
      else if (file.size > MAX_IMAGE_BYTES) {
        refused.push(`${name}: ${(file.size / 1048576).toFixed(1)} MiB, over the ` +
          `${(MAX_IMAGE_BYTES / 1048576).toFixed(0)} MiB the server takes for an image`);
      } else if (sent + state.pending.length >= MAX_IMAGES) {
        refused.push(`${name}: at most ${MAX_IMAGES} images a conversation (every turn's images are sent again)`);
      } else {
        try {
          state.pending.push({ name: file.name || "pasted image", url: await dataUrl(new Blob([file], { type })) });
        } catch (e) { refused.push(`${name}: ${e.message}`); }
      }
    }
    if (state.pending.length && state.vision === false) {   // sent anyway: the server's 400 says it too
      refused.push(`the served model ${state.model || ""} has no vision encoder: it will refuse images`);
    }
    showAttachError(refused.join("\n"));
    renderPending();
  }

  function showAttachError(text) {
    $("attach-error").textContent = text;
    $("attach-error").hidden = !text;
  }

  function renderPending() {
    const box = $("attachments");
    box.hidden = !state.pending.length;
    const drop = (i) => { state.pending.splice(i, 1); renderPending(); };
    box.replaceChildren(...thumbs(state.pending.map((p) => p.url), drop, state.pending.map((p) => p.name)));
  }

  function thumbs(urls, onRemove, names) {   // "" is an image the browser's storage could not keep
    return urls.map((url, i) => {
      const fig = document.createElement("div");
      fig.className = "thumb";
      if (url) {
        const img = document.createElement("img");
        img.src = url;
        img.alt = img.title = names ? names[i] : `image ${i + 1}`;
        fig.append(img);
      } else {
        fig.classList.add("gone");
        fig.textContent = "image not kept";
        fig.title = "The browser's storage was full: this image was not saved, and is not sent again";
      }
      if (onRemove) fig.append(button("✕", "Remove the image", () => onRemove(i), "icon thumb-remove"));
      return fig;
    });
  }

  // ------------------------------------------------------------------------------------------ generation
  function wireContent(m, textOnly) {   // OpenAI content parts when the message has images: text first
    const urls = textOnly ? [] : (m.images || []).filter(Boolean);
    if (!urls.length) return m.content;
    return (m.content ? [{ type: "text", text: m.content }] : [])
      .concat(urls.map((url) => ({ type: "image_url", image_url: { url } })));
  }

  function wireMessages(conv, draft, textOnly) {
    const out = [];
    if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
    for (const m of conv ? conv.messages : []) {
      if (m.role === "assistant" && !m.content && !m.reasoning) continue;
      out.push({ role: m.role, content: wireContent(m, textOnly) });
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
    const input = $("input"), text = input.value.trim(), pending = state.pending;
    if ((!text && !pending.length) || state.busy) return;
    const conv = current() || newConv();
    const msg = { role: "user", content: text };
    if (pending.length) msg.images = pending.map((p) => p.url);
    conv.messages.push(msg);
    if (conv.title === "New chat") conv.title = (text || pending[0].name).replace(/\s+/g, " ").slice(0, 48);
    input.value = "";
    state.pending = [];
    renderPending();
    showAttachError("");
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
    const messages = wireMessages(current(), $("input").value, true);   // text only: no image to /tokenize
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

  window.Imp.chat = { current, newConv, renderAll, renderChat, exportJson, send, stop, updateTokenCount, addImages };
})();
