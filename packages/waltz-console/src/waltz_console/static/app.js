// The Waltz console page: hash routes, one view at a time, refreshed when the
// console's event stream says something changed. Every value is put in the page as
// text (never as HTML): transaction data and names come from the cluster.
"use strict";

const state = { version: -1, overview: null, authenticated: false, route: null, busy: false,
  pending: false, lastEvent: 0 };
const PAGE = 50;

// -- helpers -------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function show(value, unit) {
  if (value === null || value === undefined) return "–";
  return unit ? `${value} ${unit}` : String(value);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function when(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  let body = null;
  try { body = await response.json(); } catch (e) { body = { error: `HTTP ${response.status}` }; }
  if (!response.ok) {
    const err = new Error(body && body.error ? body.error : `HTTP ${response.status}`);
    err.status = response.status;
    throw err;
  }
  return body;
}

async function post(path, body) {
  return api(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Waltz-Console": "1" },
    body: JSON.stringify(body || {}),
  });
}

function parseRoute() {
  const raw = location.hash.replace(/^#\/?/, "") || "cluster";
  const [path, query] = raw.split("?");
  const parts = path.split("/").filter(Boolean);
  return { view: parts[0] || "cluster", arg: parts[1], params: new URLSearchParams(query || "") };
}

function go(view, arg, params) {
  const q = params ? new URLSearchParams(params).toString() : "";
  location.hash = `#/${view}${arg !== undefined && arg !== null ? "/" + arg : ""}${q ? "?" + q : ""}`;
}

function stateClass(s) {
  return s === "writable" ? "ok" : s === "undecidable" ? "bad" : s ? "warn" : "muted";
}

function partitionLink(p) {
  return h("a", { href: `#/partition/${p}`, class: "plink" }, `${p}`);
}

function pager(total, offset, limit, onMove) {
  const last = Math.max(0, Math.ceil(total / limit) - 1);
  const current = Math.floor(offset / limit);
  return h("div", { class: "pager" },
    h("button", { id: "prev-page", disabled: current <= 0, onclick: () => onMove(Math.max(0, offset - limit)) }, "‹ Previous"),
    h("span", { id: "page-info" }, `${total ? offset + 1 : 0}–${Math.min(total, offset + limit)} of ${total}`),
    h("button", { id: "next-page", disabled: current >= last, onclick: () => onMove(offset + limit) }, "Next ›"));
}

// A table without rows says why it has none (in its foot: its body holds only rows).
function table(id, headers, rows, empty) {
  return h("table", { id },
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows),
    rows.length || !empty ? null
      : h("tfoot", {}, h("tr", { class: "empty" }, h("td", { colspan: headers.length, class: "wrap muted" }, empty))));
}

function matching(what, q) {
  return `No ${what} matches “${q}”: clear the filter to see them all.`;
}

function noHttp() {
  // the clients come from the servers' /status: without it the console cannot see them
  const o = state.overview;
  return o && o.servers.length > 0 && o.servers.every((s) => !s.http);
}

// -- charts: the console computes their geometry (history.py); the page only makes the
// SVG elements, every value set as an attribute or text -------------------------------------

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const child of children) el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return el;
}

function figure(value) {
  return value === null || value === undefined ? "–" : String(Number(value.toFixed(2)));
}

