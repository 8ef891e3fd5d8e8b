// The harmony-gateway playground: one page, no dependencies. It talks to the gateway that served it,
// through the same public routes as any client (/v1/models, /v1/chat/completions, /v1/responses,
// /v1/harmony/render). The API key lives in this tab's sessionStorage only.
"use strict";

const KEY_STORAGE = "harmony-gateway.api-key";
const FIRST_SPECIAL_ID = 199998;
const EXAMPLE_TOOLS = [
  {
    type: "function",
    name: "get_weather",
    description: "Current weather for a city.",
    parameters: {
      type: "object",
      properties: { city: { type: "string", description: "City name" } },
      required: ["city"],
    },
  },
];

const $ = (id) => document.getElementById(id);
const el = {
  model: $("model"), api: $("api"), effort: $("effort"), maxTokens: $("max-tokens"),
  key: $("api-key"), keyLabel: $("key-label"), error: $("error"), transcript: $("transcript"),
  reasoning: $("reasoning").querySelector("[data-body]"), tools: $("tool-calls").querySelector("[data-body]"),
  answer: $("answer").querySelector("[data-body]"), stats: $("stats"), status: $("status"),
  composer: $("composer"), message: $("message"), send: $("send"), stop: $("stop"),
  showPrompt: $("show-prompt"), newChat: $("new-chat"), toolsEditor: $("tools"),
  exampleTools: $("example-tools"), toolResults: $("tool-results"), toolResultFields: $("tool-result-fields"),
  previousId: $("previous-id"), openStored: $("open-stored"), storedId: $("stored-id"),
  promptDialog: $("prompt-dialog"), promptText: $("prompt-text"), promptIds: $("prompt-ids"),
  promptMeta: $("prompt-meta"), promptSummary: $("prompt-summary"), closePrompt: $("close-prompt"),
};

const state = {
  messages: [],            // Chat Completions history
  previousResponseId: null, // Responses chaining
  lastRequest: null,        // {api, request} of the latest engine request, for "Show prompt"
  turns: 0,                 // model turns so far; each transcript entry can show its own prompt
  pendingCalls: [],         // function calls waiting for a result: {id, name, arguments}
  controller: null,
  busy: false,
  modelsError: null,        // why the model list could not be loaded (a GatewayError), if it could not
};

// -- HTTP -----------------------------------------------------------------------------------------
function headers() {
  const h = { "content-type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h.authorization = "Bearer " + key;
  return h;
}

class GatewayError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error) message = body.error.message || message;
  } catch (_) { /* not JSON: keep the status text */ }
  const hints = {
    401: " Enter a valid API key above.",
    429: " The gateway is rate limiting: wait a moment and try again.",
    503: " No engine is available for this model right now.",
  };
  return new GatewayError(response.status, `${response.status}: ${message}${hints[response.status] || ""}`);
}

async function getJSON(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

async function postJSON(path, body, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw await errorOf(response);
  return response;
}

// Server-sent events from a fetch body: yields {event, data} with data parsed as JSON ([DONE] ends).
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      let event = "message";
      const data = [];
      for (const line of frame.split(/\r?\n/)) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (!data.length) continue;
      const text = data.join("\n");
      if (text === "[DONE]") return;
      yield { event, data: JSON.parse(text) };
    }
  }
}

// -- page state -------------------------------------------------------------------------------------
function showError(message) {
  el.error.textContent = message;
  el.error.hidden = false;
}

function clearError() {
  el.error.hidden = true;
  el.error.textContent = "";
}

function setStatus(text) {
  el.status.textContent = text;
}

function setBusy(busy) {
  state.busy = busy;
  el.send.disabled = busy;
  el.stop.disabled = !busy;
  el.message.setAttribute("aria-busy", String(busy));
  document.body.dataset.streaming = busy ? "true" : "false";
}

