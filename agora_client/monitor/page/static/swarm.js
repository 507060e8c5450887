"use strict";
// The swarm page: run, tokens, escrow, learning curve, stages and leaderboard, from /swarm, /learning and /leaderboard.
(function () {
  const A = window.Agora;

  function renderRun(swarm) {
    if (swarm.run) {
      A.setText("run-name", "Agora: " + swarm.run.name);
      A.setText("run-model", swarm.run.model);
      document.title = "Agora: " + swarm.run.name;
    }
    const summary = swarm.summary;
    A.setText("updated", summary ? A.time(summary.updated_at) + " (" + A.duration(swarm.generated_at - summary.updated_at) +
      " ago)" : "the monitor has not scraped the swarm yet");
    A.setText("tokens-per-s", summary ? A.compact(summary.tokens_per_s) : "–");
    A.setText("tokens-seen", summary ? A.compact(summary.tokens_seen) : "–");
    A.setText("online", swarm.online + " of " + swarm.contributors);
    const escrow = swarm.escrow;
    A.setText("escrow", A.fixed(escrow.held, 3) + " / " + A.fixed(escrow.forfeited, 3) + ", " + escrow.disputed_windows);
  }

  function spotChecks(checks) {
    if (!checks) return "off";
    return checks.checks + " checks, " + checks.strikes + " strikes, " + checks.bans + " bans; forward " +
      checks.forward + ", backward " + checks.backward;
  }

  function renderStages(summary) {
    const rows = document.createDocumentFragment();
    for (const stage of summary ? summary.stages : []) {
      const row = A.el("tr");
      row.append(A.cell("Stage", stage.stage, "key"), A.cell("Active", stage.active, "num"),
        A.cell("Syncing", stage.syncing, "num"),
        stage.queued === null ? A.el("td", { class: "num", "data-label": "Queued",
          title: "the monitor runs without --auth-url" }, "–") : A.cell("Queued", stage.queued, "num"),
        A.cell("SPARTA success", stage.sparta_success === null ? "no round yet"
          : A.fixed(100 * stage.sparta_success, 0) + "% of " + stage.sparta_rounds, "num"),
        A.cell("Spot checks", spotChecks(stage.spot_checks)));
      rows.append(row);
    }
    document.querySelector("#stages tbody").replaceChildren(rows);
  }

  function renderLeaderboard(rows) {
    const body = document.createDocumentFragment();
    for (const entry of rows) {
      const row = A.el("tr");
      const name = A.el("td", { class: "name" });
      name.append(A.el("a", { href: "/contributors/" + encodeURIComponent(entry.username) }, entry.username));
      const status = A.el("td", { class: "status " + (entry.online ? "online" : "offline") }, entry.online ? "online" : "offline");
      if (entry.flagged) status.append(A.el("br"), A.el("span", { class: "flag", title: "claims more compute than trainers receipted; "
        + "only the receipted compute counts" }, "claims > receipts"));
      row.append(A.el("td", { class: "num" }, entry.rank), name, A.el("td", { class: "num" }, A.fixed(entry.score, 3)),
        A.el("td", { class: "num" }, A.fixed(entry.active_hours, 1)),
        A.el("td", { class: "hide-narrow" }, String(entry.joined).slice(0, 10)), status);
      body.append(row);
    }
    document.querySelector("#leaderboard tbody").replaceChildren(body);
  }

  function renderLearning(learning) {
    A.lineChart(document.getElementById("loss-chart"),
      [{ name: "training loss", points: learning.loss }, { name: "held-out eval loss", points: learning.eval_loss }],
      { label: "loss over time", empty: "No loss reported yet.", fromZero: false });
  }

  A.poll(async function () {
    const [swarm, board, learning] = await Promise.all([A.getJson("/swarm"), A.getJson("/leaderboard"),
      A.getJson("/learning")]);
    renderRun(swarm);
    renderStages(swarm.summary);
    renderLearning(learning);
    renderLeaderboard(board.rows);
    return board.rows.length ? "" : "No contributors yet: the monitor has verified no metrics record.";
  });
})();