function chartFigure(c) {
  const w = c.width, ht = c.height;
  const drawing = svg("svg", { viewBox: `0 0 ${w} ${ht}`, preserveAspectRatio: "none", class: "plot-area",
    role: "img", "aria-label": `${c.title} since ${c.x_label}` },
  svg("line", { x1: 0, y1: 0.5, x2: w, y2: 0.5, class: "grid" }),
  svg("line", { x1: 0, y1: ht / 2, x2: w, y2: ht / 2, class: "grid" }),
  svg("line", { x1: 0, y1: ht - 0.5, x2: w, y2: ht - 0.5, class: "axis" }));
  c.lines.forEach((line, i) => {
    for (const segment of line.segments) {
      const points = segment.split(" ");
      if (points.length === 1) {
        const [x, y] = points[0].split(",");
        drawing.append(svg("circle", { cx: x, cy: y, r: 2, class: `series s${i}`, "data-line": line.name }));
      } else {
        drawing.append(svg("polyline", { points: segment, class: `series s${i}`, "data-line": line.name }));
      }
    }
  });
  return h("figure", { class: "chart", id: `chart-${c.key}`, "data-points": c.points },
    h("figcaption", {}, h("b", {}, c.title), " ",
      c.lines.map((l, i) => h("span", { class: `legend s${i}` }, `${l.name} ${figure(l.last)} ${c.unit}`))),
    h("div", { class: "plot" },
      h("span", { class: "ymax" }, c.y_label),
      drawing,
      c.points ? null : h("span", { class: "nodata" }, c.empty),
      h("div", { class: "xaxis" }, h("span", {}, c.x_label), h("span", {}, "now"))));
}

function chartsRow(charts) {
  return h("div", { class: "charts", id: "charts" }, charts.map(chartFigure));
}

// -- views -----------------------------------------------------------------------------------

const views = {};

views.cluster = async () => {
  const o = state.overview || await api("/api/overview");
  const charts = await api("/api/charts");
  const c = o.cluster;
  const leader = o.servers.find((s) => s.leader && s.alive);
  return h("div", { id: "view-cluster" },
    h("div", { class: "cards" },
      card("Coordination", c.coordination, "coordination"),
      card("Servers alive", c.servers_alive, "servers-alive"),
      card("Leader", leader ? `server ${leader.server_id}` : "–", "leader"),
      card("Storage nodes up", `${c.storage_up} / ${c.storage_nodes}`, "storage-up"),
      card("Partitions", c.partitions, "partition-count"),
      card("Without a live server", c.unowned, "unowned"),
      card("Commit rate", `${c.commit_rate} tx/s`, "commit-rate"),
      card("Commit p50 / p99 (last minute)", `${show(c.commit_p50_ms)} / ${show(c.commit_p99_ms)} ms`, "latency")),
    chartsRow(charts.charts),
    h("h2", {}, "Servers"),
    table("servers-table", ["server", "endpoint", "alive", "leader", "partitions owned", "preferred", "clients"],
      o.servers.map((s) => h("tr", { "data-server": s.server_id },
        h("td", {}, s.server_id), h("td", {}, s.endpoint),
        h("td", { class: s.alive ? "ok" : "bad" }, s.alive ? "alive" : "gone"),
        h("td", { class: "leader" }, s.leader ? "leader" : ""),
        h("td", { class: "wrap owned" }, `${s.partitions.length}: ${abbreviate(s.partitions)}`),
        h("td", { class: "wrap" }, s.preferred_partitions.length ? `${abbreviate(s.preferred_partitions)} (${s.preferred_source})` : "–"),
        h("td", {}, show(s.connected_clients)))),
      "No server is registered in coordination: start one with this cluster's coordination URI (waltz server)."),
    h("h2", {}, "Storage nodes"),
    table("storage-table", ["node", "group", "state", "replicas assigned", "hosted", "disk used", "disk free", "fsync p50", "fsync p99", "fenced requests"],
      o.storage.map((s) => h("tr", { "data-node": s.node },
        h("td", {}, s.node), h("td", {}, s.group),
        h("td", { class: s.up ? "ok" : s.up === false ? "bad" : "bad" }, s.up ? "up" : s.http ? "not serving" : "down / no answer"),
        h("td", { class: "wrap" }, `${s.partitions.length}: ${abbreviate(s.partitions)}`),
        h("td", {}, s.hosted.length),
        h("td", {}, bytes(s.disk_used)), h("td", {}, bytes(s.disk_free)),
        h("td", {}, show(s.fsync_p50_ms, "ms")), h("td", {}, show(s.fsync_p99_ms, "ms")),
        h("td", {}, s.fenced_requests === null ? "–" : `${s.fenced_requests} (${show(s.fenced_rate)}/s)`))),
      "No storage node is a member of this cluster: add one on the Actions page (or waltz cluster add-storage-node)."),
    Object.keys(c.probe_errors || {}).length
      ? h("div", { class: "notice" }, "Endpoints that did not answer: " +
          Object.entries(c.probe_errors).map(([u, e]) => `${u}: ${e}`).join("; "))
      : null);
};

