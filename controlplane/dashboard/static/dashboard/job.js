// A job, live: its loss curves, speed, replicas, ETA and cost; the pipeline stage by stage (replica by replica:
// what each does, its share of the micro-batches and its speed) with each one's compute and wait per step against
// the schedule's ideal bubble; its events and checkpoints; a prompt box for a text model.
"use strict";

(() => {
  const urls = document.currentScript.dataset;
  const $ = (id) => document.getElementById(id);
  const lossChart = Dashboard.chart("loss-chart", "line", {
    labels: [],
    datasets: [{ label: "training loss", data: [], borderColor: Dashboard.palette[0], pointRadius: 0, borderWidth: 1.5 }],
  }, { scales: { x: { title: { display: true, text: "step" } } } });
  const valChart = Dashboard.chart("val-chart", "line", {
    labels: [],
    datasets: [
      { label: "validation loss", data: [], borderColor: Dashboard.palette[1], yAxisID: "y" },
      { label: "accuracy", data: [], borderColor: Dashboard.palette[2], yAxisID: "y1" },
    ],
  }, {
    scales: {
      x: { title: { display: true, text: "epoch" } },
      y: { position: "left" },
      y1: { position: "right", grid: { drawOnChartArea: false } },
    },
  });
  const bubbleChart = Dashboard.chart("bubble-chart", "bar", {
    labels: [],
    datasets: [
      { label: "compute s/step", data: [], backgroundColor: Dashboard.palette[0] },
      { label: "waiting s/step", data: [], backgroundColor: Dashboard.palette[3] },
    ],
  }, { indexAxis: "y", scales: { x: { stacked: true }, y: { stacked: true } } });

  function stats(job) {
    $("job-status").textContent = job.status;
    $("job-status").className = `status status-${job.status}`;
    $("cancel-form").hidden = !job.cancellable;
    $("stat-step").textContent = `${job.step}/${job.total_steps ?? "?"}`;
    $("stat-epoch").textContent = `${job.epoch}/${job.epochs_requested}`;
    $("stat-samples").textContent = Dashboard.number(job.samples_per_second);
    const r = job.pipeline.replicas;
    $("stat-replicas").textContent = r.per_stage.length ? r.per_stage.join(" · ") : "–";
    $("stat-replicas").dataset.training = r.training;
    $("stat-replicas-range").textContent = r.min === r.max ? "" : ` (${r.min}–${r.max})`;
    $("stat-tokens").textContent = Dashboard.number(job.tokens_per_second);
    $("stat-quality-label").textContent = job.writes_text ? "Perplexity" : "Val accuracy";
    $("stat-quality").textContent = Dashboard.number(job.writes_text ? job.perplexity : job.val_accuracy);
    $("stat-eta").textContent = Dashboard.duration(job.eta_seconds);
    $("stat-cost").textContent = `$${job.cost.charged_usd}`;
    $("stat-estimate").textContent = job.cost.estimate_to_finish_usd ? `$${job.cost.estimate_to_finish_usd}` : "–";
    $("stat-budget").textContent = job.cost.budget_remaining_usd === null ? "–"
      : `$${job.cost.budget_remaining_usd} of $${job.cost.budget_usd}`;
  }

  function curves(job) {
    Dashboard.update(lossChart, job.loss_curve.map((p) => p.step), [job.loss_curve.map((p) => p.loss)]);
    valChart.data.datasets[1].label = job.writes_text ? "perplexity" : "accuracy";
    Dashboard.update(valChart, job.epochs.map((e) => e.epoch), [
      job.epochs.map((e) => e.val_loss),
      job.epochs.map((e) => (job.writes_text ? (e.val_loss === null ? null : Math.exp(e.val_loss)) : e.val_accuracy)),
    ]);
  }

  function pipeline(job) {
    const p = job.pipeline;
    const measured = p.stages.filter((s) => s.bubble !== null && s.rank === 0);
    const mean = measured.length ? measured.reduce((a, s) => a + s.bubble, 0) / measured.length : null;
    $("pipeline-summary").textContent = `${p.schedule}, ${p.micro_batches} micro-batches; transfer: ` +
      `activations ${p.transfer.activations ?? "fp32"}, gradients ${p.transfer.gradients ?? "fp32"}. ` +
      `Bubble measured ${mean === null ? "–" : `${(100 * mean).toFixed(1)}%`}, ` +
      `ideal ${p.ideal_bubble === null ? "–" : `${(100 * p.ideal_bubble).toFixed(1)}%`} = (p−1)/(m+p−1).` +
      (p.replicas.max > 1 ? ` Replicas per stage: ${p.replicas.per_stage.join(", ")} (${p.replicas.min} to ` +
        `${p.replicas.max}), ${p.replicas.training} training.` : "");
    const box = $("pipeline");
    box.replaceChildren(...p.stages.map((s) => {
      const div = document.createElement("div");
      div.className = `stage state-${s.state} activity-${s.activity}${s.relayed ? " relayed" : ""}`;
      div.dataset.index = s.stage_index;
      div.dataset.rank = s.rank;
      if (s.replica !== null) div.dataset.replica = s.replica;
      const lines = [
        ["title", `Stage ${s.stage_index}${s.rank ? ` rank ${s.rank}` : ""}${s.replica === null ? "" : ` replica ${s.replica}`}`],
        ["layers", s.layer_end - s.layer_start > 1 ? `layers ${s.layer_start}–${s.layer_end - 1}` : `layer ${s.layer_start}`],
        ["node", s.node_name ?? "(unplaced)"],
        ["device", s.device ?? ""],
        ["link", s.node_name === null ? "" : s.relayed ? "links through a relay" : "direct links"],
        ["state", `${s.state}, generation ${s.generation}`],
        ["timing", `compute ${Dashboard.number(s.step_compute_seconds)} s, wait ${Dashboard.number(s.step_wait_seconds)} s per step`],
        ["sent", `sent ${Dashboard.bytes(s.bytes_sent)}`],
        ["activity", s.activity === "joining" ? "joining: copying its state from a peer"
          : s.activity === "fenced" ? `fenced after failed steps (${s.fences} times lately): may rejoin from step ` +
            `${s.fenced_until_step}` : s.activity],
        ["share", s.replica === null ? "" : `${s.share === null ? "–" : `${(100 * s.share).toFixed(0)}%`} of the ` +
          `stage's micro-batches per step; ${s.micro_batches} processed`],
        ["speed", `${Dashboard.number(s.samples_per_second)} samples/s computing`],
      ];
      for (const [cls, text] of lines) {
        const span = document.createElement("span");
        span.className = cls;
        span.textContent = text;
        div.append(span);
      }
      return div;
    }));
    Dashboard.update(bubbleChart, p.stages.map((s) => `stage ${s.stage_index}${s.rank ? `.${s.rank}` : ""}` +
      `${s.replica === null ? "" : ` r${s.replica}`} (${s.node_name ?? "?"})`), [
      p.stages.map((s) => s.step_compute_seconds),
      p.stages.map((s) => s.step_wait_seconds),
    ]);
  }

  function events(job) {
    $("events").replaceChildren(...job.events.map((e) => {
      const li = document.createElement("li");
      li.className = `event event-${e.kind}`;
      li.textContent = `${e.at.slice(0, 19).replace("T", " ")} ${e.text}`;
      return li;
    }));
    $("checkpoints").replaceChildren(...job.checkpoints.slice().reverse().map((c) => {
      const li = document.createElement("li");
      const size = c.stages.reduce((a, s) => a + s.size_bytes, 0);
      li.textContent = `step ${c.step} (epoch ${c.epoch}), ${c.stages.length} stage files, ${Dashboard.bytes(size)}`;
      return li;
    }));
    $("download-model").hidden = job.checkpoints.length === 0;
  }

  function render(job) {
    stats(job);
    curves(job);
    pipeline(job);
    events(job);
    $("sample-card").hidden = !job.writes_text;
  }

  render(JSON.parse($("live-data").textContent));
  Dashboard.poll(urls.live, render, 1500);

  $("sample-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    $("sample-output").textContent = "Sampling…";
    const answer = await Dashboard.postJson(urls.sample, {
      prompt: $("sample-prompt").value, length: Number($("sample-length").value),
    });
    $("sample-output").textContent = answer.status === 200 ? answer.body.text : `${answer.status}: ${answer.body.detail}`;
  });
})();
