// The playground: posts to /v1/completions with stream: true and draws every denoising step as a row of cells.
"use strict";

let settings = [];  // the declared settings of generate() the form offers (/web/settings.json)
let modelId = null;
let controller = null;  // aborts the running request

class FormError extends Error {}

// ----- the form -----------------------------------------------------------------------------------------------
function configureField(setting) {
  const input = document.getElementById(setting.name);
  fill(`${setting.name}-help`, setting.help);
  if (input.tagName === "SELECT") {
    input.replaceChildren(...setting.choices.map((choice) => el("option", { value: choice }, choice)));
  }
  if (setting.low !== null) input.min = setting.low;
  if (setting.high !== null) input.max = setting.high;
  if (setting.default !== null) input.value = setting.default;
  else if (input.tagName !== "SELECT") input.placeholder = input.placeholder || "default";
}

/** "auto", or "name:weight, name:weight" (a bare name weighs 1) as the API's experts field. */
function parseExperts(text) {
  if (text === "auto") return "auto";
  const experts = {};
  for (const part of text.split(",").map((item) => item.trim()).filter(Boolean)) {
    const [name, weight = "1", extra] = part.split(":").map((item) => item.trim());
    const value = Number(weight);
    if (!name || extra !== undefined || weight === "" || !isFinite(value)) {
      throw new FormError(`experts: "${part}" is not name:weight (write auto, or e.g. code:0.5, addition:1)`);
    }
    experts[name] = value;
  }
  return experts;
}

/** One setting's value for the request, or undefined when left empty (the API's default then applies). */
function readSetting(setting) {
  const input = document.getElementById(setting.name);
  const raw = input.value.trim();
  const label = document.querySelector(`label[for="${setting.name}"]`).textContent;
  if (raw === "") return undefined;
  if (setting.name === "experts") return parseExperts(raw);
  if (setting.kind === "int") {
    if (!/^-?\d+$/.test(raw)) throw new FormError(`${label} must be a whole number, got "${raw}"`);
    return Number(raw);
  }
  if (setting.kind === "float") {
    const value = Number(raw);
    if (!isFinite(value)) throw new FormError(`${label} must be a number, got "${raw}"`);
    return value;
  }
  return raw;
}

function requestBody() {
  const prompt = document.getElementById("prompt").value;
  const body = { model: modelId, prompt, stream: true, stream_options: { include_usage: true } };
  for (const setting of settings) {
    const value = readSetting(setting);
    if (value !== undefined) body[setting.name] = value;
  }
  return body;
}

// ----- drawing ------------------------------------------------------------------------------------------------
const run = { started: 0, cells: [], previous: [] };

function showError(message) {
  const node = document.getElementById("error");
  node.textContent = message;
  node.hidden = false;
  fill("summary", "Stopped: see the message above.");
}

function cellText(piece) {
  if (piece === null) return "";
  if (piece === "") return "∎";  // a special token (end of text): no text of its own
  return piece.replace(/\n/g, "↵");
}

/** The canvas of a step event: the tokens field when the stream carries it, else the "_"-masked text. */
function canvasOf(diffusion) {
  if (Array.isArray(diffusion.tokens)) return diffusion.tokens;
  return Array.from(diffusion.text).map((char) => (char === "_" ? null : char));
}

function drawCanvas(tokens, unmasked) {
  const canvas = document.getElementById("canvas");
  if (run.cells.length !== tokens.length) {
    run.cells = tokens.map(() => el("span", { className: "cell masked" }));
    canvas.replaceChildren(...run.cells);
  }
  const fresh = new Set(unmasked);
  tokens.forEach((piece, index) => {
    const node = run.cells[index];
    node.textContent = cellText(piece);
    node.className = piece === null ? "cell masked" : fresh.has(index) ? "cell new" : "cell";
    if (piece === "") node.classList.add("special");
    node.title = piece === null ? `position ${index}: masked` : `position ${index}: ${JSON.stringify(piece)}`;
  });
}

function drawRoute(route, failovers) {
  fill("route", route && route.length ? route.join(" → ") : "this process (no swarm)");
  if (!failovers || !failovers.length) return;
  fill("failovers", ...failovers.map((event) => el("li", {},
    `${event.block >= 0 ? `block ${event.block}` : "expert query"}: ${shortPeer(event.peer_id)} failed ` +
    `(${event.error}); another server took over`)));
}

