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
  if (server.audit_failed) parts.push("failed its last audit");
  if (server.in_route) parts.push("in this client's route");
  if (server.probe_error) parts.push(`no answer to ping: ${server.probe_error}`);
  return parts.join(" · ");
}

/** "14:05" for a Unix time in seconds, local time. */
function clockTime(seconds) {
  const date = new Date(seconds * 1000);
  return `${String(date.getHours()).padStart(2, "0")}:${String(date.getMinutes()).padStart(2, "0")}`;
}

/** A server's latest trusted audit in a few words, as swarm.health's AUDIT column: "pass 3/3 at 14:05", then
 * "measured 812 of 900 tok/s", and "OVERCLAIMS 10.0x" when the server announces over the clients' default factor
 * times its calibrated throughput; a failed or unanswered check in capitals. Its reason and auditor go in the tooltip. */
function auditCell(audit, trusting, overclaims) {
  if (!audit) {
    return el("span", { className: "muted", title: trusting ? "no trusted auditor has checked this server"
      : "this page trusts no auditor" }, trusting ? "not checked" : "—");
  }
  const checks = audit.passed + audit.failed + audit.errors;
  const verdict = audit.verdict === "pass" ? "pass" : String(audit.verdict).toUpperCase();
  const title = [`checked ${plural(checks, "time")}, last ${readableTime(audit.last_check)}`,
    audit.reason ? `reason: ${audit.reason}` : null,
    audit.auditor ? `by auditor ${String(audit.auditor).slice(0, 12)}…` : null].filter(Boolean).join("; ");
  return el("span", { className: `audit audit-${audit.verdict}`, title },
    el("span", { className: "line" }, `${verdict} ${audit.passed}/${checks} at ${clockTime(audit.last_check)}`),
    typeof audit.measured === "number"
      ? el("span", { className: "line muted" }, ` measured ${num(audit.measured)} of ${num(audit.announced)} tok/s`)
      : null,
    typeof overclaims === "number"
      ? el("span", { className: "line audit-fail", title: "announces this many times what its delivery is worth " +
        "beside its peers: clients trusting the auditor route it by the calibrated figure" },
      ` OVERCLAIMS ${num(overclaims, 1)}x`)
      : null);
}

/** A server's usage totals, as it says (the column's header explains the units): "1,234 tok, 5.2 s", then
 * "12 req, 0 refused". */
function usageCell(usage) {
  if (!usage) return "—";
  return el("span", {}, el("span", { className: "line" }, `${usage.tokens.toLocaleString("en")} tok, ` +
    `${num(usage.seconds, 1)} s`), el("span", { className: "line" }, ` ${usage.requests.toLocaleString("en")} req, ` +
    `${usage.refused} refused`));
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
      className: `bar status-${server.status}${server.approximate ? " approximate" : ""}` +
        `${server.audit_failed ? " audit-failed" : ""}`,
      "aria-label": `${serverLabel(server)}: blocks ${spanText(server.start, server.end)}, ${statusText(server)}`,
    }, `${server.audit_failed ? "AUDIT FAILED · " : ""}${spanText(server.start, server.end)} · ` +
      `${num(server.throughput)} tok/s · ${num(server.rtt_ms)} ms`);
    const end = Math.min(server.end, data.num_blocks);
    rows.push(blockRow(serverLabel(server), [placed(bar, server.start, end)], "server"));
  }
  const grid = fill("blocks", ...rows);
  grid.style.setProperty("--blocks", String(Math.max(data.num_blocks, 1)));
}

function cell(label, value) {
  return el("td", { "data-label": label }, value);
}

function drawServers(servers, trusting) {
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
    cell("Adapters", server.adapter_kinds.join(", ") || "—"),
    cell("Usage", usageCell(server.usage)),
    cell("Audit", auditCell(server.audit, trusting, server.audit_overclaims))));
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: 14 }, "No server has announced any block of this model.")));
  }
  document.querySelector("#servers tbody").replaceChildren(...rows);
}

function drawAuditors(auditors) {
  fill("auditors", auditors.length
    ? `Audits by ${plural(auditors.length, "trusted auditor")}: ` +
      auditors.map((key) => `${String(key).slice(0, 12)}…`).join(", ")
    : "No auditor is trusted by this page (swarm.health --trusted-auditors, or the client's trusted_auditors; " +
      "by default the governance keys), so no audit is shown.");
}

