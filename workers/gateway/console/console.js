// Threadline's web console: pick an agent, chat with streaming text and a Stop button, follow the
// conversation tree (regenerate a turn, branch from any message), and see for each turn what the
// model saw: the token budget and the turns pruned or summarised; and a user's long-term memory, to
// correct or forget. Plain JS against the gateway's API; the API key stays in sessionStorage and goes
// only in the Authorization header (never in a URL).
"use strict";

const KEY_STORAGE = "threadline.key";
const TERMINAL = new Set(["succeeded", "paused", "failed", "cancelled", "timed_out"]);
const NEW_CONVERSATION = "";

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  // The open conversation as GET /v1/conversations/{id} returns it; null: a new one.
  conversation: null,
  // The message the next turn continues from when it is not the conversation's tip (a branch).
  selected: null,
  // The streaming turn: {turnId, messageId}.
  live: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    // styles through the CSSOM: the gateway's Content-Security-Policy refuses inline style attributes
    else if (name === "style") Object.assign(node.style, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  // Text goes in as text nodes: nothing from the server is ever parsed as HTML.
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function say(text, isError = false) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

// --- the API --------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function apiError(response) {
  let body = {};
  try { body = await response.json(); } catch { /* not JSON: the status says enough */ }
  return new ApiError(response.status, body.code || "http_" + response.status, body.message || response.statusText);
}

async function api(method, path, body) {
  const headers = { Authorization: "Bearer " + state.key };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

// Server-Sent Events from a fetch response (EventSource cannot send the Authorization header).
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    for (;;) {
      const end = buffer.search(/[\r\n]/);
      // a "\r" at the very end may be the first half of "\r\n": wait for the next chunk
      if (end < 0 || (buffer[end] === "\r" && end === buffer.length - 1)) break;
      const line = buffer.slice(0, end);
      buffer = buffer.slice(buffer.startsWith("\r\n", end) ? end + 2 : end + 1);
      if (line === "") {
        if (event.data.length) yield { id: event.id, type: event.event, data: event.data.join("\n") };
        event = { data: [] };
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const field = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (name === "data") event.data.push(field);
        else if (name === "id" || name === "event") event[name] = field;
      }
    }
  }
}

// Follow a turn's events to its terminal one; a dropped connection resumes after the last event
// seen (Last-Event-ID), so nothing is lost or shown twice.
async function followTurn(turnId, onEvent) {
  let lastId = null;
  let failures = 0;
  for (;;) {
    try {
      const headers = { Authorization: "Bearer " + state.key };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const response = await fetch(`/v1/turns/${encodeURIComponent(turnId)}/events`, { headers });
      if (!response.ok) throw await apiError(response);
      for await (const message of sseEvents(response)) {
        lastId = message.id || lastId;
        failures = 0;
        const event = JSON.parse(message.data);
        onEvent(event);
        if (TERMINAL.has(event.type)) return event;
      }
    } catch (e) {
      if (e instanceof ApiError || ++failures > 5) throw e;
    }
    await new Promise((resolve) => setTimeout(resolve, 300 * Math.max(failures, 1)));
  }
}

// --- connecting, agents, conversations ------------------------------------------------------------

async function connect() {
  try {
    const { agents } = await api("GET", "/v1/agents");
    sessionStorage.setItem(KEY_STORAGE, state.key);
    const select = $("agent");
    select.replaceChildren(...agents.map((a) => el("option", { value: a.agent_id }, `${a.agent_id} (v${a.active})`)));
    select.disabled = false;
    $("query").disabled = false;
    $("send").disabled = agents.length === 0;
    await loadConversations(null);
    for (const id of ["memory-load", "memory-add-button"]) $(id).disabled = false;
    await loadMemory();
    say(agents.length ? "connected" : "connected: no agents yet (threadline agents put FILE)");
  } catch (e) {
    say(e.status === 401 ? "that API key is not known" : e.message, true);
  }
}

async function loadConversations(openId) {
  const { conversations } = await api("GET", "/v1/conversations");
  const select = $("conversation");
  const label = (c) => `${c.agent_id} · ${new Date(c.created_at * 1000).toLocaleString()} · ${c.id.slice(0, 8)}`;
  select.replaceChildren(el("option", { value: NEW_CONVERSATION }, "New conversation"),
    ...conversations.map((c) => el("option", { value: c.id }, label(c))));
  select.disabled = false;
  select.value = openId || NEW_CONVERSATION;
}

