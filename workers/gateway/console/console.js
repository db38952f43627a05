// Threadline's web console: a chat with an agent — answers streamed and rendered as safe markdown,
// Stop, regenerate (with a `2 / 3` switcher between the siblings), branch from any message, a URL per
// conversation, delete — and beside each answer everything the turn did: its stages (queue wait and
// run time), tool calls and results, retries, a form that answers a paused `ask_human` turn, and what
// the model saw (the token budget, the turns pruned or summarised); and a user's long-term memory, to
// correct or forget. Plain JS against the gateway's API; the API key stays in sessionStorage and goes
// only in the Authorization header (never in a URL).
"use strict";

const KEY_STORAGE = "threadline.key";
const TERMINAL = new Set(["succeeded", "paused", "failed", "cancelled", "timed_out"]);
const NEW_CONVERSATION = "";
const NARROW = window.matchMedia("(max-width: 760px)");

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  connected: false,
  // The open conversation as GET /v1/conversations/{id} returns it; null: a new one.
  conversation: null,
  // The message the next turn continues from when it is not the conversation's tip (a branch).
  selected: null,
  // The streaming turn: {turnId, messageId}.
  live: null,
  // A turn's events with their stream entry ids, by turn id: what the live stream brought, or the
  // backlog read when the turn's details were first shown.
  activity: new Map(),
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

function clock(seconds) {
  const at = new Date(seconds * 1000);
  const today = at.toDateString() === new Date().toDateString();
  return today ? at.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : at.toLocaleString();
}

// --- markdown: a whitelist built as DOM nodes -----------------------------------------------------
// Model text never reaches innerHTML: every piece becomes a text node inside an element this code
// chose (p, strong, em, code, pre, ul/ol/li, table, h3-h5, blockquote, a), so any HTML in it stays
// text. Links open only http(s) URLs, in a new tab, with rel="noopener noreferrer".

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const INLINE = [
  ["code", /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/],
  ["link", /\[([^\]\n]+)\]\(([^()\s]+)\)/],
  ["strong", /\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__/],
  ["em", /\*(?=[^\s*])([^*]*?[^\s*])\*|(?<![\w])_(?=[^\s_])([^_]*?[^\s_])_(?![\w])/],
];

function renderMarkdown(text) {
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) { i++; continue; }
    const fence = line.match(FENCE);
    const heading = line.match(HEADING);
    if (fence) i = codeBlock(lines, i, fence, blocks);
    else if (heading) { blocks.push(el(`h${Math.min(5, heading[1].length + 2)}`, {}, ...inline(heading[2]))); i++; }
    else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) i = table(lines, i, blocks);
    else if (LIST_ITEM.test(line)) i = list(lines, i, blocks);
    else if (/^\s*>/.test(line)) i = quote(lines, i, blocks);
    else i = paragraph(lines, i, blocks);
  }
  return blocks;
}

