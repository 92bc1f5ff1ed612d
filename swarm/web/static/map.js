// The live swarm map: polls /map.json and redraws, with no reload. ?every=N sets the period in seconds (1-60).
"use strict";

const PERIOD_S = Math.min(60, Math.max(1, Number(new URLSearchParams(location.search).get("every")) || 3));
let timer = null;
let paused = false;

function spanText(start, end) {
  return `${start}:${end}`;
}

function statusText(server) {
  const parts = [server.status];
  if (server.state === "online" && server.status !== "online") parts.push("online");
  if (server.approximate) parts.push(`approximate: ${server.numerics}`);
  if (server.distrusted) parts.push("distrusted (wrong results)");
  if (server.in_route) parts.push("in this client's route");
  if (server.probe_error) parts.push(`no answer to ping: ${server.probe_error}`);
  return parts.join(" · ");
}

function serverLabel(server) {
  return server.public_name || shortPeer(server.peer_id);
}

function rowId(server) {
  return `server-${server.peer_id}`;
}

/** Set a live region's text only when it changes, so that screen readers do not repeat it every poll. */
function announce(node, className, text) {
  node.className = className;
  if (node.textContent !== text) node.textContent = text;
}

function drawCoverage(data) {
  const coverage = document.getElementById("coverage");
  if (data.mode === "local") {
    announce(coverage, "banner", "This API runs the whole model in its own process: there is no swarm to map.");
  } else if (data.uncovered.length) {
    const spans = data.uncovered.map(([start, end]) => spanText(start, end)).join(", ");
    announce(coverage, "banner bad",
      `Uncovered blocks ${spans}: no online server holds them, so no request can be served.`);
  } else {
    announce(coverage, "banner good", `Every block is served: ${data.num_blocks} blocks, at least ` +
      `${plural(Math.min(...data.replicas), "online server")} each.`);
  }
}

function drawGovernance(governance) {
  const node = document.getElementById("governance");
  node.className = governance.halted ? "banner bad" : "";
  if (!governance.enabled) {
    node.textContent = "Not watched: this page was started without governance keys ($SWARM_GOVERNANCE_KEYS).";
  } else if (!governance.action) {
    node.textContent = "Running: no governance decision has been published.";
  } else {
    const who = `key ${String(governance.signer).slice(0, 12)}…`;
    const when = governance.since ? readableTime(governance.since) : "an unknown time";
    const why = governance.reason ? `: ${governance.reason}` : "";
    node.textContent = governance.halted
      ? `HALTED by ${who} since ${when}${why}. Servers refuse new steps; clients stop before their next step.`
      : `Running: last decision "${governance.action}" by ${who} at ${when}${why}.`;
  }
}

/** A row of the block grid: a label, then one track of num_blocks columns holding the given cells. */
function blockRow(label, cells, className) {
  const track = el("div", { className: "track" }, ...cells);
  return el("div", { className: `block-row ${className}` }, el("div", { className: "row-label" }, label), track);
}

function placed(node, start, end) {
  node.style.gridColumn = `${start + 1} / ${end + 1}`;
  return node;
}

function drawBlocks(data) {
  const axis = [];
  const every = Math.ceil(data.num_blocks / 16);  // at most ~16 numbers on the axis
  for (let block = 0; block < data.num_blocks; block++) {
    axis.push(placed(el("span", { className: "tick" }, block % every === 0 ? block : ""), block, block + 1));
  }
  const replicas = data.replicas.map((count, block) => placed(el("span", {
    className: count ? "replicas" : "replicas uncovered",
    title: count ? `block ${block}: ${plural(count, "online server")}` : `block ${block}: no online server`,
  }, count || "!"), block, block + 1));
  const rows = [blockRow("Block", axis, "axis"), blockRow("Online servers", replicas, "coverage")];
  for (const server of data.servers) {
    const bar = el("a", {
      href: `#${rowId(server)}`, "data-key": `bar-${server.peer_id}`,
      className: `bar status-${server.status}${server.approximate ? " approximate" : ""}`,
      "aria-label": `${serverLabel(server)}: blocks ${spanText(server.start, server.end)}, ${statusText(server)}`,
    }, `${spanText(server.start, server.end)} · ${num(server.throughput)} tok/s · ${num(server.rtt_ms)} ms`);
    const end = Math.min(server.end, data.num_blocks);
    rows.push(blockRow(serverLabel(server), [placed(bar, server.start, end)], "server"));
  }
  const grid = fill("blocks", ...rows);
  grid.style.setProperty("--blocks", String(Math.max(data.num_blocks, 1)));
}