function card(label, value, id) {
  return h("div", { class: "card", id: `card-${id}` }, h("div", { class: "label" }, label),
    h("div", { class: "value" }, show(value)));
}

function abbreviate(list) {
  if (!list.length) return "none";
  return list.length > 12 ? list.slice(0, 12).join(", ") + ", …" : list.join(", ");
}

views.partitions = async (route) => {
  const offset = Number(route.params.get("offset") || 0);
  const q = route.params.get("q") || "";
  const data = await api(`/api/partitions?offset=${offset}&limit=${PAGE}&q=${encodeURIComponent(q)}`);
  const search = h("input", { id: "partition-filter", placeholder: "partition, server, state", value: q });
  search.addEventListener("keydown", (e) => { if (e.key === "Enter") go("partitions", null, { q: search.value }); });
  return h("div", { id: "view-partitions" },
    h("div", { class: "toolbar" }, search, h("button", { onclick: () => go("partitions", null, { q: search.value }) }, "Filter")),
    pager(data.total, data.offset, data.limit, (o) => go("partitions", null, { q, offset: o })),
    table("partitions-table", ["partition", "owner", "generation", "high-water mark", "commit rate", "store session", "state", "replicas (max id / lag)", "low-water mark", "lock failures/s", "p50", "p99", "clients"],
      data.rows.map((p) => h("tr", { "data-partition": p.partition },
        h("td", {}, partitionLink(p.partition)),
        h("td", { class: "owner " + (p.owner_alive ? "" : "bad") }, p.owner === null ? "none" : `server ${p.owner}${p.owner_alive ? "" : " (gone)"}`),
        h("td", { class: "generation" }, show(p.generation)),
        h("td", { class: "hwm" }, show(p.high_water_mark)),
        h("td", { class: "rate" }, show(p.commit_rate, "/s")),
        h("td", {}, show(p.session_id)),
        h("td", { class: "state" }, h("span", { class: "pill " + stateClass(p.state) }, p.state || "unknown")),
        h("td", { class: "wrap" }, p.replicas.map((r) => `${r.node} ${show(r.max_transaction_id)}${r.lag ? " (-" + r.lag + ")" : ""}`).join(", ")),
        h("td", {}, show(p.low_water_mark)),
        h("td", {}, show(p.lock_failure_rate)),
        h("td", { class: "p50" }, show(p.commit_p50_ms, "ms")), h("td", { class: "p99" }, show(p.commit_p99_ms, "ms")),
        h("td", {}, p.clients))),
      q ? matching("partition", q) : "The cluster has no partition."));
};

views.partition = async (route) => {
  const data = await api(`/api/partitions/${encodeURIComponent(route.arg)}`);
  const p = data.partition;
  return h("div", { id: "view-partition", "data-partition": p.partition },
    h("h2", {}, `Partition ${p.partition}`),
    h("div", { class: "cards" },
      card("Owner", p.owner === null ? "none" : `server ${p.owner}`, "owner"),
      card("Generation", p.generation, "generation"),
      card("High-water mark", p.high_water_mark, "hwm"),
      card("Commit rate", show(p.commit_rate, "tx/s"), "rate"),
      card("Store session", p.session_id, "session"),
      card("State", p.state || "unknown", "state"),
      card("Low-water mark", p.low_water_mark, "lwm"),
      card("Commit p50 / p99 (last minute)", `${show(p.commit_p50_ms)} / ${show(p.commit_p99_ms)} ms`, "latency"),
      card("Lock failures", show(p.lock_failure_rate, "/s"), "locks"),
      card("Archived through", p.archive_mark === null || p.archive_mark < 0 ? "not archived" : p.archive_mark, "archive")),
    chartsRow(data.charts),
    h("p", {}, h("a", { href: `#/transactions/${p.partition}?latest=1`, id: "browse-link" }, "Browse its transactions ›")),
    h("h3", {}, "Replicas"),
    table("replicas-table", ["storage node", "max transaction id", "acknowledged", "in the store session", "lag"],
      p.replicas.map((r) => h("tr", { "data-node": r.node }, h("td", {}, r.node), h("td", {}, show(r.max_transaction_id)),
        h("td", {}, show(r.acknowledged)), h("td", {}, r.writable ? "yes" : "no"), h("td", {}, show(r.lag)))),
      `Partition ${p.partition} has no replica assigned: add one on the Actions page.`),
    h("h3", {}, "Clients"),
    clientsTable(data.clients, noHttp()
      ? "Clients are not known: the console reads no server's HTTP endpoint (--http)."
      : `No client is connected to partition ${p.partition} now.`),
    h("h3", {}, "Events"),
    eventsTable(data.events, `Nothing has happened to partition ${p.partition} since the console started (${when(data.started)}).`));
};