function codeBlock(lines, start, fence, blocks) {
  let end = start + 1;
  while (end < lines.length && !(lines[end].trim().startsWith(fence[1][0].repeat(fence[1].length))
    && !lines[end].trim().replace(/[`~]/g, ""))) end++;
  const source = lines.slice(start + 1, end).join("\n");
  const copy = el("button", { type: "button", class: "copy", title: "Copy the code" }, "Copy");
  copy.addEventListener("click", () => copyText(source, copy));
  blocks.push(el("div", { class: "codeblock" }, copy, fence[2] ? el("span", { class: "lang" }, fence[2]) : "",
    el("pre", {}, el("code", fence[2] ? { "data-lang": fence[2] } : {}, source))));
  return end + 1;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
}

function cells(line) {
  const trimmed = line.trim().replace(/^\|/, "").replace(/\|$/, "");
  return trimmed.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, start, blocks) {
  const head = cells(lines[start]);
  let end = start + 2;
  const rows = [];
  while (end < lines.length && lines[end].includes("|") && lines[end].trim()) rows.push(cells(lines[end++]));
  const row = (values, tag) => el("tr", {}, ...head.map((_, k) => el(tag, {}, ...inline(values[k] || ""))));
  blocks.push(el("div", { class: "table-wrap" }, el("table", {},
    el("thead", {}, row(head, "th")), el("tbody", {}, ...rows.map((r) => row(r, "td"))))));
  return end;
}

function list(lines, start, blocks) {
  const ordered = /\d/.test(lines[start].match(LIST_ITEM)[1]);
  const items = [];
  let end = start;
  for (; end < lines.length && lines[end].trim(); end++) {
    const item = lines[end].match(LIST_ITEM);
    if (item && /\d/.test(item[1]) === ordered) items.push([item[2]]);
    else if (item || !items.length) break;
    else items[items.length - 1].push(lines[end].trim());  // a continuation line of the item
  }
  blocks.push(el(ordered ? "ol" : "ul", {}, ...items.map((parts) => el("li", {}, ...inline(parts.join(" "))))));
  return end;
}

function quote(lines, start, blocks) {
  let end = start;
  while (end < lines.length && /^\s*>/.test(lines[end])) end++;
  const inner = lines.slice(start, end).map((l) => l.replace(/^\s*>\s?/, "")).join("\n");
  blocks.push(el("blockquote", {}, ...renderMarkdown(inner)));
  return end;
}

function paragraph(lines, start, blocks) {
  let end = start;
  while (end < lines.length && lines[end].trim() && !FENCE.test(lines[end]) && !HEADING.test(lines[end])
    && !(end > start && LIST_ITEM.test(lines[end]))) end++;
  blocks.push(el("p", {}, ...inline(lines.slice(start, end).join("\n"))));
  return end;
}

// Inline markdown as nodes: the earliest match of code, link, bold or italic, text around it.
function inline(text) {
  const nodes = [];
  let rest = text;
  while (rest) {
    let best = null;
    for (const [kind, pattern] of INLINE) {
      const m = rest.match(pattern);
      if (m && (best === null || m.index < best.m.index)) best = { kind, m };
    }
    if (!best) { nodes.push(document.createTextNode(rest)); break; }
    const { kind, m } = best;
    if (m.index) nodes.push(document.createTextNode(rest.slice(0, m.index)));
    nodes.push(inlineNode(kind, m));
    rest = rest.slice(m.index + m[0].length);
  }
  return nodes;
}

function inlineNode(kind, m) {
  if (kind === "code") return el("code", {}, m[2].replace(/^ (.*) $/, "$1"));
  if (kind === "link") {
    const url = safeUrl(m[2]);
    return url ? el("a", { href: url, target: "_blank", rel: "noopener noreferrer" }, ...inline(m[1]))
      : document.createTextNode(m[0]);
  }
  return el(kind, {}, ...inline(m[1] ?? m[2]));
}

function safeUrl(href) {
  try {
    const url = new URL(href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;  // relative or malformed: not a link
  }
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
// seen (Last-Event-ID), so nothing is lost or shown twice. `onEvent(event, entryId)`: the entry id
// (`<ms>-<n>`) carries the server's clock, from which the stage timeline is drawn.
async function followTurn(turnId, onEvent, signal) {
  let lastId = null;
  let failures = 0;
  for (;;) {
    try {
      const headers = { Authorization: "Bearer " + state.key };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const response = await fetch(`/v1/turns/${encodeURIComponent(turnId)}/events`, { headers, signal });
      if (!response.ok) throw await apiError(response);
      for await (const message of sseEvents(response)) {
        lastId = message.id || lastId;
        failures = 0;
        const event = JSON.parse(message.data);
        onEvent(event, message.id);
        if (TERMINAL.has(event.type)) return event;
      }
    } catch (e) {
      if (e instanceof ApiError || (signal && signal.aborted) || ++failures > 5) throw e;
    }
    await new Promise((resolve) => setTimeout(resolve, 300 * Math.max(failures, 1)));
  }
}

// --- connecting, agents, conversations, the URL ---------------------------------------------------

async function connect() {
  try {
    const { agents } = await api("GET", "/v1/agents");
    sessionStorage.setItem(KEY_STORAGE, state.key);
    state.connected = true;
    const select = $("agent");
    select.replaceChildren(...agents.map((a) => el("option", { value: a.agent_id }, `${a.agent_id} (v${a.active})`)));
    select.disabled = false;
    $("query").disabled = false;
    $("send").disabled = agents.length === 0;
    say(agents.length ? "connected" : "connected: no agents yet (threadline agents put FILE)");
    await openFromUrl();
    for (const id of ["memory-load", "memory-add-button"]) $(id).disabled = false;
    await loadMemory();
  } catch (e) {
    say(e.status === 401 ? "that API key is not known" : e.message, true);
  }
}

// The URL names the open conversation (and a message off its current path): `#c=ID[&m=ID]`, so a
// reload or a shared link opens it. The key is never in it.
function urlTarget() {
  const params = new URLSearchParams(location.hash.slice(1));
  return { conversation: params.get("c"), message: params.get("m") };
}

function writeUrl() {
  const params = new URLSearchParams();
  if (state.conversation) params.set("c", state.conversation.conversation.id);
  if (state.conversation && state.selected) params.set("m", state.selected);
  const hash = params.toString() ? "#" + params.toString() : "";
  if (hash !== location.hash) history.replaceState(null, "", location.pathname + location.search + hash);
}

async function openFromUrl() {
  const target = urlTarget();
  try {
    await loadConversations(target.conversation);
    await openConversation(target.conversation, target.message);
  } catch (e) {
    if (e.status !== 404) throw e;
    say(`conversation ${target.conversation} is not there (deleted, or another tenant's)`, true);
    await loadConversations(null);
    await openConversation(null);
  }
}

async function loadConversations(openId) {
  const { conversations } = await api("GET", "/v1/conversations");
  const select = $("conversation");
  const label = (c) => `${c.agent_id} · ${new Date(c.created_at * 1000).toLocaleString()} · ${c.id.slice(0, 8)}`;
  select.replaceChildren(el("option", { value: NEW_CONVERSATION }, "New conversation"),
    ...conversations.map((c) => el("option", { value: c.id }, label(c))));
  if (openId && !conversations.some((c) => c.id === openId)) select.append(el("option", { value: openId }, openId));
  select.disabled = false;
  select.value = openId || NEW_CONVERSATION;
}

async function openConversation(id, selected = null) {
  const conversation = id ? await api("GET", `/v1/conversations/${encodeURIComponent(id)}`) : null;
  state.conversation = conversation;
  state.selected = conversation && selected && selected !== conversation.conversation.tip
    && conversation.messages.some((m) => m.id === selected) ? selected : null;
  const agent = $("agent");
  if (state.conversation) agent.value = state.conversation.conversation.agent_id;
  agent.disabled = Boolean(state.conversation);  // a conversation keeps the agent it started with
  $("delete").disabled = !state.conversation;
  render();
}

async function deleteConversation() {
  if (!state.conversation || state.live) return;
  const id = state.conversation.conversation.id;
  if (!window.confirm("Delete this conversation, every branch of it and its turns' records?")) return;
  try {
    const deleted = await api("DELETE", `/v1/conversations/${encodeURIComponent(id)}`);
    await loadConversations(null);
    await openConversation(null);
    say(`deleted the conversation (${deleted.messages} messages)`);
  } catch (e) {
    say(e.code === "busy" ? "a turn of this conversation runs or waits: stop it first" : e.message, true);
  }
}

// --- the tree and the path ------------------------------------------------------------------------

function messagesById() {
  return new Map((state.conversation ? state.conversation.messages : []).map((m) => [m.id, m]));
}

function tipId() {
  return state.conversation ? state.conversation.conversation.tip : null;
}

// The messages with the same parent (roots: no parent), oldest first: a message and its regenerations.
function siblingsOf(m) {
  return state.conversation.messages.filter((o) => (o.parent_id || null) === (m.parent_id || null))
    .sort((a, b) => a.created_at - b.created_at);
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
  if (branching) $("branch-from").textContent = snippet(messagesById().get(state.selected).query, 80);
  writeUrl();
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
    .map((m, index, all) => el("li", {},
      el("button", {
        type: "button", class: "node" + (onPath.has(m.id) ? " on-path" : "") + (m.id === tipId() ? " tip" : ""),
        "data-message-id": m.id, "data-status": m.status, title: m.query,
        onclick: () => select(m.id === tipId() ? null : m.id),
      }, el("span", { class: "badge " + m.status }, m.status), " ", snippet(m.query || "(an answer)", 90), " ",
      all.length > 1 ? el("span", { class: "nth" }, `#${index + 1} `) : "",
      el("span", { class: "when" }, clock(m.created_at))),
      branch(m.id))));
  $("tree").replaceChildren(state.conversation ? branch("") : el("p", { class: "hint" }, "No conversation yet."));
}

// Follow another branch; not while a turn streams into the shown one.
function select(messageId) {
  if (state.live) return;
  state.selected = messageId === tipId() ? null : messageId;
  render();
}

// Show a sibling with the branch under it, down to its latest message.
function showSibling(m) {
  const children = (id) => state.conversation.messages.filter((o) => o.parent_id === id)
    .sort((a, b) => b.created_at - a.created_at);
  let leaf = m;
  for (let next = children(leaf.id); next.length; next = children(leaf.id)) leaf = next[0];
  select(leaf.id);
}

function snippet(text, length) {
  return text.length > length ? text.slice(0, length - 1) + "…" : text;
}

function renderChat(path) {
  const byId = messagesById();
  $("chat").replaceChildren(...(path.length ? path.map((id) => renderTurn(byId.get(id), byId)) : [welcome()]));
  $("chat").scrollTop = $("chat").scrollHeight;
}

// The blank page says what to do.
function welcome() {
  const steps = state.connected
    ? [el("li", {}, "Pick an agent above (or open a conversation)."),
      el("li", {}, "Type a message below: Enter sends it, Shift+Enter starts a new line."),
      el("li", {}, "Stop cancels a turn; Regenerate asks again; Branch from here continues from any message.")]
    : [el("li", {}, "Paste an API key above and press Connect (threadline keys create TENANT)."),
      el("li", {}, "Pick an agent, then type a message below.")];
  return el("div", { class: "welcome" }, el("h2", {}, "Chat with a Threadline agent"), el("ol", {}, ...steps),
    el("p", { class: "hint" }, "Beside each answer: the stages the turn went through, its tool calls, its " +
      "retries, and what the model saw. The tree shows every branch."));
}

function renderTurn(m, byId) {
  const usage = m.usage && m.usage.requests ? usageText(m.usage) : "";
  const history = m.decisions && m.decisions.history;
  const siblings = siblingsOf(m);
  const answer = el("div", { class: "answer md" }, ...renderMarkdown(m.answer || ""));
  const bubble = el("div", { class: "bubble agent assistant" },
    el("div", { class: "who" }, el("b", {}, state.conversation.conversation.agent_id),
      el("time", {}, clock(m.updated_at || m.created_at)), el("span", { class: "badge " + m.status }, m.status)),
    answer, errorLine(m));
  const meta = el("div", { class: "meta" }, usage,
    siblings.length > 1 ? siblingSwitcher(m, siblings) : "",
    el("button", { type: "button", class: "regenerate", onclick: () => regenerate(m) }, "Regenerate"),
    el("button", { type: "button", class: "branch", onclick: () => branchFrom(m) }, "Branch from here"));
  bubble.append(meta);
  const article = el("article", { class: "turn", "data-message-id": m.id, "data-status": m.status },
    userBubble(m.query, m.created_at), bubble, askForm(m), renderActivity(m),
    history ? renderBudget(history, byId, m.usage) : el("p", { class: "hint" }, "no budget record for this turn"));
  if (m.status === "failed" || m.status === "timed_out" || m.status === "cancelled") fillError(m, article);
  return article;
}

function userBubble(query, at) {
  return el("div", { class: "bubble you" }, el("div", { class: "who" }, el("b", {}, "You"), el("time", {}, clock(at))),
    query ? el("div", { class: "user" }, query) : el("div", { class: "user empty" }, "(answered the question above)"));
}

// A failed, timed-out or stopped turn says why inside its bubble: its code, and the message from
// its terminal event (the stored message keeps only the code).
function errorLine(m) {
  if (!m.error_code && m.status !== "cancelled") return "";
  const notice = m.status === "cancelled" ? " notice" : "";
  return el("div", { class: "error-text" + notice, "data-code": m.error_code || m.status }, `${m.error_code || m.status}`);
}

async function fillError(m, article) {
  const terminal = await turnTerminal(m.turn_id);
  const line = article.querySelector(".error-text");
  if (terminal && terminal.message && line) line.textContent = `${terminal.code}: ${terminal.message}`;
}

function siblingSwitcher(m, siblings) {
  const at = siblings.findIndex((s) => s.id === m.id);
  const go = (k) => () => showSibling(siblings[k]);
  return el("span", { class: "siblings", "aria-label": "regenerations" },
    el("button", { type: "button", class: "prev", title: "the previous answer", onclick: go(at - 1),
      ...(at === 0 ? { disabled: "" } : {}) }, "‹"),
    el("span", { class: "position" }, `${at + 1} / ${siblings.length}`),
    el("button", { type: "button", class: "next", title: "the next answer", onclick: go(at + 1),
      ...(at === siblings.length - 1 ? { disabled: "" } : {}) }, "›"));
}

// A turn paused on `ask_human` (the conversation's tip, waiting): a field per question; the answers
// resume the turn (`deferred_tool_results`), which continues the same message's branch.
function askForm(m) {
  const pending = state.conversation.conversation.pending_tool_calls || [];
  if (m.status !== "paused" || m.id !== tipId() || !pending.length) return "";
  const inputs = pending.map((call) => el("input", { class: "ask-answer", "data-tool-call-id": call.tool_call_id,
    "aria-label": "Your answer", autocomplete: "off", required: "" }));
  const form = el("form", { class: "ask" },
    el("div", { class: "who" }, el("b", {}, "The agent asks you")),
    ...pending.map((call, k) => el("div", {},
      el("label", {}, questionOf(call)), el("div", { class: "ask-row" }, inputs[k]))),
    el("div", { class: "meta" }, el("button", { type: "submit", class: "ask-send" }, "Answer")));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    resume(Object.fromEntries(inputs.map((input) => [input.dataset.toolCallId, input.value])));
  });
  return form;
}

function questionOf(call) {
  const args = typeof call.args === "string" ? safeJson(call.args) : call.args;
  return args && typeof args === "object" && args.question ? String(args.question) : `${call.name}(${display(call.args)})`;
}

function safeJson(text) {
  try { return JSON.parse(text); } catch { return text; }
}

function display(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 1) ?? "";
}

// --- what the turn did: stages, tools, retries ----------------------------------------------------

// A turn's events (cached): the live stream's, or its backlog read once, bounded in time (an ended
// turn's stream is replayed to its terminal event; one whose events expired answers nothing).
async function turnEvents(turnId) {
  if (state.activity.has(turnId)) return state.activity.get(turnId);
  const seen = [];
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), 5000);
  try {
    await followTurn(turnId, (event, id) => seen.push({ event, id }), abort.signal);
    state.activity.set(turnId, seen);
  } catch {
    return seen;  // not cached: a later look tries again
  } finally {
    clearTimeout(timer);
  }
  return seen;
}

