// nla explore: the page. It talks only to the JSON API (docs/explore.md); no framework, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { input: null, tokens: [], results: new Map(), selected: null, facts: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "style") node.setAttribute("style", v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return node;
}

function showError(message) {
  const box = $("error");
  if (!message) { box.hidden = true; box.textContent = ""; return; }
  box.textContent = message;
  box.hidden = false;
}

async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  };
  let resp;
  try {
    resp = await fetch(path, opts);
  } catch (err) {
    throw new Error(`the explorer server did not answer (${err.message}); is nla explore still running?`);
  }
  let data = null;
  try { data = await resp.json(); } catch (_) { /* not JSON */ }
  if (!resp.ok) throw new Error((data && data.error) || `${path}: HTTP ${resp.status}`);
  return data;
}

const fmt = (x, nd = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(nd));

// Round-trip cosine -> background colour: red at <= 0, yellow at 0.5, green at 1.
function cosColour(cos) {
  if (cos === null || cos === undefined) return "";
  const t = Math.max(0, Math.min(1, cos));
  return `hsl(${Math.round(t * 120)}, 75%, 82%)`;
}

function sourceBody() {
  const docId = $("doc-select").value;
  const body = docId ? { doc_id: Number(docId) } : { text: $("text-input").value };
  // a pair for several blocks: the block chosen (every request of this text reads it)
  if (!$("layer-row").hidden) body.layer = Number($("layer-select").value);
  return body;
}

// ---------------------------------------------------------------- text view
async function explore() {
  showError(null);
  state.results.clear();
  state.selected = null;
  $("detail").hidden = true;
  const src = sourceBody();
  const btn = $("explore-btn");
  btn.disabled = true;
  try {
    $("status").textContent = "tokenizing…";
    const tok = await api("/api/tokenize", src);
    state.input = src;
    state.tokens = tok.tokens;
    renderTokens();
    $("status").textContent = `explaining ${tok.n_tokens} tokens in one batch…`;
    const t0 = performance.now();
    const res = await api("/api/explain", src);
    for (const r of res.results) state.results.set(r.position, r);
    renderTokens();
    const cos = res.results.map((r) => r.greedy.cosine).filter((c) => c !== null);
    const mean = cos.length ? cos.reduce((a, b) => a + b, 0) / cos.length : null;
    $("status").textContent = `${tok.n_tokens} tokens, mean cosine ${fmt(mean)} ` +
      `(${((performance.now() - t0) / 1000).toFixed(1)} s). Click a token.`;
  } catch (err) {
    showError(err.message);
    $("status").textContent = "";
  } finally {
    btn.disabled = false;
  }
}

function renderTokens() {
  const box = $("tokens");
  box.replaceChildren();
  for (const t of state.tokens) {
    const r = state.results.get(t.position);
    const cos = r ? r.greedy.cosine : null;
    const wrong = r && ((r.greedy.claims || []).some((c) => !c.correct) ||
      (r.greedy.quotation && !r.greedy.quotation.correct));
    const span = el("span", {
      class: "tok" + (r && cos === null ? " failed" : "") + (wrong ? " wrong" : "") +
        (state.selected === t.position ? " selected" : ""),
      "data-position": t.position,
      title: r ? `#${t.position}  cos ${fmt(cos)}  mse_nrm ${fmt(r.greedy.mse_nrm)}` : `#${t.position}`,
      style: r && cos !== null ? `background:${cosColour(cos)}` : "",
      onclick: () => selectToken(t.position),
    }, t.text.replace(/\n/g, "⏎"));
    box.appendChild(span);
  }
}

async function selectToken(position) {
  showError(null);
  state.selected = position;
  renderTokens();
  let r = state.results.get(position);
  if (!r) {
    try {
      const res = await api("/api/explain", { ...state.input, positions: [position] });
      r = res.results[0];
      state.results.set(position, r);
      renderTokens();
    } catch (err) { showError(err.message); return; }
  }
  renderDetail(r);
}