function resetPanes() {
  el.reasoning.textContent = "";
  el.tools.textContent = "";
  el.answer.textContent = "";
  el.stats.textContent = "";
  for (const pane of [el.reasoning, el.tools, el.answer]) pane.closest(".pane").classList.remove("filled");
}

function append(pane, text) {
  if (!text) return;
  pane.append(document.createTextNode(text));
  pane.closest(".pane").classList.add("filled");
  pane.scrollTop = pane.scrollHeight;
}

function addTranscript(role, text, prompt) {
  const item = document.createElement("li");
  item.className = "turn " + role;
  const who = document.createElement("strong");
  who.textContent = role === "user" ? "You" : role === "assistant" ? "Assistant" : "Tool";
  const body = document.createElement("p");
  body.textContent = text;
  item.append(who, body);
  if (prompt) {
    // Every turn keeps the request it was sent, so its exact prompt can be shown later.
    state.turns += 1;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "turn-prompt";
    button.textContent = "Prompt";
    button.setAttribute("aria-label", `Show prompt of turn ${state.turns}`);
    button.addEventListener("click", () => showPrompt(prompt));
    item.append(button);
  }
  el.transcript.append(item);
  item.scrollIntoView({ block: "nearest" });
}

function toolCard(title) {
  const card = document.createElement("article");
  card.className = "tool-card";
  const heading = document.createElement("h3");
  heading.textContent = title;
  const args = document.createElement("pre");
  args.className = "arguments";
  const output = document.createElement("pre");
  output.className = "output";
  output.hidden = true;
  card.append(heading, args, output);
  el.tools.append(card);
  el.tools.closest(".pane").classList.add("filled");
  return { card, heading, args, output };
}

function setOutput(card, text, failed) {
  card.output.hidden = false;
  card.output.textContent = (failed ? "error: " : "→ ") + text;
  if (failed) card.card.classList.add("failed");
}

function showStats(turn) {
  const rows = [];
  const end = turn.endedAt || performance.now();
  if (turn.firstAt) rows.push(["Time to first token", `${Math.round(turn.firstAt - turn.startedAt)} ms`]);
  const usage = turn.usage || {};
  if (turn.firstAt && usage.completion && end > turn.firstAt) {
    rows.push(["Tokens per second", (usage.completion / ((end - turn.firstAt) / 1000)).toFixed(1)]);
  }
  for (const [name, value] of [
    ["Prompt tokens", usage.prompt],
    ["Completion tokens", usage.completion],
    ["Reasoning tokens", usage.reasoning],
    ["Cached tokens", usage.cached],
    ["Finish reason", turn.finish],
    ["Worker", turn.worker],
  ]) {
    if (value !== undefined && value !== null) rows.push([name, String(value)]);
  }
  el.stats.textContent = "";
  for (const [name, value] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dd.dataset.stat = name;
    el.stats.append(dt, dd);
  }
}

// -- tools editor -----------------------------------------------------------------------------------
function editorTools() {
  const text = el.toolsEditor.value.trim();
  if (!text) return [];
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (err) {
    throw new GatewayError(0, `The tools editor does not hold valid JSON: ${err.message}`);
  }
  if (!Array.isArray(tools)) tools = [tools];
  return tools;
}

function chatTools(tools) {
  return tools.map((tool, i) => {
    if (tool.type === "function" && tool.function) return tool;
    if (tool.type === "function") {
      const { name, description, parameters, strict } = tool;
      return { type: "function", function: { name, description, parameters, strict } };
    }
    throw new GatewayError(0, `Tool ${i + 1} (${tool.type}) needs the Responses API: switch the API to Responses.`);
  });
}

function responsesTools(tools) {
  return tools.map((tool) => (tool.type === "function" && tool.function ? { type: "function", ...tool.function } : tool));
}

// -- a turn -----------------------------------------------------------------------------------------
function newTurn(response) {
  return { startedAt: performance.now(), firstAt: null, endedAt: null, usage: null, finish: null,
           worker: response ? response.headers.get("x-worker") : null };
}