async function turnTerminal(turnId) {
  const seen = await turnEvents(turnId);
  const last = seen.length ? seen[seen.length - 1].event : null;
  return last && TERMINAL.has(last.type) ? last : null;
}

function renderActivity(m) {
  const body = el("div", { class: "activity-body" }, el("p", { class: "hint" }, "loading…"));
  const details = el("details", { class: "activity", "data-turn-id": m.turn_id },
    el("summary", {}, "What the turn did"), body);
  const fill = async () => body.replaceChildren(...activityParts(await turnEvents(m.turn_id), m));
  details.addEventListener("toggle", () => { if (details.open) fill(); });
  if (state.activity.has(m.turn_id)) { details.open = true; fill(); }
  return details;
}

function activityParts(seen, m) {
  const parts = [renderTimeline(seen)];
  const retries = seen.filter(({ event }) => event.type === "retrying");
  if (retries.length) {
    parts.push(el("ul", { class: "retries" }, ...retries.map(({ event }) =>
      el("li", { class: "retry" }, `retried (attempt ${event.attempt}): ${event.reason}`))));
  }
  const tools = m.tools && m.tools.length ? m.tools : toolsFromEvents(seen);
  if (tools.length) parts.push(renderTools(tools));
  parts.push(...renderDecisions(m.decisions || {}));
  return parts;
}