function scoreLine(e) {
  return el("div", { class: "scores" },
    el("span", { class: "score-cos" }, "cosine ", el("b", {}, fmt(e.cosine))),
    el("span", { class: "score-mse" }, "mse_nrm ", el("b", {}, fmt(e.mse_nrm))),
    e.recall !== undefined ? el("span", {}, "fact recall ", el("b", {}, fmt(e.recall, 2)),
      " precision ", el("b", {}, fmt(e.precision, 2))) : null,
    el("span", { class: "muted" }, e.status));
}

// The quotation of the text's end, unit by unit: each quoted word or mark marked as a fact is.
function quoteUnits(q) {
  if (!q) return [];
  // said unsure ("The text may end with"): no claim, so marked "?" whatever its truth (shown in the title)
  return [el("span", { class: "muted small", title: `the text read ends with “${q.truth}”` },
    q.hedged ? "quotes, unsure:" : "quotes:"),
    ...q.units.map((u) => el("span", { class: "fact quote " + (q.hedged ? "hedged" : u.correct ? "true" : "false"),
      title: (u.correct ? "the text's unit here" : "not the text's unit here") +
        ` (position ${u.position} from the end; 0 = the token read)` + (q.hedged ? "; said unsure: not a claim" : "") },
    (q.hedged ? "? " : u.correct ? "✓ " : "✗ ") + u.unit))];
}

function claimsLine(e) {
  const quote = quoteUnits(e.quotation);
  if (!e.claims) return quote.length ? el("div", { class: "claims" }, quote) : null;
  const unsure = e.unsure || [];
  if (!e.claims.length && !(e.missed || []).length && !unsure.length && !quote.length) return null;
  return el("div", { class: "claims" }, quote,
    e.claims.map((c) => el("span", { class: "fact " + (c.correct ? "true" : "false"),
      title: c.correct ? "true at this token" : "not true at this token" },
    (c.correct ? "✓ " : "✗ ") + c.fact)),
    // said unsure ("may"): no claim, marked "?" whatever its truth (shown in the title)
    unsure.length ? el("span", { class: "muted small" }, "unsure:") : null,
    unsure.map((c) => el("span", { class: "fact hedged",
      title: "said unsure: not a claim; " + (c.correct ? "true at this token" : "not true at this token") },
    "? " + c.fact)),
    (e.missed || []).length ? el("span", { class: "muted small" }, "not said:") : null,
    (e.missed || []).map((f) => el("span", { class: "fact missed", title: "true here, not said" }, f)));
}

// The largest |delta_mse| over the claims of these explanations: the bars of one view share it.
function claimScale(explanations) {
  const all = explanations.flatMap((e) => (e.claim_attribution || []).map((c) => Math.abs(c.delta_mse || 0)));
  return Math.max(1e-6, ...all);
}

// Claim attribution: each claim of the explanation, with what deleting it costs the AR (delta mse_nrm).
// The bar grows right of the axis when the AR used the claim (> 0), left when it did better without it.
function claimBars(e, scale, graded) {
  const claims = e.claim_attribution || [];
  if (!claims.length) return null;
  const mark = (c) => {
    if (c.quotation && c.truth === false) return el("span", { class: "claim-mark false",
      title: "quotes the end of the text read: a word or mark of it is not the text's" }, "✗");
    if (c.quotation) return el("span", { class: "claim-mark quote", title: c.truth === true
      ? "quotes the end of the text read, every word true" : "quotes the end of the text read" }, "“”");
    if (c.truth === true) return el("span", { class: "claim-mark true", title: "true at this token" }, "✓");
    if (c.truth === false) return el("span", { class: "claim-mark false", title: "not true at this token" }, "✗");
    return el("span", { class: "claim-mark none", title: graded ? "names no fact" : "no ground truth for this text" },
      graded ? "·" : "");
  };
  const row = (c) => {
    const d = c.delta_mse;
    const w = d === null ? 0 : Math.min(50, (50 * Math.abs(d)) / scale);
    return el("div", { class: "claim-row", "data-delta": d === null ? "" : d },
      mark(c), el("span", { class: "claim-text" }, c.text),
      el("span", { class: "claim-bar", title: "cost of deleting this claim (Δ mse_nrm)" },
        el("span", { class: "bar " + (d < 0 ? "neg" : "pos"),
          style: d < 0 ? `right:50%;width:${w}%` : `left:50%;width:${w}%` })),
      el("span", { class: "claim-delta" + (d < 0 ? " neg" : "") }, d === null ? "–" : (d > 0 ? "+" : "") + fmt(d)));
  };
  return el("div", { class: "attribution" },
    el("div", { class: "muted small", title: "mse_nrm of the AR's reading with the claim deleted, minus with it. " +
      "Right of the axis (> 0): the AR used the claim; left (< 0, hatched): it reads the vector better without it." },
    "cost of deleting each claim (Δ mse_nrm; > 0: the AR used it)"),
    claims.map(row));
}

