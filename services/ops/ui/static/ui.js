// streamrl ui: each page fills <main> from the JSON routes (services/ops/ui/app.py); charts are Plotly's.
"use strict";
const main = document.getElementById("main");
const parts = location.pathname.split("/").map(decodeURIComponent);
const RUN = parts[1] === "run" ? parts[2] : null;
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const fmt = (x, d = 3) => (x === null || x === undefined ? "-" : typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : esc(x));
const runUrl = (run) => "/run/" + encodeURIComponent(run);
async function api(path) {
  const r = await fetch(path, {credentials: "same-origin"});
  const body = await r.json().catch(() => ({error: r.statusText}));
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}
function fail(err) { main.insertAdjacentHTML("afterbegin", `<p class="err" id="error">${esc(err.message || err)}</p>`); }
function crumbs(html) { document.getElementById("crumbs").innerHTML = html; }
function table(head, rows) {
  return `<table><tr>${head.map((h) => `<th>${esc(h)}</th>`).join("")}</tr>${rows.map((r) => `<tr>${r.map((c) => `<td>${c}</td>`).join("")}</tr>`).join("")}</table>`;
}
// a colour per policy version (tool output and prompt tokens: version -1, drawn as masked / prompt)
function versionColour(v) { return v < 0 ? "#e5e7eb" : `hsl(${(v * 67) % 360}, 70%, 82%)`; }

// ---- runs
async function runsPage() {
  const rows = await api("/api/runs");
  main.innerHTML = `<h2>Runs</h2>` + (rows.length ? table(["run", "state", "model", "version", "reward (last 20 steps)", "started", "ended / last step"],
    rows.map((r) => [`<a href="${runUrl(r.folder)}">${esc(r.folder)}</a>`, esc(r.state), esc(r.model), fmt(r.version), fmt(r.reward), esc(r.created), esc(r.last)]))
    : `<p class="muted">no runs under run_dir</p>`);
}