function firstToken(turn) {
  if (!turn.firstAt) {
    turn.firstAt = performance.now();
    setStatus("Streaming…");
  }
}

async function run(api, request) {
  clearError();
  resetPanes();
  el.toolResults.hidden = true;
  // A copy: the chat history grows after the request was sent.
  state.lastRequest = { api, request: structuredClone(request) };
  el.showPrompt.disabled = false;
  state.controller = new AbortController();
  setBusy(true);
  setStatus("Waiting for the first token…");
  const startedAt = performance.now();
  let turn = null;
  try {
    const path = api === "chat" ? "/v1/chat/completions" : "/v1/responses";
    const response = await postJSON(path, request, state.controller.signal);
    turn = newTurn(response);
    turn.startedAt = startedAt;
    const outcome = api === "chat" ? await readChat(response, turn) : await readResponses(response, turn);
    turn.endedAt = performance.now();
    showStats(turn);
    if (outcome.error) {
      fail(outcome.error);
      return;
    }
    if (state.pendingCalls.length) {
      askForResults();
      setStatus("Waiting for tool results");
    } else {
      setStatus(`Done (${turn.finish || "stop"})`);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      setStatus("Stopped");
    } else {
      fail(err.message || String(err));
    }
    if (turn) {
      turn.endedAt = performance.now();
      showStats(turn);
    }
  } finally {
    setBusy(false);
    state.controller = null;
  }
}

function fail(message) {
  showError(message);
  if (!el.answer.textContent) {
    append(el.answer, `No answer: ${message}`);
    el.answer.closest(".pane").classList.add("failed");
  }
  setStatus("Failed");
}

async function readChat(response, turn) {
  let content = "";
  let reasoning = "";
  const calls = [];
  const cards = [];
  for await (const { data } of sse(response)) {
    if (data.error) return { error: `Stream error: ${data.error.message}` };
    if (data.usage) {
      const u = data.usage;
      turn.usage = {
        prompt: u.prompt_tokens, completion: u.completion_tokens,
        reasoning: u.completion_tokens_details ? u.completion_tokens_details.reasoning_tokens : undefined,
        cached: u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : undefined,
      };
    }
    for (const choice of data.choices || []) {
      const delta = choice.delta || {};
      const thought = delta.reasoning_content ?? delta.reasoning;
      if (thought) { firstToken(turn); reasoning += thought; append(el.reasoning, thought); }
      if (delta.content) { firstToken(turn); content += delta.content; append(el.answer, delta.content); }
      for (const call of delta.tool_calls || []) {
        firstToken(turn);
        let slot = calls[call.index];
        if (!slot) {
          slot = calls[call.index] = { id: call.id, name: call.function?.name || "", arguments: "" };
          cards[call.index] = toolCard(`function ${slot.name}`);
        }
        const piece = call.function?.arguments || "";
        slot.arguments += piece;
        cards[call.index].args.textContent = slot.arguments;
      }
      if (choice.finish_reason) turn.finish = choice.finish_reason;
    }
    showStats(turn);
  }
  const message = { role: "assistant", content: content || null };
  if (reasoning) message.reasoning_content = reasoning;
  if (calls.length) message.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
  state.messages.push(message);
  addTranscript("assistant", content || callSummary(calls), state.lastRequest);
  state.pendingCalls = calls.filter(Boolean).map((c) => ({ ...c }));
  return {};
}