// The stages' decision records but the history stage's (drawn as the budget bar below), as they
// are stored: what each stage chose and why.
function renderDecisions(decisions) {
  return Object.entries(decisions).filter(([stage, record]) => stage !== "history" && record)
    .map(([stage, record]) => el("details", { class: "decision", "data-stage": stage },
      el("summary", {}, `the ${stage} stage's decision record`), el("pre", {}, display(record))));
}

// One entry per stage: its queue wait (from the previous stage's end, or the turn's acceptance, to
// its start) and its run time, both from the server's clock (the stream entry ids); the last attempt's.
function stageTimes(seen) {
  const at = (id) => Number(String(id || "").split("-")[0]) || null;
  const stages = new Map();
  let mark = null;
  for (const { event, id } of seen) {
    if (event.type === "accepted") mark = at(id);
    if (event.type !== "stage") continue;
    if (event.status === "started") {
      stages.set(event.stage, { stage: event.stage, attempt: event.attempt, startedAt: at(id),
        wait: mark !== null && at(id) !== null ? Math.max(0, at(id) - mark) : null, run: null });
    } else {
      const s = stages.get(event.stage) || { stage: event.stage, attempt: event.attempt, wait: null, startedAt: null };
      const run = event.ms ?? (s.startedAt !== null && at(id) !== null ? at(id) - s.startedAt : null);
      stages.set(event.stage, { ...s, run });
      mark = at(id);
    }
  }
  return [...stages.values()];
}