// ---- run
const LAYOUT = (title, x, y) => ({title: {text: title, font: {size: 13}}, margin: {l: 50, r: 10, t: 30, b: 40}, xaxis: {title: {text: x}}, yaxis: {title: {text: y}}, legend: {orientation: "h"}});
const PLOT_CFG = {displaylogo: false, responsive: true};
async function runPage() {
  crumbs(`/ <a href="${runUrl(RUN)}">${esc(RUN)}</a> / <a href="${runUrl(RUN)}/episodes">episodes</a>`);
  let v = await api(`/api/run/${encodeURIComponent(RUN)}`);
  main.innerHTML = `<h2>Run ${esc(RUN)} <span class="muted" id="state"></span></h2><div class="tiles" id="tiles"></div>
    <div class="grid">${["reward", "samples", "staleness", "busy", "fractions", "again", "restarts"].map((c) => `<div class="chart" id="chart-${c}"></div>`).join("")}</div>
    <h3>Workers</h3><div id="workers"></div><h3>Dead letters</h3><div id="dead"></div><h3>End-of-run check</h3><div id="check" class="muted">-</div>`;
  const t0 = v.train.time.length ? v.train.time[0] - 1 : v.now;
  const mins = (ts) => ts.map((t) => (t - t0) / 60);
    let last = -1;
  Plotly.newPlot("chart-reward", [
    {x: mins(v.train.time), y: v.train.reward, name: "train", mode: "lines"},
    {x: mins(v.validation.time), y: v.validation.reward, name: "validation (sampled)", mode: "lines+markers"},
    {x: mins(v.validation.time), y: v.validation.greedy, name: "validation (greedy)", mode: "lines+markers"}],
    LAYOUT("reward", "minutes", "reward"), PLOT_CFG);
  Plotly.newPlot("chart-samples", [{x: mins(v.train.time), y: v.train.samples_per_s, name: "samples/s", mode: "lines"}], LAYOUT("samples trained / s", "minutes", "samples/s"), PLOT_CFG);
  Plotly.newPlot("chart-fractions", [
    {x: mins(v.train.time), y: v.train.clip_fraction, name: "clip fraction", mode: "lines"},
    {x: mins(v.train.time), y: v.train.is_masked_fraction, name: "IS-mask fraction", mode: "lines"}], LAYOUT("clip and IS-mask fractions", "minutes", "fraction of tokens"), PLOT_CFG);
    const bars = (w) => {
    Plotly.react("chart-staleness", [{x: Object.keys(w.staleness), y: Object.values(w.staleness), type: "bar"}], {...LAYOUT("staleness at training (policy tokens)", "versions behind", "tokens"), xaxis: {type: "category", title: {text: "versions behind"}}}, PLOT_CFG);
    Plotly.react("chart-busy", [{x: w.busy.process, y: w.busy.busy_s, type: "bar", name: "busy"}, {x: w.busy.process, y: w.busy.waiting_s, type: "bar", name: "waiting"}],
      {...LAYOUT("busy / waiting per process", "", "seconds"), barmode: "stack"}, PLOT_CFG);
    const restarts = Object.values(w.restarts).reduce((a, b) => a + b, 0);
    Plotly.react("chart-restarts", [{x: Object.keys(w.restarts), y: Object.values(w.restarts), type: "bar"}], LAYOUT(`restarts (streamrl keep): ${restarts || "none"}`, "process", "restarts"), PLOT_CFG);
  };
  const tables = (w) => {
    document.getElementById("state").textContent = w.ended ? "(ended: read from its folder)" : "(live)";
    const tiles = [["version", w.version], ["train steps", last + 1], [w.index_built ? "episodes" : "episodes (indexing…)", w.episodes], ...Object.entries(w.outcomes)];
    document.getElementById("tiles").innerHTML = tiles.map(([k, x]) => `<div class="tile">${esc(k)}<b>${fmt(x)}</b></div>`).join("") +
      (w.index_error ? `<p class="err">${esc(w.index_error)}</p>` : "");
    document.getElementById("workers").innerHTML = w.workers.length ? table(["process", "version", "paused", "episodes", "heartbeat"],
      w.workers.map((x) => [esc(x.name), fmt(x.version), fmt(x.paused), fmt(x.episodes), `${fmt(w.now - Number(x.time), 1)} s ago`])) : `<p class="muted">no live process</p>`;
    document.getElementById("dead").innerHTML = w.dead_letters.length ? table(["stream", "entry", "reason", "by"],
      w.dead_letters.map((d) => [esc(d.stream), esc(d.entry), esc(d.reason), esc(d.by)])) : `<p class="muted">none</p>`;
  };
  const update = (w, first) => {
    const n = w.train.step.length;
    if (!first && n) {
      Plotly.extendTraces("chart-reward", {x: [mins(w.train.time)], y: [w.train.reward]}, [0]);
      Plotly.extendTraces("chart-samples", {x: [mins(w.train.time)], y: [w.train.samples_per_s]}, [0]);
      Plotly.extendTraces("chart-fractions", {x: [mins(w.train.time), mins(w.train.time)], y: [w.train.clip_fraction, w.train.is_masked_fraction]}, [0, 1]);
      Plotly.restyle("chart-reward", {x: [mins(w.validation.time), mins(w.validation.time)], y: [w.validation.reward, w.validation.greedy]}, [1, 2]);
    }
    if (n) last = w.train.step[n - 1];
    document.getElementById("chart-reward").dataset.points = String(document.getElementById("chart-reward").data[0].x.length);
    // the workers report every few seconds, and the index counts the streams' tokens once built: the difference
    // is exact (`streamrl check`'s row) once every worker's final report is in and the index is complete
    const exact = w.generated.final && w.index_built;
    Plotly.react("chart-again", [{x: ["generated (workers' reports)", "policy tokens in the streams"], y: [w.generated.tokens, w.index_built ? w.policy_tokens : null], type: "bar"}],
      LAYOUT(exact ? `tokens generated again: ${w.generated.tokens - w.policy_tokens}` : w.index_built ? "tokens generated again: once every worker's final report is in" : "tokens generated again: indexing the episodes…", "", "tokens"), PLOT_CFG);
    bars(w); tables(w);
  };
  update(v, true);
  const poll = async () => {
    try { const w = await api(`/api/run/${encodeURIComponent(RUN)}?since=${last}`); update(w, false); if (w.ended && w.index_built) return; }
    catch (e) { document.getElementById("state").textContent = `(${e.message})`; }
    setTimeout(poll, 2000);
  };
  if (!v.ended || !v.index_built) setTimeout(poll, 2000);  // a live run; an ended one until its index is built
  if (v.ended) {
    api(`/api/run/${encodeURIComponent(RUN)}/check`).then((c) => {
      document.getElementById("check").innerHTML = `<pre class="${c.ok ? "ok" : "err"}">${esc(c.text)}</pre>`;
    }).catch((e) => { document.getElementById("check").textContent = e.message; });
  } else {
    document.getElementById("check").textContent = "when the run has ended (reload then)";
  }
}

