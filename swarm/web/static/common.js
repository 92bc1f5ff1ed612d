// Helpers shared by both pages. Every string that came from the network is written with textContent.
"use strict";

/** An element with attributes and children (strings become text nodes, never markup). */
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "className") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

/** Replace the children of the element with the given id. */
function fill(id, ...children) {
  const node = document.getElementById(id);
  node.replaceChildren(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

/** The message of an OpenAI-style error body, with the HTTP status. */
function apiMessage(status, body) {
  const message = body && body.error && body.error.message;
  return message ? `${message} (HTTP ${status})` : `the server answered HTTP ${status}`;
}

/** GET a JSON document; throws an Error with the API's message on a non-2xx answer. */
async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(apiMessage(response.status, body));
  return body;
}

/** "12 s ago", "5 min ago", "3 h ago", "2 days ago" for a Unix time in seconds. */
function ago(seconds) {
  const delta = Math.max(0, Date.now() / 1000 - seconds);
  if (delta < 60) return `${Math.round(delta)} s ago`;
  if (delta < 3600) return `${Math.round(delta / 60)} min ago`;
  if (delta < 86400) return `${Math.round(delta / 3600)} h ago`;
  return `${Math.round(delta / 86400)} days ago`;
}

/** A Unix time as local date and time plus how long ago, e.g. "2025-01-31 14:03:22 (5 min ago)". */
function readableTime(seconds) {
  const date = new Date(seconds * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  const text = `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
  return `${text} (${ago(seconds)})`;
}

/** "1 online server", "3 online servers": the count and the noun, in the plural unless the count is 1 (as
 * swarm/utils/text.py's plural; `many` where adding an s is wrong). */
function plural(count, noun, many) {
  return `${count} ${count === 1 ? noun : many || noun + "s"}`;
}

/** A number with a fixed count of decimals, or a dash when unknown. */
function num(value, digits = 0) {
  return typeof value === "number" && isFinite(value) ? value.toFixed(digits) : "—";
}

/** The last characters of a peer id: enough to tell servers apart. */
function shortPeer(peerId) {
  return `…${String(peerId).slice(-8)}`;
}

/** Show the playground link only where the server offers it. */
function showPlaygroundLink(offered) {
  const link = document.getElementById("nav-playground");
  if (link) link.hidden = !offered;
}
