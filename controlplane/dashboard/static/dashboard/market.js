// The market: each device class's posted prices over the last days, kept fresh.
"use strict";

(() => {
  const urls = document.currentScript.dataset;
  const chart = Dashboard.chart("price-chart", "line", { datasets: [] }, {
    parsing: false,
    scales: {
      x: { type: "linear", ticks: { callback: (v) => new Date(v).toISOString().slice(5, 16).replace("T", " ") } },
      y: { title: { display: true, text: "$ per hour" } },
    },
  });

  function render(market) {
    chart.data.datasets = Object.entries(market.history).map(([name, points], i) => ({
      label: name,
      borderColor: Dashboard.palette[i % Dashboard.palette.length],
      stepped: true,
      data: points.map((p) => ({ x: Date.parse(p.at), y: p.price_per_hour })),
    }));
    chart.update("none");
    document.getElementById("no-history").hidden = chart.data.datasets.length > 0;
  }

  render(JSON.parse(document.getElementById("live-data").textContent));
  Dashboard.poll(urls.live, render, 5000);
})();
