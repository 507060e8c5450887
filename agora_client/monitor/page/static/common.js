"use strict";
// Shared by the swarm page and the contributor page: DOM building (text nodes only, never markup, so a name is
// always shown as the text it is), number and time formats, polling the monitor's JSON API, a small SVG line chart.
(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const POLL_MS = 10000;
  const MAX_CHART_POINTS = 600;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  // a table cell that, on a phone, shows its column's name beside it (page.css: table.stacked)
  function cell(label, text, className) {
    return el("td", className ? { class: className, "data-label": label } : { "data-label": label }, text);
  }

  function setText(id, text) {
    document.getElementById(id).textContent = String(text);
  }

  function fixed(value, digits) {
    return Number(value).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }

  function compact(value) {
    return new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 }).format(value);
  }

  // a chart's ticks and legends: three significant digits, thousands and up in compact form
  function short(value) {
    return Math.abs(value) >= 1000 ? compact(value) : String(Number(value.toPrecision(3)));
  }

  function time(ts) {
    return new Date(ts * 1000).toLocaleString();
  }

  function duration(seconds) {
    if (seconds < 90) return Math.round(seconds) + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    if (seconds < 172800) return fixed(seconds / 3600, 1) + " h";
    return fixed(seconds / 86400, 1) + " days";
  }

  async function getJson(url) {
    const response = await fetch(url, { cache: "no-store", headers: { Accept: "application/json" } });
    if (!response.ok) {
      const error = new Error(url + " answered HTTP " + response.status);
      error.status = response.status;
      throw error;
    }
    return response.json();
  }

  function showStatus(message) {
    const status = document.getElementById("status");
    status.textContent = message || "";
    status.hidden = !message;
  }

  // Runs refresh now and every POLL_MS while the page is visible; refresh may return a message to show.
  function poll(refresh) {
    let busy = false;
    let rendered = false;
    async function tick() {
      if (busy || (rendered && document.hidden)) return;
      busy = true;
      try {
        showStatus(await refresh());
        // once the first frame holding the data has been drawn (what bench/page.py reads)
        if (!rendered) requestAnimationFrame(() => setTimeout(() => performance.mark("agora-first-render"), 0));
        rendered = true;
      } catch (error) {
        showStatus("Could not read the monitor (" + error.message + "); trying again every " + POLL_MS / 1000 + " s.");
      } finally {
        busy = false;
      }
    }
    tick();
    setInterval(tick, POLL_MS);
    document.addEventListener("visibilitychange", tick);
  }

  function niceTicks(low, high, count) {
    const rough = (high - low) / count;
    const magnitude = Math.pow(10, Math.floor(Math.log10(rough)));
    const step = [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= rough);
    const ticks = [];
    for (let value = Math.ceil(low / step) * step; value <= high + step * 1e-9; value += step) ticks.push(value);
    return ticks;
  }

  function thin(points) {
    if (points.length <= MAX_CHART_POINTS) return points;
    const stride = Math.ceil(points.length / MAX_CHART_POINTS);
    return points.filter((_, i) => i % stride === 0 || i === points.length - 1);
  }

  function extent(values, fromZero) {
    let low = Math.min(...values), high = Math.max(...values);
    if (fromZero) low = Math.min(0, low);
    if (high === low) high = low + (Math.abs(low) || 1) * 0.1;
    return [low, high];
  }

  function timeLabel(ts, span) {
    const date = new Date(ts * 1000);
    return span > 172800 ? date.toLocaleDateString([], { month: "short", day: "numeric" })
      : date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  // series: [{name, points: [[unix seconds, value], ...]}]; draws an SVG into container, or options.empty as text.
  function lineChart(container, series, options) {
    const drawn = series.map((s) => ({ name: s.name, points: thin(s.points) }));
    const all = drawn.flatMap((s) => s.points);
    container.replaceChildren();
    if (!all.length) {
      container.append(el("p", { class: "muted" }, options.empty));
      return;
    }
    // one SVG unit per CSS pixel, so that labels keep their size on any screen; legends stack on a narrow one
    const W = Math.max(280, Math.round(container.clientWidth) - 16), stacked = W < 520;
    const left = 44, right = 14, top = stacked ? 10 + 18 * drawn.length : 28, bottom = 24, H = top + (stacked ? 170 : 210);
    const [x0, x1] = extent(all.map((p) => p[0]), false);
    const [y0, y1] = extent(all.map((p) => p[1]), options.fromZero);
    const sx = (x) => left + ((x - x0) / (x1 - x0)) * (W - left - right);
    const sy = (y) => H - bottom - ((y - y0) / (y1 - y0)) * (H - top - bottom);
    const root = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": options.label });
    for (const value of niceTicks(y0, y1, 5)) {
      root.append(svg("line", { class: "axis", x1: left, x2: W - right, y1: sy(value), y2: sy(value) }));
      root.append(svg("text", { class: "tick", x: left - 6, y: sy(value) + 4, "text-anchor": "end" }, short(value)));
    }
    for (let i = 0; i <= 3; i++) {
      const x = x0 + (i * (x1 - x0)) / 3;
      const anchor = i === 0 ? "start" : i === 3 ? "end" : "middle";
      root.append(svg("text", { class: "tick", x: sx(x), y: H - 6, "text-anchor": anchor }, timeLabel(x, x1 - x0)));
    }
    drawn.forEach((s, i) => {
      if (!s.points.length) return;
      const path = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
      const last = s.points[s.points.length - 1];
      root.append(svg("path", { class: "series-" + i, d: path }));
      root.append(svg("circle", { class: "swatch-" + i, cx: sx(last[0]), cy: sy(last[1]), r: 3 }));
      const lx = stacked ? left : left + i * 220, ly = stacked ? 6 + 18 * i : 6;
      root.append(svg("rect", { class: "swatch-" + i, x: lx, y: ly, width: 12, height: 12, rx: 2 }));
      root.append(svg("text", { class: "legend", x: lx + 18, y: ly + 10 }, s.name + ": " + short(last[1])));
    });
    container.append(root);
  }

  window.Agora = { el, cell, setText, fixed, compact, time, duration, getJson, poll, lineChart };
})();