function clientsTable(rows, empty) {
  return table("clients-table", ["partition", "client", "feed position", "lag", "server"],
    rows.map((c) => h("tr", {}, h("td", {}, partitionLink(c.partition)), h("td", {}, c.client),
      h("td", {}, c.position), h("td", { class: c.lag ? "warn" : "" }, show(c.lag)), h("td", {}, show(c.server_id)))),
    empty);
}

function eventsTable(rows, empty) {
  return table("events-table", ["time", "kind", "partition", "what happened"],
    rows.map((e) => h("tr", { class: `event-${e.kind}` }, h("td", {}, when(e.time)), h("td", {}, e.kind),
      h("td", {}, e.partition === null ? "" : partitionLink(e.partition)), h("td", { class: "wrap" }, e.message))),
    empty);
}

views.clients = async (route) => {
  const offset = Number(route.params.get("offset") || 0);
  const q = route.params.get("q") || "";
  const data = await api(`/api/clients?offset=${offset}&limit=${PAGE}&q=${encodeURIComponent(q)}`);
  const search = h("input", { id: "client-filter", placeholder: "partition or client", value: q });
  search.addEventListener("keydown", (e) => { if (e.key === "Enter") go("clients", null, { q: search.value }); });
  return h("div", { id: "view-clients" },
    h("div", { class: "toolbar" }, search),
    pager(data.total, data.offset, data.limit, (o) => go("clients", null, { q, offset: o })),
    clientsTable(data.rows, q ? matching("client", q) : noHttp()
      ? "Clients are not known: the console reads no server's HTTP endpoint (--http)."
      : "No client is connected to this cluster: producers and consumers show here while connected to a partition's server."));
};

views.events = async (route) => {
  const kind = route.params.get("kind") || "";
  const data = await api(`/api/events?limit=500${kind ? "&kind=" + encodeURIComponent(kind) : ""}`);
  return h("div", { id: "view-events" },
    h("p", { class: "muted" }, `${data.total} event(s) since the console started; newest first.`),
    eventsTable(data.events, kind
      ? `No ${kind} event since the console started (${when(data.started)}).`
      : `Nothing has happened since the console started (${when(data.started)}): servers, partitions, store sessions, replicas, ACLs and archive rounds show here as they change.`));
};