async function readResponses(response, turn) {
  const cards = new Map();
  const calls = [];
  let text = "";
  for await (const { event, data } of sse(response)) {
    const type = data.type || event;
    if (type === "response.created") {
      state.previousResponseId = data.response.id;
      el.previousId.textContent = data.response.id;
    } else if (type === "response.reasoning_text.delta") {
      firstToken(turn);
      append(el.reasoning, data.delta);
    } else if (type === "response.output_text.delta") {
      firstToken(turn);
      text += data.delta;
      append(el.answer, data.delta);
    } else if (type === "response.output_item.added") {
      const item = data.item;
      // Each model turn of a tool loop reasons anew: keep its reasoning apart from the previous one.
      if (item.type === "reasoning" && el.reasoning.textContent) append(el.reasoning, "\n\n");
      if (item.type === "function_call") cards.set(item.id, toolCard(`function ${item.name}`));
      else if (item.type === "mcp_call") cards.set(item.id, toolCard(`MCP ${item.server_label}.${item.name}`));
      else if (item.type === "mcp_list_tools") cards.set(item.id, toolCard(`MCP ${item.server_label}: list tools`));
      else if (item.type !== "message" && item.type !== "reasoning") cards.set(item.id, toolCard(item.type.replace(/_/g, " ")));
      if (cards.has(item.id)) firstToken(turn);
    } else if (type === "response.function_call_arguments.delta" || type === "response.mcp_call_arguments.delta") {
      const card = cards.get(data.item_id);
      if (card) card.args.textContent += data.delta;
    } else if (type === "response.output_item.done") {
      const item = data.item;
      const card = cards.get(item.id);
      if (!card) continue;
      if (item.type === "function_call") {
        card.args.textContent = item.arguments;
        calls.push({ id: item.call_id, name: item.name, arguments: item.arguments });
      } else if (item.type === "mcp_call") {
        card.args.textContent = item.arguments;
        setOutput(card, item.error || item.output || "", Boolean(item.error));
      } else if (item.type === "mcp_list_tools") {
        setOutput(card, (item.tools || []).map((t) => t.name).join(", ") || "(no tools)", Boolean(item.error));
      } else {
        card.args.textContent = JSON.stringify(item.action || item.code || item, null, 1);
        if (item.outputs) setOutput(card, JSON.stringify(item.outputs), false);
      }
    } else if (type === "response.completed" || type === "response.incomplete" || type === "response.failed") {
      const r = data.response;
      state.previousResponseId = r.id;
      el.previousId.textContent = r.id;
      const u = r.usage || {};
      turn.usage = {
        prompt: u.input_tokens, completion: u.output_tokens,
        reasoning: u.output_tokens_details ? u.output_tokens_details.reasoning_tokens : undefined,
        cached: u.input_tokens_details ? u.input_tokens_details.cached_tokens : undefined,
      };
      turn.finish = r.status === "incomplete" ? `incomplete (${r.incomplete_details?.reason || "?"})`
        : calls.length ? "function_call" : r.status;
      if (type === "response.failed") return { error: `Response failed: ${r.error?.message || "unknown error"}` };
    } else if (type === "error") {
      return { error: `Stream error: ${data.message || data.code}` };
    }
    showStats(turn);
  }
  addTranscript("assistant", text || callSummary(calls), state.lastRequest);
  state.pendingCalls = calls;
  return {};
}

function callSummary(calls) {
  const names = calls.filter(Boolean).map((c) => c.name);
  return names.length ? `(called ${names.join(", ")})` : "(no answer text)";
}

// -- function results ---------------------------------------------------------------------------------
function askForResults() {
  el.toolResultFields.textContent = "";
  state.pendingCalls.forEach((call, i) => {
    const id = `tool-result-${i}`;
    const label = document.createElement("label");
    label.htmlFor = id;
    label.textContent = `Result of ${call.name}(${call.arguments})`;
    const input = document.createElement("textarea");
    input.id = id;
    input.rows = 2;
    input.dataset.callId = call.id;
    el.toolResultFields.append(label, input);
  });
  el.toolResults.hidden = false;
  el.toolResultFields.querySelector("textarea")?.focus();
}

