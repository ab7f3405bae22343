// A contributor's devices: earnings per day (stacked by device) and per job, kept fresh.
"use strict";

(() => {
  const urls = document.currentScript.dataset;
  const dayChart = Dashboard.chart("earnings-day-chart", "bar", { labels: [], datasets: [] },
    { scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: "US dollars" } } } });
  const jobChart = Dashboard.chart("earnings-job-chart", "bar", {
    labels: [], datasets: [{ label: "credit (US dollars)", data: [], backgroundColor: Dashboard.palette[2] }],
  });

  function render(data) {
    const days = [...new Set(data.nodes.flatMap((n) => n.earnings.per_day.map((d) => d.day)))].sort();
    dayChart.data.labels = days;
    dayChart.data.datasets = data.nodes.map((n, i) => ({
      label: n.name,
      backgroundColor: Dashboard.palette[i % Dashboard.palette.length],
      data: days.map((day) => Number((n.earnings.per_day.find((d) => d.day === day) || { credit_usd: 0 }).credit_usd)),
    }));
    dayChart.update("none");
    const perJob = new Map();
    for (const n of data.nodes) {
      for (const j of n.earnings.per_job) perJob.set(j.job_name || j.job_id, (perJob.get(j.job_name || j.job_id) || 0) + Number(j.credit_usd));
    }
    Dashboard.update(jobChart, [...perJob.keys()], [[...perJob.values()]]);
    const total = data.nodes.reduce((a, n) => a + Number(n.earnings.credit_usd), 0);
    document.getElementById("earnings-total").textContent = `$${total.toFixed(6)}`;
    for (const n of data.nodes) {
      const status = document.querySelector(`section[data-node="${n.id}"] .node-status`);
      if (status) { status.textContent = n.status; status.className = `status node-status status-${n.status}`; }
    }
  }

  fetch(urls.live, { credentials: "same-origin" }).then((r) => r.json()).then(render);
  Dashboard.poll(urls.live, render, 3000);
})();
