/* graphkern graph viewer.
 *
 * Draws a traced graph on a canvas: layered layout (longest-path layers, barycentric ordering that
 * keeps module groups together, isotonic x placement), nested module groups that collapse into
 * one box, search, a details panel, the blast radius of a failure, pan and zoom (d3-zoom), and a
 * minimap. The data comes from the <script id="gk-data"> element written by graphkern.viz.html.
 * window.gk exposes a small API for tests and for the console.
 */
(function () {
  "use strict";
  var T0 = performance.now();
  var D = JSON.parse(document.getElementById("gk-data").textContent);
  var d3 = window.d3;

  // ------------------------------------------------------------------ data
  var N = D.nodes.length, G = D.groups.length;
  var KIND = D.kinds;
  var nId = new Array(N), nKind = new Array(N), nLabel = new Array(N), nOp = new Array(N);
  var nGroup = new Int32Array(N), nStatus = new Int32Array(N), nRoot = new Int32Array(N);
  var idIndex = new Map();
  for (var i = 0; i < N; i++) {
    var r = D.nodes[i];
    nId[i] = r[0]; nKind[i] = KIND[r[1]]; nLabel[i] = r[2]; nOp[i] = r[3];
    nGroup[i] = r[4]; nStatus[i] = r[5]; nRoot[i] = r[6];
    idIndex.set(r[0], i);
  }
  var gPath = new Array(G), gLabel = new Array(G), gParent = new Int32Array(G), gDepth = new Int32Array(G);
  var gChain = new Array(G);   // ancestors, outermost first, including the group itself
  for (var g = 0; g < G; g++) {
    var gr = D.groups[g];
    gPath[g] = gr[0]; gLabel[g] = gr[1]; gParent[g] = gr[2]; gDepth[g] = gr[3];
    gChain[g] = gParent[g] >= 0 ? gChain[gParent[g]].concat([g]) : [g];
  }
  var gSize = new Int32Array(G), gFailed = new Int32Array(G), gRootFail = new Int32Array(G);
  for (i = 0; i < N; i++) {
    if (nGroup[i] < 0) continue;
    var ch = gChain[nGroup[i]];
    for (var c = 0; c < ch.length; c++) {
      gSize[ch[c]]++;
      if (nStatus[i]) gFailed[ch[c]]++;
      if (nStatus[i] && nStatus[i] !== 10) gRootFail[ch[c]]++;
    }
  }
  var E = D.edges.length;
  var eSrc = new Int32Array(E), eDst = new Int32Array(E);
  var outE = [], inE = [];
  for (i = 0; i < N; i++) { outE.push([]); inE.push([]); }
  for (var e = 0; e < E; e++) {
    eSrc[e] = D.edges[e][0]; eDst[e] = D.edges[e][1];
    outE[eSrc[e]].push(e); inE[eDst[e]].push(e);
  }
  var details = D.details || {};
  var diff = D.diff || null;
  var diffMark = new Int8Array(N);   // 1 added, 2 changed
  if (diff) {
    diff.added.forEach(function (n) { diffMark[n] = 1; });
    Object.keys(diff.changed).forEach(function (n) { diffMark[+n] = 2; });
  }
  var roots = [];
  for (i = 0; i < N; i++) if (nStatus[i] && nStatus[i] !== 10) roots.push(i);
  var statusName = function (s) { return D.statusNames[s] || String(s); };

  // ------------------------------------------------------------------ state
  var collapsed = new Uint8Array(G);
  var selected = -1;          // a unit key: node index >= 0, or -(group+1) for a collapsed group
  var matches = new Uint8Array(N), matchList = [], matchCursor = -1;
  var L = null;               // current layout
  var transform = d3.zoomIdentity;

  // ------------------------------------------------------------------ layout
  var NODE_H = 26, GROUP_H = 34, PAD = 10, LABEL_H = 16, LAYER_GAP = 30, NODE_GAP = 18;
  var VIRTUAL_W = 4, VIRTUAL_GAP = 8, MAX_SPAN = 80;
  var measure = document.createElement("canvas").getContext("2d");
  measure.font = "12px system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif";
  var widthCache = new Map();
  function textWidth(s) {
    var w = widthCache.get(s);
    if (w === undefined) { w = measure.measureText(s).width; widthCache.set(s, w); }
    return w;
  }
  function unitText(key) {
    if (key >= 0) return nLabel[key];
    var g = -key - 1;
    return "\u25B8 " + gLabel[g] + "  \u00B7 " + gSize[g];
  }

  function layout() {
    var t = performance.now();
    // 1. units: a node, or the outermost collapsed group around it
    var unitOfNode = new Int32Array(N), keys = [], unitOfGroup = new Map();
    for (var n = 0; n < N; n++) {
      var key = n, g = nGroup[n];
      if (g >= 0) {
        var ch = gChain[g];
        for (var c = 0; c < ch.length; c++) if (collapsed[ch[c]]) { key = -ch[c] - 1; break; }
      }
      if (key >= 0) { unitOfNode[n] = keys.length; keys.push(key); }
      else {
        var u = unitOfGroup.get(key);
        if (u === undefined) { u = keys.length; unitOfGroup.set(key, u); keys.push(key); }
        unitOfNode[n] = u;
      }
    }
    var U = keys.length;
    // chain of enclosing (expanded) groups of each unit, outermost first
    var uChain = new Array(U);
    for (u = 0; u < U; u++) {
      key = keys[u];
      if (key >= 0) uChain[u] = nGroup[key] >= 0 ? gChain[nGroup[key]] : [];
      else { var cg = -key - 1; uChain[u] = gParent[cg] >= 0 ? gChain[gParent[cg]] : []; }
    }
    // 2. unit edges (deduplicated), forward = from an earlier unit to a later one
    var pred = [], succ = [], seen = new Map(), ueSrc = [], ueDst = [], ueEdge = [], ueCount = [];
    for (u = 0; u < U; u++) { pred.push([]); succ.push([]); }
    for (var e = 0; e < E; e++) {
      var a = unitOfNode[eSrc[e]], b = unitOfNode[eDst[e]];
      if (a === b) continue;
      var k = a * U + b, idx = seen.get(k);
      if (idx !== undefined) { ueCount[idx]++; continue; }
      seen.set(k, ueSrc.length);
      ueSrc.push(a); ueDst.push(b); ueEdge.push(e); ueCount.push(1);
      if (a < b) { succ[a].push(b); pred[b].push(a); }
    }
    // 3. longest-path layers, then every node sinks to just above its first consumer, so weights
    // and their transposes sit by the matmul that reads them, not at the top of the graph
    var layer = new Int32Array(U);
    for (u = 0; u < U; u++) {
      var p = pred[u], l = 0;
      for (var j = 0; j < p.length; j++) if (layer[p[j]] + 1 > l) l = layer[p[j]] + 1;
      layer[u] = l;
    }
    for (u = U - 1; u >= 0; u--) {
      if (!succ[u].length) continue;
      var m = Infinity, s = succ[u];
      for (j = 0; j < s.length; j++) if (layer[s[j]] < m) m = layer[s[j]];
      if (m - 1 > layer[u]) layer[u] = m - 1;
    }
    // 3b. a long edge gets a virtual point in every layer it crosses (shortest edges first, within
    // a budget), so it is ordered and placed like a node and routes around nodes, not through them
    var npred = [], nsucc = [], vLayer = [], uePts = new Array(ueSrc.length), T = U;
    for (u = 0; u < U; u++) { npred.push([]); nsucc.push([]); }
    var cand = [];
    for (j = 0; j < ueSrc.length; j++) {
      var span = layer[ueDst[j]] - layer[ueSrc[j]];
      if (ueSrc[j] < ueDst[j] && span > 1 && span <= MAX_SPAN) cand.push(j);
    }
    cand.sort(function (p, q) { return (layer[ueDst[p]] - layer[ueSrc[p]]) - (layer[ueDst[q]] - layer[ueSrc[q]]); });
    var budget = Math.max(2000, 2 * U), routed = new Uint8Array(ueSrc.length);
    for (j = 0; j < cand.length; j++) {
      var ei = cand[j], ea = ueSrc[ei], eb = ueDst[ei], need = layer[eb] - layer[ea] - 1;
      if (need > budget) continue;
      budget -= need; routed[ei] = 1;
      var ca = uChain[ea], cb = uChain[eb], q = 0;
      while (q < ca.length && q < cb.length && ca[q] === cb[q]) q++;
      var common = ca.slice(0, q), prev = ea, pts = [];
      for (l = layer[ea] + 1; l < layer[eb]; l++) {
        var id = T++;
        vLayer.push(l); uChain.push(common); npred.push([prev]); nsucc.push([]);
        nsucc[prev].push(id); pts.push(id); prev = id;
      }
      nsucc[prev].push(eb); npred[eb].push(prev);
      uePts[ei] = pts;
    }
    for (j = 0; j < ueSrc.length; j++) {
      if (!routed[j] && ueSrc[j] < ueDst[j]) { nsucc[ueSrc[j]].push(ueDst[j]); npred[ueDst[j]].push(ueSrc[j]); }
    }
    var lay = new Int32Array(T);
    lay.set(layer);
    for (j = 0; j < vLayer.length; j++) lay[U + j] = vLayer[j];
    var nLayers = 0;
    for (u = 0; u < T; u++) if (lay[u] + 1 > nLayers) nLayers = lay[u] + 1;
    var layers = [];
    for (l = 0; l < nLayers; l++) layers.push([]);
    for (u = 0; u < T; u++) layers[lay[u]].push(u);
    // 4. ordering: barycentre sweeps, groups kept contiguous within a layer
    var pos = new Float64Array(T);
    function setPos(ly) { var h = (ly.length - 1) / 2; for (var q = 0; q < ly.length; q++) pos[ly[q]] = q - h; }
    layers.forEach(setPos);
    var keyv = new Float64Array(T);
    function sortLayer(ly, nbrs) {
      for (var q = 0; q < ly.length; q++) {
        var v = ly[q], nb = nbrs[v];
        if (nb.length) { var sum = 0; for (var z = 0; z < nb.length; z++) sum += pos[nb[z]]; keyv[v] = sum / nb.length; }
        else keyv[v] = pos[v];
      }
      var out = [];
      groupSort(ly, 0, out);
      for (q = 0; q < ly.length; q++) ly[q] = out[q];
      setPos(ly);
    }
    function groupSort(items, depth, out) {
      if (items.length === 1) { out.push(items[0]); return; }
      var blocks = [], byGroup = new Map();
      for (var q = 0; q < items.length; q++) {
        var v = items[q], chn = uChain[v];
        if (chn.length <= depth) { blocks.push({ key: keyv[v], first: q, unit: v, items: null }); continue; }
        var gg = chn[depth], bl = byGroup.get(gg);
        if (!bl) { bl = { key: 0, first: q, unit: -1, items: [] }; byGroup.set(gg, bl); blocks.push(bl); }
        bl.items.push(v); bl.key += keyv[v];
      }
      for (q = 0; q < blocks.length; q++) if (blocks[q].items) blocks[q].key /= blocks[q].items.length;
      blocks.sort(function (x, y) { return x.key - y.key || x.first - y.first; });
      for (q = 0; q < blocks.length; q++) {
        if (blocks[q].items) groupSort(blocks[q].items, depth + 1, out); else out.push(blocks[q].unit);
      }
    }
    for (var sweep = 0; sweep < 4; sweep++) {
      if (sweep % 2 === 0) for (l = 1; l < nLayers; l++) sortLayer(layers[l], npred);
      else for (l = nLayers - 2; l >= 0; l--) sortLayer(layers[l], nsucc);
    }
    // 5. sizes and x: isotonic regression (pool adjacent violators) towards the neighbours' mean
    var w = new Float64Array(T), h = new Float64Array(T), x = new Float64Array(T), y = new Float64Array(T);
    for (u = U; u < T; u++) w[u] = VIRTUAL_W;
    for (u = 0; u < U; u++) {
      key = keys[u];
      var text = unitText(key);
      var minW = key >= 0 && nKind[key] === "constant" ? 36 : 48;
      w[u] = Math.min(260, Math.max(minW, textWidth(text) + (key >= 0 ? 20 : 28)));
      h[u] = key >= 0 ? (nKind[key] === "constant" ? NODE_H - 6 : NODE_H) : GROUP_H;
    }
    function boundaries(a, b) {
      var ca = uChain[a], cb = uChain[b], q = 0;
      while (q < ca.length && q < cb.length && ca[q] === cb[q]) q++;
      return (ca.length - q) + (cb.length - q);
    }
    var sep = layers.map(function (ly) {
      var sp = new Float64Array(Math.max(0, ly.length - 1));
      for (var q = 0; q + 1 < ly.length; q++)
        sp[q] = (w[ly[q]] + w[ly[q + 1]]) / 2 + (ly[q] >= U || ly[q + 1] >= U ? VIRTUAL_GAP : NODE_GAP) +
          PAD * boundaries(ly[q], ly[q + 1]);
      return sp;
    });
    for (l = 0; l < nLayers; l++) {
      var ly = layers[l], sp = sep[l], tot = 0;
      for (j = 0; j < sp.length; j++) tot += sp[j];
      var cx = -tot / 2;
      for (j = 0; j < ly.length; j++) { x[ly[j]] = cx; if (j < sp.length) cx += sp[j]; }
    }
    var desired = new Float64Array(T);
    function place(l, nbrs) {
      var ly = layers[l], sp = sep[l], n = ly.length;
      if (!n) return;
      for (var q = 0; q < n; q++) {
        var v = ly[q], nb = nbrs[v];
        if (nb.length) { var sum = 0; for (var z = 0; z < nb.length; z++) sum += x[nb[z]]; desired[q] = sum / nb.length; }
        else desired[q] = x[v];
      }
      // y_q = x_q - off_q must be non-decreasing; fit to desired_q - off_q
      var off = 0, bsum = [], bcnt = [], bend = [];
      for (q = 0; q < n; q++) {
        var tq = desired[q] - off;
        if (q < n - 1) off += sp[q];
        bsum.push(tq); bcnt.push(1); bend.push(q);
        while (bsum.length > 1 && bsum[bsum.length - 2] / bcnt[bcnt.length - 2] > bsum[bsum.length - 1] / bcnt[bcnt.length - 1]) {
          var s1 = bsum.pop(), c1 = bcnt.pop(), e1 = bend.pop();
          bsum[bsum.length - 1] += s1; bcnt[bcnt.length - 1] += c1; bend[bend.length - 1] = e1;
        }
      }
      off = 0; var start = 0;
      for (var bi = 0; bi < bsum.length; bi++) {
        var val = bsum[bi] / bcnt[bi];
        for (q = start; q <= bend[bi]; q++) { x[ly[q]] = val + off; if (q < n - 1) off += sp[q]; }
        start = bend[bi] + 1;
      }
    }
    for (var pass = 0; pass < 6; pass++) {
      if (pass % 2 === 0) for (l = 1; l < nLayers; l++) place(l, npred);
      else for (l = nLayers - 2; l >= 0; l--) place(l, nsucc);
    }
    // the passes let long graphs drift sideways layer by layer; remove the slow drift (a moving
    // average of layer centres over many layers) and keep the local shape
    var centre = new Float64Array(nLayers), cum = new Float64Array(nLayers + 1);
    for (l = 0; l < nLayers; l++) {
      var lo = Infinity, hi = -Infinity;
      for (j = 0; j < layers[l].length; j++) { var v = layers[l][j]; lo = Math.min(lo, x[v] - w[v] / 2); hi = Math.max(hi, x[v] + w[v] / 2); }
      centre[l] = layers[l].length ? (lo + hi) / 2 : (l ? centre[l - 1] : 0);
      cum[l + 1] = cum[l] + centre[l];
    }
    var RADIUS = 30;
    for (l = 0; l < nLayers; l++) {
      var a0 = Math.max(0, l - RADIUS), a1 = Math.min(nLayers, l + RADIUS + 1);
      var shift = (cum[a1] - cum[a0]) / (a1 - a0);
      for (j = 0; j < layers[l].length; j++) x[layers[l][j]] -= shift;
    }
    // 6. y: gaps grow where groups open or close, to leave room for their frames and labels
    var firstL = new Map(), lastL = new Map();
    for (u = 0; u < U; u++) {
      var chn = uChain[u];
      for (j = 0; j < chn.length; j++) {
        var gg = chn[j];
        if (!firstL.has(gg) || firstL.get(gg) > layer[u]) firstL.set(gg, layer[u]);
        if (!lastL.has(gg) || lastL.get(gg) < layer[u]) lastL.set(gg, layer[u]);
      }
    }
    var opens = new Int32Array(nLayers + 1), closes = new Int32Array(nLayers + 1);
    firstL.forEach(function (lv, gg) { opens[lv] = Math.max(opens[lv], gDepth[gg] + 1); });
    lastL.forEach(function (lv, gg) { closes[lv] = Math.max(closes[lv], gDepth[gg] + 1); });
    var layerY = new Float64Array(nLayers), layerH = new Float64Array(nLayers), cy = 0;
    for (l = 0; l < nLayers; l++) {
      var lh = NODE_H;
      for (j = 0; j < layers[l].length; j++) if (h[layers[l][j]] > lh) lh = h[layers[l][j]];
      if (l > 0) cy += LAYER_GAP + PAD * (closes[l - 1] + opens[l]) + (opens[l] ? LABEL_H : 0);
      else cy += PAD * opens[0] + (opens[0] ? LABEL_H : 0);
      layerY[l] = cy + lh / 2; layerH[l] = lh;
      cy += lh;
    }
    for (u = 0; u < T; u++) y[u] = layerY[lay[u]];
    // each drawn edge's bounding box, for culling
    var ueBox = new Float64Array(4 * ueSrc.length);
    for (j = 0; j < ueSrc.length; j++) {
      var s0 = ueSrc[j], d0 = ueDst[j];
      var bx0 = Math.min(x[s0], x[d0]), bx1 = Math.max(x[s0], x[d0]);
      var by0 = Math.min(y[s0], y[d0]) - NODE_H, by1 = Math.max(y[s0], y[d0]) + NODE_H;
      var pp = uePts[j];
      if (pp) for (q = 0; q < pp.length; q++) { bx0 = Math.min(bx0, x[pp[q]]); bx1 = Math.max(bx1, x[pp[q]]); }
      ueBox[4 * j] = bx0; ueBox[4 * j + 1] = by0; ueBox[4 * j + 2] = bx1; ueBox[4 * j + 3] = by1;
    }
    // 7. frames of expanded groups: per layer, the span of their members (and sub-frames), so a
    // frame hugs its nodes and never covers a node of another group in the same layer
    var spans = new Map();   // group -> Map(layer -> [x0, y0, x1, y1])
    function grow(gg, l, x0, y0, x1, y1) {
      var m = spans.get(gg);
      if (!m) { m = new Map(); spans.set(gg, m); }
      var sp = m.get(l);
      if (!sp) m.set(l, [x0, y0, x1, y1]);
      else { if (x0 < sp[0]) sp[0] = x0; if (y0 < sp[1]) sp[1] = y0; if (x1 > sp[2]) sp[2] = x1; if (y1 > sp[3]) sp[3] = y1; }
    }
    for (u = 0; u < U; u++) {
      chn = uChain[u];
      if (chn.length) grow(chn[chn.length - 1], layer[u], x[u] - w[u] / 2, y[u] - h[u] / 2, x[u] + w[u] / 2, y[u] + h[u] / 2);
    }
    var frames = [];
    for (g = G - 1; g >= 0; g--) {
      var m = spans.get(g);
      if (!m) continue;
      var ls = Array.from(m.keys()).sort(function (p, q) { return p - q; });
      var rows = ls.map(function (lv) {
        var sp = m.get(lv);
        sp[0] -= PAD; sp[2] += PAD; sp[1] -= PAD; sp[3] += PAD;
        return sp;
      });
      rows[0][1] -= LABEL_H;
      if (gParent[g] >= 0) for (j = 0; j < ls.length; j++) grow(gParent[g], ls[j], rows[j][0], rows[j][1], rows[j][2], rows[j][3]);
      var fx0 = Infinity, fx1 = -Infinity;
      rows.forEach(function (r) { fx0 = Math.min(fx0, r[0]); fx1 = Math.max(fx1, r[2]); });
      frames.push({ g: g, rows: rows, x0: fx0, y0: rows[0][1], x1: fx1, y1: rows[rows.length - 1][3] });
    }
    frames.sort(function (p, q) { return gDepth[p.g] - gDepth[q.g]; });
    var minX = Infinity, maxX = -Infinity, minY = Infinity, maxY = -Infinity;
    for (u = 0; u < T; u++) {
      minX = Math.min(minX, x[u] - w[u] / 2); maxX = Math.max(maxX, x[u] + w[u] / 2);
      minY = Math.min(minY, y[u] - h[u] / 2); maxY = Math.max(maxY, y[u] + h[u] / 2);
    }
    frames.forEach(function (f) { minX = Math.min(minX, f.x0); maxX = Math.max(maxX, f.x1); minY = Math.min(minY, f.y0); maxY = Math.max(maxY, f.y1); });
    if (!U) { minX = minY = 0; maxX = maxY = 1; }
    var unitOfKey = new Map();
    for (u = 0; u < U; u++) unitOfKey.set(keys[u], u);
    // per-unit style facts
    var uStatus = new Int32Array(U), uFailRoot = new Uint8Array(U), uDiff = new Int8Array(U), uMatch = new Uint8Array(U);
    for (n = 0; n < N; n++) {
      u = unitOfNode[n];
      if (nStatus[n]) { uStatus[u] = uStatus[u] && uStatus[u] !== 10 ? uStatus[u] : nStatus[n]; if (nStatus[n] !== 10) uFailRoot[u] = 1; }
      if (diffMark[n] && (!uDiff[u] || diffMark[n] === 1)) uDiff[u] = diffMark[n];
    }
    L = {
      U: U, T: T, keys: keys, unitOfNode: unitOfNode, unitOfKey: unitOfKey, layer: lay, layers: layers,
      uePts: uePts, ueBox: ueBox,
      layerY: layerY, layerH: layerH, x: x, y: y, w: w, h: h, ueSrc: ueSrc, ueDst: ueDst, ueEdge: ueEdge,
      ueCount: ueCount, frames: frames, bounds: [minX, minY, maxX, maxY], uStatus: uStatus,
      uFailRoot: uFailRoot, uDiff: uDiff, uMatch: uMatch, uChain: uChain, ms: performance.now() - t
    };
    refreshMatches();
    buildMinimap();
    return L;
  }

  // ------------------------------------------------------------------ drawing
  var canvas = document.getElementById("gk-canvas"), ctx = canvas.getContext("2d");
  var wrap = document.getElementById("gk-canvas-wrap");
  var dpr = window.devicePixelRatio || 1, cssW = 1, cssH = 1;
  var FONT = "12px system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif";
  var STYLE = {
    op: { fill: "#ffffff", stroke: "#64748b", lw: 1 },
    input: { fill: "#dbeafe", stroke: "#3b82f6", lw: 1.5 },
    output: { fill: "#dcfce7", stroke: "#16a34a", lw: 1.5 },
    constant: { fill: "#f1f5f9", stroke: "#94a3b8", lw: 1 },
    kernel: { fill: "#ede9fe", stroke: "#6d28d9", lw: 2.2 },
    group: { fill: "#e2e8f0", stroke: "#475569", lw: 1.5 },
    failed: { fill: "#fecaca", stroke: "#dc2626", lw: 3 },
    upstream: { fill: "#fff1f2", stroke: "#ef4444", lw: 1.5 }
  };
  function resize() {
    var r = wrap.getBoundingClientRect();
    cssW = Math.max(1, r.width); cssH = Math.max(1, r.height);
    dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
    draw();   // now: setting the size cleared the canvas
  }
  var pending = false;
  function requestDraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; draw(); });
  }
  function unitStyle(u) {
    var key = L.keys[u];
    if (L.uStatus[u]) return L.uFailRoot[u] ? "failed" : "upstream";
    return key >= 0 ? nKind[key] : "group";
  }
  function roundRect(c, x, y, w, h, r) {
    c.moveTo(x + r, y); c.arcTo(x + w, y, x + w, y + h, r); c.arcTo(x + w, y + h, x, y + h, r);
    c.arcTo(x, y + h, x, y, r); c.arcTo(x, y, x + w, y, r); c.closePath();
  }
  // A frame is the outline of its per-layer spans; it steps sideways half-way between two layers,
  // where only edges run, so it never cuts across a node of another group.
  function framePath(f) {
    var rows = f.rows, n = rows.length, q, r, top, bot;
    function cut(a, b) { return (rows[a][3] + rows[b][1]) / 2; }
    ctx.moveTo(rows[0][0], rows[0][1]);
    for (q = 0; q < n; q++) {
      r = rows[q]; top = q ? cut(q - 1, q) : r[1]; bot = q < n - 1 ? cut(q, q + 1) : r[3];
      ctx.lineTo(r[0], top); ctx.lineTo(r[0], bot);
    }
    for (q = n - 1; q >= 0; q--) {
      r = rows[q]; top = q ? cut(q - 1, q) : r[1]; bot = q < n - 1 ? cut(q, q + 1) : r[3];
      ctx.lineTo(r[2], bot); ctx.lineTo(r[2], top);
    }
    ctx.closePath();
  }
  function draw() {
    if (!L) return;
    var k = transform.k;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#f8fafc"; ctx.fillRect(0, 0, cssW, cssH);
    ctx.setTransform(dpr * k, 0, 0, dpr * k, dpr * transform.x, dpr * transform.y);
    var vx0 = -transform.x / k, vy0 = -transform.y / k, vx1 = vx0 + cssW / k, vy1 = vy0 + cssH / k;
    var i, u, f;
    // group frames
    ctx.font = FONT;
    for (i = 0; i < L.frames.length; i++) {
      f = L.frames[i];
      if (f.x1 < vx0 || f.x0 > vx1 || f.y1 < vy0 || f.y0 > vy1) continue;
      var failedIn = gFailed[f.g] > 0;
      ctx.beginPath(); framePath(f);
      ctx.fillStyle = failedIn ? "rgba(239,68,68,0.045)" : "rgba(100,116,139,0.06)"; ctx.fill();
      ctx.lineWidth = 1 / Math.max(k, 0.5); ctx.strokeStyle = failedIn ? "#fca5a5" : "#cbd5e1"; ctx.stroke();
      var r0 = f.rows[0];
      if (k * 11 >= 5) {
        ctx.fillStyle = failedIn ? "#991b1b" : "#475569";
        ctx.font = "600 11px system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif";
        ctx.fillText("\u25BE " + gLabel[f.g], r0[0] + 6, r0[1] + 12);
      }
    }
    // edges, batched by style
    var sel = selected, selU = sel === -1 ? -1 : L.unitOfKey.get(sel);
    if (selU === undefined) selU = -1;
    var batches = { normal: [], failed: [], sel: [] };
    var box = L.ueBox;
    for (i = 0; i < L.ueSrc.length; i++) {
      var a = L.ueSrc[i], b = L.ueDst[i];
      if (box[4 * i + 2] < vx0 || box[4 * i] > vx1 || box[4 * i + 3] < vy0 || box[4 * i + 1] > vy1) continue;
      if (a === selU || b === selU) batches.sel.push(i);
      else if (L.uStatus[a]) batches.failed.push(i);
      else batches.normal.push(i);
    }
    function strokeEdges(list, color, width) {
      if (!list.length) return;
      ctx.beginPath();
      for (var q = 0; q < list.length; q++) {
        var e = list[q], a = L.ueSrc[e], b = L.ueDst[e];
        var ax = L.x[a], ay = L.y[a] + L.h[a] / 2, bx = L.x[b], by = L.y[b] - L.h[b] / 2;
        ctx.moveTo(ax, ay);
        var pts = L.uePts[e];
        if (by <= ay) { // drawn against the flow (only with collapsed groups): a gentle loop
          ctx.bezierCurveTo(ax + 60, ay + 40, bx + 60, by - 40, bx, by);
        } else if (pts) {  // through its virtual points, vertical at each
          var px = ax, py = ay;
          for (var z = 0; z <= pts.length; z++) {
            var qx = z < pts.length ? L.x[pts[z]] : bx, qy = z < pts.length ? L.y[pts[z]] : by;
            if (k < 0.12) ctx.lineTo(qx, qy);
            else { var hy = (qy - py) * 0.5; ctx.bezierCurveTo(px, py + hy, qx, qy - hy, qx, qy); }
            px = qx; py = qy;
          }
        } else if (k < 0.12) ctx.lineTo(bx, by);
        else { var my = (by - ay) * 0.5; ctx.bezierCurveTo(ax, ay + my, bx, by - my, bx, by); }
      }
      ctx.strokeStyle = color; ctx.lineWidth = width / Math.max(k, 0.35); ctx.stroke();
      if (k >= 0.45) {
        ctx.beginPath();
        for (q = 0; q < list.length; q++) {
          e = list[q]; b = L.ueDst[e];
          bx = L.x[b]; by = L.y[b] - L.h[b] / 2;
          ctx.moveTo(bx, by); ctx.lineTo(bx - 3.5, by - 7); ctx.lineTo(bx + 3.5, by - 7); ctx.closePath();
        }
        ctx.fillStyle = color; ctx.fill();
      }
    }
    strokeEdges(batches.normal, "#94a3b8", 1);
    strokeEdges(batches.failed, "#ef4444", 1.4);
    strokeEdges(batches.sel, "#2563eb", 2.2);
    // edge labels (shape and dtype) when close enough
    if (k >= 0.75) {
      ctx.font = "10px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
      var shown = 0, lists = [batches.sel, batches.failed, batches.normal], placed = [];
      for (var li = 0; li < lists.length && shown < 400; li++) {
        for (var q = 0; q < lists[li].length && shown < 400; q++) {
          var ue = lists[li][q], s = L.ueSrc[ue], t = L.ueDst[ue], pt = L.uePts[ue];
          if (L.layer[t] - L.layer[s] > 1 && li > 0 && !pt) continue;
          var ed = D.edges[L.ueEdge[ue]], lab = ed[4] + "[" + ed[3] + "]";
          var tx = pt ? L.x[pt[0]] : L.x[t], ty = pt ? L.y[pt[0]] : L.y[t] - L.h[t] / 2;
          var mx = (L.x[s] + tx) / 2 + 4, my = (L.y[s] + L.h[s] / 2 + ty) / 2 + 3;
          if (mx < vx0 || mx > vx1 || my < vy0 || my > vy1) continue;
          var lw = textWidth(lab) * 0.86 + 2, clash = false;
          for (var z = 0; z < placed.length && !clash; z++) {
            var pz = placed[z];
            clash = mx < pz[0] + pz[2] + 4 && pz[0] < mx + lw + 4 && Math.abs(my - pz[1]) < 12;
          }
          if (clash) continue;
          placed.push([mx, my, lw]);
          ctx.fillStyle = "rgba(248,250,252,0.85)"; ctx.fillRect(mx - 1, my - 9, textWidth(lab) * 0.86 + 2, 12);
          ctx.fillStyle = li === 0 ? "#1d4ed8" : "#64748b"; ctx.fillText(lab, mx, my);
          shown++;
        }
      }
    }
    // nodes, batched by style
    var visible = [];
    for (u = 0; u < L.U; u++) {
      var hw = L.w[u] / 2, hh = L.h[u] / 2;
      if (L.x[u] + hw < vx0 || L.x[u] - hw > vx1 || L.y[u] + hh < vy0 || L.y[u] - hh > vy1) continue;
      visible.push(u);
    }
    var byStyle = {};
    for (i = 0; i < visible.length; i++) {
      u = visible[i]; var st = unitStyle(u);
      (byStyle[st] || (byStyle[st] = [])).push(u);
    }
    var rounded = k > 0.25;
    function shape(u, grow) {
      var x0 = L.x[u] - L.w[u] / 2 - grow, y0 = L.y[u] - L.h[u] / 2 - grow, w = L.w[u] + 2 * grow, h = L.h[u] + 2 * grow;
      var key = L.keys[u], kind = key >= 0 ? nKind[key] : "group";
      if (!rounded) ctx.rect(x0, y0, w, h);
      else if (kind === "input" || kind === "output") roundRect(ctx, x0, y0, w, h, h / 2);
      else roundRect(ctx, x0, y0, w, h, kind === "op" ? 6 : 3);
    }
    // halos: search matches, diff marks, selection
    function halo(list, color, grow, width) {
      if (!list.length) return;
      ctx.beginPath(); for (var q = 0; q < list.length; q++) shape(list[q], grow);
      ctx.strokeStyle = color; ctx.lineWidth = width; ctx.stroke();
    }
    var haloMatch = [], haloAdded = [], haloChanged = [];
    for (i = 0; i < visible.length; i++) {
      u = visible[i];
      if (L.uMatch[u]) haloMatch.push(u);
      if (L.uDiff[u] === 1) haloAdded.push(u); else if (L.uDiff[u] === 2) haloChanged.push(u);
    }
    halo(haloAdded, "#22c55e", 4, 4);
    halo(haloChanged, "#f59e0b", 4, 4);
    halo(haloMatch, "#facc15", 5, 6);
    ["constant", "op", "input", "output", "group", "kernel", "upstream", "failed"].forEach(function (st) {
      var list = byStyle[st];
      if (!list) return;
      var S = STYLE[st];
      ctx.beginPath(); for (var q = 0; q < list.length; q++) shape(list[q], 0);
      ctx.fillStyle = S.fill; ctx.fill();
      ctx.setLineDash(st === "upstream" ? [4, 3] : []);
      ctx.lineWidth = S.lw; ctx.strokeStyle = S.stroke; ctx.stroke();
      ctx.setLineDash([]);
      if (st === "group") { // second border: a box that holds more
        ctx.beginPath(); for (q = 0; q < list.length; q++) shape(list[q], -3);
        ctx.lineWidth = 0.8; ctx.stroke();
      }
    });
    if (selU >= 0 && visible.indexOf(selU) >= 0) halo([selU], "#2563eb", 3, 3);
    // labels
    if (k >= 0.4) {
      ctx.font = FONT; ctx.textAlign = "center"; ctx.textBaseline = "middle";
      for (i = 0; i < visible.length; i++) {
        u = visible[i]; var key = L.keys[u], st2 = unitStyle(u);
        ctx.fillStyle = st2 === "failed" ? "#7f1d1d" : st2 === "upstream" ? "#991b1b" : st2 === "kernel" ? "#3b0764" : "#0f172a";
        var text = unitText(key), maxw = L.w[u] - 10;
        if (textWidth(text) > maxw) {
          while (text.length > 2 && textWidth(text + "\u2026") > maxw) text = text.slice(0, -1);
          text += "\u2026";
        }
        if (key >= 0 && nKind[key] === "constant") { ctx.font = "10px system-ui, sans-serif"; ctx.fillText(text, L.x[u], L.y[u] + 1); ctx.font = FONT; }
        else ctx.fillText(text, L.x[u], L.y[u] + 1);
      }
      ctx.textAlign = "start"; ctx.textBaseline = "alphabetic";
    }
    drawMinimap();
  }

  // ------------------------------------------------------------------ minimap
  var mini = document.getElementById("gk-minimap"), mctx = mini.getContext("2d");
  var miniImg = null, MW = 150, MH = 200, msx = 1, msy = 1;
  function buildMinimap() {
    var b = L.bounds, gw = b[2] - b[0], gh = b[3] - b[1];
    msy = MH / gh; msx = Math.min(MW / gw, Math.max(msy, 50 / gw));
    var w = Math.max(20, Math.ceil(gw * msx)), h = MH;
    mini.style.width = w + "px"; mini.style.height = h + "px";
    mini.width = Math.round(w * dpr); mini.height = Math.round(h * dpr);
    miniImg = document.createElement("canvas");
    miniImg.width = mini.width; miniImg.height = mini.height;
    var c = miniImg.getContext("2d");
    c.setTransform(dpr, 0, 0, dpr, 0, 0);
    for (var u = 0; u < L.U; u++) {
      var st = unitStyle(u);
      c.fillStyle = st === "failed" ? "#dc2626" : st === "upstream" ? "#fca5a5" : st === "kernel" ? "#7c3aed" : "#94a3b8";
      c.fillRect((L.x[u] - L.w[u] / 2 - b[0]) * msx, (L.y[u] - b[1]) * msy, Math.max(1, L.w[u] * msx), Math.max(1, L.h[u] * msy));
    }
    for (var i = 0; i < roots.length; i++) {
      var ru = L.unitOfNode[roots[i]];
      c.fillStyle = "#dc2626"; c.fillRect((L.x[ru] - b[0]) * msx - 3, (L.y[ru] - b[1]) * msy - 2, 6, 4);
    }
  }
  function drawMinimap() {
    var b = L.bounds, small = (b[2] - b[0]) * transform.k <= cssW && (b[3] - b[1]) * transform.k <= cssH;
    mini.style.display = small ? "none" : "block";
    if (!miniImg || small) return;
    mctx.setTransform(1, 0, 0, 1, 0, 0);
    mctx.clearRect(0, 0, mini.width, mini.height);
    mctx.drawImage(miniImg, 0, 0);
    mctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    var k = transform.k;
    var x0 = (-transform.x / k - b[0]) * msx, y0 = (-transform.y / k - b[1]) * msy;
    mctx.strokeStyle = "#2563eb"; mctx.lineWidth = 1.5;
    mctx.strokeRect(x0, y0, Math.max(3, cssW / k * msx), Math.max(3, cssH / k * msy));
  }
  function miniNavigate(ev) {
    var r = mini.getBoundingClientRect(), b = L.bounds;
    var wx = (ev.clientX - r.left) / msx + b[0], wy = (ev.clientY - r.top) / msy + b[1];
    centerOn(wx, wy, transform.k, 0);
  }
  var miniDrag = false;
  mini.addEventListener("mousedown", function (ev) { miniDrag = true; miniNavigate(ev); ev.preventDefault(); });
  window.addEventListener("mousemove", function (ev) { if (miniDrag) miniNavigate(ev); });
  window.addEventListener("mouseup", function () { miniDrag = false; });

  // ------------------------------------------------------------------ zoom
  var zoom = d3.zoom().scaleExtent([0.002, 4]).clickDistance(4)
    .filter(function (ev) { return (!ev.ctrlKey || ev.type === "wheel") && !ev.button && ev.type !== "dblclick"; })
    .on("zoom", function (ev) { transform = ev.transform; requestDraw(); hideTip(); });
  var sel = d3.select(canvas).call(zoom);
  function centerOn(wx, wy, k, ms) {
    var t = d3.zoomIdentity.translate(cssW / 2 - wx * k, cssH / 2 - wy * k).scale(k);
    if (ms) sel.transition().duration(ms).call(zoom.transform, t); else sel.call(zoom.transform, t);
  }
  function fit(ms) {
    var b = L.bounds, gw = b[2] - b[0] + 40, gh = b[3] - b[1] + 40;
    var k = Math.min(cssW / gw, cssH / gh);
    if (k < 0.25) { // a tall graph: fit the width, show its top
      k = Math.max(0.25, Math.min(1, cssW / gw));
      centerOn((b[0] + b[2]) / 2, b[1] - 20 + cssH / 2 / k, k, ms);
    } else centerOn((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, Math.min(k, 1.5), ms);
  }

  // ------------------------------------------------------------------ hit testing
  function toWorld(cx, cy) { return [(cx - transform.x) / transform.k, (cy - transform.y) / transform.k]; }
  function unitAt(wx, wy) {
    var ly = L.layerY, lo = 0, hi = ly.length - 1;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (ly[mid] + L.layerH[mid] / 2 < wy) lo = mid + 1; else hi = mid; }
    for (var l = Math.max(0, lo - 1); l <= Math.min(ly.length - 1, lo + 1); l++) {
      var row = L.layers[l];
      for (var q = 0; q < row.length; q++) {
        var u = row[q];
        if (u >= L.U) continue;  // a virtual point of a long edge
        if (Math.abs(L.x[u] - wx) <= L.w[u] / 2 + 2 && Math.abs(L.y[u] - wy) <= L.h[u] / 2 + 2) return u;
      }
    }
    return -1;
  }
  function frameHeaderAt(wx, wy) {
    var best = null;
    for (var i = 0; i < L.frames.length; i++) {
      var f = L.frames[i];
      var r0 = f.rows[0];
      if (wx >= r0[0] && wx <= r0[2] && wy >= r0[1] && wy <= r0[1] + LABEL_H + 2 && (!best || gDepth[f.g] > gDepth[best.g])) best = f;
    }
    return best ? best.g : -1;
  }
  function eventPoint(ev) { var r = canvas.getBoundingClientRect(); return toWorld(ev.clientX - r.left, ev.clientY - r.top); }
  canvas.addEventListener("click", function (ev) {
    var p = eventPoint(ev), u = unitAt(p[0], p[1]);
    if (u >= 0) { select(L.keys[u]); return; }
    var g = frameHeaderAt(p[0], p[1]);
    if (g >= 0) { setCollapsed(g, true); select(-g - 1); return; }
    select(-1);
  });
  canvas.addEventListener("dblclick", function (ev) {
    var p = eventPoint(ev), u = unitAt(p[0], p[1]);
    if (u < 0) return;
    var key = L.keys[u];
    if (key < 0) { setCollapsed(-key - 1, false); select(-1); }
    else if (nGroup[key] >= 0) { var g = nGroup[key]; setCollapsed(g, true); select(-g - 1); }
  });
  var tip = document.getElementById("gk-tip");
  function hideTip() { tip.style.display = "none"; }
  canvas.addEventListener("mousemove", function (ev) {
    if (ev.buttons) return;
    var p = eventPoint(ev), u = unitAt(p[0], p[1]), g = u < 0 ? frameHeaderAt(p[0], p[1]) : -1;
    canvas.classList.toggle("pointer", u >= 0 || g >= 0);
    if (u < 0 && g < 0) { hideTip(); return; }
    var text;
    if (u >= 0) {
      var key = L.keys[u];
      if (key >= 0) {
        text = nId[key] + (nOp[key] && nOp[key] !== nLabel[key] ? "  (" + nOp[key] + ")" : "") + "\n" + nKind[key];
        var outs = outE[key];
        if (outs.length) { var ed = D.edges[outs[0]]; text += " \u2192 " + ed[4] + "[" + ed[3] + "]"; }
        if (nStatus[key]) text += "\n" + statusName(nStatus[key]) + (nRoot[key] >= 0 && nRoot[key] !== key ? " (root cause " + nId[nRoot[key]] + ")" : "");
      } else { var cg = -key - 1; text = gPath[cg] + "\n" + gSize[cg] + " nodes (double-click to expand)"; }
    } else text = gPath[g] + "\nclick to collapse";
    tip.textContent = text;
    var r = wrap.getBoundingClientRect();
    tip.style.left = Math.min(ev.clientX - r.left + 14, r.width - 200) + "px";
    tip.style.top = (ev.clientY - r.top + 14) + "px";
    tip.style.display = "block";
  });
  canvas.addEventListener("mouseleave", hideTip);

  // ------------------------------------------------------------------ collapse / expand
  function setCollapsed(g, on) {
    if (!!collapsed[g] === on) return;
    collapsed[g] = on ? 1 : 0;
    relayout();
  }
  function relayout(keepKey) {
    var anchor = null;
    var focusKey = keepKey !== undefined ? keepKey : selected;
    if (L && focusKey !== -1 && L.unitOfKey.has(focusKey)) {
      var u0 = L.unitOfKey.get(focusKey);
      anchor = [focusKey, L.x[u0] * transform.k + transform.x, L.y[u0] * transform.k + transform.y];
    }
    layout();
    if (treeBuilt) renderTree();
    if (anchor) {
      var u1 = L.unitOfKey.get(anchor[0]);
      if (u1 === undefined && anchor[0] >= 0) u1 = L.unitOfNode[anchor[0]];
      if (u1 !== undefined) {
        var t = d3.zoomIdentity.translate(anchor[1] - L.x[u1] * transform.k, anchor[2] - L.y[u1] * transform.k).scale(transform.k);
        sel.call(zoom.transform, t);
      }
    }
    requestDraw();
  }
  function collapseToDepth(depth) {
    for (var g = 0; g < G; g++) collapsed[g] = depth >= 0 && gDepth[g] >= depth ? 1 : 0;
    relayout();
    if (!L.unitOfKey.has(selected)) fit(0);
  }
  function reveal(n) {
    var changed = false;
    if (nGroup[n] >= 0) gChain[nGroup[n]].forEach(function (g) { if (collapsed[g]) { collapsed[g] = 0; changed = true; } });
    if (changed) { layout(); if (treeBuilt) renderTree(); }
  }

  // ------------------------------------------------------------------ selection and panel
  var panel = document.getElementById("gk-panel");
  function esc(s) { return String(s == null ? "" : s).replace(/[&<>"']/g, function (ch) { return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[ch]; }); }
  function link(n) { return '<a data-node="' + n + '" class="gk-mono">' + esc(nId[n]) + "</a>"; }
  function row(k, v) { return "<tr><td>" + esc(k) + "</td><td>" + v + "</td></tr>"; }
  function select(key) {
    selected = key;
    if (key === -1) { panel.classList.remove("open"); requestDraw(); resizeSoon(); return; }
    var html;
    if (key >= 0) html = nodePanel(key); else html = groupPanel(-key - 1);
    panel.innerHTML = html;
    panel.classList.add("open");
    panel.scrollTop = 0;
    resizeSoon();
    requestDraw();
  }
  function resizeSoon() { resize(); }   // the panel changed the canvas size: follow it now
  function badges(n) {
    var b = '<span class="gk-badge ' + (nKind[n] === "kernel" ? "kernel" : "") + '">' + esc(nKind[n]) + "</span>";
    if (nStatus[n] === 10) b += '<span class="gk-badge upstream">UPSTREAM_FAILED</span>';
    else if (nStatus[n]) b += '<span class="gk-badge failed">' + esc(statusName(nStatus[n])) + "</span>";
    else b += '<span class="gk-badge ok">OK</span>';
    if (diffMark[n] === 1) b += '<span class="gk-badge added">added</span>';
    if (diffMark[n] === 2) b += '<span class="gk-badge changed">changed</span>';
    return b;
  }
  function nodePanel(n) {
    var d = details[n] || {};
    var h = '<header><h2 class="gk-mono" data-testid="panel-title">' + esc(nId[n]) + '</h2><button class="gk-close" title="Close (Esc)">\u00D7</button></header>';
    h += "<section>" + badges(n) + "</section><section><table>";
    h += row("label", esc(nLabel[n]));
    if (nOp[n]) h += row(nKind[n] === "kernel" ? "kernel" : "op", '<span class="gk-mono">' + esc(nOp[n]) + "</span>");
    h += row("scope", nGroup[n] >= 0 ? '<span class="gk-mono">' + esc(gPath[nGroup[n]]) + "</span>" : "<i>top level</i>");
    h += row("status", esc(statusName(nStatus[n])) + " (" + nStatus[n] + ")");
    if (nStatus[n] && nRoot[n] >= 0 && nRoot[n] !== n) h += row("root cause", link(nRoot[n]) + " \u2014 " + esc(statusName(nStatus[nRoot[n]])));
    if (d.arguments) h += row("arguments", '<span class="gk-mono">' + esc(d.arguments) + "</span>");
    if (d.value) h += row("value", '<span class="gk-mono">' + esc(d.value) + "</span>");
    h += "</table>";
    if (d.message) h += '<pre class="msg" data-testid="panel-message">' + esc(d.message) + "</pre>";
    h += "</section>";
    if (nStatus[n] && nStatus[n] !== 10) {
      var count = 0; for (var q = 0; q < N; q++) if (nRoot[q] === n && q !== n) count++;
      h += "<section><h3>Blast radius</h3>" + count + " node" + (count === 1 ? "" : "s") + " downstream marked UPSTREAM_FAILED</section>";
    }
    if (nKind[n] === "kernel") {
      h += "<section><h3>Kernel</h3><table>";
      ["kernel", "backend", "grid", "threadgroup", "template", "source_hash", "generated_name"].forEach(function (f) {
        if (d[f] !== undefined && d[f] !== null && d[f] !== "") h += row(f, '<span class="gk-mono">' + esc(d[f]) + "</span>");
      });
      h += "</table>";
      if (d.source) h += '<pre data-testid="panel-source">' + esc(d.source) + "</pre>";
      h += "</section>";
    }
    var ins = inE[n].slice().sort(function (a, b) { return D.edges[a][5] - D.edges[b][5]; });
    if (ins.length) {
      h += "<section><h3>Inputs</h3><table>";
      ins.forEach(function (e) { var ed = D.edges[e]; h += row("#" + ed[5], link(ed[0]) + ' <span class="gk-mono">' + esc(ed[2]) + ": " + esc(ed[4]) + "[" + esc(ed[3]) + "]</span>"); });
      h += "</table></section>";
    }
    if (outE[n].length) {
      h += "<section><h3>Outputs</h3><table>";
      outE[n].forEach(function (e) { var ed = D.edges[e]; h += row(esc(ed[2]), '<span class="gk-mono">' + esc(ed[4]) + "[" + esc(ed[3]) + "]</span> \u2192 " + link(ed[1])); });
      h += "</table></section>";
    }
    if (diff && diff.changed[n]) {
      h += "<section><h3>Changed</h3><table>";
      diff.changed[n].forEach(function (c) { h += row(c[0], '<span class="gk-mono">' + esc(c[1]) + " \u2192 " + esc(c[2]) + "</span>"); });
      h += "</table></section>";
    }
    return h;
  }
  function groupPanel(g) {
    var h = '<header><h2 class="gk-mono" data-testid="panel-title">' + esc(gPath[g]) + '</h2><button class="gk-close">\u00D7</button></header>';
    h += '<section><span class="gk-badge">module</span>' + (gRootFail[g] ? '<span class="gk-badge failed">contains a failure</span>' : gFailed[g] ? '<span class="gk-badge upstream">upstream failed</span>' : "") + "</section>";
    h += "<section><table>" + row("nodes", gSize[g]) + row("failed", gFailed[g]) + "</table>";
    h += '<p><button class="gk-btn" data-expand="' + g + '">' + (collapsed[g] ? "Expand" : "Collapse") + "</button></p></section>";
    return h;
  }
  panel.addEventListener("click", function (ev) {
    var t = ev.target;
    if (t.classList.contains("gk-close")) { select(-1); return; }
    if (t.dataset.node !== undefined) { focusNode(+t.dataset.node); return; }
    if (t.dataset.expand !== undefined) { var g = +t.dataset.expand; setCollapsed(g, !collapsed[g]); select(collapsed[g] ? -g - 1 : -1); }
  });
  function focusNode(n, ms) {
    reveal(n);
    select(n);   // first, so the view is centred in the canvas that the open panel leaves
    var u = L.unitOfNode[n];
    centerOn(L.x[u], L.y[u], Math.max(transform.k, 0.9), ms === undefined ? 350 : ms);
  }

  // ------------------------------------------------------------------ search
  var search = document.getElementById("gk-search"), results = document.getElementById("gk-results");
  var countEl = document.getElementById("gk-search-count");
  var hay = new Array(N);
  for (i = 0; i < N; i++) {
    var dd = details[i] || {};
    hay[i] = (nId[i] + "\u0001" + nLabel[i] + "\u0001" + nOp[i] + "\u0001" + (nGroup[i] >= 0 ? gPath[nGroup[i]] : "") + "\u0001" + (dd.kernel || "")).toLowerCase();
  }
  var lastQuery = null;
  function runSearch(q) {
    q = q.trim().toLowerCase();
    lastQuery = q;
    matches = new Uint8Array(N); matchList = []; matchCursor = -1;
    if (q) {
      var exact = [];
      for (var n = 0; n < N; n++) if (hay[n].indexOf(q) >= 0) { matches[n] = 1; (nId[n].toLowerCase() === q ? exact : matchList).push(n); }
      matchList = exact.concat(matchList);
    }
    refreshMatches();
    countEl.textContent = q ? matchList.length + " found" : "";
    var html = "";
    for (var j = 0; j < Math.min(matchList.length, 60); j++) {
      n = matchList[j];
      html += '<div class="gk-result" data-node="' + n + '"><b class="gk-mono">' + esc(nId[n]) + "</b><span>" + esc(nOp[n] || nKind[n]) + (nGroup[n] >= 0 ? " \u00B7 " + esc(gPath[nGroup[n]]) : "") + "</span></div>";
    }
    if (matchList.length > 60) html += '<div class="gk-result"><span>\u2026 ' + (matchList.length - 60) + " more (Enter steps through them)</span></div>";
    if (q && !matchList.length) html = '<div class="gk-result"><span>no node matches</span></div>';
    results.innerHTML = html;
    results.classList.toggle("open", !!q);
    requestDraw();
    return matchList.map(function (n) { return nId[n]; });
  }
  function refreshMatches() {
    if (!L) return;
    L.uMatch = new Uint8Array(L.U);
    for (var q = 0; q < matchList.length; q++) L.uMatch[L.unitOfNode[matchList[q]]] = 1;
  }
  var searchTimer = 0;
  search.addEventListener("input", function () { clearTimeout(searchTimer); searchTimer = setTimeout(function () { runSearch(search.value); }, 80); });
  search.addEventListener("keydown", function (ev) {
    if (ev.key === "Enter") {
      clearTimeout(searchTimer);
      if (search.value.trim().toLowerCase() !== lastQuery) runSearch(search.value);
      if (!matchList.length) return;
      matchCursor = (matchCursor + (ev.shiftKey ? matchList.length - 1 : 1)) % matchList.length;
      focusNode(matchList[matchCursor]);
      countEl.textContent = (matchCursor + 1) + " / " + matchList.length;
    } else if (ev.key === "Escape") { search.value = ""; runSearch(""); search.blur(); }
  });
  search.addEventListener("focus", function () { if (search.value) results.classList.add("open"); });
  results.addEventListener("mousedown", function (ev) {
    var t = ev.target.closest(".gk-result");
    if (t && t.dataset.node !== undefined) { ev.preventDefault(); focusNode(+t.dataset.node); results.classList.remove("open"); }
  });
  search.addEventListener("blur", function () { setTimeout(function () { results.classList.remove("open"); }, 150); });
  document.addEventListener("keydown", function (ev) {
    if (ev.target === search) return;
    if (ev.key === "/") { ev.preventDefault(); search.focus(); search.select(); }
    else if (ev.key === "Escape") select(-1);
    else if (ev.key === "f") fit(300);
    else if (ev.key === "m") treeBtn.click();
    else if ((ev.key === "ArrowUp" || ev.key === "ArrowDown") && selected >= 0) {
      // follow the data: to the first input's producer, or to the first consumer
      var list = ev.key === "ArrowUp" ? inE[selected] : outE[selected];
      if (list.length) { ev.preventDefault(); focusNode(ev.key === "ArrowUp" ? eSrc[list[0]] : eDst[list[0]], 150); }
    }
  });

  // ------------------------------------------------------------------ toolbar, banners
  document.getElementById("gk-fit").addEventListener("click", function () { fit(300); });

  // ------------------------------------------------------------------ module tree
  var tree = document.getElementById("gk-tree"), treeBtn = document.getElementById("gk-modules");
  var gChildren = [], topGroups = [];
  for (g = 0; g < G; g++) gChildren.push([]);
  for (g = 0; g < G; g++) (gParent[g] >= 0 ? gChildren[gParent[g]] : topGroups).push(g);
  var treeOpen = new Uint8Array(G), treeBuilt = false;
  function treeRow(g) {
    var dot = gRootFail[g] ? "#dc2626" : gFailed[g] ? "#fca5a5" : "transparent";
    return '<div class="gk-trow" data-g="' + g + '" style="padding-left:' + (4 + 14 * gDepth[g]) + 'px">' +
      '<span class="tw">' + (gChildren[g].length ? (treeOpen[g] ? "\u25BE" : "\u25B8") : "") + "</span>" +
      '<span class="dot" style="background:' + dot + '"></span>' +
      '<span class="nm" title="' + esc(gPath[g]) + '">' + esc(gLabel[g]) + '</span><span class="ct">' + gSize[g] + "</span>" +
      '<button class="fold" title="fold or unfold in the graph">' + (collapsed[g] ? "unfold" : "fold") + "</button></div>";
  }
  function treeHtml(list) {
    var h = "";
    list.forEach(function (g) { h += treeRow(g); if (treeOpen[g]) h += treeHtml(gChildren[g]); });
    return h;
  }
  function renderTree() {
    if (!tree.classList.contains("open")) return;
    var top = tree.scrollTop;
    tree.innerHTML = G ? treeHtml(topGroups) : '<div class="gk-trow"><span class="nm">no module scopes</span></div>';
    tree.scrollTop = top;
    treeBuilt = true;
  }
  function focusGroup(g) {
    var changed = false;
    gChain[g].slice(0, -1).forEach(function (a) { if (collapsed[a]) { collapsed[a] = 0; changed = true; } });
    if (changed) layout();
    select(-g - 1);
    var u = L.unitOfKey.get(-g - 1);
    if (u !== undefined) { centerOn(L.x[u], L.y[u], Math.max(transform.k, 0.9), 300); return; }
    for (var i = 0; i < L.frames.length; i++) if (L.frames[i].g === g) {
      var f = L.frames[i], k = Math.max(Math.min(transform.k, 1.2), 0.5);
      centerOn((f.x0 + f.x1) / 2, Math.min((f.y0 + f.y1) / 2, f.y0 + cssH / 2 / k - 10), k, 300);
      return;
    }
  }
  treeBtn.addEventListener("click", function () {
    tree.classList.toggle("open"); renderTree(); resizeSoon();
  });
  tree.addEventListener("click", function (ev) {
    var rowEl = ev.target.closest(".gk-trow");
    if (!rowEl || rowEl.dataset.g === undefined) return;
    var g = +rowEl.dataset.g;
    if (ev.target.classList.contains("tw")) { treeOpen[g] = treeOpen[g] ? 0 : 1; renderTree(); }
    else if (ev.target.classList.contains("fold")) { setCollapsed(g, !collapsed[g]); renderTree(); }
    else focusGroup(g);
  });
  var depthSel = document.getElementById("gk-depth");
  var maxDepth = 0; for (g = 0; g < G; g++) maxDepth = Math.max(maxDepth, gDepth[g] + 1);
  for (var dpt = 0; dpt < maxDepth; dpt++) { var o = document.createElement("option"); o.value = dpt; o.textContent = dpt ? "collapse below level " + dpt : "collapse all groups"; depthSel.appendChild(o); }
  depthSel.addEventListener("change", function () { collapseToDepth(+depthSel.value); });
  if (!G) depthSel.style.display = "none";
  var banner = document.getElementById("gk-banner");
  if (roots.length) {
    var parts = roots.slice(0, 3).map(function (n) {
      var cnt = 0; for (var q = 0; q < N; q++) if (nRoot[q] === n && q !== n) cnt++;
      return '<a data-node="' + n + '">' + esc(nId[n]) + "</a> failed with " + esc(statusName(nStatus[n])) + " \u2014 " + cnt + " node" + (cnt === 1 ? "" : "s") + " downstream";
    });
    banner.innerHTML = "\u2716 " + parts.join("; ") + (roots.length > 3 ? "; and " + (roots.length - 3) + " more" : "");
    banner.classList.add("show");
    banner.addEventListener("click", function (ev) { if (ev.target.dataset.node !== undefined) focusNode(+ev.target.dataset.node); });
  }
  if (diff) {
    var bar = document.getElementById("gk-diffbar");
    bar.innerHTML = esc(diff.title) + ": <b>+" + diff.added.length + "</b> added, <b>\u2212" + diff.removed.length + "</b> removed, <b>~" + Object.keys(diff.changed).length + "</b> changed &nbsp; <a id=\"gk-difftoggle\">details</a><div id=\"gk-difflist\"></div>";
    var dl = document.getElementById("gk-difflist"), lines = [];
    diff.added.forEach(function (n) { lines.push('<div>+ <a data-node="' + n + '">' + esc(nId[n]) + "</a> " + esc(nOp[n] || nKind[n]) + (nGroup[n] >= 0 ? " [" + esc(gPath[nGroup[n]]) + "]" : "") + "</div>"); });
    diff.removed.forEach(function (r) { lines.push("<div>\u2212 <span class=\"gk-mono\">" + esc(r[0]) + "</span> " + esc(r[1]) + (r[2] ? " [" + esc(r[2]) + "]" : "") + "</div>"); });
    Object.keys(diff.changed).forEach(function (n) { lines.push('<div>~ <a data-node="' + n + '">' + esc(nId[+n]) + "</a> " + esc(diff.changed[n].map(function (c) { return c[0]; }).join(", ")) + "</div>"); });
    dl.innerHTML = lines.join("") || "<div>no differences</div>";
    document.getElementById("gk-legend").insertAdjacentHTML("beforeend",
      '<i style="border-color:#22c55e;border-width:2.5px"></i>added<i style="border-color:#f59e0b;border-width:2.5px"></i>changed');
    bar.classList.add("show");
    bar.addEventListener("click", function (ev) {
      if (ev.target.id === "gk-difftoggle") { dl.classList.toggle("open"); resizeSoon(); }
      else if (ev.target.dataset.node !== undefined) focusNode(+ev.target.dataset.node);
    });
  }

  // ------------------------------------------------------------------ start
  if (D.options && D.options.collapse_depth != null) {
    for (g = 0; g < G; g++) collapsed[g] = gDepth[g] >= D.options.collapse_depth ? 1 : 0;
    if (D.options.collapse_depth >= 0 && D.options.collapse_depth < maxDepth) depthSel.value = String(D.options.collapse_depth);
  }
  layout();
  resize();
  window.addEventListener("resize", resize);
  var bnd = L.bounds;
  if (roots.length && Math.min(cssW / (bnd[2] - bnd[0] + 40), cssH / (bnd[3] - bnd[1] + 40)) < 0.5) {
    var ru = L.unitOfNode[roots[0]]; centerOn(L.x[ru], L.y[ru], 0.9, 0);
  } else fit(0);
  draw();

  // ------------------------------------------------------------------ API (tests, console)
  function nodeIndex(id) { var n = idIndex.get(id); if (n === undefined) throw new Error("no node " + id); return n; }
  window.gk = {
    ready: true,
    firstRenderMs: performance.now(),
    scriptMs: performance.now() - T0,
    layoutMs: L.ms,
    nodeCount: N,
    data: D,
    search: function (q) { search.value = q; return runSearch(q); },
    select: function (id) { select(id == null ? -1 : nodeIndex(id)); },
    focus: function (id) { focusNode(nodeIndex(id), 0); },
    selected: function () { return selected >= 0 ? nId[selected] : selected === -1 ? null : gPath[-selected - 1]; },
    collapse: function (path, on) { var g = gPath.indexOf(path); if (g < 0) throw new Error("no group " + path); setCollapsed(g, on !== false); },
    collapseToDepth: collapseToDepth,
    focusGroup: function (path) { var g = gPath.indexOf(path); if (g < 0) throw new Error("no group " + path); focusGroup(g); },
    screenBox: function (id) {
      var n = nodeIndex(id), u = L.unitOfNode[n], k = transform.k, r = canvas.getBoundingClientRect();
      return { x: r.left + (L.x[u] - L.w[u] / 2) * k + transform.x, y: r.top + (L.y[u] - L.h[u] / 2) * k + transform.y, width: L.w[u] * k, height: L.h[u] * k };
    },
    nodeState: function (id) {
      var n = nodeIndex(id), u = L.unitOfNode[n];
      return {
        visible: L.keys[u] === n, style: unitStyle(u), status: statusName(nStatus[n]),
        failed: nStatus[n] !== 0 && nStatus[n] !== 10, upstream: nStatus[n] === 10,
        rootCause: nRoot[n] >= 0 ? nId[nRoot[n]] : null, match: !!matches[n], selected: selected === n
      };
    },
    transform: function () { return { x: transform.x, y: transform.y, k: transform.k }; },
    fitAll: function () {  // everything in view, however small
      var b = L.bounds, k = Math.min(cssW / (b[2] - b[0] + 40), cssH / (b[3] - b[1] + 40));
      centerOn((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, k, 0);
    },
    redraw: draw
  };
  document.body.setAttribute("data-ready", "1");
})();
