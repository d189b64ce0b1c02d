"""The viewer page's script (plain JavaScript, no library): reads the embedded data, draws the groups and
the dead letters that pass the filters, and keeps the filters in the URL fragment.

Every string from the run goes into the page through ``textContent``, never as HTML: a completion that
contains markup shows as text. Tokens are ``<span class="tok">`` with their version, log-prob and id in
the tooltip; the colour is the token's lag behind the learner version that trained on it (0 green, then
yellow, orange, red) or its sampling probability (the lower, the redder). Tokens the loss did not train
on (loss mask 0: environment or tool text) are faded and underlined. At most ``MAX_CARDS`` groups are drawn
at once (all steps of a long run would be hundreds of thousands of token spans): a step shows all of its.
"""

SCRIPT = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("data").textContent);
  const $ = (id) => document.getElementById(id);
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(x) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    return String(Number(Number(x).toFixed(3)));
  }
  const MAX_CARDS = 200;  // group cards drawn at once: a browser stays responsive
  const LAG_COLOURS = ["#c6f1c2", "#fff0a6", "#ffd09e", "#ffaaa8"];
  function lagColour(lag) { return LAG_COLOURS[Math.max(0, Math.min(lag, LAG_COLOURS.length - 1))]; }
  function probColour(lp) {
    const p = Math.exp(Math.min(0, lp));
    return "hsl(0, 85%, " + (58 + 40 * p).toFixed(1) + "%)";
  }
  function piece(id) {
    const p = D.pieces[String(id)];
    return p === undefined ? "\u27e8" + id + "\u27e9" : p;
  }

  const groups = D.groups || [];
  const dead = D.dead || [];
  const steps = Array.from(new Set(groups.map((g) => g.step).concat(dead.map((d) => d.step))))
    .filter((s) => s !== undefined).sort((a, b) => a - b);
  const sources = Array.from(new Set(groups.map((g) => g.data_source || ""))).sort();
  const state = { step: "all", source: "all", rmin: "", rmax: "", color: "version", dead: "1" };

  function readHash() {
    const p = new URLSearchParams(location.hash.replace(/^#/, ""));
    for (const k of Object.keys(state)) if (p.has(k)) state[k] = p.get(k);
  }
  function writeHash() {
    const p = new URLSearchParams();
    for (const [k, v] of Object.entries(state)) {
      const dflt = { step: "all", source: "all", rmin: "", rmax: "", color: "version", dead: "1" }[k];
      if (v !== dflt) p.set(k, v);
    }
    const h = p.toString();
    history.replaceState(null, "", h ? "#" + h : location.pathname + location.search);
  }
  function option(select, value, label) {
    const o = el("option", null, label);
    o.value = value;
    select.appendChild(o);
  }

  function setUp() {
    $("title").textContent = "tether view \u00b7 " + D.run;
    const s = $("step");
    option(s, "all", "all (" + steps.length + ")");
    for (const st of steps) option(s, String(st), String(st));
    const src = $("source");
    option(src, "all", "all");
    for (const x of sources) option(src, x, x || "(none)");
    s.onchange = () => { state.step = s.value; update(); };
    $("prev").onclick = () => move(-1);
    $("next").onclick = () => move(1);
    src.onchange = () => { state.source = src.value; update(); };
    $("rmin").oninput = () => { state.rmin = $("rmin").value; update(); };
    $("rmax").oninput = () => { state.rmax = $("rmax").value; update(); };
    $("color").onchange = () => { state.color = $("color").value; update(); };
    $("dead").onchange = () => { state.dead = $("dead").checked ? "1" : "0"; update(); };
    window.addEventListener("hashchange", () => { readHash(); draw(); });
  }
  function move(delta) {
    const i = steps.indexOf(Number(state.step));
    const j = i < 0 ? (delta > 0 ? 0 : steps.length - 1) : Math.max(0, Math.min(steps.length - 1, i + delta));
    if (steps.length) { state.step = String(steps[j]); update(); }
  }
  function update() { writeHash(); draw(); }

  function rewardOk(r) {
    if (state.rmin !== "" && !(r >= Number(state.rmin))) return false;
    if (state.rmax !== "" && !(r <= Number(state.rmax))) return false;
    return true;
  }
  function stepOk(step) { return state.step === "all" || String(step) === state.step; }

  function legend() {
    const box = $("legend");
    box.replaceChildren();
    if (state.color === "version") {
      box.appendChild(el("span", null, "tokens by lag behind the learner version that trained them:"));
      ["0", "1", "2", "\u2265 3"].forEach((label, i) => {
        const t = el("span", "tok", label);
        t.style.background = LAG_COLOURS[i];
        box.appendChild(t);
      });
    } else {
      box.appendChild(el("span", null, "tokens by sampling probability exp(log-prob):"));
      for (const p of [1, 0.5, 0.1, 0.01]) {
        const t = el("span", "tok", String(p));
        t.style.background = probColour(Math.log(p));
        box.appendChild(t);
      }
    }
    const m = el("span", "tok masked", "not trained (mask 0)");
    box.appendChild(m);
  }

  function tokens(sample, group) {
    const cell = el("td", "completion");
    const ids = sample.ids || [];
    const lps = sample.lp || [];
    const mask = sample.mask;
    for (let i = 0; i < ids.length; i++) {
      const v = Array.isArray(sample.v) ? sample.v[i] : sample.v;
      const t = el("span", "tok", piece(ids[i]));
      const masked = mask && !mask[i];
      if (masked) t.classList.add("masked");
      let tip = "id " + ids[i];
      if (v !== undefined && group) {
        const lag = group.version - v;
        tip += " \u00b7 v" + v + " (lag " + lag + ")";
        if (state.color === "version") t.style.background = lagColour(lag);
      }
      if (lps[i] !== undefined) {
        tip += " \u00b7 log-prob " + fmt(lps[i]) + " (p " + fmt(Math.exp(lps[i])) + ")";
        if (state.color === "logprob") t.style.background = probColour(lps[i]);
      }
      if (masked) tip += " \u00b7 not trained";
      t.title = tip;
      cell.appendChild(t);
    }
    if (sample.cut) cell.appendChild(el("span", "context", " \u2026 " + sample.cut + " more tokens"));
    return cell;
  }

  function head(parent, items) {
    const h = el("div", "ghead");
    for (const [label, value, cls] of items) {
      if (value === undefined || value === null || value === "") continue;
      const s = el("span", cls || null);
      if (label) s.appendChild(el("span", null, label + " "));
      s.appendChild(el("b", null, value));
      h.appendChild(s);
    }
    parent.appendChild(h);
  }

  function sampleTable(samples, group, withAdv) {
    const table = el("table");
    const tr = el("tr");
    const cols = ["#", "reward", withAdv ? "advantage" : null, "finish", "tokens", "completion"];
    for (const c of cols) if (c !== null) tr.appendChild(el("th", null, c));
    table.appendChild(tr);
    samples.forEach(([i, s]) => {
      const row = el("tr", "sample");
      row.dataset.reward = String(s.reward);
      row.appendChild(el("td", "num", i));
      row.appendChild(el("td", "num reward", fmt(s.reward)));
      if (withAdv) row.appendChild(el("td", "num adv", fmt(s.adv)));
      row.appendChild(el("td", null, s.finish || ""));
      row.appendChild(el("td", "num", (s.ids || []).length + (s.cut || 0)));
      row.appendChild(tokens(s, group));
      if (s.components && Object.keys(s.components).length) {
        row.title = Object.entries(s.components).map(([k, v]) => k + " " + fmt(v)).join(", ");
      }
      table.appendChild(row);
    });
    return table;
  }

  function groupCard(g) {
    const shown = (g.samples || []).map((s, i) => [i, s]).filter(([, s]) => rewardOk(s.reward));
    if (!shown.length) return null;
    const card = el("section", "group");
    card.dataset.step = String(g.step);
    card.dataset.group = g.group_id || "";
    const rewards = (g.samples || []).map((s) => s.reward);
    const mean = rewards.reduce((a, b) => a + b, 0) / Math.max(1, rewards.length);
    head(card, [
      ["step", g.step], ["group", g.group_id], ["trained at version", g.version], ["staleness", g.staleness],
      ["server", g.server], ["data source", g.data_source], ["mean reward", fmt(mean)],
    ]);
    const ctx = Object.entries(g.context || {});
    if (ctx.length) card.appendChild(el("div", "context", ctx.map(([k, v]) => k + ": " + v).join(" \u00b7 ")));
    card.appendChild(el("pre", "prompt", g.prompt_text || ""));
    card.appendChild(sampleTable(shown, g, true));
    return card;
  }

  function deadCard(d) {
    const card = el("section", "dead");
    card.dataset.step = String(d.step);
    card.dataset.group = d.group_id || "";
    const when = d.time ? new Date(d.time * 1000).toISOString().replace("T", " ").slice(0, 19) : "";
    head(card, [
      ["dead-lettered:", d.reason || "(no reason recorded)", "reason"], ["seen by step", d.step],
      ["group", d.group_id], ["from", d.origin], ["server", d.server], ["data source", d.data_source],
      ["at", when],
    ]);
    if (d.prompt_text) card.appendChild(el("pre", "prompt", d.prompt_text));
    const samples = (d.samples || []).map((s, i) => [i, s]);
    if (samples.length) card.appendChild(sampleTable(samples, null, false));
    return card;
  }

  function draw() {
    $("step").value = steps.includes(Number(state.step)) ? state.step : "all";
    $("source").value = sources.includes(state.source) ? state.source : "all";
    $("rmin").value = state.rmin;
    $("rmax").value = state.rmax;
    $("color").value = state.color === "logprob" ? "logprob" : "version";
    $("dead").checked = state.dead !== "0";
    legend();
    const main = $("main");
    main.replaceChildren();
    let nGroups = 0, hidden = 0;
    for (const g of groups) {
      if (!stepOk(g.step) || (state.source !== "all" && (g.data_source || "") !== state.source)) continue;
      if (nGroups >= MAX_CARDS) { hidden++; continue; }
      const card = groupCard(g);
      if (card) { main.appendChild(card); nGroups++; }
    }
    if (hidden) main.appendChild(el("div", "empty", "\u2026 and up to " + hidden + " more: pick a step to see them."));
    if (!nGroups) {
      main.appendChild(el("div", "empty", groups.length
        ? "No sampled group passes these filters."
        : "No sampled groups yet: the learner writes them after its logged steps (learner.log_train_generations)."));
    }
    let nDead = 0;
    if (state.dead !== "0") {
      const shown = dead.filter((d) => stepOk(d.step)
        && (state.source === "all" || !d.data_source || d.data_source === state.source));
      if (shown.length) {
        main.appendChild(el("h2", null, "Dead letters (" + shown.length + ")"));
        for (const d of shown) { main.appendChild(deadCard(d)); nDead++; }
      }
    }
    const counts = Object.entries(D.dead_counts || {}).map(([k, v]) => k + " " + v).join(", ");
    const parts = [
      nGroups + " of " + groups.length + " sampled groups shown",
      steps.length ? "steps " + steps[0] + "\u2013" + steps[steps.length - 1] : "",
      D.every ? "logged every " + D.every + " step" + (D.every > 1 ? "s" : "") : "",
      dead.length ? nDead + " of " + dead.length + " dead letters kept" : "no dead letters kept",
      counts ? "books: " + counts : "",
      D.lengths || "",
      D.model ? "model " + D.model : "",
      D.tokenizer || "",
      D.unreadable_lines ? D.unreadable_lines + " unreadable lines skipped" : "",
      "page made " + D.made,
    ];
    $("summary").textContent = parts.filter((x) => x).join(" \u00b7 ");
  }

  readHash();
  setUp();
  draw();
})();
"""