function renderTimeline(seen) {
  const stages = stageTimes(seen);
  if (!stages.length) return el("p", { class: "hint" }, "no stage events (they expire with the turn's record)");
  const total = Math.max(1, ...stages.map((s) => (s.wait || 0) + (s.run || 0)));
  const ms = (v) => (v === null || v === undefined ? "?" : `${Math.round(v)} ms`);
  return el("ol", { class: "timeline" }, ...stages.map((s) => el("li", {
    class: "stage", "data-stage": s.stage, "data-wait-ms": s.wait ?? "", "data-run-ms": s.run ?? "" },
  el("span", { class: "stage-name" }, s.stage),
  el("span", { class: "track", role: "img", "aria-label": `waited ${ms(s.wait)}, ran ${ms(s.run)}` },
    el("span", { class: "wait", style: { flexBasis: `${(100 * (s.wait || 0)) / total}%` } }),
    el("span", { class: "run", style: { flexBasis: `${Math.max(1, (100 * (s.run || 0)) / total)}%` } })),
  el("span", { class: "figures" }, `queued ${ms(s.wait)} · ran ${ms(s.run)}` +
    (s.attempt > 1 ? ` · attempt ${s.attempt}` : "")))));
}

function toolsFromEvents(seen) {
  const calls = new Map();
  for (const { event } of seen) {
    if (event.type === "tool_call") calls.set(event.tool_call_id, { ...event });
    if (event.type === "tool_result") calls.set(event.tool_call_id, { ...(calls.get(event.tool_call_id) || {}), ...event });
  }
  return [...calls.values()];
}