function sendResults(event) {
  event.preventDefault();
  if (state.busy) return;
  const results = [...el.toolResultFields.querySelectorAll("textarea")].map((input) => ({
    id: input.dataset.callId, output: input.value,
  }));
  const names = Object.fromEntries(state.pendingCalls.map((c) => [c.id, c.name]));
  state.pendingCalls = [];
  el.toolResults.hidden = true;
  for (const r of results) addTranscript("tool", `${names[r.id]} → ${r.output}`);
  try {
    if (el.api.value === "chat") {
      for (const r of results) state.messages.push({ role: "tool", tool_call_id: r.id, content: r.output });
      run("chat", chatRequest());
    } else {
      const input = results.map((r) => ({ type: "function_call_output", call_id: r.id, output: r.output }));
      run("responses", responsesRequest(input));
    }
  } catch (err) {
    fail(err.message);
  }
}

// -- requests -----------------------------------------------------------------------------------------
function maxTokens() {
  const value = parseInt(el.maxTokens.value, 10);
  return Number.isFinite(value) && value > 0 ? value : undefined;
}

function chatRequest() {
  const request = {
    model: el.model.value, messages: state.messages, stream: true,
    stream_options: { include_usage: true }, reasoning_effort: el.effort.value,
  };
  const tools = chatTools(editorTools());
  if (tools.length) request.tools = tools;
  const limit = maxTokens();
  if (limit) request.max_completion_tokens = limit;
  return request;
}

function responsesRequest(input) {
  const request = { model: el.model.value, input, stream: true, store: true, reasoning: { effort: el.effort.value } };
  const tools = responsesTools(editorTools());
  if (tools.length) request.tools = tools;
  if (state.previousResponseId) request.previous_response_id = state.previousResponseId;
  const limit = maxTokens();
  if (limit) request.max_output_tokens = limit;
  return request;
}

async function send(event) {
  if (event) event.preventDefault();
  const text = el.message.value.trim();
  if (!text || state.busy) return;
  if (!el.model.value) {
    await loadModels(); // a worker may have joined, or a key been entered, since the page loaded
    if (!el.model.value) {
      // loadModels has said why (a key is needed, no worker yet); the message stays in its box.
      if (state.modelsError && state.modelsError.status === 401) el.key.focus();
      return;
    }
  }
  let api;
  let request;
  try {
    if (el.api.value === "chat") {
      api = "chat";
      state.messages.push({ role: "user", content: text });
      request = chatRequest();
    } else {
      api = "responses";
      request = responsesRequest([{ role: "user", content: text }]);
    }
  } catch (err) {
    if (el.api.value === "chat") state.messages.pop();
    showError(err.message);
    return;
  }
  state.pendingCalls = [];
  el.message.value = "";
  addTranscript("user", text);
  run(api, request);
}

function newConversation() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  state.previousResponseId = null;
  state.pendingCalls = [];
  state.lastRequest = null;
  state.turns = 0;
  el.previousId.textContent = "none";
  el.transcript.textContent = "";
  el.showPrompt.disabled = true;
  el.toolResults.hidden = true;
  resetPanes();
  clearError();
  setStatus("Ready");
  el.message.focus();
}

// -- "Show prompt" --------------------------------------------------------------------------------------
async function showPrompt(which) {
  const target = which && which.api ? which : state.lastRequest;
  if (!target) return;
  clearError();
  try {
    const response = await postJSON("/v1/harmony/render", target);
    const shown = await response.json();
    el.promptText.textContent = "";
    const fragment = document.createDocumentFragment();
    for (const [id, text] of shown.tokens) {
      const span = document.createElement("span");
      span.textContent = text ?? `[${id}]`;
      span.title = `token ${id}`;
      span.dataset.id = String(id);
      span.className = id >= FIRST_SPECIAL_ID ? "tok special" : "tok";
      fragment.append(span);
    }
    el.promptText.append(fragment);
    el.promptIds.textContent = shown.token_ids.join(", ");
    const routing = shown.routing || {};
    // The worker choice is shown to admins only (a tenant's render leaves it out).
    const worker = !("worker" in routing) ? "" : " would pick " +
      (routing.worker ? `${routing.worker.id} (${routing.worker.url})` : "none available");
    el.promptSummary.textContent = `${shown.token_count} tokens in ${shown.messages.length} messages · ` +
      `model ${shown.model} · ${routing.policy}${worker}` +
      (routing.cache_match_tokens != null ? ` · cached prefix ${routing.cache_match_tokens} tokens` : "");
    el.promptMeta.textContent = JSON.stringify(
      { messages: shown.messages.map(({ text, ...m }) => m), stop_token_ids: shown.stop_token_ids,
        sampling: shown.sampling, constraint: shown.constraint, routing, notes: shown.notes }, null, 2);
    el.promptDialog.showModal();
  } catch (err) {
    showError(err.message);
  }
}

