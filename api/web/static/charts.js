// Line charts drawn as SVG, for the dashboard. No library: a time axis (the last N
// seconds, "now" at the right), a value axis with round ticks from 0, one path per series
// (a gap where a value is null), a legend with each series' latest value.
//
// Each chart's root element carries data-samples (points drawn) and data-max (the largest
// value drawn), so a test can tell that a chart moved without reading pixels. A chart with
// nothing above zero (an idle server) draws a 0..1 value axis.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT = { left: 46, right: 10, top: 8, bottom: 20 }; // margins inside the SVG, in px

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

// Round tick step for a range: 1, 2 or 5 times a power of ten, about `count` ticks.
function niceStep(max, count) {
  const raw = max / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const m = raw / power;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * power;
}

class LineChart {
  // spec: {id, title, unit, series: [{key, name, color, area?}], format?(v), minMax? (the least
  // top of the value axis), fixedMax? (its top, always)}
  constructor(container, spec) {
    this.spec = spec;
    this.root = ferrox.el("div", "chart panel");
    this.root.dataset.chart = spec.id;
    const head = ferrox.el("div", "head");
    head.append(ferrox.el("span", "title", spec.title), ferrox.el("span", "unit", spec.unit || ""));
    this.legend = ferrox.el("div", "legend");
    this.legendValues = {};
    for (const s of spec.series) {
      const item = ferrox.el("span");
      const swatch = ferrox.el("i");
      swatch.style.background = s.color;
      const value = ferrox.el("b", "", "–");
      item.append(swatch, document.createTextNode(s.name), value);
      this.legend.append(item);
      this.legendValues[s.key] = value;
    }
    this.svg = svgEl("svg", { preserveAspectRatio: "none" });
    this.root.append(head, this.legend, this.svg);
    container.append(this.root);
  }

  // points: [{t (ms), values: {key: number|null}}], oldest first; spanS: seconds shown.
  draw(points, spanS, nowMs) {
    const width = Math.max(this.svg.clientWidth || 400, 200);
    const height = Math.max(this.svg.clientHeight || 190, 100);
    this.svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const plotW = width - PLOT.left - PLOT.right;
    const plotH = height - PLOT.top - PLOT.bottom;
    let max = 0;
    let drawn = 0;
    for (const p of points) {
      for (const s of this.spec.series) {
        const v = p.values[s.key];
        if (v !== null && v !== undefined && Number.isFinite(v)) { max = Math.max(max, v); drawn++; }
      }
    }
    // Nothing drawn yet, or only zeros (an idle server): a 0..1 axis. Scaled to the tiny
    // floor a zero maximum used to get, the ticks were 5e-10 apart and read "0.0000000015".
    const top = this.spec.fixedMax || Math.max(max, this.spec.minMax || 0) * 1.1 || 1;
    const step = niceStep(top, 4);
    const yMax = this.spec.fixedMax || Math.ceil(top / step) * step;
    const x = (t) => PLOT.left + plotW * (1 - (nowMs - t) / (spanS * 1000));
    const y = (v) => PLOT.top + plotH * (1 - v / yMax);
    const fmt = this.spec.format || ((v) => ferrox.num(v));
    // step is 1, 2 or 5 times a power of ten: that many decimals and no more ("0.5", not "0.50").
    const decimals = step >= 1 ? 0 : Math.min(Math.ceil(-Math.log10(step)), 6);
    const tickText = this.spec.format
      || ((v) => (step >= 1000 ? ferrox.num(v) : String(Number(v.toFixed(decimals)))));

    const grid = svgEl("g", { class: "grid" });
    const axis = svgEl("g", { class: "axis" });
    for (let v = 0; v <= yMax + step / 2; v += step) {
      grid.append(svgEl("line", { x1: PLOT.left, x2: width - PLOT.right, y1: y(v), y2: y(v) }));
      const label = svgEl("text", { x: PLOT.left - 6, y: y(v) + 3.5, "text-anchor": "end" });
      label.textContent = tickText(v);
      axis.append(label);
    }
    const tickS = spanS <= 120 ? 30 : spanS <= 600 ? 60 : 300;
    for (let s = 0; s <= spanS; s += tickS) {
      const label = svgEl("text", { x: x(nowMs - s * 1000), y: height - 5,
        "text-anchor": s === 0 ? "end" : s === spanS ? "start" : "middle" });
      label.textContent = s === 0 ? "now" : "-" + (s >= 60 ? s / 60 + "m" : s + "s");
      axis.append(label);
    }
    const paths = svgEl("g");
    for (const s of this.spec.series) {
      let d = "";
      let open = false;
      let first = null;
      let last = null;
      for (const p of points) {
        const v = p.values[s.key];
        if (v === null || v === undefined || !Number.isFinite(v)) { open = false; continue; }
        const px = x(p.t).toFixed(1);
        const py = y(v).toFixed(1);
        d += (open ? "L" : "M") + px + "," + py;
        open = true;
        if (first === null) first = px;
        last = px;
      }
      if (!d) continue;
      if (s.area) {
        const base = y(0).toFixed(1);
        paths.append(svgEl("path", { class: "area", fill: s.color, d: d + `L${last},${base}L${first},${base}Z` }));
      }
      paths.append(svgEl("path", { class: "line", stroke: s.color, d }));
    }
    this.svg.replaceChildren(grid, axis, paths);
    const latest = points.length ? points[points.length - 1].values : {};
    for (const s of this.spec.series) this.legendValues[s.key].textContent = fmt(latest[s.key]);
    this.root.dataset.samples = String(drawn);
    this.root.dataset.max = String(max);
  }
}

window.LineChart = LineChart;
