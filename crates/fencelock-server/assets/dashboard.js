// The dashboard's charts: the last hour per minute from GET /ui/series, drawn with
// the vendored uPlot. No inline script (the page's CSP allows scripts from this
// server only). The first data is in the page (`data-series`); refreshed every 30 s.
(function () {
  "use strict";
  var root = document.getElementById("charts");
  if (!root || typeof uPlot === "undefined") {
    return;
  }
  var dark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
  var ink = dark ? "#c8c8c8" : "#333";
  var grid = dark ? "#3a3a3a" : "#e4e4e4";
  var charts = [];

  function axis(label) {
    return { stroke: ink, grid: { stroke: grid }, ticks: { stroke: grid }, label: label };
  }

  function chart(id, title, unit, series, data) {
    var box = document.createElement("div");
    box.className = "chart";
    box.id = id;
    root.appendChild(box);
    var width = Math.max(280, Math.min(480, Math.floor((root.clientWidth || 960) / 3) - 16));
    var opts = {
      title: title,
      width: width,
      height: 200,
      scales: { x: { time: true } },
      axes: [axis(), axis(unit)],
      series: [{}].concat(series)
    };
    charts.push(new uPlot(opts, data, box));
  }

  function draw(minutes) {
    charts.forEach(function (c) { c.destroy(); });
    charts = [];
    root.textContent = "";
    var t = minutes.map(function (m) { return m.start_ms / 1000; });
    var col = function (f) { return minutes.map(f); };
    chart("chart-grants", "Grants per minute", "grants", [
      { label: "grants", stroke: "#2a7ae2", fill: "rgba(42,122,226,0.15)" }
    ], [t, col(function (m) { return m.grants; })]);
    chart("chart-wait", "Wait before grant (ms)", "ms", [
      { label: "p50", stroke: "#2e9e4f" },
      { label: "p99", stroke: "#d9822b" }
    ], [t, col(function (m) { return m.wait_p50_ms; }), col(function (m) { return m.wait_p99_ms; })]);
    chart("chart-contention", "Contention per minute", "requests", [
      { label: "peak waiters", stroke: "#c0392b" },
      { label: "acquires queued", stroke: "#8e44ad" }
    ], [t, col(function (m) { return m.peak_waiters; }), col(function (m) { return m.queued; })]);
    root.setAttribute("data-drawn", String(charts.length));
  }

  function load() {
    fetch(root.getAttribute("data-src"), { credentials: "same-origin" })
      .then(function (r) {
        if (!r.ok) {
          throw new Error("GET " + root.getAttribute("data-src") + ": " + r.status);
        }
        return r.json();
      })
      .then(function (j) { draw(j.minutes); })
      .catch(function (e) {
        root.setAttribute("data-error", String(e));
        root.textContent = "The charts could not be loaded: " + e;
      });
  }

  try {
    draw(JSON.parse(root.getAttribute("data-series")).minutes);
  } catch (e) {
    root.setAttribute("data-error", String(e));
  }
  window.setInterval(load, 30000);
})();
