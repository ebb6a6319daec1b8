// Flywheel dashboard: polls the JSON endpoints and draws curves, streams and samples.
"use strict";

const POLL_MS = 5000;

async function getJSON(path) {
  const r = await fetch(path, {credentials: "same-origin"});
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function pickSeries(series, preferred, prefix) {
  for (const name of preferred) if (series[name]) return name;
  return Object.keys(series).find((k) => k.startsWith(prefix)) || null;
}

function drawChart(id, steps, values, label) {
  const box = document.getElementById(id);
  const canvas = box.querySelector("canvas");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, w, h);
  const pts = steps.map((s, i) => [s, values ? values[i] : null]).filter((p) => p[1] !== null);
  box.dataset.points = String(pts.length);
  box.dataset.series = label || "";
  box.querySelector(".last").textContent = pts.length
    ? `${label} = ${pts[pts.length - 1][1].toPrecision(4)} @ step ${pts[pts.length - 1][0]}` : "no data";
  const pad = {l: 60, r: 10, t: 8, b: 22};
  ctx.strokeStyle = "#c8ced8"; ctx.lineWidth = 1;
  ctx.strokeRect(pad.l, pad.t, w - pad.l - pad.r, h - pad.t - pad.b);
  if (!pts.length) return;
  let x0 = pts[0][0], x1 = pts[pts.length - 1][0];
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = (y) => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
  ctx.fillStyle = "#6b7383"; ctx.font = "11px system-ui";
  ctx.fillText(y1.toPrecision(3), 2, pad.t + 9);
  ctx.fillText(y0.toPrecision(3), 2, h - pad.b);
  ctx.fillText(`step ${x0}`, pad.l, h - 6);
  ctx.fillText(`${x1}`, w - pad.r - 24, h - 6);
  ctx.strokeStyle = "#2f6fdb"; ctx.lineWidth = 2; ctx.beginPath();
  pts.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
  ctx.stroke();
  ctx.fillStyle = "#2f6fdb";
  for (const [x, y] of pts) { ctx.beginPath(); ctx.arc(X(x), Y(y), 3, 0, 2 * Math.PI); ctx.fill(); }
}

async function refreshCurves() {
  const c = await getJSON("/dashboard/api/curves");
  const reward = pickSeries(c.series, ["reward/mean"], "reward/");
  const loss = pickSeries(c.series, ["loss/total", "loss/pg"], "loss/");
  const kl = pickSeries(c.series, [], "kl/");
  drawChart("chart-reward", c.steps, c.series[reward], reward);
  drawChart("chart-loss", c.steps, c.series[loss], loss);
  drawChart("chart-kl", c.steps, c.series[kl], kl);
  document.getElementById("curves-note").textContent = c.missing
    ? `no trainer metrics file at ${c.source} yet` : `${c.steps.length} steps from ${c.source}`;
}

async function refreshStreams() {
  const s = await getJSON("/dashboard/api/streams");
  const body = document.querySelector("#streams tbody");
  body.replaceChildren();
  for (const st of s.streams) {
    const groups = st.groups.length ? st.groups : [{group: "-", lag: "-", pending: "-"}];
    groups.forEach((g, i) => {
      const tr = document.createElement("tr");
      for (const v of [i ? "" : st.key, i ? "" : st.length, g.group, g.lag ?? "?", g.pending]) {
        const td = document.createElement("td"); td.textContent = String(v); tr.append(td);
      }
      body.append(tr);
    });
  }
}

function tokenStyle(mask, adv) {
  if (!mask) return null;
  if (adv === null || adv === undefined || adv === 0) return "rgba(120,130,150,.25)";
  const a = Math.min(Math.abs(adv), 2) / 2 * 0.55 + 0.15;
  return adv > 0 ? `rgba(46,160,67,${a})` : `rgba(215,58,73,${a})`;
}

function fmt(v) { return v === null || v === undefined ? "-" : Number(v).toPrecision(3); }

function renderSample(s) {
  const card = document.createElement("div");
  card.className = "sample";
  card.dataset.sampleId = s.sample_id;
  const meta = document.createElement("div");
  meta.className = "meta";
  const rewards = Object.entries(s.rewards).map(([k, v]) => `${k}=${fmt(v)}`).join(" ");
  for (const text of [`reward ${fmt(s.reward)}`, `advantage ${fmt(s.advantage)}`,
                      `group ${s.group_id || "-"}`, `finish ${s.finish_reason || "-"}`,
                      `weight version ${s.weight_version ?? "-"}`, rewards,
                      s.teacher_status ? `teacher ${s.teacher_status}` : ""]) {
    if (!text) continue;
    const span = document.createElement("span"); span.textContent = text; meta.append(span);
  }
  card.append(meta);
  if (s.error) {
    const e = document.createElement("div"); e.className = "error"; e.textContent = s.error;
    card.append(e);
  }
  if (s.votes.length) {
    const v = document.createElement("div"); v.className = "votes";
    v.textContent = "judge: " + s.votes.map((x) =>
      `${x.judge} ${x.value === null ? "invalid" : fmt(x.value)}` +
      (x.explanation ? ` (${x.explanation.slice(0, 160)})` : "")).join("; ");
    card.append(v);
  }
  if (s.hint) {
    const hnt = document.createElement("div"); hnt.className = "hint";
    hnt.textContent = `hint: ${s.hint}`; card.append(hnt);
  }
  const toks = document.createElement("div");
  toks.className = "tokens";
  if (s.omitted_before) toks.append(`[${s.omitted_before} context tokens] `);
  for (const [piece, mask] of s.tokens) {
    const span = document.createElement("span");
    span.textContent = piece;
    const bg = tokenStyle(mask, s.advantage);
    if (bg) { span.style.background = bg; span.dataset.mask = "1"; } else span.className = "tok-ctx";
    toks.append(span);
  }
  if (s.omitted_after) toks.append(` [${s.omitted_after} more tokens]`);
  card.append(toks);
  return card;
}

async function refreshSamples() {
  const d = await getJSON("/dashboard/api/samples?limit=8");
  const box = document.getElementById("samples");
  box.replaceChildren(...d.samples.map(renderSample));
  box.dataset.count = String(d.samples.length);
  document.getElementById("samples-source").textContent = `(${d.source})`;
}

async function refresh() {
  const results = await Promise.allSettled([refreshCurves(), refreshStreams(), refreshSamples()]);
  const failed = results.filter((r) => r.status === "rejected").map((r) => r.reason.message);
  document.getElementById("updated").textContent = failed.length
    ? `update failed: ${failed.join("; ")}` : `updated ${new Date().toLocaleTimeString()}`;
  document.body.dataset.loaded = "1";
}

refresh();
setInterval(refresh, POLL_MS);