function renderTools(tools) {
  return el("ul", { class: "tool-calls" }, ...tools.map((t) => el("li", { class: "tool", "data-tool": t.name },
    el("b", {}, t.name), ` (${t.outcome || "no result yet"})`,
    el("div", { class: "hint" }, "arguments"), el("pre", { class: "tool-args" }, display(t.args ?? {})),
    ...(t.content !== undefined && t.content !== null
      ? [el("div", { class: "hint" }, "result"), el("pre", { class: "tool-result" }, display(t.content))] : []))));
}

// A turn's usage: tokens, the cached share of its input, its cost ("unknown" when not priced, never 0).
function usageText(u) {
  const cached = u.cache_read_tokens ? ` (${cachedShare(u)} cached)` : "";
  const cost = u.cost_usd === null || u.cost_usd === undefined ? "cost unknown" : `$${u.cost_usd.toFixed(6)}`;
  const counted = u.counted_by ? `, counted locally (${u.counted_by})` : "";
  return `${u.input_tokens} tokens in${cached} · ${u.output_tokens} out${counted} · ${cost}`;
}

function cachedShare(u) {
  return u.input_tokens ? `${Math.round((100 * (u.cache_read_tokens || 0)) / u.input_tokens)}%` : "0%";
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

function renderBudget(record, byId, usage) {
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
  const cache = usage && usage.requests ? el("p", { class: "cache", "data-cached-share": cachedShare(usage) },
    `served from the provider's cache: ${cachedShare(usage)} of ${usage.input_tokens} input tokens ` +
    `(${usage.cache_read_tokens || 0} read, ${usage.cache_write_tokens || 0} written)`) : "";
  return el("details", { class: "budget", open: "" },
    el("summary", {}, "What the model saw"), bar, legend, el("p", { class: "caption" }, caption), cache,
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

// --- sending, streaming, stopping, answering ------------------------------------------------------

function regenerate(m) {
  // The same query again from the same parent: a sibling of `m` (the first message: a new root).
  return submit(m.query, m.parent_id || "root");
}

function branchFrom(m) {
  select(m.id);
  $("query").focus();
}

function submit(query, parentId) {
  if (state.live || !query.trim()) return undefined;
  const body = { agent_id: $("agent").value, query, app_id: "console", user_id: "console" };
  if (state.conversation) body.conversation_id = state.conversation.conversation.id;
  if (parentId) body.parent_message_id = parentId;
  return runTurn(body, query);
}

// Answer the paused tip's pending tool calls (tool call id → answer): a turn that resumes it.
function resume(answers) {
  if (state.live || !state.conversation) return undefined;
  const c = state.conversation.conversation;
  return runTurn({ agent_id: c.agent_id, app_id: c.app_id, user_id: c.user_id, conversation_id: c.id, query: "",
    deferred_tool_results: { calls: answers } }, "");
}

async function runTurn(body, query) {
  let accepted;
  try {
    accepted = await api("POST", "/v1/turns", body);
  } catch (e) {
    say(`${e.code}: ${e.message}`, true);
    return;
  }
  if (query) $("query").value = "";
  state.live = { turnId: accepted.turn_id, messageId: null };
  setRunning(true);
  if ($("chat").querySelector(".welcome")) $("chat").replaceChildren();
  const answer = el("div", { class: "answer md" });
  const status = el("span", { class: "badge running" }, "streaming");
  const activity = el("ol", { class: "live-stages" });
  const live = el("article", { class: "turn live", "data-status": "running" }, userBubble(query, Date.now() / 1000),
    el("div", { class: "bubble agent assistant" }, el("div", { class: "who" }, el("b", {}, body.agent_id), status),
      answer),
    el("details", { class: "activity", open: "" }, el("summary", {}, "What the turn is doing"), activity));
  $("chat").append(live);
  $("chat").scrollTop = $("chat").scrollHeight;
  const seen = [];
  let text = "";
  let drawing = null;  // the answer is drawn again at most every 50 ms, not on every delta
  const draw = () => {
    drawing = null;
    answer.replaceChildren(...renderMarkdown(text));
    $("chat").scrollTop = $("chat").scrollHeight;
  };
  let terminal = null;
  try {
    terminal = await followTurn(accepted.turn_id, (event, id) => {
      seen.push({ event, id });
      if (event.type === "accepted") state.live.messageId = event.message_id;
      else if (event.type === "text_delta") {
        text += event.text;
        drawing = drawing || setTimeout(draw, 50);
      } else if (event.type === "stage" && event.status === "started") {
        status.textContent = event.stage;
        activity.append(el("li", { class: "hint" }, `${event.stage}…`));
      } else if (event.type === "retrying") activity.append(el("li", { class: "retry" }, `retrying: ${event.reason}`));
    });
    state.activity.set(accepted.turn_id, seen);
    if (drawing) clearTimeout(drawing);
    const failedBadly = terminal.type === "failed" || terminal.type === "timed_out";
    say(terminal.type === "succeeded" ? "" : `${terminal.type}${terminal.message ? ": " + terminal.message : ""}`,
      failedBadly);
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
  $("delete").disabled = running || !state.conversation;
  for (const button of document.querySelectorAll(".regenerate, .branch, .siblings button, .ask-send")) {
    button.disabled = running;
  }
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
$("delete").addEventListener("click", deleteConversation);
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
// a link to another conversation pasted into this tab's address bar
window.addEventListener("hashchange", () => {
  const target = urlTarget();
  const open = state.conversation ? state.conversation.conversation.id : null;
  if (state.connected && !state.live && (target.conversation !== open || target.message !== state.selected)) {
    openFromUrl().catch((err) => say(err.message, true));
  }
});
// a phone: the side panels start folded, the chat gets the screen
if (NARROW.matches) for (const id of ["tree-pane", "memory-pane"]) $(id).open = false;

renderChat([]);
if (state.key) {
  $("key").value = state.key;
  connect();
}
