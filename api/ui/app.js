'use strict';
// Ferry ops UI: plain JavaScript, no build step. Data comes from
// GET /v1/status (once, with history) and the server-sent events of
// GET /v1/events (a `status` event every second), read with fetch() so that
// the bearer token travels in a header, never in a URL.

const $ = (sel, el = document) => el.querySelector(sel);
const CLASSES = ['urgent', 'scheduled', 'background'];
const HISTORY_MS = 10 * 60 * 1000;

const ui = {
  token: sessionStorage.getItem('ferry-token') || '',
  role: null,          // 'reader' | 'signaler' | 'operator' once known
  history: {},         // link name -> [{at_ms, urgent_bps, scheduled_bps, background_bps}]
  expanded: new Set(), // transfer ids whose score terms are shown
  status: null,
  stream: null,        // AbortController of the event stream
  settings: null,      // the answer of GET /v1/settings
};

// ---- formatting ------------------------------------------------------

function fmtBytes(n) {
  if (n == null) return '–';
  const u = ['B', 'kB', 'MB', 'GB', 'TB', 'PB'];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + ' ' + u[i];
}
function fmtRate(bps) {
  if (bps == null) return '–';
  const u = ['bit/s', 'kbit/s', 'Mbit/s', 'Gbit/s', 'Tbit/s'];
  let i = 0;
  while (bps >= 1000 && i < u.length - 1) { bps /= 1000; i++; }
  return (i === 0 ? bps.toFixed(0) : bps.toFixed(bps < 10 ? 2 : 1)) + ' ' + u[i];
}
function fmtDur(s) {
  if (s == null || !isFinite(s)) return '–';
  if (s < 0) return '-' + fmtDur(-s);
  if (s < 10) return s.toFixed(1) + ' s';
  if (s < 60) return Math.round(s) + ' s';
  if (s < 3600) return Math.floor(s / 60) + 'm ' + String(Math.round(s % 60)).padStart(2, '0') + 's';
  if (s < 86400) return Math.floor(s / 3600) + 'h ' + String(Math.floor((s % 3600) / 60)).padStart(2, '0') + 'm';
  return Math.floor(s / 86400) + 'd ' + Math.floor((s % 86400) / 3600) + 'h';
}
function fmtTime(ms) {
  return ms == null ? '–' : new Date(ms).toLocaleTimeString();
}
function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function setCell(td, text) {
  if (td.textContent !== text) td.textContent = text;
}

// ---- API -------------------------------------------------------------

function headers(json) {
  const h = {};
  if (ui.token) h.Authorization = 'Bearer ' + ui.token;
  if (json) h['Content-Type'] = 'application/json';
  return h;
}

async function api(method, path, body) {
  const r = await fetch(path, {
    method,
    headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = null;
  try { data = await r.json(); } catch (_) { /* not JSON */ }
  if (!r.ok) {
    const e = new Error((data && data.error) || r.statusText);
    e.status = r.status;
    throw e;
  }
  return data;
}

function notice(text, isError) {
  const n = $('#notice');
  n.textContent = text;
  n.classList.toggle('error', !!isError);
}

// ---- live updates ----------------------------------------------------

function setLive(kind, text) {
  const l = $('#live');
  l.className = 'live ' + kind;
  l.textContent = text;
}

async function connect() {
  if (ui.stream) ui.stream.abort();
  const ctl = new AbortController();
  ui.stream = ctl;
  setLive('off', 'connecting');
  try {
    await whoami();
    const first = await api('GET', '/v1/status?history=true');
    ui.history = {};
    for (const l of first.links) ui.history[l.name] = l.history.slice();
    render(first);
    loadSettings();
    loadRetention();
    const r = await fetch('/v1/events', { headers: headers(), signal: ctl.signal });
    if (!r.ok) {
      const d = await r.json().catch(() => null);
      const e = new Error((d && d.error) || r.statusText);
      e.status = r.status;
      throw e;
    }
    setLive('on', 'live');
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        frame(buf.slice(0, i));
        buf = buf.slice(i + 2);
      }
    }
    throw new Error('the event stream ended');
  } catch (e) {
    if (ctl.signal.aborted) return;
    const auth = e.status === 401 || e.status === 403;
    setLive('err', auth ? 'needs a token' : 'reconnecting');
    if (auth) notice(e.status + ': ' + e.message + ' — enter a reader or operator token above.', true);
    setTimeout(() => { if (ui.stream === ctl) connect(); }, auth ? 15000 : 2000);
  }
}

