// The live dashboard: polls /admin/stats (the engine's counters and gauges) and /metrics
// (the latency histograms) once a second and draws the last minutes.
//
// Every figure is measured from the server's counters between two polls, the way
// Prometheus' rate() and histogram_quantile() read them (docs/grafana-dashboard.json
// draws the same from a Prometheus server):
//   tokens/s       Δ prefill_tokens and Δ tokens_generated over the last RATE_S seconds;
//   TTFT / ITL     percentiles of the histogram buckets' Δ over the last QUANTILE_S seconds,
//                  linearly interpolated inside a bucket;
//   hit rate       Δ prefix_cache_hits / Δ prefix_cache_queries (prompt tokens) over HIT_S;
//   rows, queue, KV blocks: the gauges as polled.
// The history lives in this page (from when it was opened), at most MAX_SPAN_S seconds.
"use strict";

const POLL_MS = 1000;
const RATE_S = 5;
const QUANTILE_S = 30;
const HIT_S = 60;
const MAX_SPAN_S = 900;
const HISTOGRAMS = { ttft: "ferrox_time_to_first_token_seconds", itl: "ferrox_inter_token_latency_seconds" };
const COLORS = { a: "#d9480f", b: "#1f77b4", c: "#2b8a3e", d: "#7048e8" };

const samples = []; // {t, stats, hist: {ttft: {les, counts}, itl: ...}}
let charts = {};

// ---------------------------------------------------------------- reading the server

// The cumulative bucket counts of each histogram we draw, from Prometheus' text format.
function parseHistograms(text) {
  const out = {};
  const pattern = /^(\w+)_bucket\{[^}]*le="([^"]+)"[^}]*\}\s+(\S+)/;
  for (const line of text.split("\n")) {
    const m = pattern.exec(line);
    if (!m) continue;
    for (const [key, name] of Object.entries(HISTOGRAMS)) {
      if (m[1] !== name) continue;
      const h = out[key] || (out[key] = { les: [], counts: [] });
      h.les.push(m[2] === "+Inf" ? Infinity : Number(m[2]));
      h.counts.push(Number(m[3]));
    }
  }
  return out;
}

async function poll() {
  try {
    const [stats, metrics] = await Promise.all([
      ferrox.json("/admin/stats"),
      fetch("/metrics").then((r) => (r.ok ? r.text() : "")),
    ]);
    samples.push({ t: Date.now(), stats, hist: parseHistograms(metrics) });
    while (samples.length && samples[0].t < Date.now() - MAX_SPAN_S * 1000) samples.shift();
    showHeader(stats);
    render();
  } catch (e) {
    const state = document.getElementById("state");
    state.textContent = "unreachable";
    state.className = "state down";
  }
  setTimeout(poll, POLL_MS);
}

// ---------------------------------------------------------------- deriving the series

// The oldest sample at most `windowS` before sample i (i itself when none).
function windowStart(i, windowS) {
  let j = i;
  while (j > 0 && samples[j - 1].t >= samples[i].t - windowS * 1000) j--;
  return j;
}

function counterRate(i, field, windowS) {
  const j = windowStart(i, windowS);
  const dt = (samples[i].t - samples[j].t) / 1000;
  const dv = samples[i].stats[field] - samples[j].stats[field];
  return dt > 0 && dv >= 0 ? dv / dt : null; // a negative step is a new engine (a model swap)
}

// histogram_quantile over the buckets' increase between two samples; null without observations.
function quantile(q, now, then) {
  if (!now || !then || now.counts.length !== then.counts.length) return null;
  const counts = now.counts.map((c, k) => c - then.counts[k]);
  const total = counts[counts.length - 1];
  if (!(total > 0)) return null;
  const rank = q * total;
  for (let k = 0; k < counts.length; k++) {
    if (counts[k] < rank) continue;
    if (now.les[k] === Infinity) return now.les[k - 1] || null; // above the largest finite bound
    const lower = k ? now.les[k - 1] : 0;
    const below = k ? counts[k - 1] : 0;
    const inBucket = counts[k] - below;
    return lower + (now.les[k] - lower) * (inBucket > 0 ? (rank - below) / inBucket : 1);
  }
  return null;
}

function latencyMs(i, key, q) {
  const j = windowStart(i, QUANTILE_S);
  const v = quantile(q, samples[i].hist[key], samples[j].hist[key]);
  return v === null ? null : v * 1000;
}

function hitRatePercent(i) {
  const j = windowStart(i, HIT_S);
  const queries = samples[i].stats.prefix_cache_queries - samples[j].stats.prefix_cache_queries;
  const hits = samples[i].stats.prefix_cache_hits - samples[j].stats.prefix_cache_hits;
  return queries > 0 && hits >= 0 ? (100 * hits) / queries : null;
}