// ---- episodes
const FILTERS = ["outcome", "reward_below", "reward_above", "min_aborts", "min_span", "taken_over", "repacked", "kind", "group", "sort", "desc", "offset", "limit"];
async function episodesPage() {
  crumbs(`/ <a href="${runUrl(RUN)}">${esc(RUN)}</a> / episodes`);
  const q = new URLSearchParams(location.search);
  const outcomes = ["finished", "failed", "truncated", "running", "paused", "unreadable"];
  const chosen = (q.get("outcome") || "").split(",");
  main.innerHTML = `<h2>Episodes of ${esc(RUN)}</h2><form class="filters" id="filters">
    ${outcomes.map((o) => `<label><input type="checkbox" name="outcome" value="${o}" ${chosen.includes(o) ? "checked" : ""}>${o}</label>`).join("")}
    <label>reward &lt; <input type="number" step="any" name="reward_below" value="${esc(q.get("reward_below") || "")}"></label>
    <label>reward &gt; <input type="number" step="any" name="reward_above" value="${esc(q.get("reward_above") || "")}"></label>
    <label>aborts ≥ <input type="number" name="min_aborts" value="${esc(q.get("min_aborts") || "")}"></label>
    <label>versions ≥ <input type="number" name="min_span" value="${esc(q.get("min_span") || "")}"></label>
    <label><input type="checkbox" name="taken_over" value="1" ${q.get("taken_over") ? "checked" : ""}>taken over</label>
    <label><input type="checkbox" name="repacked" value="1" ${q.get("repacked") ? "checked" : ""}>repacked</label>
    <label>kind <select name="kind"><option value="">any</option><option ${q.get("kind") === "agent" ? "selected" : ""}>agent</option><option ${q.get("kind") === "plain" ? "selected" : ""}>plain</option></select></label>
    <label>group <input name="group" size="10" value="${esc(q.get("group") || "")}"></label>
    <label>sort <select name="sort">${["id", "reward", "length", "span", "aborts"].map((s) => `<option ${q.get("sort") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
    <label><input type="checkbox" name="desc" value="1" ${q.get("desc") ? "checked" : ""}>descending</label>
    <button id="apply">apply</button></form><p id="count" class="muted"></p><div id="rows"></div>
    <p><button id="prev">← previous</button> <button id="next">next →</button></p>`;
  const form = document.getElementById("filters");
  const params = () => {
    const p = new URLSearchParams();
    const o = [...form.querySelectorAll("input[name=outcome]:checked")].map((x) => x.value).join(",");
    if (o) p.set("outcome", o);
    for (const el of form.elements) if (el.name && el.name !== "outcome" && (el.type === "checkbox" ? el.checked : el.value)) p.set(el.name, el.value);
    return p;
  };
  let offset = Number(q.get("offset") || 0);
  const load = async () => {
    const p = params(); p.set("offset", offset); p.set("limit", 50);
    history.replaceState(null, "", "?" + p.toString());
    const t0 = performance.now();
    const r = await api(`/api/run/${encodeURIComponent(RUN)}/episodes?${p}`);
    const ms = performance.now() - t0;
    document.getElementById("count").innerHTML = r.built ? `<span id="total">${r.total}</span> of ${r.indexed} episodes match · query ${r.query_ms} ms on the server, <span id="roundtrip">${ms.toFixed(0)}</span> ms here` +
      (r.error ? ` <span class="err">${esc(r.error)}</span>` : "") : `building the index: ${r.progress} episodes read…`;
    document.getElementById("rows").innerHTML = table(["episode", "outcome", "reward", "tokens", "versions", "aborts", "takeovers", "repacks", "agent calls", "error"],
      r.rows.map((s) => [`<a class="ep" href="${runUrl(RUN)}/ep/${encodeURIComponent(s.episode_id)}">${esc(s.episode_id)}</a>`, esc(s.outcome), fmt(s.reward), s.length,
        s.versions.length ? `v${s.versions[0]}${s.span > 1 ? "..v" + s.versions[s.versions.length - 1] : ""} (${s.span})` : "-", s.aborts, s.takeovers, s.repacks, s.agent ? s.calls : "", esc(s.error.slice(0, 80))]));
    document.getElementById("prev").disabled = offset === 0;
    document.getElementById("next").disabled = offset + r.rows.length >= r.total;
    main.dataset.loaded = String(Date.now());
    if (!r.built) setTimeout(load, 1000);
  };
  form.addEventListener("submit", (e) => { e.preventDefault(); offset = 0; load().catch(fail); });
  document.getElementById("prev").onclick = () => { offset = Math.max(0, offset - 50); load().catch(fail); };
  document.getElementById("next").onclick = () => { offset += 50; load().catch(fail); };
  await load();
}

// ---- episode
// a token's experts, layer by layer ("1,5 | 0,3")
const expertsText = (route) => route.map((layer) => layer.join(",")).join(" | ");
// how many MoE layers another version routes a token differently: white (none) to red (every layer)
function routeColour(k, layers) { return k === null ? "" : k === 0 ? "#f3f4f6" : `hsl(0, 85%, ${88 - (40 * k) / layers}%)`; }
function tokensHtml(pieces, ids, versions, logprobs, mask, marks, routes) {
  const byAt = {};
  for (const m of marks) (byAt[m.at] = byAt[m.at] || []).push(m);
  const markHtml = (m) => `<span class="marker m-${m.kind}" data-kind="${m.kind}" data-at="${m.at}" data-worker="${esc(m.worker)}" data-version="${m.version}" data-seq="${m.seq}" title="seq ${m.seq}: ${esc(m.kind)} at token ${m.at} by ${esc(m.worker)} under v${m.version}${m.why ? " (" + esc(m.why) + ")" : ""}">${m.kind === "aborted" ? "■" : m.kind.startsWith("tool") ? "◆" : "▶"} ${esc(m.kind)} · ${esc(m.worker)} · v${m.version}</span>`;
  let out = "";
  for (let i = 0; i <= ids.length; i++) {
    for (const m of byAt[i] || []) out += markHtml(m);
    if (i === ids.length) break;
    const masked = mask && !mask[i];
    const experts = routes && routes[i] ? ` · experts ${expertsText(routes[i])}` : "";
    const tip = masked ? `masked (tool output): token ${ids[i]}` : `v${versions[i]} · logprob ${Number(logprobs[i]).toFixed(4)} · token ${ids[i]}${experts}`;
    out += `<span class="tok${masked ? " masked" : ""}" data-i="${i}" data-version="${versions[i]}" data-masked="${masked ? 1 : 0}" data-logprob="${logprobs[i]}" title="${tip}" style="background:${versionColour(masked ? -1 : versions[i])}">${esc(pieces[i])}</span>`;
  }
  return out;
}
async function episodePage() {
  const eid = parts[4];
  crumbs(`/ <a href="${runUrl(RUN)}">${esc(RUN)}</a> / <a href="${runUrl(RUN)}/episodes">episodes</a> / ${esc(eid)}`);
  const v = await api(`/api/run/${encodeURIComponent(RUN)}/ep/${encodeURIComponent(eid)}`);
  const r = v.replay;
  const seen = [...new Set(v.agent ? v.calls.flatMap((c) => c.versions) : r.versions.filter((x, i) => r.mask[i]))].sort((a, b) => a - b);
  let body = `<h2>Episode ${esc(r.episode_id)}</h2>
    <p>group ${esc(r.group_id)} #${r.index} · status <b id="status">${esc(r.status)}</b>${r.finish_reason ? " (" + esc(r.finish_reason) + ")" : ""} · reward <b id="reward">${fmt(r.reward)}</b>
    ${r.error ? `<span class="err">${esc(r.error)}</span>` : ""} ${Object.keys(r.reward_details || {}).length ? `· details <code>${esc(JSON.stringify(r.reward_details))}</code>` : ""}</p>
    <p class="legend">versions: ${seen.map((x) => `<span style="background:${versionColour(x)}">v${x}</span>`).join("")}<span class="tok masked">masked (tool output)</span></p>
    <p>replay it: <code class="cmd" id="command">${esc(v.command)}</code></p>`;
  if (v.agent) {
    body += `<h3>Agent ${esc(r.agent)}: ${v.calls.length} calls</h3>` + v.calls.map((c) => {
      const pmask = c.prompt_pieces.map((_, i) => i >= c.new_from && c.extends >= 0);
      const prompt = c.prompt_pieces.map((p, i) => `<span class="tok ${pmask[i] ? "new masked" : "prompt"}">${esc(p)}</span>`).join("");
      return `<div class="call${c.fork ? " fork" : ""}" data-call="${c.index}"><b>call ${c.index}</b> · ${c.fork ? "fork: a whole new prompt" : c.extends < 0 ? "whole prompt" : "extends call " + c.extends + " (its new tokens masked)"} · ${c.tokens.length} generated · ${c.done ? esc(c.reason) : "in flight"} · by ${esc(c.worker)}
        <details><summary>prompt (${c.prompt_pieces.length} tokens)</summary><div class="tokens">${prompt}</div></details>
        <div class="tokens response">${tokensHtml(c.pieces, c.tokens, c.versions, c.logprobs, null, c.markers)}</div>
        <p>from this call: <code class="cmd">${esc(c.command)}</code></p></div>`;
    }).join("");
  } else {
    body += `<h3>Prompt (${r.prompt_ids.length} tokens)</h3><div class="tokens" id="prompt">${v.prompt_pieces.map((p) => `<span class="tok prompt">${esc(p)}</span>`).join("")}</div>
      <h3>Response (${r.tokens.length} tokens)</h3><div class="tokens response" id="response">${tokensHtml(v.pieces, r.tokens, r.versions, r.logprobs, r.mask, v.markers, v.routes)}</div>`;
    if (v.routes) body += `<p id="routes-ctl">expert routes: colour each token by how many layers version <input id="routes-v" type="number" min="0" value="${seen.length ? seen[seen.length - 1] : 0}"> routes differently <button id="routes-go">compare</button> <span id="routes-sum" class="muted"></span></p>`;
  }
  body += `<h3>Events</h3>` + table(["seq", "+ms", "worker", "policy", "event", "continue from here"], r.events.map((e) => [e.seq, e.time_ms - r.events[0].time_ms, esc(e.worker), "v" + e.policy, esc(e.kind),
    v.commands[String(e.seq)] ? `<code>${esc(v.commands[String(e.seq)])}</code>` : ""]));
  main.innerHTML = body;
  main.dataset.loaded = "1";
  const go = document.getElementById("routes-go");
  if (go) go.onclick = () => compareRoutes(eid, v).catch(fail);
}
async function compareRoutes(eid, v) {
  const version = document.getElementById("routes-v").value;
  const w = await api(`/api/run/${encodeURIComponent(RUN)}/ep/${encodeURIComponent(eid)}?routes_under=${encodeURIComponent(version)}`);
  const under = w.routes_under;
  const layers = v.routes.find((x) => x) ? v.routes.find((x) => x).length : 1;
  for (const span of document.querySelectorAll("#response .tok")) {
    const i = Number(span.dataset.i), k = under.layers_changed[i];
    if (k === null || k === undefined) continue;
    span.style.background = routeColour(k, layers);
    span.dataset.layersChanged = k;
    span.title += ` · under ${under.version}: ${expertsText(under.routes[i])} (${k} layer${k === 1 ? "" : "s"} changed)`;
  }
  document.getElementById("routes-sum").textContent = under.summary;
}

const PAGES = {runs: runsPage, run: runPage, episodes: episodesPage, episode: episodePage};
PAGES[document.body.dataset.page]().catch(fail);