function explanationCard(e, label, scale) {
  return el("div", { class: "explanation-card" },
    label ? el("div", { class: "label muted" }, label) : null,
    e.explanation !== null && e.explanation !== undefined ? el("div", { class: "explanation" }, e.explanation)
      : el("div", { class: "explanation none" }, `no explanation (${e.status}): `,
        el("span", { class: "raw" }, e.text || "(empty)")),
    scoreLine(e), claimsLine(e), claimBars(e, scale || claimScale([e]), e.recall !== undefined));
}

// The greedy card and the samples' cards, their claim bars on one scale.
function renderCards(greedy, samples) {
  const scale = claimScale([greedy, ...samples]);
  $("d-greedy").replaceChildren(explanationCard(greedy, "greedy explanation", scale));
  $("d-samples").replaceChildren(...samples.map((s, i) => explanationCard(s, `sample ${i + 1}`, scale)));
}

function renderDetail(r) {
  $("detail").hidden = false;
  $("d-token").textContent = JSON.stringify(r.token);
  $("d-position").textContent = r.position;
  const truth = $("d-truth");
  if (r.facts) {
    truth.hidden = false;
    truth.replaceChildren(el("span", { class: "muted" }, "ground truth at this token:"),
      ...(r.facts.length ? r.facts.map((f) => el("span", { class: "fact truthful" }, f))
        : [el("span", { class: "muted" }, "nothing revealed yet")]));
  } else {
    truth.hidden = true;
  }
  $("sample-status").textContent = "";
  $("own-result").replaceChildren();
  $("own-text").value = r.greedy.explanation || "";
  renderCards(r.greedy, r.samples || []);
}

async function sample() {
  if (state.selected === null) return;
  showError(null);
  const k = Number($("k-input").value);
  $("sample-status").textContent = `sampling ${k}…`;
  try {
    const res = await api("/api/explain", {
      ...state.input, positions: [state.selected], n_samples: k, seed: Math.floor(Math.random() * 1e6),
    });
    renderCards(state.results.get(state.selected).greedy, res.results[0].samples);
    $("sample-status").textContent = "";
  } catch (err) {
    showError(err.message);
    $("sample-status").textContent = "";
  }
}

async function scoreOwn() {
  if (state.selected === null) return;
  showError(null);
  try {
    const res = await api("/api/score", {
      ...state.input, position: state.selected, texts: [$("own-text").value],
    });
    $("own-result").replaceChildren(explanationCard({ ...res.results[0], explanation: $("own-text").value,
      status: "your text" }));
  } catch (err) { showError(err.message); }
}

// ---------------------------------------------------------------- run view
function table(t) {
  return el("div", { class: "table-wrap" }, el("h2", {}, t.title),
    el("table", {},
      el("thead", {}, el("tr", {}, t.columns.map((c) => el("th", {}, c)))),
      el("tbody", {}, t.rows.map((row) => el("tr", {}, row.map((v) => el("td", {},
        typeof v === "number" ? String(v) : (v === null ? "–" : String(v)))))))));
}