function onStep(diffusion) {
  const tokens = canvasOf(diffusion);
  const unmasked = Array.isArray(diffusion.unmasked) ? diffusion.unmasked
    : tokens.map((piece, index) => (piece !== null && run.previous[index] === null ? index : -1)).filter((i) => i >= 0);
  run.previous = tokens;
  drawCanvas(tokens, unmasked);
  const filled = tokens.filter((piece) => piece !== null).length;
  const seconds = (performance.now() - run.started) / 1000;
  fill("step", diffusion.step + 1);
  fill("masked", diffusion.masked_left);
  fill("rate", num(filled / Math.max(seconds, 1e-3), 1));
  if (Array.isArray(diffusion.route)) drawRoute(diffusion.route, diffusion.failovers);
}

function onFinal(text, details) {
  fill("final-text", text);
  const info = details.info || {};
  drawRoute(info.route, info.failovers);
  const rate = details.elapsed_s > 0 ? ` in ${num(details.elapsed_s, 2)} s` : "";
  if (details.model_finish_reason === "halted") {
    const halt = info.halt || {};
    showError(`The swarm is halted by its governance: ${halt.reason || "no reason given"} ` +
      `(stopped before step ${halt.step ?? "?"}). Try again once it is resumed.`);
    return;
  }
  fill("step", details.steps);
  fill("summary", `Done: ${details.steps} steps, ${details.denoiser_calls} denoiser calls${rate} ` +
    `(${details.model_finish_reason}).`);
}

function onUsage(usage) {
  const seconds = (performance.now() - run.started) / 1000;
  fill("rate", num(usage.completion_tokens / Math.max(seconds, 1e-3), 1));
}

/** One server-sent event of the completions stream. */
function onEvent(data) {
  if (data === "[DONE]") return;
  const event = JSON.parse(data);
  if (event.error) {
    showError(event.error.message);
  } else if (!event.choices.length) {
    if (event.usage) onUsage(event.usage);
  } else if (event.choices[0].finish_reason === null) {
    onStep(event.choices[0].diffusion);
  } else {
    onFinal(event.choices[0].text, event.diffusion || {});
  }
}

async function readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, cut).split("\n").filter((line) => line.startsWith("data: "));
      buffer = buffer.slice(cut + 2);
      if (lines.length) onEvent(lines.map((line) => line.slice(6)).join("\n"));
    }
  }
}

// ----- a request ----------------------------------------------------------------------------------------------
function reset() {
  Object.assign(run, { started: performance.now(), cells: [], previous: [] });
  document.getElementById("error").hidden = true;
  fill("canvas");
  fill("final-text");
  fill("failovers", el("li", { className: "muted" }, "None."));
  for (const id of ["step", "masked", "rate", "route"]) fill(id, "—");
}

function busy(running) {
  document.getElementById("generate").disabled = running;
  document.getElementById("stop").disabled = !running;
}

async function generate(event) {
  event.preventDefault();
  let body;
  try {
    body = requestBody();
  } catch (error) {
    if (!(error instanceof FormError)) throw error;
    reset();
    showError(error.message);
    return;
  }
  reset();
  fill("summary", "Generating…");
  busy(true);
  controller = new AbortController();
  try {
    const response = await fetch("/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      showError(apiMessage(response.status, await response.json().catch(() => null)));
      return;
    }
    await readEvents(response);
  } catch (error) {
    showError(error.name === "AbortError" ? "Stopped by you." : `The request failed: ${error.message}`);
  } finally {
    busy(false);
    controller = null;
  }
}

async function init() {
  document.getElementById("form").addEventListener("submit", generate);
  document.getElementById("stop").addEventListener("click", () => controller && controller.abort());
  try {
    const [declared, models] = await Promise.all([getJSON("/web/settings.json"), getJSON("/v1/models")]);
    settings = declared;
    settings.forEach(configureField);
    modelId = models.data[0].id;
    fill("model", `· ${modelId}`);
    document.body.dataset.ready = "true";
  } catch (error) {
    showError(`The playground could not load its settings: ${error.message}`);
  }
}

init();