async function openConversation(id, selected = null) {
  state.selected = selected;
  state.conversation = id ? await api("GET", `/v1/conversations/${encodeURIComponent(id)}`) : null;
  const agent = $("agent");
  if (state.conversation) agent.value = state.conversation.conversation.agent_id;
  agent.disabled = Boolean(state.conversation);  // a conversation keeps the agent it started with
  render();
}

// --- the tree and the path ------------------------------------------------------------------------

function messagesById() {
  return new Map((state.conversation ? state.conversation.messages : []).map((m) => [m.id, m]));
}

function tipId() {
  return state.conversation ? state.conversation.conversation.tip : null;
}

// The path shown: root → the selected message when one is, else the conversation's current path.
function shownPath() {
  if (!state.conversation) return [];
  if (!state.selected) return state.conversation.path;
  const byId = messagesById();
  const path = [];
  for (let m = byId.get(state.selected); m; m = byId.get(m.parent_id)) path.unshift(m.id);
  return path;
}

function render() {
  const path = shownPath();
  renderTree(new Set(path));
  renderChat(path);
  const branching = state.selected && state.selected !== tipId();
  $("branch-note").hidden = !branching;
  if (branching) $("branch-from").textContent = messagesById().get(state.selected).query;
}

function renderTree(onPath) {
  const children = new Map();
  for (const m of state.conversation ? state.conversation.messages : []) {
    const key = m.parent_id || "";
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(m);
  }
  const branch = (parent) => el("ul", {}, ...(children.get(parent) || [])
    .sort((a, b) => a.created_at - b.created_at)
    .map((m) => el("li", {},
      el("button", {
        type: "button", class: "node" + (onPath.has(m.id) ? " on-path" : "") + (m.id === tipId() ? " tip" : ""),
        "data-message-id": m.id, "data-status": m.status, title: m.query,
        onclick: () => select(m.id === tipId() ? null : m.id),
      }, el("span", { class: "badge " + m.status }, m.status), " ", snippet(m.query, 40)),
      branch(m.id))));
  $("tree").replaceChildren(state.conversation ? branch("") : el("p", { class: "hint" }, "No conversation yet."));
}

// Follow another branch; not while a turn streams into the shown one.
function select(messageId) {
  if (state.live) return;
  state.selected = messageId;
  render();
}

function snippet(text, length) {
  return text.length > length ? text.slice(0, length - 1) + "…" : text;
}

function renderChat(path) {
  const byId = messagesById();
  $("chat").replaceChildren(...path.map((id) => renderTurn(byId.get(id), byId)));
  $("chat").scrollTop = $("chat").scrollHeight;
}

function renderTurn(m, byId) {
  const usage = m.usage && m.usage.requests ? `${m.usage.input_tokens} in · ${m.usage.output_tokens} out` : "";
  const history = m.decisions && m.decisions.history;
  return el("article", { class: "turn", "data-message-id": m.id, "data-status": m.status },
    el("div", { class: "user" }, m.query),
    el("div", { class: "assistant" },
      el("span", { class: "answer" }, m.answer || (m.error_code ? `(${m.error_code})` : "")),
      el("div", { class: "meta" },
        el("span", { class: "badge " + m.status }, m.status), usage ? " " + usage + " tokens " : " ",
        el("button", { type: "button", class: "regenerate", onclick: () => regenerate(m) }, "Regenerate"),
        el("button", { type: "button", class: "branch", onclick: () => branchFrom(m) }, "Branch from here"))),
    history ? renderBudget(history, byId) : el("p", { class: "hint" }, "no budget record for this turn"));
}

// --- what the model saw ---------------------------------------------------------------------------

// The parts of the context window, in the order of the request: the bar's segments.
function budgetParts(record) {
  const b = record.budget;
  const w = record.window;
  const summary = record.summary ? record.summary.tokens : 0;
  return [
    ["instructions", "instructions + context", b.instructions],
    ["summary", "summary", summary],
    ["history", "history kept", w.kept_tokens],
    ["unused", "history unused", Math.max(0, b.history - w.kept_tokens - summary)],
    ["query", "query", b.query],
    ["tools", "tools", b.tools],
    ["output", "output reserve", b.max_output],
    ["margin", "margin", b.safety_margin],
  ];
}