function cell(label, value) {
  return el("td", { "data-label": label }, value);
}

function drawServers(servers) {
  const rows = servers.map((server) => el("tr", { id: rowId(server), className: `status-row-${server.status}` },
    cell("Name", server.public_name || "—"),
    cell("Peer", el("code", { title: server.peer_id }, shortPeer(server.peer_id))),
    cell("Blocks", spanText(server.start, server.end)),
    cell("Status", statusText(server)),
    cell("Throughput (tok/s)", num(server.throughput, 1)),
    cell("Round trip (ms)", num(server.rtt_ms, 1)),
    cell("In flight", server.in_flight ?? "—"),
    cell("Cache room (tokens)", num(server.cache_tokens_left)),
    cell("Version", server.version || "?"),
    cell("Numerics", server.numerics || "?"),
    cell("Experts", server.experts.join(", ") || "—"),
    cell("Adapters", server.adapter_kinds.join(", ") || "—")));
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: 12 }, "No server has announced any block of this model.")));
  }
  document.querySelector("#servers tbody").replaceChildren(...rows);
}

function drawExperts(experts) {
  if (!experts.length) {
    fill("experts", el("p", { className: "muted" }, "No expert announced."));
    return;
  }
  fill("experts", ...experts.map((expert) => el("div", { className: "expert" },
    el("h3", {}, expert.domain),
    el("ul", {}, ...expert.peers.map((peer) => el("li", {},
      `${peer.public_name || shortPeer(peer.peer_id)} (${peer.state}) hosts ${peer.model || "?"}, ` +
      `${num(peer.throughput, 1)} tok/s; tag: tokenizer ${peer.tag.tokenizer}, vocabulary ${peer.tag.vocab_size}, ` +
      `mask id ${peer.tag.mask_token_id}`))),
    expert.malformed ? el("p", { className: "muted" }, `${plural(expert.malformed, "malformed announcement")} ignored`)
      : null)));
}

/** Redraw everything; a keyboard user's focus stays on the same bar (the old one is replaced). */
function draw(data) {
  const focused = document.activeElement && document.activeElement.dataset.key;
  redraw(data);
  const again = focused && document.querySelector(`[data-key="${CSS.escape(focused)}"]`);
  if (again) again.focus({ preventScroll: true });
}

function redraw(data) {
  document.getElementById("problem").hidden = true;
  fill("model", data.model ? `· ${data.model}` : "");
  showPlaygroundLink(data.playground);
  drawCoverage(data);
  drawGovernance(data.governance);
  drawBlocks(data);
  drawServers(data.servers);
  drawExperts(data.experts);
  const route = data.route.length ? ` Route of this client: ${data.route.join(" → ")}.` : "";
  fill("updated", `Updated ${readableTime(data.generated_at)}, every ${PERIOD_S} s.${route}`);
}

function showProblem(message) {
  const problem = document.getElementById("problem");
  problem.textContent = `The map could not be read (${message}); trying again in ${PERIOD_S} s.`;
  problem.hidden = false;
}

async function refresh() {
  clearTimeout(timer);
  try {
    draw(await getJSON("/map.json"));
  } catch (error) {
    showProblem(error.message);
  } finally {
    if (!paused) timer = setTimeout(refresh, PERIOD_S * 1000);
  }
}

function togglePause(event) {
  paused = !paused;
  event.target.setAttribute("aria-pressed", String(paused));
  event.target.textContent = paused ? "Resume updates" : "Pause updates";
  if (paused) clearTimeout(timer);
  else refresh();
}

document.getElementById("pause").addEventListener("click", togglePause);
refresh();