function exampleCard(ex) {
  const side = (label, e) => el("div", { class: "explanation-card" },
    el("div", { class: "label muted" }, `${label} (mse_nrm ${fmt(e.mse_nrm)})`),
    el("div", { class: "explanation" }, e.explanation || `(${e.status})`), claimsLine(e));
  return el("div", { class: "card example" },
    el("div", { class: "context" }, "…" + (ex.context || "").slice(-160)),
    el("div", { class: "truth" }, el("span", { class: "muted" }, "ground truth: "),
      (ex.facts || []).map((f) => el("span", { class: "fact truthful" }, f))),
    el("div", { class: "muted" }, "data explainer: " + (ex.reference || "–")),
    side("warm-start AV", ex.warmstart), side("after RL", ex.rl));
}

async function loadRun() {
  try {
    const run = await api("/api/run");
    $("run-path").textContent = `${run.kind} run: ${run.path}`;
    $("run-headline").replaceChildren(...run.headline.map((h) =>
      el("div", { class: "stat" }, el("div", { class: "muted" }, h.label),
        el("div", { class: "value" }, h.value === null ? "–" : String(h.value)))));
    $("run-tables").replaceChildren(...run.tables.map(table));
    $("run-plots").replaceChildren(...run.plots.map((p) =>
      el("figure", {}, el("img", { src: p.url, alt: p.title, loading: "lazy" }), el("figcaption", {}, p.title))));
    $("run-examples-title").hidden = !run.examples.length;
    $("run-examples").replaceChildren(...run.examples.map(exampleCard));
  } catch (err) { showError(err.message); }
}

// ---------------------------------------------------------------- start
function switchView(id) {
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== id;
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.view === id);
}

async function init() {
  for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => switchView(t.dataset.view));
  $("explore-btn").addEventListener("click", explore);
  // another block is another vector at every token: explain the text again there
  $("layer-select").addEventListener("change", () => { if (state.input) explore(); });
  $("sample-btn").addEventListener("click", sample);
  $("own-btn").addEventListener("click", scoreOwn);
  $("text-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) explore();
  });
  $("doc-select").addEventListener("change", () => {
    const opt = $("doc-select").selectedOptions[0];
    $("text-input").value = opt && opt.dataset.text ? opt.dataset.text : $("text-input").value;
    $("text-input").readOnly = Boolean($("doc-select").value);
  });
  let info;
  try { info = await api("/api/info"); } catch (err) { showError(err.message); return; }
  if (info.setup_error) showError(`The models could not be loaded: ${info.setup_error}`);
  $("k-input").max = info.limits.max_samples;
  if (info.d_model) {
    const blocks = info.layers ? `blocks ${info.layers.join(", ")}` : `layer ${info.layer_index}`;
    $("pair-info").textContent = `subject ${info.subject.split("/").slice(-3).join("/")} · ${blocks}` +
      ` · d_model ${info.d_model}` + (info.world ? " · world ground truth on" : "");
  }
  if (info.layers) {  // one pair for several blocks: the reader picks the block (the deepest first)
    for (const k of info.layers) $("layer-select").appendChild(el("option", { value: k }, `block ${k}`));
    $("layer-select").value = String(info.layer_index);
    $("layer-row").hidden = false;
  }
  for (const d of info.world_docs || []) {
    const opt = el("option", { value: d.doc_id }, `#${d.doc_id}: ${d.title}…`);
    opt.dataset.text = d.text;
    $("doc-select").appendChild(opt);
  }
  if (info.max_tokens) {
    // Say the caps before they are hit: the token cap, and why fewer documents may be offered.
    let hint = `Up to ${info.max_tokens} tokens per text.`;
    const shown = (info.world_docs || []).length, considered = info.world_docs_considered || 0;
    if (considered > shown) {
      hint += ` ${shown} of ${considered} held-out documents fit that cap (nla explore --max-tokens raises it).`;
    }
    $("input-hint").textContent = hint;
  }
  if (info.run) { $("tab-run").hidden = false; loadRun(); }
}

init();