function frame(text) {
  let event = 'message';
  const data = [];
  for (const line of text.split('\n')) {
    if (line.startsWith(':')) continue;
    const c = line.indexOf(':');
    const field = c < 0 ? line : line.slice(0, c);
    const value = c < 0 ? '' : line.slice(c + 1).replace(/^ /, '');
    if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  if (event !== 'status' || !data.length) return;
  const st = JSON.parse(data.join('\n'));
  for (const l of st.links) {
    const h = (ui.history[l.name] ||= []);
    const last = h.length ? h[h.length - 1].at_ms : 0;
    if (st.now_ms - last >= 900) {
      h.push({ at_ms: st.now_ms, urgent_bps: l.class_bps.urgent,
               scheduled_bps: l.class_bps.scheduled, background_bps: l.class_bps.background });
    }
    while (h.length && h[0].at_ms < st.now_ms - HISTORY_MS) h.shift();
  }
  render(st);
}

async function whoami() {
  try {
    const w = await api('GET', '/v1/whoami');
    ui.role = w.role;
    $('#whoami').textContent = w.name === 'anonymous'
      ? 'no token needed (allow_unauthenticated)'
      : 'token “' + w.name + '” (' + w.role + ')';
  } catch (e) {
    ui.role = null;
    $('#whoami').textContent = ui.token ? 'token refused' : 'no token';
    throw e;
  }
}

// ---- rendering -------------------------------------------------------

function render(st) {
  ui.status = st;
  $('#agent').textContent = st.agent + ' · ' + (st.roles.join(' + ') || 'no role');
  document.title = 'Ferry · ' + st.agent;
  const isSource = st.roles.includes('source');
  $('#links-panel').hidden = !isSource;
  $('#queue-panel').hidden = !isSource;
  $('#published-panel').hidden = !isSource;
  $('#signals-panel').hidden = !isSource;
  $('#replicas-panel').hidden = !st.roles.includes('sink');
  if (isSource) {
    renderLinks(st);
    renderQueue(st);
    renderPublished(st);
    renderSignals(st);
  }
  if (st.roles.includes('sink')) renderReplicas(st);
  renderPool(st);
}

function renderPool(st) {
  const agents = st.pool || [];
  // Shown also while the catalog does not answer (no agents then): the
  // note says so.
  $('#pool-panel').hidden = agents.length === 0 && st.catalog_up !== false;
  $('#pool-note').textContent = st.catalog_up ? '' : '· this agent\'s catalog does not answer: it claims nothing';
  fill($('#pool tbody'), agents.map((a) => [
    a.name + (a.name === st.agent ? ' (this agent)' : ''), a.role,
    el('span', { class: 'pool-' + a.state }, a.state),
    a.heartbeat_age_s.toFixed(1) + ' s ago',
    a.held + ' (' + fmtBytes(a.held_bytes_left) + ' left)' +
      (a.watches ? ' · watches ' + a.watches + (a.watches === 1 ? ' root' : ' roots') : ''),
    fmtRate(a.sent_bps), fmtRate(a.received_bps), a.version]));
}

function canOperate() {
  return ui.role === 'operator';
}

function renderLinks(st) {
  const box = $('#links');
  const seen = new Set();
  for (const l of st.links) {
    seen.add(l.name);
    let card = box.querySelector(`[data-link="${CSS.escape(l.name)}"]`);
    if (!card) {
      const input = el('input', { type: 'number', min: '0.001', step: 'any', 'aria-label': 'Rate cap in Mbit/s' });
      card = el('div', { class: 'link', 'data-link': l.name },
        el('div', {},
          el('strong', {}, l.name),
          el('div', { class: 'cap' }),
          el('div', { class: 'meter' }, el('div')),
          el('div', { class: 'util' }),
          el('div', { class: 'rates legend' }),
          el('form', { class: 'rate-form', onsubmit: (ev) => { ev.preventDefault(); setRate(l.name, input); } },
            input, el('span', { class: 'muted' }, 'Mbit/s'), el('button', { type: 'submit' }, 'Set cap'))),
        el('div', {}, svgNS('svg', { class: 'chart', viewBox: '0 0 600 150' }),
          el('div', { class: 'legend' },
            ...CLASSES.map((c) => el('span', {}, el('i', { style: `background: var(--${c})` }), c)),
            el('span', { class: 'muted' }, 'last 10 minutes; dashed: rate cap'))));
      box.append(card);
    }
    const conns = l.connections > 1 || l.connections_open !== l.connections
      ? ` · ${l.connections_open} of ${l.connections} connections open` : '';
    const sink = l.sink ? ` · to sink agent ${l.sink}` : '';
    setCell(card.querySelector('.cap'), 'rate cap ' + fmtRate(l.rate_bps) + conns + sink);
    const pct = Math.min(100, 100 * l.utilisation);
    card.querySelector('.meter div').style.width = pct.toFixed(1) + '%';
    setCell(card.querySelector('.util'), 'utilisation ' + pct.toFixed(1) + ' % · goodput ' + fmtRate(l.goodput_bps));
    setCell(card.querySelector('.rates'), CLASSES.map((c) => c + ' ' + fmtRate(l.class_bps[c])).join(' · '));
    card.querySelector('.rate-form').hidden = !canOperate();
    drawChart(card.querySelector('svg'), ui.history[l.name] || [], l.rate_bps, st.now_ms);
  }
  for (const c of [...box.children]) if (!seen.has(c.dataset.link)) c.remove();
}

function svgNS(tag, attrs = {}) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function drawChart(svg, points, cap, now) {
  // Drawn in CSS pixels so that the labels keep their shape.
  const W = Math.max(200, Math.round(svg.clientWidth || 600)), H = 150, top = 8, bottom = 18;
  svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
  let ymax = cap;
  for (const p of points) ymax = Math.max(ymax, p.urgent_bps + p.scheduled_bps + p.background_bps);
  ymax = ymax * 1.05 || 1;
  const x = (t) => W * (1 - (now - t) / HISTORY_MS);
  const y = (v) => top + (H - top - bottom) * (1 - v / ymax);
  svg.replaceChildren();
  // Stacked areas: background at the bottom, then scheduled, then urgent.
  const order = ['background', 'scheduled', 'urgent'];
  const base = points.map(() => 0);
  for (const c of order) {
    if (!points.length) break;
    const upper = points.map((p, i) => base[i] + p[c + '_bps']);
    let d = '';
    points.forEach((p, i) => { d += (i ? 'L' : 'M') + x(p.at_ms).toFixed(1) + ',' + y(upper[i]).toFixed(1); });
    for (let i = points.length - 1; i >= 0; i--) d += 'L' + x(points[i].at_ms).toFixed(1) + ',' + y(base[i]).toFixed(1);
    svg.append(svgNS('path', { d: d + 'Z', fill: `var(--${c})`, 'fill-opacity': '0.75', stroke: 'none' }));
    upper.forEach((v, i) => { base[i] = v; });
  }
  const yc = y(cap).toFixed(1);
  svg.append(svgNS('line', { x1: 0, x2: W, y1: yc, y2: yc, stroke: '#0f172a', 'stroke-dasharray': '4 3' }));
  const label = svgNS('text', { x: 4, y: Math.max(10, yc - 3) });
  label.textContent = fmtRate(cap);
  svg.append(label);
  for (const m of [10, 5, 0]) {
    const t = svgNS('text', { x: Math.min(W - 30, Math.max(2, x(now - m * 60000) - 10)), y: H - 4 });
    t.textContent = m ? '-' + m + ' min' : 'now';
    svg.append(t);
  }
}

function liveDone(t) {
  if (t.state === 'published') return t.bytes_total;
  const p = t.progress;
  const moved = p ? p.bytes_sent + p.bytes_skipped : 0;
  const cap = p ? Math.max(p.bytes_total, t.bytes_total) : 0;
  const live = cap > 0 ? Math.min(cap, moved) : moved;
  return Math.max(t.bytes_done, live);
}

function renderQueue(st) {
  const body = $('#queue tbody');
  const parts = Object.entries(st.counts).map(([k, v]) => v + ' ' + k);
  const shownLive = st.transfers.filter((r) => r.ranking).length;
  if (st.unfinished > shownLive) parts.push(`showing the first ${shownLive} of ${st.unfinished} unfinished`);
  setCell($('#counts'), parts.join(' · '));
  $('#queue-empty').hidden = st.transfers.length > 0;
  const rows = new Map([...body.querySelectorAll('tr.row')].map((r) => [r.dataset.id, r]));
  let prev = null;
  for (const t of st.transfers) {
    const id = String(t.id);
    let tr = rows.get(id);
    if (tr) rows.delete(id); else tr = queueRow(t);
    updateRow(tr, t, st.now_ms);
    // Keep rank order; the details row follows its transfer.
    const after = prev ? (prev.nextSibling && prev.nextSibling.classList.contains('details') ? prev.nextSibling : prev) : null;
    const want = after ? after.nextSibling : body.firstChild;
    if (want !== tr) body.insertBefore(tr, want);
    let det = tr.nextSibling && tr.nextSibling.classList.contains('details') ? tr.nextSibling : null;
    if (ui.expanded.has(t.id)) {
      if (!det) { det = el('tr', { class: 'details' }, el('td', { colspan: 12 })); tr.after(det); }
      det.firstChild.replaceChildren(details(t));
    } else if (det) det.remove();
    prev = tr;
  }
  for (const tr of rows.values()) {
    if (tr.nextSibling && tr.nextSibling.classList.contains('details')) tr.nextSibling.remove();
    tr.remove();
  }
}

function queueRow(t) {
  const tr = el('tr', { class: 'row', 'data-id': t.id });
  for (const c of ['id', 'job', 'ckpt', 'class', 'score num', 'state', 'bar', 'bytes num', 'rate num', 'eta num', 'age num', 'act']) {
    tr.append(el('td', { class: c }));
  }
  tr.querySelector('.bar').append(el('progress', { max: 1, value: 0 }));
  tr.addEventListener('click', (ev) => {
    if (ev.target.closest('.actions')) return;
    if (ui.expanded.has(t.id)) ui.expanded.delete(t.id); else ui.expanded.add(t.id);
    if (ui.status) renderQueue(ui.status);
  });
  return tr;
}

function updateRow(tr, t, now) {
  const r = t.ranking;
  const cls = r ? r.class : t.class;
  setCell(tr.querySelector('.id'), String(t.id));
  setCell(tr.querySelector('.job'), t.job);
  setCell(tr.querySelector('.ckpt'), t.rel);
  tr.querySelector('.ckpt').title = t.source_path;
  const c = tr.querySelector('.class');
  if (c.dataset.v !== cls) {
    c.dataset.v = cls;
    c.replaceChildren(el('span', { class: 'cls ' + cls }, cls + (r && r.promoted_until ? ' ↑' : '')));
  }
  setCell(tr.querySelector('.score'), r ? r.score.value.toFixed(2) : '–');
  const s = tr.querySelector('.state');
  const due = t.deadline_state === 'at_risk' ? ' · deadline at risk'
    : t.deadline_state === 'missed' ? ' · deadline missed' : '';
  setCell(s, t.state + due);
  s.title = t.deadline ? 'deadline ' + fmtTime(t.deadline) + (t.deadline_state ? ' (' + t.deadline_state + ')' : '') : '';
  s.className = 'state ' + t.state + (due ? ' late' : '');
  s.dataset.state = t.state;
  const done = liveDone(t);
  // While the checkpoint is being written its size is not final.
  const total = Math.max(t.bytes_total, t.progress ? t.progress.bytes_total : 0);
  const writing = t.checkpoint === 'open' || t.checkpoint === 'announced';
  const bar = tr.querySelector('progress');
  if (total > 0) {
    bar.max = total;
    bar.value = Math.min(done, total);
  } else {
    bar.removeAttribute('value'); // indeterminate
  }
  bar.dataset.done = done;
  bar.title = total ? (100 * Math.min(done, total) / total).toFixed(1) + ' %' : '';
  setCell(tr.querySelector('.bytes'), fmtBytes(done) + ' / ' + (writing ? '≥ ' : '') + fmtBytes(Math.max(total, done))
    + (writing ? ' (being written)' : ''));
  const rate = t.progress && t.state === 'active' ? t.progress.rate_bps : null;
  setCell(tr.querySelector('.rate'), rate ? fmtRate(rate) : '–');
  let eta = null;
  if (!writing && t.state === 'active' && rate > 0 && total >= done) eta = (total - done) * 8 / rate;
  else if (!writing && r && r.eta_s != null && t.state !== 'paused') eta = r.eta_s;
  setCell(tr.querySelector('.eta'), eta == null ? '–' : fmtDur(eta));
  setCell(tr.querySelector('.age'), fmtDur((now - t.created_at) / 1000));
  const act = tr.querySelector('.act');
  const key = t.state + '|' + canOperate();
  if (act.dataset.key !== key) {
    act.dataset.key = key;
    act.replaceChildren(actions(t));
  }
}

function actions(t) {
  const box = el('div', { class: 'actions' });
  const final = ['published', 'failed', 'cancelled'].includes(t.state);
  if (!canOperate() || final) {
    if (!final) box.append(el('span', { class: 'muted', title: 'Actions need an operator token' }, 'read-only'));
    return box;
  }
  if (t.state === 'paused') box.append(el('button', { 'data-action': 'resume', onclick: () => act(t, 'resume') }, 'Resume'));
  else box.append(el('button', { 'data-action': 'pause', onclick: () => act(t, 'pause') }, 'Pause'));
  const cancel = el('button', { class: 'danger', 'data-action': 'cancel' }, 'Cancel');
  cancel.addEventListener('click', () => {
    if (cancel.classList.contains('confirm')) { act(t, 'cancel'); return; }
    cancel.classList.add('confirm');
    cancel.textContent = 'Confirm cancel';
    setTimeout(() => { cancel.classList.remove('confirm'); cancel.textContent = 'Cancel'; }, 4000);
  });
  box.append(cancel);
  const sel = el('select', { 'aria-label': 'Class', 'data-action': 'class' },
    ...CLASSES.map((c) => el('option', c === t.class ? { value: c, selected: '' } : { value: c }, c)));
  sel.addEventListener('change', () => patch(t, { class: sel.value }, 'class set to ' + sel.value));
  box.append(sel);
  const imp = el('input', { type: 'number', min: 0, max: 1, step: 0.05, placeholder: 'job', 'aria-label': 'Importance 0..1 (empty: the job’s)',
                            value: t.importance == null ? '' : t.importance });
  box.append(imp, el('button', { 'data-action': 'importance', onclick: () => {
    const v = imp.value.trim() === '' ? null : Number(imp.value);
    patch(t, { importance: v }, v == null ? 'importance returned to the job’s' : 'importance set to ' + v);
  } }, 'Set'));
  return box;
}

function label(t) {
  return 'transfer ' + t.id + ' (' + t.job + ' ' + t.rel + ')';
}

async function act(t, what) {
  try {
    const now = await api('POST', `/v1/transfers/${t.id}/${what}`);
    const past = { pause: 'Paused', resume: 'Resumed', cancel: 'Cancelled' }[what];
    notice(`${past} ${label(t)}: its state is now ${now.state}.`);
    mergeRow(now);
  } catch (e) {
    notice(`Could not ${what} ${label(t)}: ${e.status || ''} ${e.message}`, true);
  }
}

async function patch(t, body, what) {
  try {
    const now = await api('PATCH', `/v1/transfers/${t.id}`, body);
    notice(`${label(t)}: ${what}.`);
    mergeRow(now);
  } catch (e) {
    notice(`Could not change ${label(t)}: ${e.status || ''} ${e.message}`, true);
  }
}

// Shows an action's result at once, before the next event.
function mergeRow(t) {
  if (!ui.status) return;
  const row = ui.status.transfers.find((r) => r.id === t.id);
  if (row) Object.assign(row, t);
  renderQueue(ui.status);
}

async function setRate(link, input) {
  const mbps = Number(input.value);
  if (!(mbps > 0)) { notice('Enter the new rate cap in Mbit/s.', true); return; }
  try {
    const l = await api('PUT', `/v1/links/${encodeURIComponent(link)}`, { rate_bps: Math.round(mbps * 1e6) });
    const scope = ui.settings && ui.settings.shared
      ? 'for every agent of the pool' : 'until the agent restarts';
    notice(`Link ${link}: rate cap set to ${fmtRate(l.rate_bps)} (${scope}).`);
    input.value = '';
    loadSettings();
    loadRetention();
  } catch (e) {
    notice(`Could not change link ${link}: ${e.status || ''} ${e.message}`, true);
  }
}

function details(t) {
  const r = t.ranking;
  if (!r) return el('span', { class: 'muted' }, t.error ? 'error: ' + t.error : 'finished ' + fmtTime(t.finished_at));
  const s = r.score;
  const pairs = [
    ['score', s.value.toFixed(3) + ' = size × importance × severity × aging'],
    ['size term', s.size.toFixed(3) + ' (model ' + (r.model_params ? (r.model_params / 1e9).toFixed(1) + 'B params' : 'size unknown') + ')'],
    ['importance term', s.importance.toFixed(3) + ' (importance ' + r.importance + ' from ' + r.importance_from + ')'],
    ['severity term', s.severity.toFixed(3) + ' (live severity ' + r.severity.toFixed(2) + ')'],
    ['aging term', s.aging.toFixed(3) + ' (waiting ' + fmtDur(r.waiting_s) + ')'],
    ['class', r.class + (r.promoted_until ? ' until ' + fmtTime(r.promoted_until) + ' (signal)' : '') + ' · policy ' + r.policy],
    ['class weight', r.class_weight == null ? '–' : (100 * r.class_weight).toFixed(1) + ' %'],
    ['share of link', r.share == null ? 'not active' : (100 * r.share).toFixed(1) + ' %'],
    ['checkpoint', t.checkpoint + (t.format ? ' (' + t.format + ')' : '')],
  ];
  if (t.deadline || t.deadline_after_commit_s) {
    pairs.push(['deadline', (t.deadline ? fmtTime(t.deadline) : fmtDur(t.deadline_after_commit_s) + ' after commit')
      + (t.deadline_state ? ' · ' + t.deadline_state.replace('_', ' ') : '')]);
  }
  const dl = el('dl', { class: 'terms' });
  for (const [k, v] of pairs) dl.append(el('dt', {}, k), el('dd', {}, v));
  return dl;
}

function fill(tbody, rows) {
  if (!rows.length) {
    const cols = tbody.parentElement.querySelectorAll('thead th').length;
    tbody.replaceChildren(el('tr', {}, el('td', { colspan: cols, class: 'muted' }, 'None yet.')));
    return;
  }
  tbody.replaceChildren(...rows.map((cells) => el('tr', {}, ...cells.map((c) =>
    c instanceof Node ? el('td', {}, c) : el('td', {}, c == null ? '–' : c)))));
}

// Phases after the commit, in the order a checkpoint passes them.
const PHASES = ['waiting_for_writer', 'queued', 'sending', 'verifying', 'publishing'];

// Commit to eval-ready as a bar of its phases (each segment's width its
// share; the title lists them in seconds), after the total.
function readyCell(total, phases) {
  const cell = el('span', { class: 'ready' }, fmtDur(total));
  const after = phases && phases.after_commit;
  if (!after) return cell;
  const sum = PHASES.reduce((a, k) => a + (after[k] || 0), 0);
  const title = PHASES.filter((k) => k in after).map((k) => k.replace(/_/g, ' ') + ' ' + after[k].toFixed(2) + ' s');
  if (phases.unattributed_s != null && Math.abs(phases.unattributed_s) >= 0.05) {
    title.push('unattributed (network, clock skew) ' + phases.unattributed_s.toFixed(2) + ' s');
  }
  const bar = el('span', { class: 'phases', title: title.join('\n') });
  for (const k of PHASES) {
    if (!after[k] || sum <= 0) continue;
    bar.append(el('i', { class: 'ph-' + k, style: 'width:' + (100 * after[k] / sum).toFixed(1) + '%' }));
  }
  cell.append(' ', bar);
  return cell;
}

function renderPublished(st) {
  fill($('#published tbody'), st.published.map((p) => [
    p.id, p.job, p.rel, fmtBytes(p.bytes_total), fmtTime(p.published_at), readyCell(p.commit_to_replica_s, p.phases)]));
}

function renderSignals(st) {
  fill($('#signals tbody'), st.signals.map((s) => [
    fmtTime(s.received_at), s.job, s.kind, s.severity.toFixed(2), s.step, s.transfer == null ? '–' : 'transfer ' + s.transfer]));
}

function renderReplicas(st) {
  fill($('#replicas tbody'), st.replicas.map((r) => {
    const bar = el('progress', { max: Math.max(1, r.bytes_total), value: r.state === 'published' ? r.bytes_total : r.bytes_done });
    const done = r.state === 'published' ? r.bytes_total : r.bytes_done;
    // A pin, or why and when a removed replica went (its record's title).
    let state = r.state;
    // Without optimizer state (a weights-only root, or a weights-first
    // publish's first version).
    if (r.profile) state += ' · ' + r.profile;
    if (r.pin) state += ' · pinned';
    // A version a reader lease holds (it is not removed until then).
    if (r.leased_until) state += ' · leased';
    // HDFS hot files at a raised replication factor (while it lasts).
    if (r.hot) state += ' · hot ×' + r.hot.factor;
    if (r.removal) state += ' (' + r.removal.reason + (r.removal.forced ? ', forced' : '') + ')';
    const why = [];
    if (r.removal) why.push(r.removal.detail);
    if (r.pin) why.push('pinned: ' + r.pin.reason);
    if (r.leased_until) why.push('leased until ' + new Date(r.leased_until).toISOString());
    if (r.hot) why.push('hot files at ' + r.hot.factor + ' replicas until ' + r.hot.until + ', then ' + r.hot.previous);
    if (r.weights_version != null) why.push('weights first: its weights-only version is replica ' + r.weights_version);
    const stateCell = el('span', { title: why.join('; ') }, state);
    return [r.id, r.job, r.source_path, stateCell, bar, fmtBytes(done) + ' / ' + fmtBytes(r.bytes_total),
            r.state === 'published' ? (r.url || r.local_path) : '–',
            fmtTime(r.published_at), readyCell(r.commit_to_replica_s, r.phases), replicaActions(r)];
  }));
}

// Pin, unpin and remove a published replica (operators).
function replicaActions(r) {
  const box = el('div', { class: 'actions' });
  if (r.state !== 'published' || r.replaced_by != null) return box;
  if (!canOperate()) {
    box.append(el('span', { class: 'muted', title: 'Actions need an operator token' }, 'read-only'));
    return box;
  }
  if (r.pin) {
    box.append(el('button', { 'data-action': 'unpin', onclick: () => replicaAct(r, 'DELETE', `/v1/replicas/${r.id}/pin`, undefined, 'unpinned') }, 'Unpin'));
  } else {
    box.append(el('button', { 'data-action': 'pin', onclick: () => {
      const reason = window.prompt('Pin replica ' + r.id + ': why?', 'bisecting');
      if (reason === null) return;
      replicaAct(r, 'POST', `/v1/replicas/${r.id}/pin`, { reason }, 'pinned');
    } }, 'Pin'));
  }
  // The table is redrawn at each update: a dialog, not a second click,
  // confirms.
  box.append(el('button', { class: 'danger', 'data-action': 'remove', onclick: () => {
    const held = r.pin ? ' It is pinned: the sink refuses unless forced (ferry replica rm --force).'
      : r.leased_until ? ' A reader lease holds it: the sink refuses unless forced.' : '';
    if (!window.confirm('Remove replica ' + r.id + ' (' + r.job + ' ' + r.rel + ')? Its files are deleted.' + held)) return;
    replicaAct(r, 'DELETE', `/v1/replicas/${r.id}?reason=${encodeURIComponent('from the web UI')}`, undefined, 'removed');
  } }, 'Remove'));
  return box;
}

async function replicaAct(r, method, path, body, done) {
  try {
    await api(method, path, body);
    notice(`Replica ${r.id} (${r.job} ${r.rel}) ${done}.`);
    loadRetention();
  } catch (e) {
    notice(`Replica ${r.id}: ${e.status || ''} ${e.message}`, true);
  }
}

// ---- retention (GET /v1/retention, every 5 s; not in the status stream) --

async function loadRetention() {
  if (!ui.status || !ui.status.roles.includes('sink')) {
    $('#retention-panel').hidden = true;
    return;
  }
  try {
    renderRetention(await api('GET', '/v1/retention'));
  } catch (e) {
    // The event stream reports an agent that does not answer.
  }
}

function describePolicy(p) {
  const keys = [];
  if (p.keep_last != null) keys.push('keep_last ' + p.keep_last);
  if (p.keep_every != null) keys.push('keep_every ' + p.keep_every);
  if (p.min_age != null) keys.push('min_age ' + p.min_age);
  if (p.max_bytes != null) keys.push('max_bytes ' + fmtBytes(Number(p.max_bytes)));
  if (p.dry_run) keys.push('dry run');
  return 'job "' + p.job + '": ' + keys.join(', ');
}

function renderRetention(v) {
  $('#retention-panel').hidden = false;
  $('#retention-note').textContent = '· policies from ' + v.set_by;
  const waiting = (v.pending_pins || []).map((p) => p.job + ' ' + p.target + ' (' + p.reason + ')');
  $('#retention-policies').textContent = (v.policies.length
    ? v.policies.map(describePolicy).join(' · ')
    : 'No policy: every replica is kept.') +
    (waiting.length ? ' · pins waiting for their replica: ' + waiting.join('; ') : '');
  const rows = [];
  for (const j of v.jobs) {
    for (const x of j.versions) {
      rows.push([j.job, j.source_site, x.step, x.replica, fmtTime(x.published_at), fmtBytes(x.bytes),
                 el('span', { class: x.kept ? '' : 'expiring' }, (x.kept ? 'kept: ' : 'expires: ') + x.why),
                 x.until == null ? '–' : new Date(x.until).toLocaleString()]);
    }
  }
  fill($('#retention tbody'), rows);
}
setInterval(loadRetention, 5000);

// ---- settings (GET /v1/settings, every 5 s; not in the status stream) --

async function loadSettings() {
  if (!ui.status || !ui.status.roles.includes('source')) {
    $('#settings-panel').hidden = true;
    return;
  }
  try {
    renderSettings(await api('GET', '/v1/settings'));
  } catch (e) {
    // The event stream reports an agent that does not answer.
  }
}

function renderSettings(s) {
  ui.settings = s;
  $('#settings-panel').hidden = false;
  $('#settings-note').textContent = s.shared
    ? '· the pool\'s, stored in its catalog: a change reaches every agent'
    : '· from this agent\'s config file (a single agent)';
  fill($('#settings tbody'), s.items.map((i) => [
    i.name,
    i.value === null ? 'unknown' : i.name.endsWith('.rate') ? fmtRate(i.value) : String(i.value),
    i.updated_by || 'config file']));
  const sel = $('#setting-name');
  const names = s.items.map((i) => i.name);
  if ([...sel.options].map((o) => o.value).join() !== names.join()) {
    sel.replaceChildren(...names.map((n) => el('option', { value: n }, n)));
  }
  // A single agent takes [scheduler] from its config; its links' caps
  // change in the Links panel.
  $('#setting-form').hidden = !canOperate() || !s.shared;
}

$('#setting-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const name = $('#setting-name').value;
  const value = $('#setting-value').value.trim();
  if (!value) { notice('Enter the new value of ' + name + '.', true); return; }
  try {
    renderSettings(await api('PUT', `/v1/settings/${encodeURIComponent(name)}`, { value }));
    notice(`${name} set to ${value} for every agent of the pool.`);
    $('#setting-value').value = '';
  } catch (e) {
    notice(`Could not set ${name}: ${e.status || ''} ${e.message}`, true);
  }
});
setInterval(loadSettings, 5000);

// ---- token -----------------------------------------------------------

$('#auth').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const t = $('#token').value.trim();
  if (!t) { notice('Paste a token first (ferry token new --role reader|operator prints one).', true); return; }
  ui.token = t;
  sessionStorage.setItem('ferry-token', t);
  $('#token').value = '';
  notice('Token set.');
  connect();
});
$('#token-forget').addEventListener('click', () => {
  ui.token = '';
  sessionStorage.removeItem('ferry-token');
  notice('Token forgotten.');
  connect();
});

connect();
