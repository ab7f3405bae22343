// Helpers every dashboard page shares: polling a page's live.json, the CSRF token for the API's POSTs,
// number formats, and Chart.js charts that are updated in place.
"use strict";

const Dashboard = {
  /** Call `render(data)` with the document at `url` now and every `ms` milliseconds. */
  poll(url, render, ms = 2000) {
    const tick = async () => {
      try {
        const response = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
        if (response.ok) render(await response.json());
      } finally {
        setTimeout(tick, ms);
      }
    };
    setTimeout(tick, ms);
  },

  csrfToken() {
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  },

  /** POST `body` as JSON to the API with the session's CSRF token; the parsed answer and its status. */
  async postJson(url, body) {
    const response = await fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": this.csrfToken() },
      body: JSON.stringify(body),
    });
    return { status: response.status, body: await response.json() };
  },

  number(value, digits = 3) {
    return value === null || value === undefined ? "–" : Number(value).toPrecision(digits);
  },

  duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const s = Math.round(seconds);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  },

  bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  },

  /** A Chart.js chart on canvas `id` (no animation: the data changes every poll). */
  chart(id, type, data, options = {}) {
    return new Chart(document.getElementById(id), {
      type,
      data,
      options: { animation: false, responsive: true, maintainAspectRatio: false, ...options },
    });
  },

  /** Replace a chart's labels and datasets' data, keeping its look. */
  update(chart, labels, series) {
    chart.data.labels = labels;
    series.forEach((values, i) => { chart.data.datasets[i].data = values; });
    chart.update("none");
  },

  palette: ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"],
};
