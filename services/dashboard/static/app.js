// Replicaplane's live dashboard. Plain browser JavaScript, no build step and nothing loaded from
// elsewhere. It reads one Server-Sent Events stream (api/events) over fetch(), so the API token
// travels in a header rather than a URL, and redraws from what arrives: no polling, no reloads.
// Every value from the controller goes into the page as text (textContent), never as HTML.
"use strict";

(() => {
  const TOKEN_KEY = "replicaplane.dashboard.token";
  const MAX_EVENTS = 300;
  const MAX_TIMELINE_ROWS = 200;
  const WINDOW_MAX_MS = 30 * 60 * 1000;
  const WINDOW_MIN_MS = 30 * 1000;
  const LEGEND = [
    "PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY", "SHUTTING_DOWN", "FAILED", "PREEMPTED",
  ];

  const state = {
    services: new Map(),
    replicas: new Map(),
    events: [],
    offsetMs: 0, // the dashboard's clock minus ours
    stopped: false,
  };
  let abort = null;
  let retryMs = 500;
  let retryTimer = null;
  let drawQueued = false;

  const $ = (id) => document.getElementById(id);

  // ---- small DOM helpers: text only ----------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "class") node.className = value;
      else if (key === "title") node.title = value;
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else if (key === "style") Object.assign(node.style, value);
    }
    for (const child of children) {
      if (child === undefined || child === null) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function statusClass(status) {
    return /^[A-Z_]{1,40}$/.test(status) ? `st-${status}` : "st-UNKNOWN";
  }

  function badge(status) {
    return el("span", { class: `badge ${statusClass(status)}` }, status);
  }

  // A link only for http(s) URLs; anything else stays text.
  function link(url) {
    if (!url) return "";
    let parsed;
    try {
      parsed = new URL(url);
    } catch (e) {
      return url;
    }
    if (parsed.protocol !== "http:" && parsed.protocol !== "https:") return url;
    const a = el("a", {}, url);
    a.href = parsed.href;
    a.target = "_blank";
    a.rel = "noopener noreferrer";
    return a;
  }

  function now() {
    return Date.now() + state.offsetMs;
  }

  function clock(ms) {
    return new Date(ms - state.offsetMs).toLocaleTimeString([], { hour12: false });
  }

  function duration(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
    return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  }

  // ---- the token -----------------------------------------------------------------------------

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  // `replicactl dashboard --open` passes the token in the fragment (never sent to a server);
  // it is moved to session storage and taken out of the address bar and history at once.
  function takeTokenFromFragment() {
    const params = new URLSearchParams(location.hash.slice(1));
    if (!params.has("token")) return false;
    const value = params.get("token");
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
    return true;
  }

  function showTokenPanel(message) {
    $("token-panel").hidden = false;
    $("token-message").textContent = message || "";
    $("token-input").focus();
  }

  // ---- the stream ----------------------------------------------------------------------------

  function setConnection(name, message) {
    const pill = $("connection");
    pill.dataset.state = name;
    pill.textContent = name;
    pill.title = message || "";
  }

  function retry(message) {
    if (state.stopped) return;
    setConnection("reconnecting", message);
    clearTimeout(retryTimer);
    retryTimer = setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  }

  async function errorOf(resp) {
    try {
      return (await resp.json()).error || `HTTP ${resp.status}`;
    } catch (e) {
      return `HTTP ${resp.status}`;
    }
  }

  async function connect() {
    clearTimeout(retryTimer);
    if (abort) abort.abort();
    abort = new AbortController();
    const mine = abort;
    state.stopped = false;
    const headers = { Accept: "text/event-stream" };
    if (token()) headers.Authorization = `Bearer ${token()}`;
    let resp;
    try {
      resp = await fetch("api/events", { headers, cache: "no-store", signal: mine.signal });
    } catch (e) {
      if (!mine.signal.aborted) retry("cannot reach the dashboard");
      return;
    }
    if (resp.status === 401) {
      state.stopped = true; // wait for a token
      const message = await errorOf(resp);
      setConnection("denied", message);
      showTokenPanel(message);
      return;
    }
    if (!resp.ok) {
      retry(await errorOf(resp));
      return;
    }
    retryMs = 500;
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          handleBlock(block);
        }
      }
    } catch (e) {
      if (mine.signal.aborted) return;
    }
    if (!mine.signal.aborted) retry("the stream ended");
  }

  function handleBlock(block) {
    let kind = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue; // keep-alive
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") kind = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return;
    let message;
    try {
      message = JSON.parse(data.join("\n"));
    } catch (e) {
      return;
    }
    handle(kind, message);
  }

  function handle(kind, msg) {
    if (typeof msg.now === "number") state.offsetMs = msg.now - Date.now();
    if (kind === "snapshot") {
      state.services = new Map(msg.services.map((s) => [s.name, s]));
      state.replicas = new Map(msg.replicas.map((r) => [r.key, r]));
      state.events = msg.events.slice(-MAX_EVENTS);
      showConnection(msg.connection);
    } else if (kind === "change") {
      if (msg.service) state.services.set(msg.service.name, msg.service);
      if (msg.deleted) state.services.delete(msg.deleted);
      for (const r of msg.replicas) state.replicas.set(r.key, r);
      state.events.push(...msg.events);
      if (state.events.length > MAX_EVENTS) state.events.splice(0, state.events.length - MAX_EVENTS);
    } else if (kind === "connection") {
      showConnection(msg);
    } else if (kind === "denied") {
      state.stopped = true;
      if (abort) abort.abort();
      setConnection("denied", msg.message);
      showTokenPanel(msg.message);
    } else if (kind === "closing") {
      setConnection("reconnecting", msg.message);
    }
    queueDraw();
  }

  function showConnection(c) {
    if (!c) return;
    setConnection(c.state, c.message);
    if (c.state === "live") $("token-panel").hidden = true;
  }

  // ---- drawing -------------------------------------------------------------------------------

  function queueDraw() {
    if (drawQueued) return;
    drawQueued = true;
    requestAnimationFrame(() => {
      drawQueued = false;
      draw();
    });
  }

  function draw() {
    drawSummary();
    drawServices();
    drawReplicas();
    drawTimeline();
    drawEvents();
  }

  function liveReplicas() {
    return [...state.replicas.values()]
      .filter((r) => r.removed === null && state.services.has(r.service))
      .sort((a, b) => a.service.localeCompare(b.service) || a.id - b.id);
  }

  function drawSummary() {
    const live = liveReplicas();
    const ready = live.filter((r) => r.status === "READY").length;
    const n = state.services.size;
    $("summary").textContent = `${n} service${n === 1 ? "" : "s"} · ${ready}/${live.length} replicas ready`;
    $("clock").textContent = clock(now());
  }

  function drawServices() {
    const body = $("services").tBodies[0];
    const rows = [...state.services.values()].sort((a, b) => a.name.localeCompare(b.name)).map((s) => {
      const scaler = s.autoscaler || {};
      const scalerText = scaler.kind
        ? `${scaler.kind}: target ${scaler.target} (${scaler.min}-${scaler.max}), ${scaler.qps} qps`
        : "";
      const endpoint = s.endpoint || (s.endpoints.length ? s.endpoints[0] : "");
      const more = !s.endpoint && s.endpoints.length > 1 ? ` (+${s.endpoints.length - 1})` : "";
      const versions = s.versions.length ? s.versions.join(", ") : "-";
      return el(
        "tr",
        { "data-service": s.name, "data-status": s.status },
        el("td", {}, el("strong", {}, s.name)),
        el("td", {}, badge(s.status), s.probing_stale ? el("span", { class: "stale", title: "no prober answered recently" }, " probing stale") : null),
        el("td", { class: "num" }, versions, s.latest_version && !s.versions.includes(s.latest_version) ? ` (latest ${s.latest_version})` : ""),
        el("td", { class: "num" }, `${s.ready}/${s.total}`, s.target !== s.total ? ` (target ${s.target})` : ""),
        el("td", {}, link(endpoint), more),
        el("td", { title: scaler.reason || "" }, scalerText),
        el("td", { class: "message" }, s.message),
      );
    });
    body.replaceChildren(...rows);
    $("services-empty").hidden = rows.length > 0;
  }

  function drawReplicas() {
    const body = $("replicas").tBodies[0];
    const t = now();
    const rows = liveReplicas().map((r) =>
      el(
        "tr",
        { "data-key": r.key, "data-service": r.service, "data-id": r.id, "data-status": r.status },
        el("td", {}, r.service),
        el("td", { class: "num" }, r.id),
        el("td", {}, badge(r.status)),
        el("td", { class: "num" }, r.version),
        el("td", {}, link(r.endpoint)),
        el("td", {}, [r.zone, r.spot ? "spot" : ""].filter(Boolean).join(" · ")),
        el("td", { class: "num", title: r.created ? `created ${clock(r.created)}` : "" }, r.created ? duration(t - r.created) : ""),
        el("td", { class: "reason" }, r.failure_reason),
      ),
    );
    body.replaceChildren(...rows);
    $("replicas-empty").hidden = rows.length > 0;
  }

  function drawTimeline() {
    const t = now();
    const rows = [...state.replicas.values()]
      .filter((r) => r.history.length)
      .sort((a, b) => a.service.localeCompare(b.service) || (a.created || 0) - (b.created || 0) || a.id - b.id)
      .slice(-MAX_TIMELINE_ROWS);
    let start = Math.min(t - WINDOW_MIN_MS, ...rows.map((r) => r.history[0].since));
    start = Math.max(start, t - WINDOW_MAX_MS);
    const span = Math.max(1, t - start);
    const pct = (ms) => `${(100 * (Math.min(Math.max(ms, start), t) - start)) / span}%`;
    const cells = [];
    for (const r of rows) {
      const end = r.removed === null ? t : r.removed;
      if (end < start) continue;
      const label = el(
        "div",
        { class: r.removed === null ? "tl-label" : "tl-label removed", title: `${r.service} replica ${r.id}, version ${r.version}` },
        `${r.service}/${r.id} v${r.version}`,
      );
      const bar = el("div", { class: "tl-bar", "data-key": r.key });
      r.history.forEach((h, i) => {
        const until = i + 1 < r.history.length ? r.history[i + 1].since : end;
        if (until < start) return;
        const from = Math.max(h.since, start);
        const tip = `${h.status} ${clock(h.since)}-${clock(until)} (${duration(until - h.since)})${h.inferred ? ", from the replica's timestamps" : ""}`;
        bar.append(
          el("div", {
            class: `tl-seg ${statusClass(h.status)}${h.inferred ? " inferred" : ""}`,
            "data-status": h.status,
            title: tip,
            style: { left: pct(from), width: `calc(${pct(until)} - ${pct(from)})` },
          }),
        );
      });
      cells.push(label, bar);
    }
    $("timeline").replaceChildren(...cells);
    const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => el("span", {}, clock(start + f * span)));
    $("timeline-axis").replaceChildren(...(cells.length ? ticks : []));
    $("timeline-range").textContent = cells.length ? `last ${duration(span)}` : "";
  }

  function drawEvents() {
    const items = state.events.slice(-200).reverse().map((e) =>
      el(
        "li",
        { class: e.level, "data-service": e.service, "data-status": e.status },
        el("time", {}, clock(e.t)),
        e.text,
      ),
    );
    $("events").replaceChildren(...items);
    $("events-empty").hidden = items.length > 0;
  }

  function drawLegend() {
    $("legend").replaceChildren(
      ...LEGEND.map((s) => badge(s)),
      el("span", { class: "badge st-READY inferred-sample", style: { opacity: "0.45" } }, "faded: from timestamps"),
    );
  }

  // ---- start ---------------------------------------------------------------------------------

  function start() {
    takeTokenFromFragment();
    drawLegend();
    $("token-button").addEventListener("click", () => {
      const panel = $("token-panel");
      panel.hidden = !panel.hidden;
      if (!panel.hidden) $("token-input").focus();
    });
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token-input").value.trim();
      $("token-input").value = "";
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      $("token-message").textContent = "";
      connect();
    });
    $("token-forget").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      $("token-input").value = "";
      connect();
    });
    // A token pasted into the address bar of an open page changes only the fragment: no reload.
    window.addEventListener("hashchange", () => {
      if (takeTokenFromFragment()) connect();
    });
    // Ages and the timeline move with the clock; this redraws locally, it asks the server nothing.
    setInterval(queueDraw, 1000);
    draw();
    connect();
  }

  start();
})();