views.transactions = async (route) => {
  const partition = route.arg;
  const count = Number(route.params.get("count") || 20);
  const follow = route.params.get("follow") === "1";
  const latest = route.params.get("latest") === "1" || follow;
  const start = route.params.get("start") || "0";
  const pInput = h("input", { id: "tx-partition", size: 6, value: partition || "" });
  const sInput = h("input", { id: "tx-start", size: 10, value: latest ? "" : start, placeholder: "first id" });
  const cInput = h("input", { id: "tx-count", size: 4, value: count });
  const read = () => go("transactions", pInput.value.trim(), { start: sInput.value.trim() || "0", count: cInput.value.trim() });
  const toolbar = h("div", { class: "toolbar" },
    h("label", {}, "Partition ", pInput), h("label", {}, "from id ", sInput), h("label", {}, "count ", cInput),
    h("button", { id: "tx-read", class: "primary", onclick: read }, "Read"),
    h("button", { id: "tx-latest", onclick: () => go("transactions", pInput.value.trim(), { latest: 1, count: cInput.value.trim() }) }, "Jump to latest"),
    h("label", {}, h("input", { type: "checkbox", id: "tx-follow", checked: follow,
      onchange: (e) => go("transactions", pInput.value.trim(), e.target.checked ? { follow: 1, count: cInput.value.trim() } : { latest: 1, count: cInput.value.trim() }) }), " follow live"));
  const root = h("div", { id: "view-transactions" }, toolbar);
  if (partition === undefined || partition === "") {
    root.append(h("p", { class: "muted" }, "Choose a partition."));
    return root;
  }
  let data;
  try {
    const q = latest ? `latest=1&count=${encodeURIComponent(count)}` : `start=${encodeURIComponent(start)}&count=${encodeURIComponent(count)}`;
    data = await api(`/api/partitions/${encodeURIComponent(partition)}/transactions?${q}`);
  } catch (err) {
    root.append(h("div", { class: "error", id: "tx-error" }, err.message));
    return root;
  }
  const first = data.start, last = data.start + data.transactions.length - 1;
  root.append(h("p", { id: "tx-summary" }, `Partition ${data.partition}: high-water mark ${data.high_water_mark}; ` +
      (data.transactions.length ? `transactions ${first}–${last}` : "no transaction in this range"),
    " ", data.start > 0 ? h("a", { href: `#/transactions/${partition}?start=${Math.max(0, first - count)}&count=${count}`, id: "tx-older" }, "‹ older") : null,
    " ", last < data.high_water_mark ? h("a", { href: `#/transactions/${partition}?start=${last + 1}&count=${count}`, id: "tx-newer" }, "newer ›") : null));
  if (data.note) root.append(h("div", { class: "notice" }, data.note));
  for (const tx of data.transactions.slice().reverse()) root.append(transaction(tx));
  return root;
};

function transaction(tx) {
  const body = h("pre", { class: "tx-data" });
  const modes = { json: tx.json, text: tx.text, hex: tx.hex };
  const buttons = h("span", { class: "tabs" });
  const pick = (mode) => {
    body.textContent = modes[mode];
    for (const b of buttons.children) b.classList.toggle("sel", b.dataset.mode === mode);
  };
  for (const mode of ["json", "text", "hex"]) {
    if (modes[mode] === null || modes[mode] === undefined) continue;
    buttons.append(h("button", { "data-mode": mode, onclick: () => pick(mode) }, mode === "text" ? "UTF-8" : mode.toUpperCase()));
  }
  const el = h("div", { class: "tx", "data-transaction": tx.transaction_id },
    h("div", { class: "meta" },
      h("b", {}, `#${tx.transaction_id}`),
      h("span", {}, `header ${tx.header}`),
      h("span", {}, `${tx.size} bytes${tx.truncated ? " (first 4 KiB shown)" : ""}`),
      h("span", {}, `client ${tx.request.client_id}, request ${tx.request.seq_num}, generation ${tx.request.generation}`),
      h("span", {}, `crc32c ${tx.checksum}`),
      h("span", { class: "muted" }, "locks: not stored in the log"),
      buttons),
    body);
  pick(tx.json !== null ? "json" : tx.text !== null ? "text" : "hex");
  return el;
}

