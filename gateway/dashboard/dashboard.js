// tierlane dashboard: reads GET /v1/dashboard and draws it; plain DOM and hand-drawn SVG, no libraries.
"use strict";
(function () {
  const LANE_COLORS = { upstream: "#4c78a8", cache: "#54a24b", edge: "#f58518" };
  const OTHER_COLORS = ["#b279a2", "#72b7b2", "#e45756", "#9d755d", "#bab0ac"];
  const PARAMS = ["from", "to", "tz", "bucket", "tenant"];
  // polling period: 15 s, or `refresh=<seconds>` in the page's URL (1 s at least)
  const REFRESH_MS = Math.max(1, Number(new URL(location.href).searchParams.get("refresh")) || 15) * 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let inFlight = false;
  let generation = 0;

  // Formatting -------------------------------------------------------------------------------
  const intFmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  function fmtInt(v) { return v == null ? "–" : intFmt.format(v); }
  function fmtUsd(v) {
    if (v == null) return "–";
    const a = Math.abs(v);
    const digits = a === 0 ? 2 : a >= 100 ? 2 : a >= 1 ? 4 : 6;
    return "$" + v.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }
  function fmtPct(v) { return v == null ? "–" : (v * 100).toFixed(1) + "%"; }
  function fmtMs(v) { return v == null ? "–" : (v < 10 ? v.toFixed(2) : v < 1000 ? v.toFixed(1) : intFmt.format(v)) + " ms"; }
  function fmtNum(v, d) { return v == null ? "–" : Number(v).toFixed(d); }
  function laneColor(lane, i) { return LANE_COLORS[lane] || OTHER_COLORS[i % OTHER_COLORS.length]; }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null) continue;
      if (k === "text") node.textContent = v;
      else if (k === "cls") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.append(child);
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }
  function table(headers, rows) {
    const head = el("tr", {}, headers.map((h, i) => el("th", { cls: i === 0 || h.startsWith("!") ? "t" : null, text: h.replace(/^!/, "") })));
    const body = rows.map((cells) => el("tr", {}, cells.map((c) => {
      if (c instanceof Node) return el("td", {}, [c]);
      if (c && typeof c === "object") return el("td", { cls: c.cls, text: c.text, title: c.title });
      return el("td", { text: c });
    })));
    return el("table", {}, [el("thead", {}, [head]), el("tbody", {}, body)]);
  }

  // Query parameters ------------------------------------------------------------------------
  function currentParams() {
    const url = new URL(location.href);
    const out = {};
    for (const p of PARAMS) {
      const input = $("f-" + p);
      const value = input ? input.value.trim() : url.searchParams.get(p);
      if (value && !(p === "bucket" && value === "auto")) out[p] = value;
    }
    if (!out.tz) out.tz = "UTC";
    return out;
  }
  function loadForm() {
    const url = new URL(location.href);
    for (const p of PARAMS) {
      const v = url.searchParams.get(p);
      if (v != null && $("f-" + p)) $("f-" + p).value = v;
    }
    if (url.searchParams.get("live") === "0") $("f-live").checked = false;
    const zones = new Set(["UTC", "Europe/London", "Europe/Berlin", "America/New_York", "America/Los_Angeles",
      "Asia/Kolkata", "Asia/Kathmandu", "Asia/Tokyo", "Australia/Adelaide"]);
    try { zones.add(Intl.DateTimeFormat().resolvedOptions().timeZone); } catch (e) { /* no Intl zone */ }
    for (const z of zones) if (z) $("zones").append(el("option", { value: z }));
  }
  function apiUrl(extra) {
    const q = new URLSearchParams({ ...currentParams(), ...(extra || {}) });
    return "/v1/dashboard?" + q.toString();
  }
  function authHeaders() {
    const key = sessionStorage.getItem("tierlane-key");
    return key ? { Authorization: "Bearer " + key } : {};
  }

  // Fetching ----------------------------------------------------------------------------------
  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    try {
      const resp = await fetch(apiUrl(), { headers: authHeaders(), cache: "no-store" });
      const text = await resp.text();
      let body = null;
      try { body = JSON.parse(text); } catch (e) { body = null; }
      if (!resp.ok) {
        const message = body && body.error ? body.error.message : text.slice(0, 300);
        showError(resp.status, message);
        return;
      }
      $("notice").hidden = true;
      $("keyform").hidden = true;
      render(body);
    } catch (e) {
      showError(0, "the gateway did not answer: " + e);
    } finally {
      inFlight = false;
    }
  }
  function showError(status, message) {
    const notice = $("notice");
    notice.hidden = false;
    notice.className = "notice error";
    notice.textContent = (status ? status + ": " : "") + message;
    document.body.dataset.state = "error";
    document.body.dataset.status = String(status);
    if (status === 401 || status === 403) {
      $("keyform").hidden = false;
      $("key-message").textContent = status === 403 ? "This key may not read the dashboard; use an admin key:" : "An admin API key is needed:";
    }
  }
  function schedule() {
    if (timer) clearInterval(timer);
    timer = null;
    if ($("f-live").checked) {
      timer = setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);
    }
  }
  async function downloadCsv() {
    const resp = await fetch(apiUrl({ format: "csv" }), { headers: authHeaders(), cache: "no-store" });
    if (!resp.ok) { showError(resp.status, await resp.text()); return; }
    const disposition = resp.headers.get("Content-Disposition") || "";
    const match = /filename="([^"]+)"/.exec(disposition);
    const blob = await resp.blob();
    const link = el("a", { href: URL.createObjectURL(blob), download: match ? match[1] : "tierlane-dashboard.csv" });
    document.body.append(link);
    link.click();
    setTimeout(() => { URL.revokeObjectURL(link.href); link.remove(); }, 1000);
  }

  // Rendering ---------------------------------------------------------------------------------
  function render(d) {
    generation += 1;
    const tenant = d.tenant ? " · tenant <b>" + escapeHtml(d.tenant) + "</b>" : "";
    $("range").innerHTML = "From <b>" + escapeHtml(d.from_local) + "</b> to <b>" + escapeHtml(d.to_local) + "</b>" +
      (d.open_end ? " (now)" : "") + " · time zone <b id=\"tz-shown\">" + escapeHtml(d.tz) + "</b> · by " + escapeHtml(d.bucket) + tenant +
      " · totals: " + escapeHtml(d.source === "fleet" ? "every replica (shared store)" : "this gateway's ledger");
    if (d.warning) { $("notice").hidden = false; $("notice").className = "notice"; $("notice").textContent = d.warning; }
    $("tenant-field").hidden = d.scope === "tenant";
    renderHeadline(d.headline);
    renderSeries($("chart-requests"), d.series, "requests", fmtInt, fmtInt, true);
    renderSeries($("chart-cost"), d.series, "cost_usd", fmtUsd, (v) => "$" + Number(v.toPrecision(3)).toLocaleString("en-US"));
    renderBreakdown(d.breakdown);
    renderWarnings(d.warnings || []);
    renderBudgets(d.budgets);
    renderQuality(d.quality);
    renderHistogram($("chart-confidence"), [
      { name: "served", values: d.quality.confidence_histogram.served, color: LANE_COLORS.edge },
      { name: "escalated", values: d.quality.confidence_histogram.escalated, color: "#c0392b" }]);
    renderHistogram($("chart-similarity"), [
      { name: "cache hits", values: d.quality.cache_similarity_histogram, color: LANE_COLORS.cache }]);
    renderEngine(d.edge_engine, d.scope);
    renderBatches(d.batches);
    renderLearned(d.learned);
    renderErrors(d.errors);
    $("footer").textContent = "Updated " + new Date().toLocaleTimeString() + " · query " + d.query_ms + " ms · " +
      (d.rollups ? "rollups" : "raw rows") + " · percentiles " + d.headline.percentiles +
      ($("f-live").checked ? " · refreshing every " + REFRESH_MS / 1000 + " s" : "");
    document.body.dataset.state = "ready";
    document.body.dataset.generation = String(generation);
  }
  function escapeHtml(s) {
    return String(s == null ? "" : s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }
  function card(metric, label, value, text, sub) {
    return el("div", { cls: "card", "data-metric": metric, "data-value": value == null ? "" : String(value) }, [
      el("div", { cls: "k", text: label }), el("div", { cls: "v", text: text }), el("div", { cls: "s", text: sub || "" })]);
  }
  function renderHeadline(h) {
    const lat = h.latency_ms, ttft = h.ttft_ms;
    $("headline").replaceChildren(
      card("requests", "Requests", h.requests, fmtInt(h.requests), fmtInt(h.errors) + " errors · " + fmtInt(h.rejected) + " 429s"),
      card("cost_usd", "Cost", h.cost_usd, fmtUsd(h.cost_usd), "all upstream: " + fmtUsd(h.upstream_equivalent_usd)),
      card("saved_usd", "Saved", h.saved_usd, fmtUsd(h.saved_usd), fmtPct(h.saved_share) + " of all-upstream"),
      card("saved_cache_usd", "Saved by cache", h.saved_cache_usd, fmtUsd(h.saved_cache_usd)),
      card("saved_edge_usd", "Saved by edge", h.saved_edge_usd, fmtUsd(h.saved_edge_usd)),
      card("saved_trim_usd", "Saved by trim", h.saved_trim_usd, fmtUsd(h.saved_trim_usd), fmtInt(h.trimmed_tokens) + " tokens trimmed"),
      card("saved_vs_strong_usd", "Saved vs all-strong", h.saved_vs_strong_usd, fmtUsd(h.saved_vs_strong_usd), "had every request gone to the strong tier"),
      card("saved_vs_named_usd", "Saved vs named model", h.saved_vs_named_usd, fmtUsd(h.saved_vs_named_usd), "had every request gone to the model it named"),
      card("local_share", "Answered locally", h.local_share, fmtPct(h.local_share), "cache + edge"),
      card("cache_hit_rate", "Cache hit rate", h.cache_hit_rate, fmtPct(h.cache_hit_rate), fmtInt(h.cache_lookups) + " lookups"),
      card("error_rate", "Error rate", h.error_rate, fmtPct(h.error_rate)),
      card("input_tokens", "Tokens in / out", h.input_tokens, fmtInt(h.input_tokens), fmtInt(h.output_tokens) + " out"),
      card("latency_p50", "Latency p50", lat.p50, fmtMs(lat.p50), "p95 " + fmtMs(lat.p95) + " · p99 " + fmtMs(lat.p99)),
      card("ttft_p50", "TTFT p50", ttft.p50, fmtMs(ttft.p50), "p95 " + fmtMs(ttft.p95) + " · p99 " + fmtMs(ttft.p99)),
      card("judge_cost_usd", "Judging spend", h.judge_cost_usd, fmtUsd(h.judge_cost_usd),
        fmtInt(h.judge_requests) + " re-asks (shadow.bill_judging_to)"),
    );
    // the figures' values on hidden cards too, so the whole /v1/usage total can be checked on the page
    for (const metric of ["output_tokens", "errors", "cached_input_tokens", "cache_write_tokens", "trimmed_tokens", "estimated_requests",
      "judge_requests", "judge_input_tokens", "judge_output_tokens"]) {
      const c = card(metric, metric, h[metric], fmtInt(h[metric]));
      c.hidden = true;
      $("headline").append(c);
    }
  }
  // the top of an axis with `ticks` round steps (1, 2 or 5 times a power of ten) that reaches v;
  // a count axis (`whole`) steps by 1 at least, so no tick is a fraction rounded onto its neighbour's label
  function niceMax(v, ticks, whole) {
    if (!(v > 0)) return ticks;
    if (whole && v <= ticks) return ticks;
    const raw = v / ticks, p = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p * ticks;
    return 10 * p * ticks;
  }
  function renderSeries(node, series, measure, fmt, tickFmt, whole) {
    const labels = series.labels, lanes = Object.keys(series.lanes);
    const W = 960, H = 220, L = 64, B = 34, T = 8, R = 8;
    const n = Math.max(1, labels.length);
    const totals = labels.map((_, i) => lanes.reduce((s, lane) => s + (series.lanes[lane][measure][i] || 0), 0));
    const max = niceMax(Math.max(0, ...totals), 4, whole);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": measure + " by lane" });
    const plotW = W - L - R, plotH = H - T - B, step = plotW / n, barW = Math.max(1, step * 0.8);
    for (let g = 0; g <= 4; g++) {
      const y = T + plotH - (plotH * g) / 4;
      root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, stroke: "#e2e5ea" }));
      const t = svg("text", { x: L - 6, y: y + 3, "text-anchor": "end" });
      t.textContent = (tickFmt || fmt)((max * g) / 4);
      root.append(t);
    }
    labels.forEach((label, i) => {
      let y = T + plotH;
      lanes.forEach((lane, j) => {
        const v = series.lanes[lane][measure][i] || 0;
        if (v <= 0) return;
        const h = (v / max) * plotH;
        y -= h;
        const rect = svg("rect", { x: L + i * step + (step - barW) / 2, y, width: barW, height: h, fill: laneColor(lane, j) });
        const title = svg("title", {});
        title.textContent = `${label} · ${lane}: ${fmt(v)}`;
        rect.append(title);
        root.append(rect);
      });
      const every = Math.ceil(n / 12);
      if (i % every === 0) {
        const t = svg("text", { x: L + i * step + step / 2, y: H - B + 14, "text-anchor": "middle" });
        t.textContent = series.bucket === "hour" ? label.slice(5, 16).replace("T", " ") : label;
        root.append(t);
      }
    });
    const legend = el("div", { cls: "legend" }, lanes.map((lane, j) => el("span", {}, [el("i", { style: "background:" + laneColor(lane, j) }), lane])));
    node.replaceChildren(root, legend);
    node.dataset.total = String(totals.reduce((a, b) => a + b, 0));
  }
  function renderHistogram(node, sets) {
    const bins = sets[0].values.length, W = 460, H = 160, L = 48, B = 24, T = 6, R = 10;
    const totals = Array.from({ length: bins }, (_, b) => sets.reduce((s, set) => s + (set.values[b] || 0), 0));
    const max = niceMax(Math.max(0, ...totals), 2, true);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    const plotW = W - L - R, plotH = H - T - B, step = plotW / bins;
    for (let g = 0; g <= 2; g++) {
      const y = T + plotH - (plotH * g) / 2;
      root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, stroke: "#e2e5ea" }));
      const t = svg("text", { x: L - 4, y: y + 3, "text-anchor": "end" });
      t.textContent = fmtInt((max * g) / 2);
      root.append(t);
    }
    for (let b = 0; b < bins; b++) {
      let y = T + plotH;
      for (const set of sets) {
        const v = set.values[b] || 0;
        if (!v) continue;
        const h = (v / max) * plotH;
        y -= h;
        const rect = svg("rect", { x: L + b * step + 1, y, width: Math.max(1, step - 2), height: h, fill: set.color });
        const title = svg("title", {});
        title.textContent = `${(b / bins).toFixed(2)}–${((b + 1) / bins).toFixed(2)} ${set.name}: ${v}`;
        rect.append(title);
        root.append(rect);
      }
    }
    for (const x of [0, 0.5, 1]) {
      const t = svg("text", { x: L + x * plotW, y: H - 8, "text-anchor": "middle" });
      t.textContent = x.toFixed(1);
      root.append(t);
    }
    const total = totals.reduce((a, b) => a + b, 0);
    const legend = el("div", { cls: "legend" }, sets.map((s) => el("span", {}, [el("i", { style: "background:" + s.color }), s.name])));
    node.replaceChildren(total ? root : el("p", { cls: "muted", text: "No data in this range." }), legend);
  }
  function renderWarnings(warnings) {
    const node = $("warnings");
    node.hidden = !warnings.length;
    node.replaceChildren(...warnings.map((w) => el("p", { text: "⚠ " + w })));
  }
  function renderBreakdown(rows) {
    if (!rows.length) { $("breakdown").replaceChildren(el("p", { cls: "muted", text: "No requests in this range." })); return; }
    $("breakdown").replaceChildren(table(
      ["tenant", "!app", "!model", "requests", "input tokens", "prompt cache read / written", "output tokens", "cost", "saved", "429s", "errors"],
      rows.map((r) => [{ cls: "t", text: r.tenant }, { cls: "t", text: r.app }, { cls: "t", text: r.model }, fmtInt(r.requests),
        fmtInt(r.input_tokens), cacheShares(r), fmtInt(r.output_tokens), fmtUsd(r.cost_usd), fmtUsd(r.saved_usd), fmtInt(r.rejected), fmtInt(r.errors)])));
  }
  // the share of input tokens read from the upstream's prompt cache, and written to it (priced on their own)
  function cacheShares(r) {
    const input = r.input_tokens || 0;
    if (!input) return "–";
    return { text: fmtPct((r.cached_input_tokens || 0) / input) + " / " + fmtPct((r.cache_write_tokens || 0) / input),
      title: fmtInt(r.cached_input_tokens || 0) + " tokens read, " + fmtInt(r.cache_write_tokens || 0) + " written" };
  }
  function spendBar(spent, limit) {
    if (limit == null) return el("span", { cls: "muted", text: fmtUsd(spent) });
    const share = limit > 0 ? spent / limit : 1;
    const bar = el("div", { cls: "bar", title: fmtUsd(spent) + " of " + fmtUsd(limit) }, [
      el("span", { cls: share >= 1 ? "over" : null, style: "width:" + Math.min(100, share * 100).toFixed(1) + "%" })]);
    return el("div", {}, [el("div", { text: fmtUsd(spent) + " / " + fmtUsd(limit) + " (" + fmtPct(share) + ")" }), bar]);
  }
  function renderBudgets(rows) {
    if (!rows.length) { $("budgets").replaceChildren(el("p", { cls: "muted", text: "No budgets apply to this traffic (or budgets are off)." })); return; }
    $("budgets").replaceChildren(table(["scope", "!tenant / app", "!today (UTC)", "!this month", "rpm", "tpm", "429s"],
      rows.map((r) => [{ cls: "t", text: r.scope }, { cls: "t", text: r.tenant + (r.app ? " / " + r.app : "") },
        spendBar(r.spent_today_usd, r.daily_spend_usd), spendBar(r.spent_month_usd, r.monthly_spend_usd),
        r.requests_per_minute == null ? "–" : fmtInt(r.requests_per_minute), r.tokens_per_minute == null ? "–" : fmtInt(r.tokens_per_minute),
        fmtInt(r.rejected)])));
  }
  function renderQuality(q) {
    const e = q.edge;
    const parts = [];
    parts.push(table(["edge (local lane)", "value"], [
      [{ cls: "t", text: "answered by the edge" }, fmtInt(e.requests)],
      [{ cls: "t", text: "escalated upstream" }, fmtInt(e.escalated)],
      [{ cls: "t", text: "escalation rate" }, fmtPct(e.escalation_rate)],
      [{ cls: "t", text: "mean confidence" }, fmtNum(e.mean_confidence, 3)],
      [{ cls: "t", text: "edge tokens" }, fmtInt(e.edge_tokens)]]));
    if (e.reasons.length) parts.push(table(["escalation reason", "count"], e.reasons.map((r) => [{ cls: "t", text: r.reason }, fmtInt(r.count)])));
    const shadow = q.shadow || [];
    parts.push(shadow.length
      ? table(["shadow agreement", "sampled", "mean similarity", "agree"], shadow.map((s) => [{ cls: "t", text: s.lane }, fmtInt(s.count),
        fmtNum(s.mean_similarity, 3), { text: fmtPct(s.agreement), title: "share above " + s.agree_above }]))
      : el("p", { cls: "muted", text: "No shadow comparisons in this range (policy shadow.sample_rate)." }));
    const bound = q.cache_bound || [];
    if (bound.length) parts.push(table(["cache error bound", "!tenant / app", "serve threshold", "served error", "upper bound", "judged hits", "hit rate"],
      bound.map((b) => [{ cls: "t", text: b.kind }, { cls: "t", text: b.tenant + " / " + b.app }, fmtNum(b.threshold, 3),
        fmtPct(b.served_error), { text: fmtPct(b.upper_bound) + " / " + fmtPct(b.max_error_rate), title: "upper confidence bound / cache.max_error_rate" },
        fmtInt(b.judged), fmtPct(b.hit_rate)])));
    const regions = q.route_bound || [];
    if (regions.length) parts.push(table(["routing quality bound: region", "!tenant / app", "strong share", "threshold (router's)",
      "disagreement", "upper bound / max loss", "judged", "saved", "judging spend"],
      regions.map((r) => [{ cls: "t", text: r.label, title: "region " + r.region }, { cls: "t", text: r.tenant + " / " + r.app },
        { text: fmtPct(r.strong_share), title: fmtInt(r.requests) + " tiered requests on this replica" },
        fmtNum(r.threshold, 3) + " (" + fmtNum(r.router_threshold, 3) + ")",
        { text: fmtPct(r.disagreement), title: "cost-tier answers that differed from the strong tier's, as a share of the judged" },
        { text: fmtPct(r.upper_bound) + " / " + fmtPct(r.max_quality_loss), title: "one-sided upper bound / lanes.upstream.tiers.max_quality_loss" },
        { text: fmtInt(r.judged) + (r.judge_failed ? " (" + fmtInt(r.judge_failed) + " failed)" : ""), title: fmtInt(r.disagreed) + " disagreed" },
        fmtUsd(r.saved_usd), fmtUsd(r.judge_usd)])));
    if (q.routes.length) parts.push(table(["routing reason", "requests"], q.routes.map((r) => [{ cls: "t", text: r.reason }, fmtInt(r.count)])));
    const tiers = q.tiers || [];
    if (tiers.length) parts.push(table(["upstream tier", "requests", "escalated from edge", "tokens", "cost"], tiers.map((t) => [
      { cls: "t", text: t.tier }, fmtInt(t.requests), fmtInt(t.escalated), fmtInt(t.input_tokens + t.output_tokens), fmtUsd(t.cost_usd)])));
    const classes = q.priorities || [];
    if (classes.length) parts.push(table(["priority class", "requests", "errors", "refused (busy)", "mean latency", "p95 latency", "mean TTFT"],
      classes.map((c) => [{ cls: "t", text: c.priority }, fmtInt(c.requests), fmtInt(c.errors),
        { text: fmtInt(c.refused), title: "answered 429 upstream_busy by flow control (queue full or waited too long)" },
        fmtMs(c.mean_latency_ms), fmtMs(c.p95_latency_ms), fmtMs(c.mean_ttft_ms)])));
    const sessions = q.sessions || [];
    if (sessions.length) parts.push(table(["session (costliest)", "!tenant / app", "requests", "errors", "tokens", "prompt cache read / written",
      "cached share after the first turns", "masking saved", "cost"],
      sessions.map((x) => [{ cls: "t", text: x.session, title: x.first + " – " + x.last }, { cls: "t", text: x.tenant + " / " + x.app },
        fmtInt(x.requests), fmtInt(x.errors), fmtInt(x.input_tokens + x.output_tokens), cacheShares(x),
        { cls: x.prefix_broken ? "bad" : "", text: (x.cached_share_late == null ? "–" : fmtPct(x.cached_share_late)) + (x.prefix_broken ? " (prefix broken)" : ""),
          title: fmtInt(x.cold_turns) + " later turns read under half their input from the prompt cache" },
        { text: x.mask_mode ? fmtUsd(x.saved_mask_usd) + (x.mask_mode === "shadow" ? " (shadow)" : "") : "–",
          title: fmtInt(x.masked_tokens) + " tokens of old tool output" + (x.mask_mode === "shadow" ? " would have been" : "") + " masked; net of the cache rewrites" },
        fmtUsd(x.cost_usd)])));
    $("quality").replaceChildren(...parts);
  }
  function renderEngine(s, scope) {
    if (!s) {
      $("engine").replaceChildren(el("p", { cls: "muted", text: scope === "tenant" ? "Shown to global admins only." : "The edge lane is off on this gateway." }));
      return;
    }
    const kv = s.kv_cells_total ? fmtInt(s.kv_cells_used) + " / " + fmtInt(s.kv_cells_total) : fmtInt(s.kv_cells_used);
    $("engine").replaceChildren(table(["figure", "value"], [
      [{ cls: "t", text: "model" }, String(s.model || "–")],
      [{ cls: "t", text: "available" }, s.available ? "yes" : "no"],
      [{ cls: "t", text: "decode tokens/s" }, fmtNum(s.decode_tokens_per_s, 1)],
      [{ cls: "t", text: "prefill tokens/s" }, fmtNum(s.prefill_tokens_per_s, 1)],
      [{ cls: "t", text: "queue depth" }, fmtInt(s.queue_depth)],
      [{ cls: "t", text: "active sequences" }, fmtInt(s.active_sequences) + (s.slots ? " / " + s.slots : "")],
      [{ cls: "t", text: "KV cells in use" }, kv],
      [{ cls: "t", text: "speculative acceptance" }, fmtPct(s.spec_acceptance_rate)]]));
  }
  function renderBatches(b) {
    if (!b) { $("batches").replaceChildren(el("p", { cls: "muted", text: "The Batch API is off on this gateway." })); return; }
    const jobs = Object.entries(b.jobs).sort();
    const rows = jobs.map(([status, n]) => [{ cls: "t", text: "jobs " + status }, fmtInt(n)]);
    rows.push([{ cls: "t", text: "lines waiting (jobs running)" }, fmtInt(b.lines.pending)]);
    rows.push([{ cls: "t", text: "lines answered / errored" }, fmtInt(b.lines.succeeded) + " / " + fmtInt(b.lines.errored)]);
    $("batches").replaceChildren(table(["figure", "value"], rows));
  }
  function renderLearned(rows) {
    if (!rows) { $("learned").replaceChildren(el("p", { cls: "muted", text: "No template is named to learn on this gateway." })); return; }
    $("learned").replaceChildren(table(["tenant / app / template", "state", "pairs", "adapter", "judged", "disagreement (upper bound / bound)",
      "served", "local share"], rows.map((r) => {
      const g = r.learned || {};
      const bound = g.judged ? fmtPct(g.disagreement) + " (" + fmtPct(g.disagreement_upper) + " / " + fmtPct(g.max_disagreement) + ")" : "–";
      return [{ cls: "t", text: r.tenant + " / " + r.app + " / " + r.template }, { cls: "t", text: r.state }, fmtInt(r.pairs),
        { cls: "t", text: g.sha256 ? g.sha256.slice(0, 12) : "–" }, fmtInt(g.judged || 0), bound, fmtInt(g.served || 0),
        fmtPct(g.local_share)];
    })));
  }
  function renderErrors(rows) {
    if (!rows.length) { $("errors").replaceChildren(el("p", { cls: "muted", text: "No errors in this range." })); return; }
    $("errors").replaceChildren(table(["!local time", "status", "!code", "!request id", "!trace id", "!tenant", "!app", "!lane", "!model"],
      rows.map((r) => [{ cls: "t", text: r.local_time }, String(r.status), { cls: "t", text: r.error_code || "" },
        { cls: "t mono", text: r.request_id }, { cls: "t mono", text: r.trace_id || "–" }, { cls: "t", text: r.tenant },
        { cls: "t", text: r.app }, { cls: "t", text: r.lane }, { cls: "t", text: r.model }])));
  }

  // Wiring ----------------------------------------------------------------------------------------
  $("controls").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const url = new URL(location.href);
    const params = currentParams();
    for (const p of PARAMS) { if (params[p]) url.searchParams.set(p, params[p]); else url.searchParams.delete(p); }
    history.replaceState(null, "", url);
    schedule();
    refresh();
  });
  $("f-live").addEventListener("change", schedule);
  $("csv").addEventListener("click", downloadCsv);
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("tierlane-key", $("f-key").value.trim());
    $("f-key").value = "";
    refresh();
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden && $("f-live").checked) refresh(); });
  loadForm();
  schedule();
  refresh();
})();