/** Per task, the latest audited score: "addition 7/10 (70%)". */
function auditedScores(audits) {
  const tasks = Object.entries(audits);
  if (!tasks.length) return "—";
  return tasks.map(([task, score]) =>
    `${task} ${score.correct}/${score.examples} (${num(100 * score.score)}%)`).join(", ");
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attributes = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  for (const child of children) node.append(child);
  return node;
}

/** The name's curve, one point per version: the publisher's own figure (dashed) and the trusted audited score. */
function versionCurve(versions) {
  const live = (versions || []).filter((v) => typeof v.number === "number");
  if (!live.length) return "—";
  const width = 140, height = 40, pad = 4;
  const x = (i) => pad + (live.length === 1 ? 0 : i * (width - 2 * pad) / (live.length - 1));
  const y = (score) => height - pad - Math.max(0, Math.min(1, score)) * (height - 2 * pad);
  const audited = (v) => Object.values(v.audited || {}).find((s) => typeof s === "number");
  const line = (values, attributes) => {
    const points = values.map((value, i) => (typeof value === "number" ? `${x(i)},${y(value)}` : null))
      .filter(Boolean).join(" ");
    return points ? svg("polyline", { points, fill: "none", ...attributes }) : null;
  };
  const parts = [line(live.map((v) => v.claimed), { stroke: "currentColor", "stroke-dasharray": "3 2", opacity: 0.5 }),
                 line(live.map(audited), { stroke: "currentColor", "stroke-width": 2 })].filter(Boolean);
  const title = live.map((v) => `v${v.number}${v.withdrawn ? " (withdrawn)" : ""}: own ${v.claimed ?? "—"}, ` +
    `audited ${typeof audited(v) === "number" ? num(100 * audited(v)) + "%" : "—"}`).join("; ");
  return el("span", { className: "version-curve", title },
    svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title }, ...parts),
    ` v${live[live.length - 1].number}`);
}

function drawAdapters(adapters) {
  const rows = adapters.map((adapter) => el("tr", {},
    cell("Adapter", adapter.name),
    cell("Author", el("code", { title: adapter.author }, adapter.author)),
    cell("Claimed", typeof adapter.claimed === "number" ? String(adapter.claimed) : "—"),
    cell("Audited", auditedScores(adapter.audits)),
    cell("Versions", versionCurve(adapter.versions)),
    cell("Hosts", adapter.hosts),
    cell("Content", el("code", { title: adapter.sha256 }, String(adapter.sha256).slice(0, 16)))));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 7 }, "No adapter is published for this model.")));
  document.querySelector("#adapters tbody").replaceChildren(...rows);
}

/** A stream's audited curve, round by round, as a small line (scores 0-1). */
function streamCurve(curve) {
  if (!curve.length) return "—";
  const width = 140, height = 40, pad = 4;
  const x = (i) => pad + (curve.length === 1 ? 0 : i * (width - 2 * pad) / (curve.length - 1));
  const y = (score) => height - pad - Math.max(0, Math.min(1, score)) * (height - 2 * pad);
  const points = curve.map((score, i) => `${x(i)},${y(score)}`).join(" ");
  const title = curve.map((score, i) => `round ${i + 1}: ${num(100 * score)}%`).join("; ");
  return el("span", { className: "version-curve", title },
    svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title },
      svg("polyline", { points, fill: "none", stroke: "currentColor", "stroke-width": 2 })),
    ` ${num(100 * curve[curve.length - 1])}%`);
}

function drawStreams(streams) {
  const rows = streams.map((stream) => el("tr", {},
    cell("Stream", stream.stream),
    cell("Task", stream.task),
    cell("Weight", num(stream.weight, 2)),
    cell("Pool", el("span", { title: stream.pool.join(", ") }, plural(stream.pool.length, "node"))),
    cell("Audited curve", streamCurve(stream.curve)),
    cell("State", stream.stalled ? "stalled: its nodes go back" : "live"),
    cell("Flags", stream.flags.length ? stream.flags.join("; ") : "—")));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 7 }, "No trusted coordinator publishes streams.")));
  document.querySelector("#streams tbody").replaceChildren(...rows);
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
  drawServers(data.servers, data.auditors.length > 0);
  drawAuditors(data.auditors);
  drawAdapters(data.adapters);
  drawStreams(data.streams || []);
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