function renderBudget(record, byId) {
  const parts = budgetParts(record);
  const total = Math.max(record.budget.context_window, parts.reduce((sum, p) => sum + p[2], 0));
  const shown = parts.filter((p) => p[2] > 0);
  const bar = el("div", { class: "bar", role: "img",
    "aria-label": shown.map(([, label, tokens]) => `${label} ${tokens}`).join(", ") },
    ...shown.map(([part, label, tokens]) => el("span", {
      class: "seg " + part, "data-part": part, "data-tokens": tokens, title: `${label}: ${tokens} tokens`,
      style: { flexBasis: `${(100 * tokens) / total}%` },
    })));
  const legend = el("ul", { class: "legend" }, ...shown.map(([part, label, tokens]) =>
    el("li", {}, el("i", { class: "seg " + part }), ` ${label} ${tokens}`)));
  const w = record.window;
  const counted = record.tokenizer_fallback ? `${record.tokenizer}, instead of ${record.tokenizer_fallback}`
    : record.tokenizer;
  const caption = `${record.budget.context_window}-token window (${counted}); history budget ` +
    `${record.budget.history}: kept ${turns(w.kept_turns)} (${w.kept_tokens} tokens), dropped ` +
    `${turns(w.dropped_turns)} (${w.dropped_tokens} tokens): ${w.reason.replaceAll("_", " ")}`;
  return el("details", { class: "budget", open: "" },
    el("summary", {}, "What the model saw"), bar, legend, el("p", { class: "caption" }, caption),
    renderPruned(record, byId));
}

function turns(n) {
  return n === 1 ? "1 turn" : `${n} turns`;
}

function renderPruned(record, byId) {
  const w = record.window;
  const describe = (id) => (byId.get(id) ? `“${snippet(byId.get(id).query, 60)}”` : id);
  const items = (w.dropped || []).map((id) => el("li", { class: "dropped", "data-message-id": id },
    describe(id), " — pruned"));
  if (w.dropped_turns > (w.dropped || []).length) {
    items.unshift(el("li", { class: "dropped" }, `and ${turns(w.dropped_turns - w.dropped.length)} before them`));
  }
  if (record.summary) {
    items.unshift(el("li", { class: "summarised", "data-message-id": record.summary.watermark },
      `summarised: the turns up to ${describe(record.summary.watermark)} (${record.summary.tokens} tokens)`));
  }
  return items.length ? el("ul", { class: "pruned" }, ...items) : el("p", { class: "hint" }, "nothing pruned");
}

// --- sending, streaming, stopping -----------------------------------------------------------------

function regenerate(m) {
  // The same query again from the same parent: a sibling of `m` (the first message: a new root).
  return submit(m.query, m.parent_id || "root");
}

function branchFrom(m) {
  select(m.id);
  $("query").focus();
}

async function submit(query, parentId) {
  if (state.live || !query.trim()) return;
  const conversationId = state.conversation ? state.conversation.conversation.id : null;
  const body = { agent_id: $("agent").value, query, app_id: "console", user_id: "console" };
  if (conversationId) body.conversation_id = conversationId;
  if (parentId) body.parent_message_id = parentId;
  let accepted;
  try {
    accepted = await api("POST", "/v1/turns", body);
  } catch (e) {
    say(e.message, true);
    return;
  }
  $("query").value = "";
  state.live = { turnId: accepted.turn_id, messageId: null };
  setRunning(true);
  const answer = el("span", { class: "answer" });
  const live = el("article", { class: "turn live", "data-status": "running" },
    el("div", { class: "user" }, query), el("div", { class: "assistant" }, answer,
      el("div", { class: "meta" }, el("span", { class: "badge running" }, "streaming"))));
  $("chat").append(live);
  let terminal = null;
  try {
    terminal = await followTurn(accepted.turn_id, (event) => {
      if (event.type === "accepted") state.live.messageId = event.message_id;
      else if (event.type === "text_delta") {
        answer.textContent += event.text;
        $("chat").scrollTop = $("chat").scrollHeight;
      }
    });
    say(terminal.type === "succeeded" ? "" : `${terminal.type}${terminal.message ? ": " + terminal.message : ""}`,
      terminal.type === "failed" || terminal.type === "timed_out");
  } catch (e) {
    say(e.message, true);
  }
  const messageId = state.live.messageId;
  state.live = null;
  setRunning(false);
  try {
    await loadConversations(accepted.conversation_id);
    // The new message is shown whether or not it became the conversation's tip.
    await openConversation(accepted.conversation_id, messageId);
    if (state.selected === tipId()) select(null);
  } catch (e) {
    say(e.message, true);
  }
  loadMemory();  // what the turn added shows once the memory stage has run (Show: look again)
}

async function stop() {
  if (!state.live) return;
  $("stop").disabled = true;
  try {
    await api("POST", `/v1/turns/${encodeURIComponent(state.live.turnId)}/cancel`, { reason: "stopped in the console" });
  } catch (e) {
    say(e.message, true);
  }
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
  $("conversation").disabled = running;
  for (const button of document.querySelectorAll(".regenerate, .branch")) button.disabled = running;
}

// --- long-term memory: one user's facts and notes, corrected or forgotten here -------------------

