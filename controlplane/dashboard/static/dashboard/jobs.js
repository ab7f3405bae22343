// The jobs page: the submit form's estimate (POST /api/jobs/estimate, then its URL polled until a worker
// answers) and the jobs table kept fresh.
"use strict";

(() => {
  const urls = document.currentScript.dataset;
  const form = document.getElementById("submit-form");
  const out = document.getElementById("estimate");

  function body() {
    const f = new FormData(form);
    const parsed = { name: f.get("name") || "" };
    for (const key of ["model_config", "dataset_config"]) {
      try { parsed[key] = JSON.parse(f.get(key)); } catch (e) { throw new Error(`${key}: not JSON (${e.message})`); }
    }
    for (const key of ["epochs", "micro_batches", "stages", "checkpoint_interval_steps"]) if (f.get(key)) parsed[key] = Number(f.get(key));
    if (f.get("learning_rate")) parsed.learning_rate = Number(f.get("learning_rate"));
    parsed.schedule = f.get("schedule");
    const replicas = (f.get("replicas") || "").trim();
    if (replicas) {
      const range = replicas.match(/^(\d+)\s*(?:-\s*(\d+))?$/);
      if (!range) throw new Error(`replicas: "${replicas}" is neither a number of replicas (2) nor a range min-max (1-3)`);
      parsed.replicas = range[2] === undefined ? Number(range[1]) : { min: Number(range[1]), max: Number(range[2]) };
    }
    if ((f.get("replica_sync") || "").trim()) {
      try { parsed.replica_sync = JSON.parse(f.get("replica_sync")); } catch (e) { throw new Error(`replica_sync: not JSON (${e.message})`); }
    }
    if (!f.get("owner_diversity")) parsed.requirements = { owner_diversity: false };
    return parsed;
  }

  function show(result) {
    if (!result.feasible) {
      out.textContent = `Cannot be placed now: ${result.reason} (${result.candidates} candidate nodes).`;
      return;
    }
    const nodes = result.stages.map((s) => `stage ${s.stage_index}${s.replica ? ` replica ${s.replica}` : ""} ` +
      `(layers ${s.layer_start} to ${s.layer_end - 1}) on ${s.node_name}`);
    out.replaceChildren();
    const summary = document.createElement("p");
    summary.id = "estimate-result";
    summary.textContent = `About ${Dashboard.number(result.samples_per_second)} samples/s, ` +
      `${Dashboard.duration(result.hours * 3600)}, $${result.total_usd} at ` +
      `$${Dashboard.number(result.price_per_hour)}/h.`;
    const placement = document.createElement("p");
    placement.textContent = nodes.join("; ");
    out.append(summary, placement);
  }

  async function estimate() {
    out.textContent = "Estimating…";
    let answer;
    try {
      answer = await Dashboard.postJson(urls.estimate, body());
    } catch (e) {
      out.textContent = e.message;
      return;
    }
    if (answer.status !== 202) {
      const errors = answer.body.errors ? Object.entries(answer.body.errors).map(([k, v]) => `${k}: ${v}`).join("; ") : "";
      out.textContent = `${answer.body.detail} ${errors}`;
      return;
    }
    let state = answer.body;
    for (let i = 0; i < 120 && state.status === "pending"; i += 1) {
      await new Promise((r) => setTimeout(r, 500));
      state = await (await fetch(state.url, { credentials: "same-origin" })).json();
    }
    if (state.status === "done") show(state.result);
    else out.textContent = state.status === "failed" ? `The estimate failed: ${state.error}` : "No answer yet; try again.";
  }

  document.getElementById("estimate-button").addEventListener("click", estimate);

  const tbody = document.querySelector("#jobs-table tbody");
  Dashboard.poll(urls.live, (data) => {
    for (const job of data.jobs) {
      const row = tbody.querySelector(`tr[data-job="${job.id}"]`);
      if (!row) continue;
      const cells = row.querySelectorAll("td");
      cells[1].textContent = job.status;
      cells[1].className = `status status-${job.status}`;
      cells[2].querySelector("progress").max = job.total_steps || 1;
      cells[2].querySelector("progress").value = job.step;
      cells[2].lastChild.textContent = ` ${job.step}/${job.total_steps ?? "?"}`;
      cells[3].textContent = job.last_loss === null ? "–" : job.last_loss.toFixed(4);
      cells[4].textContent = `$${job.cost.charged_usd}`;
      cells[5].textContent = job.cost.estimate_to_finish_usd ? `$${job.cost.estimate_to_finish_usd}` : "–";
    }
  }, 3000);
})();