views.actions = async () => {
  const session = await api("/api/session");
  state.authenticated = session.authenticated;
  updateWho();
  const root = h("div", { id: "view-actions" });
  if (!session.authenticated) {
    const token = h("input", { id: "login-token", type: "password", size: 40, placeholder: "console token" });
    const message = h("div", { id: "login-message" });
    root.append(h("p", {}, "Actions change the cluster: log in with the token the console printed at start (",
      h("code", {}, "waltz dev"), " writes it to ", h("code", {}, "DATA_DIR/console.token"), ")."),
    h("form", { id: "login-form", onsubmit: async (e) => {
      e.preventDefault();
      try { await post("/api/login", { token: token.value }); render(); }
      catch (err) { message.replaceChildren(h("div", { class: "error" }, err.message)); }
    } }, token, " ", h("button", { class: "primary", id: "login-button" }, "Log in")), message);
    return root;
  }
  const o = state.overview || await api("/api/overview");
  const nodes = o.storage.map((s) => s.node);
  const result = h("div", { id: "action-result" });
  const form = (name, title, fields, describe) => {
    const inputs = {};
    const f = h("form", { id: `form-${name}` }, h("h3", {}, title),
      fields.map(([key, label, placeholder, type]) => {
        const input = h("input", { name: key, id: `${name}-${key}`, placeholder: placeholder || "", type: type || "text" });
        if (type === "checkbox") input.removeAttribute("placeholder");
        inputs[key] = input;
        return h("label", {}, label, " ", input);
      }),
      h("button", { class: name === "verify" ? "primary" : "danger", id: `${name}-submit` }, title));
    f.addEventListener("submit", async (e) => {
      e.preventDefault();
      const body = {};
      for (const [key, input] of Object.entries(inputs)) body[key] = input.type === "checkbox" ? input.checked : input.value.trim();
      if (!(await confirmAction(describe(body)))) {
        result.replaceChildren(h("div", { class: "notice" }, "Cancelled: nothing was changed."));
        return;
      }
      result.replaceChildren(h("div", { class: "notice" }, "Working ..."));
      try {
        const answer = await post(`/api/actions/${name}`, Object.assign({ confirm: true }, body));
        result.replaceChildren(actionResult(name, answer));
      } catch (err) {
        result.replaceChildren(h("div", { class: "error" }, err.message));
      }
    });
    return f;
  };
  root.append(
    h("div", { class: "toolbar" }, h("span", { class: "ok" }, "Logged in"),
      h("button", { id: "logout", onclick: async () => { await post("/api/logout"); render(); } }, "Log out")),
    h("p", { class: "muted" }, `Storage nodes: ${nodes.join(", ") || "none"}. Every action asks for a confirmation first.`),
    result,
    h("div", { class: "forms" },
      form("verify", "Verify the cluster", [], () => "Run `cluster verify`: read the metadata, every storage node and the servers (changes nothing)."),
      form("add-replica", "Add a replica", [["partition", "Partition", "0"], ["storage_node", "Storage node", "host:port"]],
        (b) => `Add a replica of partition ${b.partition} on ${b.storage_node}? The owner starts a new store session and catches it up.`),
      form("remove-replica", "Remove a replica", [["partition", "Partition", "0"], ["storage_node", "Storage node", "host:port"]],
        (b) => `Remove the replica of partition ${b.partition} on ${b.storage_node}? Its data stays on the node.`),
      form("add-storage-node", "Add a storage node", [["storage_node", "Storage node", "host:port"], ["group", "Group", "0"]],
        (b) => `Make ${b.storage_node} a member of the cluster (group ${b.group || 0})?`),
      form("remove-storage-node", "Remove a storage node", [["storage_node", "Storage node", "host:port"], ["force", "Also drop its replicas", "", "checkbox"]],
        (b) => `Remove storage node ${b.storage_node} from the cluster${b.force ? " and drop its replicas" : ""}?`),
      form("preferred-partitions", "Set preferred partitions", [["endpoint", "Server endpoint", "tcp://host:port"], ["partitions", "Partitions", "0, 3, 5"], ["reset", "Reset to the server's config", "", "checkbox"]],
        (b) => b.reset ? `Reset the preferred partitions of ${b.endpoint}?` : `Set the preferred partitions of ${b.endpoint} to [${b.partitions}]?`)));
  return root;
};

function actionResult(name, answer) {
  const box = h("div", { class: answer.ok === false ? "error" : "notice", id: "action-message" }, answer.message);
  if (name !== "verify") return box;
  return h("div", {}, box,
    table("findings-table", ["severity", "kind", "subject", "finding"],
      answer.findings.map((f) => h("tr", { class: `finding ${f.severity}` }, h("td", {}, f.severity), h("td", {}, f.kind),
        h("td", {}, f.subject), h("td", { class: "wrap" }, f.message))),
      "No finding: the metadata, the storage nodes and the servers agree."));
}

function confirmAction(text) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
  });
}