// -- stored responses -----------------------------------------------------------------------------------
async function openStored(event) {
  event.preventDefault();
  const id = el.storedId.value.trim();
  if (!id) return;
  clearError();
  try {
    const response = await getJSON(`/v1/responses/${encodeURIComponent(id)}`);
    const items = await getJSON(`/v1/responses/${encodeURIComponent(id)}/input_items?order=asc&limit=100`);
    newConversation();
    el.api.value = "responses";
    for (const item of items.data || []) {
      if (item.type === "message") addTranscript(item.role === "user" ? "user" : "assistant", partsText(item.content));
    }
    for (const item of response.output || []) {
      if (item.type === "message") addTranscript("assistant", partsText(item.content));
      if (item.type === "reasoning") append(el.reasoning, partsText(item.content));
    }
    state.previousResponseId = response.id;
    el.previousId.textContent = response.id;
    setStatus(`Opened ${response.id}: the next message continues it`);
  } catch (err) {
    showError(err.message);
  }
}

function partsText(parts) {
  if (typeof parts === "string") return parts;
  return (parts || []).map((p) => p.text ?? p.refusal ?? "").join("");
}

// -- start-up -----------------------------------------------------------------------------------------
async function loadModels() {
  try {
    const models = await getJSON("/v1/models");
    const current = el.model.value;
    el.model.textContent = "";
    for (const m of models.data) {
      const option = document.createElement("option");
      option.value = option.textContent = m.id;
      el.model.append(option);
    }
    if (current) el.model.value = current;
    state.modelsError = null;
    clearError();
    if (!models.data.length) showError("The gateway serves no model yet: add a worker.");
  } catch (err) {
    state.modelsError = err;
    if (err.status === 401) {
      askForKey();
    } else {
      showError(`Cannot list models: ${err.message}`);
    }
  }
}

// The gateway has API keys and the page holds none, or one the gateway refused (401 on /v1/models).
function askForKey() {
  el.keyLabel.hidden = false;
  const refused = Boolean(sessionStorage.getItem(KEY_STORAGE));
  showError(refused
    ? "401: The gateway refused this API key. Enter a valid key in the API key field above."
    : "401: The gateway needs an API key. Enter it in the API key field above.");
}

function init() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) {
    el.key.value = key;
    el.keyLabel.hidden = false;
  }
  el.key.addEventListener("change", () => {
    const value = el.key.value.trim();
    if (value) sessionStorage.setItem(KEY_STORAGE, value);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  el.composer.addEventListener("submit", send);
  el.message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  el.stop.addEventListener("click", () => state.controller && state.controller.abort());
  el.newChat.addEventListener("click", newConversation);
  el.showPrompt.addEventListener("click", () => showPrompt());
  el.closePrompt.addEventListener("click", () => el.promptDialog.close());
  el.toolResults.addEventListener("submit", sendResults);
  el.openStored.addEventListener("submit", openStored);
  el.api.addEventListener("change", () => {
    state.messages = [];
    state.previousResponseId = null;
    el.previousId.textContent = "none";
  });
  el.exampleTools.addEventListener("click", () => {
    el.toolsEditor.value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
  });
  document.querySelectorAll("#settings").forEach((form) => form.addEventListener("submit", (e) => e.preventDefault()));
  loadModels();
  el.message.focus();
}

init();