function point(i) {
  const s = samples[i].stats;
  const used = s.kv_blocks_total - s.kv_blocks_free;
  return {
    t: samples[i].t,
    values: {
      output: counterRate(i, "tokens_generated", RATE_S), prompt: counterRate(i, "prefill_tokens", RATE_S),
      ttft50: latencyMs(i, "ttft", 0.5), ttft90: latencyMs(i, "ttft", 0.9), ttft99: latencyMs(i, "ttft", 0.99),
      itl50: latencyMs(i, "itl", 0.5), itl90: latencyMs(i, "itl", 0.9), itl99: latencyMs(i, "itl", 0.99),
      running: s.running_rows, queue: s.queue_depth,
      used, cached: s.kv_blocks_cached, free: s.kv_blocks_free,
      hit: hitRatePercent(i),
    },
  };
}

// ---------------------------------------------------------------- drawing

const CHARTS = [
  { id: "throughput", title: "Throughput", unit: "tokens/s (" + RATE_S + " s rate)", series: [
    { key: "output", name: "output", color: COLORS.a, area: true }, { key: "prompt", name: "prompt", color: COLORS.b }] },
  { id: "ttft", title: "Time to first token", unit: "ms (last " + QUANTILE_S + " s)", series: [
    { key: "ttft50", name: "p50", color: COLORS.c }, { key: "ttft90", name: "p90", color: COLORS.b },
    { key: "ttft99", name: "p99", color: COLORS.a }] },
  { id: "itl", title: "Inter-token latency", unit: "ms (last " + QUANTILE_S + " s)", series: [
    { key: "itl50", name: "p50", color: COLORS.c }, { key: "itl90", name: "p90", color: COLORS.b },
    { key: "itl99", name: "p99", color: COLORS.a }] },
  { id: "scheduler", title: "Scheduler", unit: "rows · jobs", minMax: 1, series: [
    { key: "running", name: "running rows", color: COLORS.a, area: true },
    { key: "queue", name: "queue depth", color: COLORS.d }] },
  { id: "kv", title: "KV blocks", unit: "blocks", series: [
    { key: "used", name: "used", color: COLORS.a, area: true }, { key: "cached", name: "cached", color: COLORS.c },
    { key: "free", name: "free", color: COLORS.b }] },
  { id: "prefix", title: "Prefix-cache hit rate", unit: "% of prompt tokens (last " + HIT_S + " s)", fixedMax: 100,
    format: (v) => (v === null || v === undefined ? "–" : Math.round(v) + "%"),
    series: [{ key: "hit", name: "hit rate", color: COLORS.c, area: true }] },
];

function spanS() {
  return Number(document.getElementById("span").value);
}

function render() {
  const now = Date.now();
  const from = now - spanS() * 1000;
  const points = [];
  for (let i = 0; i < samples.length; i++) if (samples[i].t >= from) points.push(point(i));
  for (const spec of CHARTS) charts[spec.id].draw(points, spanS(), now);
  const last = points.length ? points[points.length - 1].values : {};
  const s = samples.length ? samples[samples.length - 1].stats : {};
  tile("output", last.output, "tok/s");
  tile("prompt", last.prompt, "tok/s");
  tile("ttft", last.ttft50, "ms");
  tile("itl", last.itl50, "ms");
  tile("running", last.running, s.kv_blocks_total !== undefined ? "rows" : "");
  tile("queue", last.queue, "jobs");
  tile("kv", s.kv_blocks_total ? (100 * last.used) / s.kv_blocks_total : null, "%");
  tile("hit", last.hit, "%");
  document.getElementById("totals").textContent =
    `requests ${ferrox.num(s.requests_total)} · errors ${ferrox.num(s.errors_total)} · ` +
    `generated ${ferrox.num(s.tokens_generated)} tokens · prefilled ${ferrox.num(s.prefill_tokens)} · ` +
    `recompiles after warm-up ${ferrox.num(s.recompiles_after_warmup)}`;
}

function tile(id, value, unit) {
  const node = document.getElementById("tile-" + id);
  node.replaceChildren(document.createTextNode(ferrox.num(value)), ferrox.el("small", "", unit));
}

function showHeader(stats) {
  const info = stats.model_info || {};
  document.getElementById("model-name").textContent = info.id || "no model";
  const state = document.getElementById("state");
  state.textContent = stats.state;
  state.className = "state " + (stats.state === "ready" ? "ready"
    : (stats.state === "loading" || stats.state === "draining") ? stats.state : "down");
}

document.addEventListener("DOMContentLoaded", () => {
  const box = document.getElementById("charts");
  for (const spec of CHARTS) charts[spec.id] = new LineChart(box, spec);
  document.getElementById("span").addEventListener("change", render);
  document.getElementById("forget-key").addEventListener("click", () => ferrox.forgetKey());
  window.addEventListener("resize", render);
  poll();
});
