"use strict";
// One contributor's page: standing, points over time and peers, from /identities/<name>.
(function () {
  const A = window.Agora;
  const PREFIX = "/contributors/";

  function nameFromPath() {
    try {
      return decodeURIComponent(location.pathname.slice(PREFIX.length));
    } catch (error) {
      return location.pathname.slice(PREFIX.length);
    }
  }

  function shortId(peerId) {
    return peerId.length > 14 ? peerId.slice(0, 6) + "…" + peerId.slice(-6) : peerId;
  }

  function withheld(peer) {
    if (peer.withheld_reason) return A.fixed(peer.withheld_compute, 3) + " PFLOP: " + peer.withheld_reason;
    if (peer.flagged) return A.fixed(peer.unreceipted_compute, 3) + " PFLOP claimed beyond the trainers' receipts";
    return "–";
  }

  function renderPeers(peers) {
    const rows = document.createDocumentFragment();
    for (const peer of peers) {
      const row = A.el("tr");
      row.append(A.el("td", { class: "key", "data-label": "Peer", title: peer.peer_id }, shortId(peer.peer_id)),
        A.cell("Stage", peer.stage), A.cell("Phase", peer.sync_phase),
        A.cell("Status", peer.online ? "online" : "offline", peer.online ? "online" : "offline"),
        A.cell("Presence", A.fixed(peer.presence, 3), "num"), A.cell("Verified compute", A.fixed(peer.compute, 3), "num"),
        A.cell("Claimed", A.fixed(peer.claimed_compute, 3), "num"), A.cell("Withheld", withheld(peer), "reason"));
      rows.append(row);
    }
    document.querySelector("#peers tbody").replaceChildren(rows);
  }

  function render(view) {
    A.setText("updated", A.time(view.generated_at));
    A.setText("rank", view.standing.rank);
    A.setText("score", A.fixed(view.standing.score, 3));
    A.setText("active", A.duration(view.standing.active_hours * 3600));
    A.setText("withheld", A.fixed(view.withheld_compute, 3));
    const history = view.history;
    A.lineChart(document.getElementById("points-chart"),
      [{ name: "presence", points: history.map((p) => [p[0], p[1]]) },
        { name: "verified compute", points: history.map((p) => [p[0], p[2]]) }],
      { label: "points over time", empty: "No points recorded yet.", fromZero: true });
    renderPeers(view.peers);
  }

  const name = nameFromPath();
  A.setText("identity", name);
  document.title = name + ": Agora";
  A.poll(async function () {
    try {
      render(await A.getJson("/identities/" + encodeURIComponent(name)));
      return "";
    } catch (error) {
      if (error.status === 404) return "The monitor has verified no peer of this contributor (yet).";
      throw error;
    }
  });
})();