function memoryPath(recordId) {
  const base = `/v1/users/${encodeURIComponent($("memory-user-id").value.trim())}/memory`;
  const path = recordId ? `${base}/${encodeURIComponent(recordId)}` : base;
  // the partition: the user's own, or the console app's, or the selected agent's
  const scope = $("memory-scope").value;
  if (scope === "app") return `${path}?app_id=console`;
  if (scope === "agent") return `${path}?agent_id=${encodeURIComponent($("agent").value)}`;
  return path;
}

async function loadMemory() {
  if (!$("memory-user-id").value.trim()) return;
  try {
    const { records } = await api("GET", memoryPath());
    $("memory").replaceChildren(...records.map(renderMemory));
    if (!records.length) $("memory").append(el("li", { class: "hint" }, "Nothing remembered."));
  } catch (e) {
    say(e.message, true);
  }
}

function renderMemory(r) {
  const what = el("div", { class: "memory-what" },
    r.kind === "fact" ? el("span", { class: "memory-key" }, `${r.key}: `) : el("span", { class: "badge" }, "note"),
    " ", el("span", { class: "memory-value" }, r.value));
  const item = el("li", { class: "memory-record", "data-record-id": r.id, "data-kind": r.kind }, what,
    renderProvenance(r),
    el("div", { class: "memory-actions" },
      el("button", { type: "button", class: "memory-edit", onclick: () => editMemory(item, r) }, "Correct"),
      el("button", { type: "button", class: "memory-forget", onclick: () => forgetMemory(r) }, "Forget")));
  return item;
}

// Who said it and when; a link to the conversation (and message) it was taken from, when it was.
function renderProvenance(r) {
  const s = r.source;
  const who = s.origin === "extracted" ? `from a turn (${s.extractor || "extractor"})` : `set by the ${s.origin}`;
  const parts = [el("span", { class: "memory-origin" }, who), ` · ${new Date(r.valid_at * 1000).toLocaleString()}`];
  if (s.conversation_id) {
    parts.push(" · ", el("a", {
      href: "#", class: "memory-source", "data-conversation-id": s.conversation_id,
      "data-message-id": s.message_id, onclick: (e) => { e.preventDefault(); openSource(s); },
    }, s.message_id ? "the message" : "the conversation"));
  }
  return el("div", { class: "meta memory-provenance" }, ...parts);
}

async function openSource(source) {
  if (state.live) return;
  try {
    await loadConversations(source.conversation_id);
    await openConversation(source.conversation_id);
    const message = source.message_id;
    if (message && message !== tipId() && messagesById().has(message)) select(message);
  } catch (e) {
    say(e.message, true);
  }
}

function editMemory(item, r) {
  const input = el("input", { class: "memory-input", value: r.value, "aria-label": "Corrected value" });
  const form = el("form", {
    class: "memory-correct",
    onsubmit: (e) => { e.preventDefault(); changeMemory("PUT", r.id, { value: input.value }, "corrected"); },
  }, input, el("button", { type: "submit", class: "memory-save" }, "Save"),
  el("button", { type: "button", class: "memory-cancel", onclick: () => item.replaceWith(renderMemory(r)) }, "Cancel"));
  item.querySelector(".memory-what").replaceWith(form);
  item.querySelector(".memory-actions").hidden = true;
  input.focus();
}

function forgetMemory(r) {
  return changeMemory("DELETE", r.id, undefined, "forgotten");
}

function addMemory() {
  const key = $("memory-key").value.trim();
  const value = $("memory-value").value;
  return changeMemory("PUT", null, key ? { key, value } : { note: value }, "remembered").then((done) => {
    if (done) $("memory-key").value = $("memory-value").value = "";
  });
}

async function changeMemory(method, recordId, body, done) {
  try {
    await api(method, memoryPath(recordId), body);
  } catch (e) {
    say(e.message, true);
    return false;
  }
  say(done);
  await loadMemory();
  return true;
}

// --- wiring ---------------------------------------------------------------------------------------

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("key").value.trim();
  connect();
});
$("conversation").addEventListener("change", (e) => {
  openConversation(e.target.value || null).catch((err) => say(err.message, true));
});
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  submit($("query").value, state.selected);
});
$("query").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("branch-cancel").addEventListener("click", () => select(null));
$("memory-user").addEventListener("submit", (e) => {
  e.preventDefault();
  loadMemory();
});
$("memory-scope").addEventListener("change", loadMemory);
$("memory-add").addEventListener("submit", (e) => {
  e.preventDefault();
  addMemory();
});

if (state.key) {
  $("key").value = state.key;
  connect();
}