function updateWho() {
  document.getElementById("who").textContent = state.authenticated ? "logged in" : "read-only";
}

// -- rendering and live updates ------------------------------------------------------------------

function errorPage(c) {
  return h("div", { class: "errorpage", id: "error-page" },
    h("h2", {}, "The cluster cannot be read"),
    h("p", {}, `The console reads the cluster from ${c.coordination}, which answers: `),
    h("div", { class: "error", id: "coordination-error" }, c.coordination_error),
    h("p", {}, "Check that the coordination service (ZooKeeper, etcd, or the local store of ",
      h("code", {}, "waltz dev"), ") runs and that the URI is right. The console retries by itself; ",
      "this page updates when it connects."));
}

async function render() {
  if (state.busy) { state.pending = true; return; }
  state.busy = true;
  try {
    do {
      state.pending = false;
      const route = parseRoute();
      const routeKey = location.hash;
      state.route = route;
      for (const a of document.querySelectorAll("#nav a")) {
        a.classList.toggle("active", a.dataset.view === route.view || (route.view === "partition" && a.dataset.view === "partitions"));
      }
      const main = document.getElementById("main");
      let content;
      try {
        state.overview = await api("/api/overview");
        state.authenticated = state.overview.authenticated;
        updateWho();
        const c = state.overview.cluster;
        const banner = document.getElementById("banner");
        if (c.coordination_error && !c.cluster_key) {
          banner.classList.add("hidden");
          content = errorPage(c);
        } else {
          banner.classList.toggle("hidden", !c.coordination_error);
          banner.textContent = c.coordination_error ? `Coordination: ${c.coordination_error} (showing what was read last)` : "";
          const view = views[route.view];
          content = view ? await view(route) : h("div", { class: "error" }, `No view ${route.view}.`);
        }
      } catch (err) {
        content = h("div", { class: "error", id: "view-error" }, err.message);
      }
      // the route changed while this one was read: its hashchange renders the new one
      if (routeKey !== location.hash) { state.pending = true; continue; }
      // keep the focus and the scroll position of a form being typed in
      const active = document.activeElement;
      if (active && active.tagName === "INPUT" && main.contains(active) && state.routeKey === routeKey) {
        continue;
      }
      state.routeKey = routeKey;
      // the same view with the same values: keep the page as it is (a button being
      // clicked or text being selected stays where it is)
      const current = main.firstElementChild;
      if (!(current && current.outerHTML === content.outerHTML)) main.replaceChildren(content);
      main.dataset.version = state.overview ? state.overview.version : "";
    } while (state.pending);
  } finally {
    state.busy = false;
  }
}

function liveView() {
  // views that follow the cluster refresh on every update; a transaction range only when following
  const r = state.route || parseRoute();
  if (r.view === "transactions") return r.params.get("follow") === "1";
  return r.view !== "actions";
}

// At most one live-update connection per tab. A page the browser keeps in its
// back/forward cache would otherwise hold its stream open while hidden, and after a
// few navigations the browser's six connections per host would all be taken: the
// next page would wait for one ("Loading ...") until a cached page is evicted.
let source = null;

function setLive(text, on) {
  const live = document.getElementById("live");
  live.textContent = text;
  live.className = on ? "live on" : "live off";
}

function connect() {
  if (source !== null) return;
  setLive("connecting", false);
  source = new EventSource("/api/stream");
  source.addEventListener("update", (e) => {
    setLive("live", true);
    const data = JSON.parse(e.data);
    state.version = data.version;
    if (liveView()) render();
  });
  source.addEventListener("error", () => setLive("reconnecting", false));
}

function disconnect() {
  if (source === null) return;
  source.close();
  source = null;
  setLive("paused", false);
}

window.addEventListener("hashchange", render);
window.addEventListener("DOMContentLoaded", () => { render(); connect(); });
// leaving the page (it may be kept in the back/forward cache): close the stream;
// shown again from that cache: reopen it and show what changed meanwhile
window.addEventListener("pagehide", disconnect);
window.addEventListener("pageshow", (e) => {
  if (e.persisted) render();
  connect();
});
