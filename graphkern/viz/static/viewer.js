/* graphkern graph viewer.
 *
 * Draws a traced graph on a canvas. Module scopes nest: every open module is laid out on its own
 * (longest-path layers top to bottom in data-flow order, barycentric ordering, isotonic x
 * placement) and drawn as a frame around its contents; a closed module is one box. Edges that
 * cross a frame leave it through a port on its bottom edge and enter through one on its top edge,
 * so frames never overlap and a long edge is routed around the boxes between its ends. Weights
 * and constants are attributes of the node that uses them unless "weights" is on. Search, a
 * details panel, the blast radius of a failure, pan and zoom (d3-zoom) and a minimap complete it.
 * The data comes from the <script id="gk-data"> element written by graphkern.viz.html; window.gk
 * is a small API for tests and for the console.
 */
(function () {
  "use strict";
  var T0 = performance.now();
  var D = JSON.parse(document.getElementById("gk-data").textContent);
  var d3 = window.d3;
  var UPSTREAM = 10;

  // ------------------------------------------------------------------ data
  var N = D.nodes.length, G = D.groups.length, E = D.edges.length, KIND = D.kinds;
  var nId = new Array(N), nKind = new Array(N), nLabel = new Array(N), nOp = new Array(N);
  var nGroup = new Int32Array(N), nStatus = new Int32Array(N), nRoot = new Int32Array(N);
  var nWeight = new Uint8Array(N);
  var idIndex = new Map(), i, g, e;
  for (i = 0; i < N; i++) {
    var r = D.nodes[i];
    nId[i] = r[0]; nKind[i] = KIND[r[1]]; nLabel[i] = r[2]; nOp[i] = r[3];
    nGroup[i] = r[4]; nStatus[i] = r[5]; nRoot[i] = r[6]; nWeight[i] = r[7] & 1;
    idIndex.set(r[0], i);
  }
  var gPath = new Array(G), gLabel = new Array(G), gClass = new Array(G);
  var gParent = new Int32Array(G), gDepth = new Int32Array(G), gChain = new Array(G);
  var gChildren = [], topGroups = [];
  for (g = 0; g < G; g++) {
    var gr = D.groups[g];
    gPath[g] = gr[0]; gLabel[g] = gr[1]; gParent[g] = gr[2]; gDepth[g] = gr[3]; gClass[g] = gr[4] || "";
    gChain[g] = gParent[g] >= 0 ? gChain[gParent[g]].concat([g]) : [g];
    gChildren.push([]);
  }
  for (g = 0; g < G; g++) (gParent[g] >= 0 ? gChildren[gParent[g]] : topGroups).push(g);
  var eSrc = new Int32Array(E), eDst = new Int32Array(E), outE = [], inE = [];
  for (i = 0; i < N; i++) { outE.push([]); inE.push([]); }
  for (e = 0; e < E; e++) {
    eSrc[e] = D.edges[e][0]; eDst[e] = D.edges[e][1];
    outE[eSrc[e]].push(e); inE[eDst[e]].push(e);
  }
  for (i = 0; i < N; i++) inE[i].sort(function (a, b) { return D.edges[a][5] - D.edges[b][5]; });
  var details = D.details || {}, sources = D.sources || {};
  function det(n) { return details[n] || {}; }
  // per group: what it holds (weights aside), for box captions, panels and the module tree
  var gOps = new Int32Array(G), gKernels = new Int32Array(G), gFailed = new Int32Array(G);
  var gRootFail = new Int32Array(G);
  for (i = 0; i < N; i++) {
    if (nGroup[i] < 0) continue;
    var ch = gChain[nGroup[i]];
    for (var c = 0; c < ch.length; c++) {
      g = ch[c];
      if (!nWeight[i]) { if (nKind[i] === "kernel") gKernels[g]++; else gOps[g]++; }
      if (nStatus[i]) gFailed[g]++;
      if (nStatus[i] && nStatus[i] !== UPSTREAM) gRootFail[g]++;
    }
  }
  var diff = D.diff || null;
  var diffMark = new Int8Array(N);   // 1 added, 2 changed
  if (diff) {
    diff.added.forEach(function (n) { diffMark[n] = 1; });
    Object.keys(diff.changed).forEach(function (n) { diffMark[+n] = 2; });
  }
  var roots = [];
  for (i = 0; i < N; i++) if (nStatus[i] && nStatus[i] !== UPSTREAM) roots.push(i);
  function statusName(s) { return D.statusNames[s] || String(s); }
  function downstreamOf(n) { var c = 0; for (var q = 0; q < N; q++) if (nRoot[q] === n && q !== n) c++; return c; }

  // ------------------------------------------------------------------ names in the user's terms
  function pathParts(p) { return p ? p.split(".") : []; }
  // a module path or parameter path as seen from inside ``scope``: the shared leading parts go
  function relative(path, scope) {
    var a = pathParts(path), b = pathParts(scope), q = 0;
    while (q < a.length - 1 && q < b.length && a[q] === b[q]) q++;
    return a.slice(q).join(".");
  }
  function scopeOf(n) { return nGroup[n] >= 0 ? gPath[nGroup[n]] : ""; }
  // what a box says first: the op for an op, the kernel for a kernel, the name otherwise
  function title(n) {
    var k = nKind[n];
    if (k === "op" || k === "kernel") return nOp[n] || nLabel[n];
    if (k === "input" && nWeight[n]) return relative(nLabel[n], scopeOf(n));
    if (k === "constant") return det(n).value || nLabel[n];
    return nLabel[n];
  }
  // the weights and constants a node reads, drawn as its attributes while they are not nodes
  var nAttrs = new Array(N);
  for (i = 0; i < N; i++) {
    var list = [];
    for (var q = 0; q < inE[i].length; q++) { var s = eSrc[inE[i][q]]; if (nWeight[s] && list.indexOf(s) < 0) list.push(s); }
    nAttrs[i] = list;
  }
  function weightShort(s, n) {
    var w = det(s).weight;
    return w ? relative(w[1], scopeOf(n)) : nLabel[s];
  }
  function weightFull(s) { var w = det(s).weight; return w ? w[0] : nLabel[s]; }
  function attrLine(n) {
    if (showWeights || !nAttrs[n].length) return "";
    return nAttrs[n].map(function (s) { return weightShort(s, n); }).join(", ");
  }
  function inputName(n, index) {
    var names = det(n).input_names;
    return names && index < names.length ? names[index] : "";
  }

  // ------------------------------------------------------------------ values (gk.inspect, gk.compare)
  // D.values (graphkern.viz.overlay): stats per node [min, max, mean, absmax, nan, inf], the
  // comparison's rows [b node, b output, a node, a output, op, scope, shape, dtype a, dtype b,
  // max abs, max rel, beyond tolerance, ok, note], the colouring the page opens with. A
  // non-finite number arrives as text ("Infinity"), which Number() reads back.
  var V = D.values || null, NON_FINITE = 12;
  function numberOf(x) { return x === null || x === undefined ? NaN : typeof x === "number" ? x : Number(x); }
  var nStats = V && V.stats ? V.stats : null;
  var cmp = V && V.compare ? V.compare : null;
  var nRows = null, firstNode = -1;
  // per node, its worst row: verdict (0 none, 1 not compared, 2 within tolerance, 3 beyond), errors
  var eVerdict = null, eAbs = null, eRel = null;
  if (cmp) {
    nRows = new Array(N); eVerdict = new Int8Array(N);
    eAbs = new Float64Array(N).fill(NaN); eRel = new Float64Array(N).fill(NaN);
    cmp.rows.forEach(function (r, j) {
      var n = r[0];
      if (n < 0) return;
      (nRows[n] || (nRows[n] = [])).push(j);
      var verdict = r[12] === true ? 2 : r[12] === false ? 3 : 1;
      if (verdict > eVerdict[n]) eVerdict[n] = verdict;
      if (verdict < 2) return;
      var a = numberOf(r[9]), rel = numberOf(r[10]);
      if (isNaN(a)) a = Infinity;
      if (isNaN(rel)) rel = Infinity;
      if (!(eAbs[n] >= a)) eAbs[n] = a;
      if (!(eRel[n] >= rel)) eRel[n] = rel;
    });
    if (cmp.first !== null && cmp.first !== undefined && cmp.rows[cmp.first]) firstNode = cmp.rows[cmp.first][0];
  }
  function elements(n) {   // how many values a node's outputs hold, from the shapes on its edges
    var seen = new Set(), total = 0, list = outE[n].length ? outE[n] : inE[n];
    for (var q = 0; q < list.length; q++) {
      var ed = D.edges[list[q]];
      if (seen.has(ed[2])) continue;
      seen.add(ed[2]);
      total += ed[3] === "" ? 1 : ed[3].split(",").reduce(function (p, d) { return p * (+d || 0); }, 1);
      if (!outE[n].length) break;
    }
    return total;
  }

  // ------------------------------------------------------------------ node colour
  // The one place a node's fill is decided: a colouring maps a node to its fill and lists its
  // legend. The statistic colourings give each node a category (-1 no value, 0 the quiet
  // range, 1 the loud range, 2 non-finite) and a value; a closed module takes the worst node
  // inside it (highest category, then largest value), weights only where they are loud.
  var KIND_FILL = { op: "#ffffff", input: "#dbeafe", output: "#dcfce7", constant: "#f1f5f9", kernel: "#ede9fe",
                    collective: "#ffedd5" };
  var hasCollectives = nKind.indexOf("collective") >= 0;
  var FAILED_FILL = "#fecaca", UPSTREAM_FILL = "#fff1f2", BOX_FILL = "#e2e8f0";
  var NONE_FILL = "#f1f5f9", NONFINITE_FILL = "#881337", FINITE_FILL = "#ecfdf5", FIRST_HALO = "#ea580c";
  var LIMIT_FILL = "#94a3b8";
  var RAMPS = {
    absmax: ["#f0f9ff", "#7dd3fc", "#0369a1"],
    count: ["#ffe4e6", "#fb7185"],
    ok: ["#dcfce7", "#86efac"],
    bad: ["#fed7aa", "#f97316", "#dc2626"]
  };
  var STEPS = 24;   // a ramp in so many colours: few fill batches, and a legend that matches
  var rampColours = {};
  function rampOf(name) {
    var cs = rampColours[name];
    if (!cs) {
      var f = d3.piecewise(d3.interpolateLab, RAMPS[name]);
      cs = []; for (var q = 0; q <= STEPS; q++) cs.push(d3.color(f(q / STEPS)).formatHex());
      rampColours[name] = cs;
    }
    return cs;
  }
  // a scale over the values of one category: logarithmic where they span two decades or more
  function scaleOver(values, ramp) {
    var lo = Infinity, hi = -Infinity, pos = Infinity;
    for (var q = 0; q < values.length; q++) {
      var x = values[q];
      if (!isFinite(x)) continue;
      if (x < lo) lo = x; if (x > hi) hi = x;
      if (x > 0 && x < pos) pos = x;
    }
    if (lo === Infinity) return null;
    var log = pos !== Infinity && hi / pos >= 100, a = log ? Math.log10(pos) : lo, b = log ? Math.log10(hi) : hi;
    var cs = rampOf(ramp);
    return {
      lo: log ? pos : lo, hi: hi, log: log, ramp: ramp, zero: lo <= 0,
      colour: function (x) {
        var v = log ? (x > 0 ? Math.log10(x) : a) : x;
        var t = b > a ? (v - a) / (b - a) : hi > 0 ? 1 : 0;
        return cs[Math.round(Math.max(0, Math.min(1, t)) * STEPS)];
      }
    };
  }
  // a statistic: cat and val per node, per group the worst, the scales of categories 0 and 1;
  // nodes of category ``apart`` are left out of their modules' worst. ``shared``: categories 0
  // and 1 are verdicts on the one value, not ranges of it (an error within tolerance can be
  // larger than one beyond it), so both ramps run over the range of both, a value in one place
  function statMeasure(nodeCat, nodeVal, ramps, fills, apart, shared) {
    var cat = new Int8Array(N), val = new Float64Array(N), n, q;
    for (n = 0; n < N; n++) { cat[n] = nodeCat(n); val[n] = cat[n] >= 0 ? nodeVal(n) : NaN; }
    var gCat = new Int8Array(G).fill(-1), gVal = new Float64Array(G).fill(NaN), gWorst = new Int32Array(G).fill(-1);
    var pools = [[], []];
    for (n = 0; n < N; n++) {
      var c = cat[n];
      if (c < 0 || (nWeight[n] && c < 1)) continue;
      if (c < 2) pools[c].push(val[n]);
      if (nGroup[n] < 0 || c === apart) continue;
      var chain = gChain[nGroup[n]];
      for (q = 0; q < chain.length; q++) {
        var g2 = chain[q];
        if (c > gCat[g2] || (c === gCat[g2] && val[n] > gVal[g2])) { gCat[g2] = c; gVal[g2] = val[n]; gWorst[g2] = n; }
      }
    }
    var scales = [0, 1].map(function (c) {
      if (!ramps[c] || (shared && !pools[c].length)) return null;
      return scaleOver(shared ? pools[0].concat(pools[1]) : pools[c], ramps[c]);
    });
    function fillOf(c, x) {
      if (c < 0) return NONE_FILL;
      if (c === 2) return fills[2];
      if (scales[c]) return isFinite(x) ? scales[c].colour(x) : scales[c].colour(scales[c].lo);
      return fills[c] || NONE_FILL;
    }
    return {
      cat: cat, val: val, gCat: gCat, gVal: gVal, gWorst: gWorst, scales: scales,
      fill: function (n2) { return fillOf(cat[n2], val[n2]); },
      group: function (g2) { return fillOf(gCat[g2], gVal[g2]); }
    };
  }
  // a statistic colouring: its measure is built the first time it is chosen
  function statColouring(label, build, legend) {
    var m = null;
    function get() { return m || (m = build()); }
    return {
      label: label, stat: true,
      fill: function (n) { return get().fill(n); },
      group: function (g) { return get().group(g); },
      measure: get,
      legend: function () { return legend(get()); }
    };
  }
  function rampLegend(title, sc) {
    return sc ? { ramp: sc, title: title } : null;
  }
  // the ramps of a shared scale, each [scale, what it stands for], as one legend item: one range,
  // a bar per ramp
  function sharedLegend(title, ramps) {
    ramps = ramps.filter(function (r) { return r[0]; });
    if (ramps.length < 2) return ramps.length ? rampLegend(title + ", " + ramps[0][1], ramps[0][0]) : null;
    return { ramp: ramps[0][0], title: title, rows: ramps };
  }
  var COLOURINGS = {
    kind: {
      label: "kind",
      fill: function (n) {
        if (nStatus[n]) return nStatus[n] === UPSTREAM ? UPSTREAM_FILL : FAILED_FILL;
        return KIND_FILL[nKind[n]] || KIND_FILL.op;
      },
      group: function (g) { return gRootFail[g] ? FAILED_FILL : gFailed[g] ? UPSTREAM_FILL : BOX_FILL; },
      legend: function () {
        return [[KIND_FILL.op, "#64748b", "op"], [KIND_FILL.kernel, "#6d28d9", "kernel"]].concat(
          hasCollectives ? [[KIND_FILL.collective, "#c2410c", "collective"]] : [],
          [[KIND_FILL.input, "#3b82f6", "input"], [KIND_FILL.output, "#16a34a", "output"],
           [BOX_FILL, "#475569", "module (closed)"]]);
      }
    }
  };
  // A value at its dtype's largest finite magnitude is a mask's fill (attention scores masked
  // with the dtype's minimum), not a magnitude: arithmetic that overflows gives Inf. Such nodes
  // are drawn apart and left out of the scale and of their modules' worst.
  var DTYPE_MAX = { float32: 3.4028234663852886e38, float16: 65504, bfloat16: 3.3895313892515355e38, float64: 1.7976931348623157e308 };
  function dtypeOf(n) { var list = outE[n].length ? outE[n] : inE[n]; return list.length ? D.edges[list[0]][4] : ""; }
  function atDtypeLimit(n) {
    var lim = DTYPE_MAX[dtypeOf(n)];
    return lim !== undefined && numberOf(nStats[n][3]) >= lim * (1 - 1e-6);
  }
  if (nStats) {
    COLOURINGS.absmax = statColouring("abs-max", function () {
      // integers and booleans (token ids, indices, masks) are not magnitudes: no colour
      return statMeasure(function (n) {
        var s = nStats[n];
        return !s ? -1 : s[4] + s[5] ? 2 : dtypeOf(n).indexOf("float") < 0 ? -1 : atDtypeLimit(n) ? 1 : 0;
      },
                         function (n) { var x = numberOf(nStats[n][3]); return isNaN(x) ? 0 : x; },
                         ["absmax", null], [null, LIMIT_FILL, NONFINITE_FILL], 1);
    }, function (m) {
      var items = [rampLegend("abs-max", m.scales[0]), [NONFINITE_FILL, "#64748b", "holds NaN / Inf"]];
      for (var n = 0; n < N; n++) if (m.cat[n] === 1) { items.push([LIMIT_FILL, "#64748b", "\u00B1 its dtype's largest (a mask's fill)"]); break; }
      return items.concat([[NONE_FILL, "#64748b", "no values, or not floating point"]]);
    });
    COLOURINGS.nonfinite = statColouring("NaN / Inf", function () {
      return statMeasure(function (n) { var s = nStats[n]; return !s ? -1 : nStatus[n] === NON_FINITE ? 2 : s[4] + s[5] ? 1 : 0; },
                     function (n) { return nStats[n][4] + nStats[n][5]; },
                     [null, "count"], [FINITE_FILL, null, NONFINITE_FILL]);
    }, function (m) {
      return [[NONFINITE_FILL, "#dc2626", "NaN / Inf starts here"], rampLegend("NaN + Inf count below it", m.scales[1]),
              [FINITE_FILL, "#64748b", "finite"], [NONE_FILL, "#64748b", "no values"]];
    });
  }
  if (cmp) {
    var errorColouring = function (label, errors) {
      return statColouring(label, function () {
        return statMeasure(function (n) { var v = eVerdict[n]; return v < 2 ? -1 : !isFinite(errors[n]) ? 2 : v - 2; },
                       function (n) { return errors[n]; }, ["ok", "bad"], [null, null, NONFINITE_FILL], undefined, true);
      }, function (m) {
        return [sharedLegend(label, [[m.scales[0], "within tolerance"], [m.scales[1], "beyond tolerance"]]),
                [NONFINITE_FILL, "#64748b", "NaN / Inf error"], [NONE_FILL, "#64748b", "not compared"],
                ["#ffffff", FIRST_HALO, "first divergence", false, true]];
      });
    };
    COLOURINGS.error_abs = errorColouring("max abs error", eAbs);
    COLOURINGS.error_rel = errorColouring("max rel error", eRel);
  }
  var colouring = COLOURINGS[V && COLOURINGS[V.colour] ? V.colour : "kind"];
  var lumCache = new Map();
  function luminance(colour) {   // 0 (black) .. 255 (white)
    var y = lumCache.get(colour);
    if (y === undefined) { var c = d3.rgb(colour); y = 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b; lumCache.set(colour, y); }
    return y;
  }
  function isDark(colour) { return luminance(colour) < 135; }   // white text reads better on it
  // outline: the kind, or the status, which every colouring shows the same way
  var KIND_STROKE = { op: ["#64748b", 1], input: ["#3b82f6", 1.5], output: ["#16a34a", 1.5],
                      constant: ["#94a3b8", 1], kernel: ["#6d28d9", 2.2], collective: ["#c2410c", 2.2] };
  function strokeOf(n) {
    if (nStatus[n] === UPSTREAM) return ["#ef4444", 1.5, 1];
    if (nStatus[n]) return ["#dc2626", 3, 0];
    var s = KIND_STROKE[nKind[n]] || KIND_STROKE.op;
    return [s[0], s[1], 0];
  }
  function groupStroke(g) {
    if (gRootFail[g]) return ["#dc2626", 3, 0];
    if (gFailed[g]) return ["#ef4444", 1.5, 1];
    return ["#475569", 1.5, 0];
  }

  // ------------------------------------------------------------------ state
  var collapsed = new Uint8Array(G);
  var showWeights = false;
  var selected = -1;          // none, a node index >= 0, or groupKey(g) for a module
  function groupKey(g) { return -g - 2; }
  function keyGroup(key) { return -key - 2; }
  var matches = new Uint8Array(N), matchList = [], matchCursor = -1;
  var L = null;               // the current layout
  var transform = d3.zoomIdentity;

  // ------------------------------------------------------------------ sizes
  var FONT = "12px system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif";
  var BOLD = "600 12px system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif";
  var SMALL = "10px system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif";
  var MONO = "10px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
  var NODE_H = 28, NODE_H2 = 40, BOX_H = 44, TITLE_H = 24, PAD = 14, PAD_BOTTOM = 14;
  var LAYER_GAP = 34, NODE_GAP = 22, DUMMY_W = 6, DUMMY_GAP = 10, MAX_W = 260;
  var measure = document.createElement("canvas").getContext("2d");
  var widthCache = new Map();
  function textWidth(s, font) {
    var key = (font || FONT) + "\u0001" + s, w = widthCache.get(key);
    if (w === undefined) { measure.font = font || FONT; w = measure.measureText(s).width; widthCache.set(key, w); }
    return w;
  }
  function clip(text, max, font) {
    if (textWidth(text, font) <= max) return text;
    var lo = 0, hi = text.length;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (textWidth(text.slice(0, mid) + "\u2026", font) <= max) lo = mid; else hi = mid - 1; }
    return text.slice(0, lo) + "\u2026";
  }
  function boxCaption(g) {
    var bits = [];
    if (gClass[g]) bits.push(gClass[g]);
    if (gOps[g]) bits.push(gOps[g] + " op" + (gOps[g] === 1 ? "" : "s"));
    if (gKernels[g]) bits.push(gKernels[g] + " kernel" + (gKernels[g] === 1 ? "" : "s"));
    if (gRootFail[g]) bits.push("\u2716 failed");
    return bits.join(" \u00B7 ");
  }

  // ------------------------------------------------------------------ what is drawn
  // Display nodes: every node that is not a weight; with "weights" on, each weight chain is
  // copied next to every node that reads it, so a weight shared by all layers (an epsilon, a
  // mask) is drawn where it is used instead of pulling edges across the whole model.
  var dNode = [], dGroup = [], dRank = [], dES = [], dED = [], dEE = [], dOfNode = null;
  function buildDisplay() {
    dNode = []; dGroup = []; dRank = []; dES = []; dED = []; dEE = [];
    dOfNode = new Int32Array(N).fill(-1);
    var n, q;
    for (n = 0; n < N; n++) if (!nWeight[n]) { dOfNode[n] = dNode.length; dNode.push(n); dGroup.push(nGroup[n]); dRank.push(n); }
    if (showWeights) {
      var used = new Uint8Array(N);
      for (n = 0; n < N; n++) {
        if (nWeight[n]) continue;
        var copies = new Map();
        var copy = function (s) {
          var k = copies.get(s);
          if (k !== undefined) return k;
          k = dNode.length; copies.set(s, k); dNode.push(s); dGroup.push(nGroup[n]); dRank.push(n - 1 + s / N); used[s] = 1;
          if (dOfNode[s] < 0) dOfNode[s] = k;
          for (var z = 0; z < inE[s].length; z++) {
            var e2 = inE[s][z], p = eSrc[e2];
            if (nWeight[p]) { var kp = copy(p); dES.push(kp); dED.push(k); dEE.push(e2); }
          }
          return k;
        };
        for (q = 0; q < inE[n].length; q++) {
          var ed = inE[n][q], src = eSrc[ed];
          if (nWeight[src]) { dES.push(copy(src)); dED.push(dOfNode[n]); dEE.push(ed); }
        }
      }
      for (n = 0; n < N; n++) if (nWeight[n] && !used[n]) {   // read by nothing drawn: its own place
        dOfNode[n] = dNode.length; dNode.push(n); dGroup.push(nGroup[n]); dRank.push(n);
      }
      for (n = 0; n < N; n++) if (nWeight[n] && !used[n]) {
        for (q = 0; q < outE[n].length; q++) {
          var e3 = outE[n][q], t = eDst[e3];
          if (nWeight[t] && !used[t]) { dES.push(dOfNode[n]); dED.push(dOfNode[t]); dEE.push(e3); }
        }
      }
    }
    for (e = 0; e < E; e++) {
      if (nWeight[eSrc[e]] || nWeight[eDst[e]] || D.edges[e][6]) continue;   // [6]: cross-rank, drawn apart
      dES.push(dOfNode[eSrc[e]]); dED.push(dOfNode[eDst[e]]); dEE.push(e);
    }
  }

  // ------------------------------------------------------------------ layout
  function unitText(u) {   // [first line, second line]
    var lay = L0 || L;
    if (lay.uBox[u] >= 0) { var g = lay.uBox[u]; return ["\u25B8 " + gLabel[g], boxCaption(g)]; }
    var n = dNode[lay.uRef[u]];
    return [title(n), attrLine(n)];
  }
  var L0 = null;   // the layout under construction
  function containerChain(u) {   // open modules around a unit, outermost first
    var g = L0.uBox[u] >= 0 ? gParent[L0.uBox[u]] : dGroup[L0.uRef[u]];
    return g >= 0 ? gChain[g] : [];
  }

  function layout() {
    var t0 = performance.now();
    buildDisplay();
    var DN = dNode.length;
    // 1. units: a display node, or the outermost closed module around it
    var unitOfDn = new Int32Array(DN), uRef = [], uBox = [], boxUnit = new Map(), n, k, q;
    for (k = 0; k < DN; k++) {
      var gg = dGroup[k], box = -1;
      if (gg >= 0) { var chn = gChain[gg]; for (q = 0; q < chn.length; q++) if (collapsed[chn[q]]) { box = chn[q]; break; } }
      if (box < 0) { unitOfDn[k] = uRef.length; uRef.push(k); uBox.push(-1); }
      else {
        var u0 = boxUnit.get(box);
        if (u0 === undefined) { u0 = uRef.length; boxUnit.set(box, u0); uRef.push(k); uBox.push(box); }
        unitOfDn[k] = u0;
      }
    }
    var U = uRef.length;
    L0 = { U: U, uRef: uRef, uBox: uBox };
    var uW = new Float64Array(U), uH = new Float64Array(U), uRank = new Float64Array(U);
    for (var u = 0; u < U; u++) {
      var tx = unitText(u);
      if (uBox[u] >= 0) {
        uW[u] = Math.min(MAX_W + 60, Math.max(150, textWidth(tx[0], BOLD) + 30, textWidth(tx[1], SMALL) + 24));
        uH[u] = BOX_H; uRank[u] = Infinity;
      } else {
        n = dNode[uRef[u]];
        var w1 = textWidth(tx[0], nKind[n] === "kernel" ? BOLD : FONT) + 24;
        var w2 = tx[1] ? textWidth(tx[1], SMALL) + 18 : 0;
        uW[u] = Math.min(MAX_W, Math.max(nWeight[n] ? 40 : 56, w1, w2));
        uH[u] = tx[1] ? NODE_H2 : (nWeight[n] ? NODE_H - 6 : NODE_H);
        uRank[u] = dRank[uRef[u]];
      }
    }
    for (k = 0; k < DN; k++) if (uRank[unitOfDn[k]] > dRank[k]) uRank[unitOfDn[k]] = dRank[k];
    // 2. containers: the root (-1) and every open module with something drawn in it
    var C = new Map();
    function container(g) {
      var c = C.get(g);
      if (!c) {
        c = { g: g, items: [], index: new Map(), edges: new Map(), w: 0, h: 0, x: 0, y: 0, rank: Infinity };
        C.set(g, c);
        if (g >= 0) { var p = container(gParent[g]); addItem(p, "g" + g, 1, g); }
      }
      return c;
    }
    function addItem(c, key, type, ref) {
      var idx = c.index.get(key);
      if (idx === undefined) { idx = c.items.length; c.index.set(key, idx); c.items.push({ key: key, type: type, ref: ref }); }
      return idx;
    }
    container(-1);
    for (u = 0; u < U; u++) {
      var cc = containerChain(u), own = container(cc.length ? cc[cc.length - 1] : -1);
      addItem(own, "u" + u, 0, u);
    }
    // 3. routes: one per (source display node, target unit), registered as an edge in every
    // container it crosses: up through ports on the bottom of the source's frames, across at
    // the innermost frame holding both ends, down through ports on the top of the target's
    var routes = [], routeOf = new Map();
    function itemKey(chain, j, unit) { return j < chain.length ? "g" + chain[j] : "u" + unit; }
    function link(c, a, b, rt) {
      var key = a + ">" + b, ed = c.edges.get(key);
      if (!ed) { ed = { a: a, b: b, routes: [] }; c.edges.set(key, ed); }
      ed.routes.push(rt);
      return ed;
    }
    for (var de = 0; de < dES.length; de++) {
      var sDn = dES[de], ua = unitOfDn[sDn], ub = unitOfDn[dED[de]];
      if (ua === ub) continue;
      var rkey = sDn * U + ub, ri = routeOf.get(rkey);
      if (ri !== undefined) { routes[ri].count++; continue; }
      ri = routes.length; routeOf.set(rkey, ri);
      var rt = { src: sDn, a: ua, b: ub, edge: dEE[de], count: 1, hops: [] };
      routes.push(rt);
      var ca = containerChain(ua), cb = containerChain(ub), m = 0;
      while (m < ca.length && m < cb.length && ca[m] === cb[m]) m++;
      var up = [], down = [];
      for (var j = ca.length - 1; j >= m; j--) {
        var cj = C.get(ca[j]), port = "o" + sDn;
        addItem(cj, port, 2, sDn);
        up.push([cj, link(cj, itemKey(ca, j + 1, ua), port, rt)]);
      }
      var lca = C.get(m ? ca[m - 1] : -1);
      var mid = [lca, link(lca, itemKey(ca, m, ua), itemKey(cb, m, ub), rt)];
      for (j = m; j < cb.length; j++) {
        var cj2 = C.get(cb[j]), pin = "i" + sDn;
        addItem(cj2, pin, 3, sDn);
        down.push([cj2, link(cj2, pin, itemKey(cb, j + 1, ub), rt)]);
      }
      rt.hops = up.concat([mid], down);
    }
    // 4. lay out each container, innermost first (a module's size is known before its parent's)
    var order = Array.from(C.values()).sort(function (p, q2) {
      return (q2.g >= 0 ? gDepth[q2.g] : -1) - (p.g >= 0 ? gDepth[p.g] : -1);
    });
    for (q = 0; q < order.length; q++) layoutContainer(order[q], C, uW, uH, uRank);
    // 5. absolute positions, outermost first
    var root = C.get(-1);
    root.x = 0; root.y = 0;
    var uX = new Float64Array(U), uY = new Float64Array(U);
    var frames = [];
    for (q = order.length - 1; q >= 0; q--) {
      var c2 = order[q];
      if (c2.g >= 0) frames.push(c2);
      for (j = 0; j < c2.items.length; j++) {
        var it = c2.items[j];
        if (it.type === 0) { uX[it.ref] = c2.x + it.x; uY[it.ref] = c2.y + it.y; }
        else if (it.type === 1) { var sub = C.get(it.ref); sub.x = c2.x + it.x - sub.w / 2; sub.y = c2.y + it.y; }
      }
    }
    // 6. each route as points: (x, y) pairs, vertical at every box, port and layer it crosses
    for (q = 0; q < routes.length; q++) routePoints(routes[q], C, uX, uY, uH);
    var bounds = [0, 0, Math.max(1, root.w), Math.max(1, root.h)];
    var unitOfKey = new Map();
    for (u = 0; u < U; u++) unitOfKey.set(uBox[u] >= 0 ? groupKey(uBox[u]) : dNode[uRef[u]], u);
    var frameOf = new Map();
    frames.forEach(function (f) { frameOf.set(f.g, f); });
    // per-unit style facts
    var uStatus = new Int32Array(U), uFailRoot = new Uint8Array(U), uDiff = new Int8Array(U), uMatch = new Uint8Array(U);
    for (k = 0; k < DN; k++) {
      u = unitOfDn[k]; n = dNode[k];
      if (nStatus[n]) { uStatus[u] = uStatus[u] && uStatus[u] !== UPSTREAM ? uStatus[u] : nStatus[n]; if (nStatus[n] !== UPSTREAM) uFailRoot[u] = 1; }
      if (diffMark[n] && (!uDiff[u] || diffMark[n] === 1)) uDiff[u] = diffMark[n];
    }
    L = {
      U: U, uRef: uRef, uBox: uBox, unitOfDn: unitOfDn, unitOfKey: unitOfKey, x: uX, y: uY, w: uW, h: uH,
      routes: routes, frames: frames, frameOf: frameOf, containers: C, bounds: bounds,
      uStatus: uStatus, uFailRoot: uFailRoot, uDiff: uDiff, uMatch: uMatch, ms: 0
    };
    L0 = null;
    refreshMatches();
    buildMinimap();
    L.ms = performance.now() - t0;
    return L;
  }

  // One container: its items are units, open child modules and ports; edges among them as
  // registered by the routes. Longest-path layers, barycentre ordering, isotonic x placement.
  function layoutContainer(c, C, uW, uH, uRank) {
    var items = c.items, I = items.length, q, j, it;
    var w = new Float64Array(I), h = new Float64Array(I), rank = new Float64Array(I);
    var pins = 0, pouts = 0;
    for (q = 0; q < I; q++) {
      it = items[q];
      if (it.type === 0) { w[q] = uW[it.ref]; h[q] = uH[it.ref]; rank[q] = uRank[it.ref]; }
      else if (it.type === 1) { var sub = C.get(it.ref); w[q] = sub.w; h[q] = sub.h; rank[q] = sub.rank; }
      else if (it.type === 3) { w[q] = DUMMY_W; rank[q] = -1; pins++; }
      else { w[q] = DUMMY_W; rank[q] = Infinity; pouts++; }
      if (it.type < 2 && rank[q] < c.rank) c.rank = rank[q];
    }
    var pred = [], succ = [], isBack = new Uint8Array(c.edges.size);
    for (q = 0; q < I; q++) { pred.push([]); succ.push([]); }
    var edges = Array.from(c.edges.values());
    var ea = new Int32Array(edges.length), eb = new Int32Array(edges.length);
    for (j = 0; j < edges.length; j++) { ea[j] = c.index.get(edges[j].a); eb[j] = c.index.get(edges[j].b); edges[j].dummies = null; }
    // data-flow order: the items sorted topologically (ties by rank); where closed modules
    // make a cycle, the edges into the item that comes first by rank run against the flow
    var byRank = topoOrder(I, ea, eb, rank, isBack);
    var place0 = new Int32Array(I);
    for (q = 0; q < I; q++) place0[byRank[q]] = q;
    for (j = 0; j < edges.length; j++) {
      var a = ea[j], b = eb[j];
      if (!isBack[j] && place0[a] < place0[b]) { succ[a].push(b); pred[b].push(a); }
      else isBack[j] = 1;
    }
    // layers
    var layer = new Int32Array(I), base = pins ? 1 : 0, maxL = base;
    for (q = 0; q < I; q++) {
      var v = byRank[q];
      if (items[v].type === 3) { layer[v] = 0; continue; }
      if (items[v].type === 2) continue;
      var l = base, p = pred[v];
      for (j = 0; j < p.length; j++) if (layer[p[j]] + 1 > l) l = layer[p[j]] + 1;
      layer[v] = l;
      if (l > maxL) maxL = l;
    }
    // a unit that nothing feeds sits just above its first consumer, not at the top
    for (q = I - 1; q >= 0; q--) {
      v = byRank[q];
      if (items[v].type >= 2 || pred[v].length || !succ[v].length) continue;
      var mn = Infinity, s = succ[v];
      for (j = 0; j < s.length; j++) if (items[s[j]].type < 2 && layer[s[j]] < mn) mn = layer[s[j]];
      if (mn !== Infinity && mn - 1 > layer[v]) layer[v] = mn - 1;
    }
    var outL = maxL + 1;
    for (q = 0; q < I; q++) if (items[q].type === 2) layer[q] = outL;
    var nLayers = pouts ? outL + 1 : maxL + 1;
    // long edges: one dummy point per layer crossed
    var T = I, dLayer = [], npred = pred.map(function () { return []; }), nsucc = pred.map(function () { return []; });
    for (j = 0; j < edges.length; j++) {
      a = ea[j]; b = eb[j];
      if (isBack[j]) continue;
      var prev = a, pts = [];
      for (l = layer[a] + 1; l < layer[b]; l++) {
        var id = T++;
        dLayer.push(l); npred.push([prev]); nsucc.push([]); nsucc[prev].push(id); pts.push(id); prev = id;
      }
      nsucc[prev].push(b); npred[b].push(prev);
      edges[j].dummies = pts;
    }
    var lay = new Int32Array(T);
    lay.set(layer);
    for (j = 0; j < dLayer.length; j++) lay[I + j] = dLayer[j];
    var W = new Float64Array(T);
    W.set(w);
    for (j = I; j < T; j++) W[j] = DUMMY_W;
    var layers = [];
    for (l = 0; l < nLayers; l++) layers.push([]);
    var initial = byRank.slice();
    for (j = I; j < T; j++) initial.push(j);
    for (q = 0; q < initial.length; q++) layers[lay[initial[q]]].push(initial[q]);
    // ordering: barycentre sweeps on positions
    var pos = new Float64Array(T), keyv = new Float64Array(T);
    function setPos(ly) { for (var z = 0; z < ly.length; z++) pos[ly[z]] = z; }
    layers.forEach(setPos);
    function sortLayer(ly, nbrs) {
      for (var z = 0; z < ly.length; z++) {
        var vv = ly[z], nb = nbrs[vv];
        if (nb.length) { var sum = 0; for (var y = 0; y < nb.length; y++) sum += pos[nb[y]]; keyv[vv] = sum / nb.length; }
        else keyv[vv] = pos[vv];
      }
      ly.sort(function (x1, x2) { return keyv[x1] - keyv[x2] || pos[x1] - pos[x2]; });
      setPos(ly);
    }
    for (var sweep = 0; sweep < 4; sweep++) {
      if (sweep % 2 === 0) for (l = 1; l < nLayers; l++) sortLayer(layers[l], npred);
      else for (l = nLayers - 2; l >= 0; l--) sortLayer(layers[l], nsucc);
    }
    // x: isotonic regression towards the neighbours' mean, keeping the separations
    var x = new Float64Array(T);
    var sep = layers.map(function (ly) {
      var sp = new Float64Array(Math.max(0, ly.length - 1));
      for (var z = 0; z + 1 < ly.length; z++)
        sp[z] = (W[ly[z]] + W[ly[z + 1]]) / 2 + (ly[z] >= I || ly[z + 1] >= I || items[ly[z]].type >= 2 || items[ly[z + 1]].type >= 2 ? DUMMY_GAP : NODE_GAP);
      return sp;
    });
    for (l = 0; l < nLayers; l++) {
      var ly = layers[l], sp = sep[l], tot = 0;
      for (j = 0; j < sp.length; j++) tot += sp[j];
      var cx = -tot / 2;
      for (j = 0; j < ly.length; j++) { x[ly[j]] = cx; if (j < sp.length) cx += sp[j]; }
    }
    var desired = new Float64Array(T);
    function place(l2, nbrs) {
      var row = layers[l2], spc = sep[l2], cnt = row.length;
      if (!cnt) return;
      for (var z = 0; z < cnt; z++) {
        var vv = row[z], nb = nbrs[vv];
        if (nb.length) { var sum = 0; for (var y = 0; y < nb.length; y++) sum += x[nb[y]]; desired[z] = sum / nb.length; }
        else desired[z] = x[vv];
      }
      var off = 0, bsum = [], bcnt = [], bend = [];
      for (z = 0; z < cnt; z++) {
        bsum.push(desired[z] - off); bcnt.push(1); bend.push(z);
        if (z < cnt - 1) off += spc[z];
        while (bsum.length > 1 && bsum[bsum.length - 2] / bcnt[bcnt.length - 2] > bsum[bsum.length - 1] / bcnt[bcnt.length - 1]) {
          var s1 = bsum.pop(), c1 = bcnt.pop(), e1 = bend.pop();
          bsum[bsum.length - 1] += s1; bcnt[bcnt.length - 1] += c1; bend[bend.length - 1] = e1;
        }
      }
      off = 0; var start = 0;
      for (var bi = 0; bi < bsum.length; bi++) {
        var val = bsum[bi] / bcnt[bi];
        for (z = start; z <= bend[bi]; z++) { x[row[z]] = val + off; if (z < cnt - 1) off += spc[z]; }
        start = bend[bi] + 1;
      }
    }
    for (var pass = 0; pass < 6; pass++) {
      if (pass % 2 === 0) for (l = 1; l < nLayers; l++) place(l, npred);
      else for (l = nLayers - 2; l >= 0; l--) place(l, nsucc);
    }
    // y: layers stacked, items top-aligned; ports on the frame's top and bottom edges
    var isModule = c.g >= 0, top = isModule ? TITLE_H + PAD / 2 : 0;
    var layerTop = new Float64Array(nLayers), layerH = new Float64Array(nLayers), cy = top;
    for (l = 0; l < nLayers; l++) {
      if (l === 0 && pins) { layerTop[0] = 0; layerH[0] = 0; continue; }
      if (l === nLayers - 1 && pouts) continue;
      var lh = 0;
      for (j = 0; j < layers[l].length; j++) if (layers[l][j] < I && h[layers[l][j]] > lh) lh = h[layers[l][j]];
      if (cy > top) cy += LAYER_GAP;
      layerTop[l] = cy; layerH[l] = lh; cy += lh;
    }
    var contentBottom = cy;
    // width: the content centred, wide enough for the frame's title
    var minX = Infinity, maxX = -Infinity;
    for (j = 0; j < T; j++) { if (x[j] - W[j] / 2 < minX) minX = x[j] - W[j] / 2; if (x[j] + W[j] / 2 > maxX) maxX = x[j] + W[j] / 2; }
    if (!T) { minX = 0; maxX = 0; }
    var contentW = maxX - minX;
    var titleW = isModule ? textWidth(frameTitle(c.g), BOLD) + 40 : 0;
    c.w = Math.max(contentW + (isModule ? 2 * PAD : 0), titleW, isModule ? 120 : 1);
    c.h = contentBottom + (isModule ? PAD_BOTTOM : 0);
    var shift = (c.w - contentW) / 2 - minX;
    for (j = 0; j < T; j++) x[j] += shift;
    if (pouts) { layerTop[nLayers - 1] = c.h; layerH[nLayers - 1] = 0; }
    for (q = 0; q < I; q++) { items[q].x = x[q]; items[q].y = layerTop[layer[q]]; }
    for (q = 0; q < I; q++) if (items[q].type === 2) items[q].y = c.h;
    c.dummyX = x; c.layerTop = layerTop; c.layerH = layerH; c.lay = lay;
  }
  // Kahn's algorithm taking the lowest rank among the ready items; on a cycle, the lowest-rank
  // item left goes next and its remaining incoming edges are marked in isBack
  function topoOrder(I, ea, eb, rank, isBack) {
    var indeg = new Int32Array(I), ins = [], outs = [], q, j;
    for (q = 0; q < I; q++) { ins.push([]); outs.push([]); }
    for (j = 0; j < ea.length; j++) { if (ea[j] === eb[j]) { isBack[j] = 1; continue; } indeg[eb[j]]++; ins[eb[j]].push(j); outs[ea[j]].push(j); }
    var heap = [], done = new Uint8Array(I), order = [];
    function less(x, y) { return rank[x] < rank[y] || (rank[x] === rank[y] && x < y); }
    function push(v) {
      heap.push(v); var z = heap.length - 1;
      while (z > 0) { var p = (z - 1) >> 1; if (!less(heap[z], heap[p])) break; var t = heap[z]; heap[z] = heap[p]; heap[p] = t; z = p; }
    }
    function pop() {
      var top = heap[0], last = heap.pop();
      if (heap.length) {
        heap[0] = last; var z = 0;
        for (;;) {
          var l = 2 * z + 1, r = l + 1, m = z;
          if (l < heap.length && less(heap[l], heap[m])) m = l;
          if (r < heap.length && less(heap[r], heap[m])) m = r;
          if (m === z) break;
          var t = heap[z]; heap[z] = heap[m]; heap[m] = t; z = m;
        }
      }
      return top;
    }
    for (q = 0; q < I; q++) if (!indeg[q]) push(q);
    var byRankAll = null;
    while (order.length < I) {
      var v;
      if (heap.length) v = pop();
      else {   // a cycle: the lowest-rank item not yet placed breaks it
        if (!byRankAll) { byRankAll = Array.from({ length: I }, function (_, z) { return z; }); byRankAll.sort(function (x, y) { return less(x, y) ? -1 : 1; }); }
        v = -1;
        for (q = 0; q < I && v < 0; q++) if (!done[byRankAll[q]]) v = byRankAll[q];
        for (j = 0; j < ins[v].length; j++) if (!done[ea[ins[v][j]]]) isBack[ins[v][j]] = 1;
      }
      if (done[v]) continue;
      done[v] = 1; order.push(v);
      for (j = 0; j < outs[v].length; j++) {
        var w = eb[outs[v][j]];
        if (!done[w] && --indeg[w] === 0) push(w);
      }
    }
    return order;
  }
  function frameTitle(g) { return "\u25BE " + gLabel[g] + (gClass[g] ? "  " + gClass[g] : ""); }

  // the drawn path of a route, in absolute coordinates
  function routePoints(rt, C, uX, uY, uH) {
    var pts = [];
    function itemPoint(c, key, bottom) {
      var it = c.items[c.index.get(key)];
      if (it.type === 0) return [uX[it.ref], uY[it.ref] + (bottom ? uH[it.ref] : 0)];
      if (it.type === 1) { var s = C.get(it.ref); return [s.x + s.w / 2, s.y + (bottom ? s.h : 0)]; }
      return [c.x + it.x, c.y + it.y];
    }
    for (var j = 0; j < rt.hops.length; j++) {
      var c = rt.hops[j][0], ed = rt.hops[j][1];
      var a = itemPoint(c, ed.a, true), b = itemPoint(c, ed.b, false);
      if (!pts.length) pts.push(a[0], a[1]);
      else if (pts[pts.length - 2] !== a[0] || pts[pts.length - 1] !== a[1]) pts.push(a[0], a[1]);
      if (ed.dummies) {
        for (var z = 0; z < ed.dummies.length; z++) {
          var d = ed.dummies[z], l = c.lay[d], dx = c.x + c.dummyX[d];
          pts.push(dx, c.y + c.layerTop[l], dx, c.y + c.layerTop[l] + c.layerH[l]);
        }
      } else {   // against the flow (only between closed modules): around the right-hand side
        var xr = Math.max(a[0], b[0]) + 60;
        pts.push(xr, a[1] + 20, xr, b[1] - 20);
      }
      pts.push(b[0], b[1]);
    }
    rt.pts = pts;
    var x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
    for (j = 0; j < pts.length; j += 2) {
      if (pts[j] < x0) x0 = pts[j]; if (pts[j] > x1) x1 = pts[j];
      if (pts[j + 1] < y0) y0 = pts[j + 1]; if (pts[j + 1] > y1) y1 = pts[j + 1];
    }
    rt.box = [x0, y0, x1, y1];
  }

  // ------------------------------------------------------------------ drawing
  var canvas = document.getElementById("gk-canvas"), ctx = canvas.getContext("2d");
  var wrap = document.getElementById("gk-canvas-wrap");
  var dpr = window.devicePixelRatio || 1, cssW = 1, cssH = 1;
  function resize() {
    var rc = wrap.getBoundingClientRect();
    cssW = Math.max(1, rc.width); cssH = Math.max(1, rc.height);
    dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
    draw();   // now: setting the size cleared the canvas
  }
  // redraws asked for between two frames are folded into one, drawn just before the next frame
  // is shown; painted() resolves once the canvas shows everything asked for so far
  var pending = false, onPainted = [];
  function requestDraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () {
      pending = false;
      try { draw(); } finally {
        var waiting = onPainted; onPainted = [];
        waiting.forEach(function (resolve) { resolve(); });
      }
    });
  }
  function painted() {
    return pending ? new Promise(function (resolve) { onPainted.push(resolve); }) : Promise.resolve();
  }
  // a unit's look: [fill, stroke, line width, dashed]
  function unitLook(u) {
    if (L.uBox[u] >= 0) { var g = L.uBox[u], s = groupStroke(g); return [colouring.group(g), s[0], s[1], s[2]]; }
    var n = dNode[L.uRef[u]], st = strokeOf(n);
    return [colouring.fill(n), st[0], st[1], st[2]];
  }
  function unitStyle(u) {   // a name for tests and the tooltip
    if (L.uStatus[u]) return L.uFailRoot[u] ? "failed" : "upstream";
    return L.uBox[u] >= 0 ? "group" : nKind[dNode[L.uRef[u]]];
  }
  function hexagon(c, x, y, w, h) {
    var d = Math.min(h / 2, w / 4);
    c.moveTo(x + d, y); c.lineTo(x + w - d, y); c.lineTo(x + w, y + h / 2);
    c.lineTo(x + w - d, y + h); c.lineTo(x + d, y + h); c.lineTo(x, y + h / 2); c.closePath();
  }
  function roundRect(c, x, y, w, h, r) {
    c.moveTo(x + r, y); c.arcTo(x + w, y, x + w, y + h, r); c.arcTo(x + w, y + h, x, y + h, r);
    c.arcTo(x, y + h, x, y, r); c.arcTo(x, y, x + w, y, r); c.closePath();
  }
  function unitShape(c, u, grow, rounded) {
    var x0 = L.x[u] - L.w[u] / 2 - grow, y0 = L.y[u] - grow, w = L.w[u] + 2 * grow, h = L.h[u] + 2 * grow;
    if (!rounded) { c.rect(x0, y0, w, h); return; }
    var kind = L.uBox[u] >= 0 ? "group" : nKind[dNode[L.uRef[u]]];
    if (kind === "collective") { hexagon(c, x0, y0, w, h); return; }
    roundRect(c, x0, y0, w, h, kind === "input" || kind === "output" ? h / 2 : kind === "op" ? 6 : 4);
  }
  var FRAME_FILL = ["rgba(241,245,249,0.85)", "rgba(226,232,240,0.55)", "rgba(203,213,225,0.35)", "rgba(203,213,225,0.3)"];
  function strokeRoute(rt) {
    var p = rt.pts, k = transform.k;
    ctx.moveTo(p[0], p[1]);
    for (var j = 2; j < p.length; j += 2) {
      var ax = p[j - 2], ay = p[j - 1], bx = p[j], by = p[j + 1];
      if (ax === bx || k < 0.15) ctx.lineTo(bx, by);
      else { var hy = (by - ay) * 0.5; ctx.bezierCurveTo(ax, ay + hy, bx, by - hy, bx, by); }
    }
  }
  // edges between two ranks of a merged job: drawn over the layout, which they do not shape, so
  // the ranks' lanes stand side by side
  var crossE = [];
  for (e = 0; e < E; e++) if (D.edges[e][6]) crossE.push(e);
  function strokeCrossRank(k) {
    if (!crossE.length) return;
    var drawn = new Set();
    ctx.beginPath();
    for (var z = 0; z < crossE.length; z++) {
      var ua = unitOfNode(eSrc[crossE[z]]), ub = unitOfNode(eDst[crossE[z]]);
      if (ua < 0 || ub < 0 || ua === ub || drawn.has(ua * L.U + ub)) continue;
      drawn.add(ua * L.U + ub);
      var ax = L.x[ua], ay = L.y[ua] + L.h[ua], bx = L.x[ub], by = L.y[ub], my = (ay + by) / 2;
      ctx.moveTo(ax, ay); ctx.bezierCurveTo(ax, my, bx, my, bx, by);
    }
    ctx.setLineDash([6, 4]); ctx.strokeStyle = "#ea580c"; ctx.lineWidth = 1.4 / Math.max(k, 0.35);
    ctx.stroke(); ctx.setLineDash([]);
  }
  function draw() {
    if (!L) return;
    var k = transform.k, j, u, f;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#f8fafc"; ctx.fillRect(0, 0, cssW, cssH);
    ctx.setTransform(dpr * k, 0, 0, dpr * k, dpr * transform.x, dpr * transform.y);
    var vx0 = -transform.x / k, vy0 = -transform.y / k, vx1 = vx0 + cssW / k, vy1 = vy0 + cssH / k;
    function inView(x0, y0, x1, y1) { return !(x1 < vx0 || x0 > vx1 || y1 < vy0 || y0 > vy1); }
    // frames of open modules, outermost first
    var frames = [];
    for (j = 0; j < L.frames.length; j++) {
      f = L.frames[j];
      if (inView(f.x, f.y, f.x + f.w, f.y + f.h)) frames.push(f);
    }
    for (j = 0; j < frames.length; j++) {
      f = frames[j];
      ctx.beginPath(); roundRect(ctx, f.x, f.y, f.w, f.h, 8);
      ctx.fillStyle = gRootFail[f.g] ? "rgba(254,226,226,0.55)" : FRAME_FILL[Math.min(3, gDepth[f.g])]; ctx.fill();
      ctx.lineWidth = Math.max(1, 1 / k); ctx.strokeStyle = gRootFail[f.g] ? "#f87171" : "#94a3b8"; ctx.stroke();
    }
    // edges, batched by colour
    var sel = selected, selU = sel === -1 ? -1 : L.unitOfKey.get(sel);
    if (selU === undefined) selU = -1;
    var normal = [], failed = [], hot = [];
    for (j = 0; j < L.routes.length; j++) {
      var rt = L.routes[j], b = rt.box;
      if (!inView(b[0], b[1], b[2], b[3])) continue;
      if (rt.a === selU || rt.b === selU) hot.push(rt);
      else if (nStatus[dNode[rt.src]]) failed.push(rt);
      else normal.push(rt);
    }
    function strokeAll(list, colour, width) {
      if (!list.length) return;
      ctx.beginPath();
      for (var z = 0; z < list.length; z++) strokeRoute(list[z]);
      ctx.strokeStyle = colour; ctx.lineWidth = width / Math.max(k, 0.35); ctx.stroke();
      if (k < 0.4) return;
      ctx.beginPath();
      for (z = 0; z < list.length; z++) {
        var p = list[z].pts, ex = p[p.length - 2], ey = p[p.length - 1];
        ctx.moveTo(ex, ey); ctx.lineTo(ex - 3.5, ey - 7); ctx.lineTo(ex + 3.5, ey - 7); ctx.closePath();
      }
      ctx.fillStyle = colour; ctx.fill();
    }
    strokeAll(normal, "#94a3b8", 1);
    strokeAll(failed, "#ef4444", 1.4);
    strokeCrossRank(k);
    strokeAll(hot, "#2563eb", 2.2);
    // units, batched by look
    var visible = [];
    for (u = 0; u < L.U; u++) if (inView(L.x[u] - L.w[u] / 2, L.y[u], L.x[u] + L.w[u] / 2, L.y[u] + L.h[u])) visible.push(u);
    var rounded = k > 0.25;
    var halos = [[], [], []];   // search matches, added, changed
    for (j = 0; j < visible.length; j++) {
      u = visible[j];
      if (L.uMatch[u]) halos[0].push(u);
      if (L.uDiff[u] === 1) halos[1].push(u); else if (L.uDiff[u] === 2) halos[2].push(u);
    }
    function halo(list, colour, grow, width) {
      if (!list.length) return;
      ctx.beginPath(); for (var z = 0; z < list.length; z++) unitShape(ctx, list[z], grow, rounded);
      ctx.strokeStyle = colour; ctx.lineWidth = width; ctx.stroke();
    }
    halo(halos[1], "#22c55e", 4, 4);
    halo(halos[2], "#f59e0b", 4, 4);
    halo(halos[0], "#facc15", 5, 6);
    if (firstNode >= 0 && dOfNode[firstNode] >= 0) {
      var fu = L.unitOfDn[dOfNode[firstNode]];
      if (visible.indexOf(fu) >= 0) halo([fu], FIRST_HALO, 5, 3.5);
    }
    var batches = new Map();
    for (j = 0; j < visible.length; j++) {
      u = visible[j];
      var look = unitLook(u), key = look.join("|"), bt = batches.get(key);
      if (!bt) { bt = { look: look, units: [] }; batches.set(key, bt); }
      bt.units.push(u);
    }
    batches.forEach(function (bt) {
      var lk = bt.look, list = bt.units;
      ctx.beginPath(); for (var z = 0; z < list.length; z++) unitShape(ctx, list[z], 0, rounded);
      ctx.fillStyle = lk[0]; ctx.fill();
      ctx.setLineDash(lk[3] ? [4, 3] : []);
      ctx.lineWidth = lk[2]; ctx.strokeStyle = lk[1]; ctx.stroke();
      ctx.setLineDash([]);
    });
    // closed modules: a second border, a box that holds more
    ctx.beginPath();
    for (j = 0; j < visible.length; j++) if (L.uBox[visible[j]] >= 0) unitShape(ctx, visible[j], -3, rounded);
    ctx.lineWidth = 0.8; ctx.strokeStyle = "#64748b"; ctx.stroke();
    if (selU >= 0 && visible.indexOf(selU) >= 0) halo([selU], "#2563eb", 3, 3);
    // labels: at least 9 screen pixels, or none; box labels and frame titles at the same zooms
    var placed = [], labelled = k * 12 >= 7;
    if (labelled) {
      ctx.textAlign = "center"; ctx.textBaseline = "middle";
      for (j = 0; j < visible.length; j++) drawUnitLabel(visible[j], k, placed);
      ctx.textAlign = "start"; ctx.textBaseline = "alphabetic";
    }
    // frame titles, over the edges that enter the frame, grown as box labels grow
    if (labelled) {
      var ts = Math.max(1, 9 / (12 * k));
      for (j = 0; j < frames.length; j++) {
        f = frames[j];
        var tt = clip(frameTitle(f.g), (f.w - 16) / ts, BOLD), tw = textWidth(tt, BOLD) * ts;
        ctx.fillStyle = gRootFail[f.g] ? "#fef2f2" : "#f8fafc";
        ctx.fillRect(f.x + 6, f.y + 4, tw + 8, 17 * ts);
        ctx.font = BOLD.replace("12px", (12 * ts).toFixed(1) + "px");
        ctx.fillStyle = gRootFail[f.g] ? "#991b1b" : "#334155";
        ctx.fillText(tt, f.x + 10, f.y + 4 + 13 * ts);
        placed.push([f.x + 6, f.y + 4, f.x + 14 + tw, f.y + 4 + 17 * ts, "title", gPath[f.g]]);
      }
    }
    // dtype[shape] once for each array leaving a unit, where it does not cover anything
    if (k >= 0.7) drawEdgeLabels(visible, placed, hot, vx0, vy0, vx1, vy1);
    lastPlaced = placed;
    drawMinimap();
  }
  var lastPlaced = [];   // what the last frame wrote where: box labels, frame titles, edge labels
  function drawUnitLabel(u, k, placed) {
    var x0 = L.x[u] - L.w[u] / 2, w = L.w[u], h = L.h[u], y0 = L.y[u];
    placed.push([x0, y0, x0 + w, y0 + h, "box"]);
    var st = unitStyle(u), tx = unitText(u), box = L.uBox[u] >= 0;
    var scale = Math.max(1, 9 / (12 * k));   // text grows in the world as the view shrinks
    var room = w - 12;
    var dark = colouring.stat && isDark(unitLook(u)[0]);
    ctx.fillStyle = dark ? "#ffffff" : st === "failed" ? "#7f1d1d" : st === "upstream" ? "#991b1b" : st === "kernel" ? "#3b0764" : "#0f172a";
    var big = (box || st === "kernel" ? BOLD : FONT), size = 12 * scale;
    var two = tx[1] && 12 * scale + 10 * scale + 4 <= h;
    ctx.font = big.replace("12px", size.toFixed(1) + "px");
    var line1 = clip(tx[0], room / scale, big);
    if (!line1) return;
    ctx.fillText(line1, L.x[u], two ? y0 + h / 2 - 7 * scale : y0 + h / 2 + 1);
    if (two) {
      ctx.font = SMALL.replace("10px", (10 * scale).toFixed(1) + "px");
      ctx.fillStyle = dark ? "#e2e8f0" : st === "failed" ? "#991b1b" : colouring.stat ? "#1e293b" : "#475569";
      ctx.fillText(clip(tx[1], room / scale, SMALL), L.x[u], y0 + h / 2 + 8 * scale);
    }
  }
  function drawEdgeLabels(visible, placed, hot, vx0, vy0, vx1, vy1) {
    ctx.font = MONO;
    var done = new Set(), hotSet = new Set(hot);
    var list = L.routes.slice().sort(function (p, q) { return (hotSet.has(q) ? 1 : 0) - (hotSet.has(p) ? 1 : 0); });
    var shown = 0;
    for (var j = 0; j < list.length && shown < 500; j++) {
      var rt = list[j], ed = D.edges[rt.edge], key = rt.a + ":" + ed[2];
      if (done.has(key)) continue;
      var p = rt.pts;
      if (p[0] < vx0 || p[0] > vx1 || p[1] < vy0 || p[1] > vy1) continue;
      done.add(key);
      var text = ed[4] + "[" + ed[3] + "]", tw = textWidth(text, MONO) + 4;
      var lx = p[0] + 5, ly = p[1] + 4;
      var box = [lx - 2, ly, lx + tw, ly + 12, "edge"], clash = false;
      for (var z = 0; z < placed.length && !clash; z++) {
        var q = placed[z];
        clash = box[0] < q[2] && q[0] < box[2] && box[1] < q[3] && q[1] < box[3];
      }
      if (clash) continue;
      placed.push(box);
      ctx.fillStyle = "rgba(248,250,252,0.9)"; ctx.fillRect(box[0], box[1], tw + 2, 12);
      ctx.fillStyle = hotSet.has(rt) ? "#1d4ed8" : "#64748b"; ctx.fillText(text, lx, ly + 9);
      shown++;
    }
  }

  // ------------------------------------------------------------------ minimap
  var mini = document.getElementById("gk-minimap"), mctx = mini.getContext("2d");
  // a long graph keeps a usable width: x and y are scaled apart, x by at most 6 times y
  var miniImg = null, MW = 160, MH = 220, msx = 1, msy = 1;
  function buildMinimap() {
    var b = L.bounds, gw = b[2] - b[0], gh = b[3] - b[1];
    msy = Math.min(MH / gh, MW / gw); msx = Math.min(MW / gw, 6 * msy);
    var w = Math.max(24, Math.ceil(gw * msx)), h = Math.max(24, Math.ceil(gh * msy));
    mini.style.width = w + "px"; mini.style.height = h + "px";
    mini.width = Math.round(w * dpr); mini.height = Math.round(h * dpr);
    miniImg = document.createElement("canvas");
    miniImg.width = mini.width; miniImg.height = mini.height;
    var c = miniImg.getContext("2d");
    c.setTransform(dpr * msx, 0, 0, dpr * msy, -b[0] * dpr * msx, -b[1] * dpr * msy);
    L.frames.forEach(function (f) {
      c.fillStyle = gRootFail[f.g] ? "rgba(254,202,202,0.6)" : "rgba(148,163,184,0.18)";
      c.fillRect(f.x, f.y, f.w, f.h);
    });
    for (var u = 0; u < L.U; u++) {
      var st = unitStyle(u), lk = colouring.stat ? unitLook(u)[0] : null;
      if (lk) c.fillStyle = luminance(lk) > 225 ? "#cbd5e1" : lk;   // pale fills vanish on the white
      else c.fillStyle = st === "failed" ? "#dc2626" : st === "upstream" ? "#fca5a5" : st === "kernel" ? "#7c3aed" : st === "group" ? "#64748b" : "#94a3b8";
      c.fillRect(L.x[u] - L.w[u] / 2, L.y[u], Math.max(L.w[u], 1 / msx), Math.max(L.h[u], 1 / msy));
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
    var vw = Math.max(3, cssW / k * msx), vh = Math.max(3, cssH / k * msy);
    mctx.fillStyle = "rgba(37,99,235,0.08)"; mctx.strokeStyle = "#2563eb"; mctx.lineWidth = 1.5;
    mctx.fillRect(x0, y0, vw, vh); mctx.strokeRect(x0, y0, vw, vh);
  }
  function miniNavigate(ev) {
    var rc = mini.getBoundingClientRect(), b = L.bounds;
    centerOn((ev.clientX - rc.left) / msx + b[0], (ev.clientY - rc.top) / msy + b[1], transform.k, 0);
  }
  var miniDrag = false;
  mini.addEventListener("mousedown", function (ev) { miniDrag = true; miniNavigate(ev); ev.preventDefault(); });
  window.addEventListener("mousemove", function (ev) { if (miniDrag) miniNavigate(ev); });
  window.addEventListener("mouseup", function () { miniDrag = false; });

  // ------------------------------------------------------------------ zoom
  var zoom = d3.zoom().scaleExtent([0.005, 4]).clickDistance(4)
    .filter(function (ev) { return (!ev.ctrlKey || ev.type === "wheel") && !ev.button && ev.type !== "dblclick"; })
    .on("zoom", function (ev) { transform = ev.transform; requestDraw(); hideTip(); });
  var zsel = d3.select(canvas).call(zoom);
  function setTransform(t, ms) {
    if (ms) zsel.transition().duration(ms).call(zoom.transform, t); else zsel.call(zoom.transform, t);
  }
  function centerOn(wx, wy, k, ms) {
    setTransform(d3.zoomIdentity.translate(cssW / 2 - wx * k, cssH / 2 - wy * k).scale(k), ms);
  }
  var READABLE = 0.55;   // below this zoom a box's text is too small to read
  // The first view: the whole graph when it is readable so; otherwise its full width (or as much
  // as is readable) from the top, the minimap showing the rest
  function firstView(ms) {
    var b = L.bounds, gw = b[2] - b[0] + 48, gh = b[3] - b[1] + 48;
    var k = Math.min(cssW / gw, cssH / gh, 1.25);
    if (k >= READABLE) { centerOn((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, k, ms); return; }
    k = Math.max(READABLE, Math.min(1, cssW / gw));
    var cx = cssW / k >= gw ? (b[0] + b[2]) / 2 : b[0] - 24 + cssW / 2 / k;
    setTransform(d3.zoomIdentity.translate(cssW / 2 - cx * k, 24 - b[1] * k).scale(k), ms);
  }
  // Fit (the button, "f"): the whole graph on screen, however small that makes it
  function fitAll(ms) {
    var b = L.bounds, k = Math.min(cssW / (b[2] - b[0] + 40), cssH / (b[3] - b[1] + 40), 1.25);
    centerOn((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, k, ms || 0);
  }

  // ------------------------------------------------------------------ hit testing
  function toWorld(cx, cy) { return [(cx - transform.x) / transform.k, (cy - transform.y) / transform.k]; }
  function unitAt(wx, wy) {
    for (var u = L.U - 1; u >= 0; u--) {
      if (Math.abs(L.x[u] - wx) <= L.w[u] / 2 + 2 && wy >= L.y[u] - 2 && wy <= L.y[u] + L.h[u] + 2) return u;
    }
    return -1;
  }
  function frameTitleAt(wx, wy) {
    var best = -1;
    for (var j = 0; j < L.frames.length; j++) {
      var f = L.frames[j];
      if (wx >= f.x && wx <= f.x + f.w && wy >= f.y && wy <= f.y + TITLE_H) best = f.g;   // the innermost wins: frames come outermost first
    }
    return best;
  }
  function eventPoint(ev) { var rc = canvas.getBoundingClientRect(); return toWorld(ev.clientX - rc.left, ev.clientY - rc.top); }
  function unitKey(u) { return L.uBox[u] >= 0 ? groupKey(L.uBox[u]) : dNode[L.uRef[u]]; }
  canvas.addEventListener("click", function (ev) {
    var p = eventPoint(ev), u = unitAt(p[0], p[1]);
    if (u >= 0) { select(unitKey(u)); return; }
    var g = frameTitleAt(p[0], p[1]);
    if (g >= 0) { setCollapsed(g, true); select(groupKey(g)); return; }
    select(-1);
  });
  canvas.addEventListener("dblclick", function (ev) {
    var p = eventPoint(ev), u = unitAt(p[0], p[1]);
    if (u < 0) return;
    if (L.uBox[u] >= 0) { var g = L.uBox[u]; setCollapsed(g, false); select(groupKey(g)); }
    else { var n = dNode[L.uRef[u]]; if (nGroup[n] >= 0) { g = nGroup[n]; setCollapsed(g, true); select(groupKey(g)); } }
  });
  var tip = document.getElementById("gk-tip");
  function hideTip() { tip.style.display = "none"; }
  canvas.addEventListener("mousemove", function (ev) {
    if (ev.buttons) return;
    var p = eventPoint(ev), u = unitAt(p[0], p[1]), g = u < 0 ? frameTitleAt(p[0], p[1]) : -1;
    canvas.classList.toggle("pointer", u >= 0 || g >= 0);
    if (u < 0 && g < 0) { hideTip(); return; }
    var text;
    if (u >= 0 && L.uBox[u] < 0) {
      var n = dNode[L.uRef[u]];
      text = nId[n] + (nOp[n] && nOp[n] !== nLabel[n] ? "  (" + nOp[n] + ")" : "") + "\n" + nKind[n] + (scopeOf(n) ? " in " + scopeOf(n) : "");
      var outs = outE[n];
      if (outs.length) { var ed = D.edges[outs[0]]; text += " \u2192 " + ed[4] + "[" + ed[3] + "]"; }
      if (nAttrs[n].length && !showWeights) text += "\n" + nAttrs[n].map(weightFull).join("\n");
      if (nStatus[n]) text += "\n" + statusName(nStatus[n]) + (nRoot[n] >= 0 && nRoot[n] !== n ? " (root cause " + nId[nRoot[n]] + ")" : "");
      var vl = valuesLine(n);
      if (vl) text += "\n" + vl;
    } else if (u >= 0) { var cg = L.uBox[u]; text = gPath[cg] + (gClass[cg] ? " (" + gClass[cg] + ")" : "") + "\n" + boxCaption(cg) + "\ndouble-click to open"; }
    else text = gPath[g] + "\nclick to close";
    tip.textContent = text;
    var rc = wrap.getBoundingClientRect();
    tip.style.left = Math.min(ev.clientX - rc.left + 14, rc.width - 240) + "px";
    tip.style.top = (ev.clientY - rc.top + 14) + "px";
    tip.style.display = "block";
  });
  canvas.addEventListener("mouseleave", hideTip);

  // ------------------------------------------------------------------ open / close in place
  // The anchor keeps still on screen across a relayout: the module opened or closed, else the
  // selection; everything else moves around it.
  function anchorPoint(key) {
    if (key === -1 || !L) return null;
    var u = L.unitOfKey.get(key);
    if (u !== undefined) return [L.x[u], L.y[u]];
    if (key < 0) { var f = L.frameOf.get(keyGroup(key)); if (f) return [f.x + f.w / 2, f.y]; }
    if (key >= 0 && dOfNode && dOfNode[key] >= 0) { u = L.unitOfDn[dOfNode[key]]; return [L.x[u], L.y[u]]; }
    return null;
  }
  function relayout(anchorKey) {
    var key = anchorKey !== undefined ? anchorKey : selected;
    var before = anchorPoint(key);
    layout();
    if (treeBuilt) renderTree();
    if (selected !== -1 && !L.unitOfKey.has(selected)) selectContaining(selected);
    var after = anchorPoint(key);
    if (before && after) {
      var k = transform.k;
      setTransform(d3.zoomIdentity.translate(transform.x + (before[0] - after[0]) * k, transform.y + (before[1] - after[1]) * k).scale(k), 0);
      var u = L.unitOfKey.get(key);   // a box that lands off screen is brought into view
      if (u !== undefined) {
        var sx = L.x[u] * k + transform.x, sy0 = L.y[u] * k + transform.y, sy1 = sy0 + L.h[u] * k;
        if (sx < 0 || sx > cssW || sy1 < 0 || sy0 > cssH) centerOn(L.x[u], L.y[u] + L.h[u] / 2, k, 0);
      }
    }
    requestDraw();
  }
  // a selection that is no longer drawn moves to the closed module that now holds it
  function selectContaining(key) {
    if (key >= 0) {
      var u = dOfNode[key] >= 0 ? L.unitOfDn[dOfNode[key]] : -1;
      if (u >= 0 && L.uBox[u] >= 0) { select(groupKey(L.uBox[u])); return; }
      if (u >= 0) { select(dNode[L.uRef[u]]); return; }
    } else {
      var g = keyGroup(key), chain = gChain[g];
      for (var q = 0; q < chain.length; q++) if (collapsed[chain[q]]) { select(groupKey(chain[q])); return; }
      if (L.frameOf.has(g)) { select(key); return; }
    }
    select(-1);
  }
  function setCollapsed(g, on) {
    if (!!collapsed[g] === on) return;
    collapsed[g] = on ? 1 : 0;
    relayout(groupKey(g));
  }
  function setDepth(depth) {
    applyDepth(depth);
    depthSel.value = String(depth);
    relayout(-1);
    if (selected !== -1 && !L.unitOfKey.has(selected) && !(selected < 0 && L.frameOf.has(keyGroup(selected)))) selectContaining(selected);
    firstView(0);
  }
  function applyDepth(depth) {
    if (depth === "auto") { autoCollapse(); return; }
    for (var g2 = 0; g2 < G; g2++) collapsed[g2] = depth >= 0 && gDepth[g2] >= depth ? 1 : 0;
  }
  // Open at first: the module hierarchy down to the repeated blocks (model.layers.0, .1, ...),
  // each block one box; small modules stay open. Without repeated blocks, as deep as keeps the
  // picture to a few hundred boxes.
  var REPEAT = /\.\d+$/;
  function autoDepth() {
    var best = Infinity;
    for (var g2 = 0; g2 < G; g2++) {
      if (!REPEAT.test(gLabel[g2])) continue;
      var sib = gParent[g2] >= 0 ? gChildren[gParent[g2]] : topGroups, count = 0;
      for (var q = 0; q < sib.length; q++) if (REPEAT.test(gLabel[sib[q]])) count++;
      if (count >= 2 && gDepth[g2] < best) best = gDepth[g2];
    }
    if (best !== Infinity) return best;
    var drawn = 0;
    for (var n = 0; n < N; n++) if (!nWeight[n]) drawn++;
    if (drawn <= 400) return -1;
    for (var d = 0; d < 12; d++) {
      var units = 0, seen = new Set();
      for (n = 0; n < N; n++) {
        if (nWeight[n]) continue;
        var gg = nGroup[n];
        if (gg >= 0 && gDepth[gg] >= d) { var top = gChain[gg][d]; if (!seen.has(top)) { seen.add(top); units++; } }
        else units++;
      }
      if (units > 300) return Math.max(0, d - 1);
    }
    return -1;
  }
  function autoCollapse() {
    var depth = autoDepth();
    for (var g2 = 0; g2 < G; g2++) collapsed[g2] = depth >= 0 && gDepth[g2] >= depth && gOps[g2] + gKernels[g2] > 4 ? 1 : 0;
  }
  function reveal(n) {
    var changed = false;
    if (nWeight[n] && !showWeights) return;
    if (nGroup[n] >= 0) gChain[nGroup[n]].forEach(function (g2) { if (collapsed[g2]) { collapsed[g2] = 0; changed = true; } });
    if (changed) relayout(-1);
  }

  // ------------------------------------------------------------------ selection and panel
  var panel = document.getElementById("gk-panel");
  function esc(s) { return String(s == null ? "" : s).replace(/[&<>"']/g, function (ch) { return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[ch]; }); }
  function link(n) { return '<a data-node="' + n + '" class="gk-mono">' + esc(nId[n]) + "</a>"; }
  function groupLink(g2) { return '<a data-group="' + g2 + '" class="gk-mono">' + esc(gPath[g2]) + "</a>"; }
  function row(k, v) { return "<tr><td>" + esc(k) + "</td><td>" + v + "</td></tr>"; }
  function mono(s) { return '<span class="gk-mono">' + esc(s) + "</span>"; }
  function select(key) {
    selected = key;
    if (key === -1) { panel.classList.remove("open"); requestDraw(); resize(); return; }
    panel.innerHTML = key >= 0 ? nodePanel(key) : groupPanel(keyGroup(key));
    panel.classList.add("open");
    panel.scrollTop = 0;
    resize();
    requestDraw();
  }
  function badges(n) {
    var b = '<span class="gk-badge ' + (nKind[n] === "kernel" ? "kernel" : "") + '">' + esc(nWeight[n] ? (nKind[n] === "op" ? "op on weights" : nKind[n] === "input" ? "weight" : "constant") : nKind[n]) + "</span>";
    if (nStatus[n] === UPSTREAM) b += '<span class="gk-badge upstream">UPSTREAM_FAILED</span>';
    else if (nStatus[n]) b += '<span class="gk-badge failed">' + esc(statusName(nStatus[n])) + "</span>";
    else b += '<span class="gk-badge ok">OK</span>';
    var st = nStats ? nStats[n] : null;
    if (st && st[4]) b += '<span class="gk-badge nonfinite">NaN</span>';
    if (st && st[5]) b += '<span class="gk-badge nonfinite">Inf</span>';
    if (diffMark[n] === 1) b += '<span class="gk-badge added">added</span>';
    if (diffMark[n] === 2) b += '<span class="gk-badge changed">changed</span>';
    return b;
  }
  // where an input comes from, in the user's terms: the parameter or constant it is, or the
  // node that made it
  function producerText(s, n) {
    if (nWeight[s] && !showWeights) return '<span class="gk-mono" title="' + esc(nId[s]) + '">' + esc(weightFull(s)) + "</span>";
    return link(s) + (nOp[s] && nKind[s] !== "kernel" ? ' <span class="gk-dim">' + esc(nOp[s]) + "</span>" : nKind[s] === "input" ? ' <span class="gk-dim">input</span>' : "");
  }
  function nodePanel(n) {
    var d = det(n), h = "";
    h += '<header><h2 class="gk-mono" data-testid="panel-title">' + esc(nId[n]) + '</h2><button class="gk-close" title="Close (Esc)">\u00D7</button></header>';
    h += "<section>" + badges(n) + "</section><section><table>";
    if (nOp[n]) h += row(nKind[n] === "kernel" ? "kernel" : "op", mono(nOp[n]));
    else if (nLabel[n] !== nId[n]) h += row("name", mono(nLabel[n]));
    h += row("module", nGroup[n] >= 0 ? groupLink(nGroup[n]) + (gClass[nGroup[n]] ? ' <span class="gk-dim">' + esc(gClass[nGroup[n]]) + "</span>" : "") : "<i>top level</i>");
    h += row("status", esc(statusName(nStatus[n])) + " (" + nStatus[n] + ")");
    if (nStatus[n] && nRoot[n] >= 0 && nRoot[n] !== n) h += row("root cause", link(nRoot[n]) + " \u2014 " + esc(statusName(nStatus[nRoot[n]])) + (nGroup[nRoot[n]] >= 0 ? " in " + groupLink(nGroup[nRoot[n]]) : ""));
    if (d.weight) h += row("is", mono(d.weight[0]));
    if (d.value) h += row("value", mono(d.value));
    if (d.arguments) h += row("arguments", mono(d.arguments));
    if (nKind[n] === "collective") {   // what it does across the ranks
      h += row("group", esc((d.reduce ? d.reduce + " over " : "over ") + d.group_size + " ranks (rank " + d.rank + ")"));
      if (d.peer != null) h += row(nOp[n] === "send" ? "to rank" : "from rank", esc(d.peer));
    }
    if (d.on_rank != null) h += row("on rank", esc(d.on_rank));
    h += "</table>";
    if (d.message) h += '<pre class="msg" data-testid="panel-message">' + esc(d.message) + "</pre>";
    h += "</section>";
    h += valuesSection(n, d) + compareSection(n) + referenceSection(d);
    if (nStatus[n] && nStatus[n] !== UPSTREAM) {
      var count = downstreamOf(n);
      h += "<section><h3>Blast radius</h3>" + count + " node" + (count === 1 ? "" : "s") + " downstream marked UPSTREAM_FAILED</section>";
    }
    if (nKind[n] === "kernel") h += kernelSection(n, d);
    if (inE[n].length) {
      h += '<section><h3>Inputs</h3><table data-testid="panel-inputs">';
      inE[n].forEach(function (e2) {
        var ed = D.edges[e2], name = ed[7] || inputName(n, ed[5]);
        if (!name && det(n).input_names) name = "also reads";   // a node the kernel's body shares
        h += row((name || "#" + ed[5]), producerText(ed[0], n) + ' <span class="gk-mono gk-dim">' + esc(ed[4]) + "[" + esc(ed[3]) + "]</span>");
      });
      h += "</table></section>";
    }
    if (outE[n].length) {
      h += "<section><h3>Outputs</h3><table>";
      var byArray = new Map();
      outE[n].forEach(function (e2) { var ed = D.edges[e2]; if (!byArray.has(ed[2])) byArray.set(ed[2], [ed, []]); byArray.get(ed[2])[1].push(ed[1]); });
      var idx = 0;
      byArray.forEach(function (v) {
        h += row("#" + idx++, '<span class="gk-mono">' + esc(v[0][4]) + "[" + esc(v[0][3]) + "]</span> \u2192 " + v[1].slice(0, 8).map(link).join(", ") + (v[1].length > 8 ? " \u2026" : ""));
      });
      h += "</table></section>";
    }
    if (diff && diff.changed[n]) {
      h += "<section><h3>Changed</h3><table>";
      diff.changed[n].forEach(function (c2) { h += row(c2[0], mono(c2[1] + " \u2192 " + c2[2])); });
      h += "</table></section>";
    }
    return h;
  }
  // gk.inspect's statistics of the node's output (each output's too, where it has several)
  function statsRows(st, size) {
    var h = row("min", mono(fmt(st[0]))) + row("max", mono(fmt(st[1]))) + row("mean", mono(fmt(st[2]))) + row("abs-max", mono(fmt(st[3])));
    [["NaN", st[4]], ["Inf", st[5]]].forEach(function (p) {
      var bad = p[1] > 0, share = bad && size ? " (" + fmt(100 * p[1] / size) + "% of " + count(size) + ")" : "";
      h += row(p[0], '<span class="gk-mono' + (bad ? ' gk-nonfinite' : "") + '">' + count(p[1]) + share + "</span>");
    });
    return h;
  }
  function valuesSection(n, d) {
    var st = nStats ? nStats[n] : null;
    if (!st && !d.values_note) return "";
    var h = '<section data-testid="panel-values"><h3>Values</h3>';
    if (st) {
      if (st[0] === null && st[4] + st[5]) h += '<p class="gk-dim">no finite value: min, max, mean and abs-max count finite values only</p>';
      h += "<table>" + statsRows(st, elements(n)) + "</table>";
    }
    if (d.output_stats) {
      d.output_stats.forEach(function (s2, k) {
        if (s2) h += '<h3>output #' + k + "</h3><table>" + statsRows(s2, 0) + "</table>";
      });
    }
    if (d.module_outputs) h += '<p class="gk-dim">output of ' + d.module_outputs.map(esc).join(", ") + "</p>";
    if (d.values_note) h += '<p class="gk-dim">' + esc(d.values_note) + "</p>";
    return h + "</section>";
  }
  function verdictBadge(r, j) {
    if (j === cmp.first) return '<span class="gk-badge failed">first divergence</span>';
    if (r[12] === false) return '<span class="gk-badge bad">beyond tolerance</span>';
    if (r[12] === true) return '<span class="gk-badge ok">within tolerance</span>';
    return '<span class="gk-badge">' + esc(r[13] || "not compared") + "</span>";
  }
  function tolerance() {
    return cmp.rtol !== null && cmp.rtol !== undefined ? "|a \u2212 b| \u2264 " + fmt(cmp.atol) + " + " + fmt(cmp.rtol) + " \u00B7 |a|" : "";
  }
  // gk.compare's rows for this node: its error against the reference graph's node
  function compareSection(n) {
    if (!nRows || !nRows[n]) return "";
    var h = '<section data-testid="panel-compare"><h3>Compared</h3>';
    nRows[n].forEach(function (j) {
      var r = cmp.rows[j], size = r[6] ? r[6].reduce(function (p, x) { return p * x; }, 1) : 0;
      h += "<p>" + verdictBadge(r, j) + "</p><table>";
      h += row("against", mono(r[2] + (r[3] ? " #" + r[3] : "")) + ' <span class="gk-dim">in the reference</span>');
      if (r[1]) h += row("output", "#" + r[1]);
      if (r[4]) h += row("op", mono(r[4].replace(" -> ", " \u2192 ")));
      if (r[6]) h += row("shape", mono(r[7] === r[8] ? r[7] + "[" + r[6].join(",") + "]" : r[7] + " / " + r[8] + " [" + r[6].join(",") + "]"));
      h += row("max abs", mono(fmt(r[9]))) + row("max rel", mono(fmt(r[10])));
      if (r[11] !== null && r[11] !== undefined) h += row("beyond", mono(count(r[11]) + (size ? " of " + count(size) : "")));
      if (tolerance()) h += row("tolerance", mono(tolerance()));
      h += "</table>";
    });
    return h + "</section>";
  }
  // a kernel checked in place: its output against its reference on the inputs it received
  function referenceSection(d) {
    var c = d.reference_check;
    if (!c) return "";
    var h = '<section data-testid="panel-refcheck"><h3>Against its reference, in place</h3><table>';
    if (c.error) h += row("error", mono(c.error));
    else {
      var bad = c.mismatched > 0;
      h += row("verdict", '<span class="gk-badge ' + (bad ? "bad" : "ok") + '">' + (bad ? "beyond tolerance" : "within tolerance") + "</span>");
      h += row("max abs", mono(fmt(c.max_abs))) + row("max rel", mono(fmt(c.max_rel)));
      if (c.mismatched !== undefined) h += row("beyond", mono(count(c.mismatched)));
      if (c.rtol !== undefined) h += row("tolerance", mono("rtol " + fmt(c.rtol) + ", atol " + fmt(c.atol)));
    }
    return h + "</table></section>";
  }
  // one line of a node's values, for the tooltip
  function valuesLine(n) {
    var bits = [], st = nStats ? nStats[n] : null;
    if (st) {
      if (st[0] !== null) bits.push("[" + fmt(st[0]) + ", " + fmt(st[1]) + "] abs-max " + fmt(st[3]));
      if (st[4]) bits.push("NaN " + count(st[4]));
      if (st[5]) bits.push("Inf " + count(st[5]));
    }
    if (eVerdict && eVerdict[n] >= 2) bits.push("error abs " + fmt(eAbs[n]) + ", rel " + fmt(eRel[n]) + (eVerdict[n] === 3 ? " (beyond tolerance)" : ""));
    return bits.join(" \u00B7 ");
  }
  function kernelSection(n, d) {
    var h = "<section><h3>Launch</h3><table>";
    ["backend", "grid", "threadgroup", "template", "source_hash", "generated_name"].forEach(function (f) {
      if (d[f] !== undefined && d[f] !== null && d[f] !== "") h += row(f, mono(d[f]));
    });
    h += "</table></section>";
    var table = sources[d.source_hash] || {}, backends = Object.keys(table);
    if (!backends.length && d.source) { table = {}; table[d.backend || "source"] = d.source; backends = Object.keys(table); }
    if (backends.length) {
      var active = backends.indexOf(d.backend) >= 0 ? d.backend : backends[0];
      h += '<section><h3>Source</h3><div class="gk-tabs">';
      backends.forEach(function (b) { h += '<button class="gk-tab' + (b === active ? " on" : "") + '" data-source="' + esc(b) + '">' + esc(b === "reference" ? "reference (Python)" : b) + (b === d.backend ? " \u2713" : "") + "</button>"; });
      h += "</div>";
      backends.forEach(function (b) { h += '<pre data-testid="panel-source" data-backend="' + esc(b) + '"' + (b === active ? "" : ' hidden') + ">" + esc(table[b]) + "</pre>"; });
      h += "</section>";
    }
    return h;
  }
  function groupPanel(g) {
    var h = '<header><h2 class="gk-mono" data-testid="panel-title">' + esc(gPath[g]) + '</h2><button class="gk-close">\u00D7</button></header>';
    h += '<section><span class="gk-badge">module</span>' + (gClass[g] ? '<span class="gk-badge">' + esc(gClass[g]) + "</span>" : "") + (gRootFail[g] ? '<span class="gk-badge failed">contains a failure</span>' : gFailed[g] ? '<span class="gk-badge upstream">upstream failed</span>' : "") + "</section>";
    h += "<section><table>" + row("ops", gOps[g]) + row("kernels", gKernels[g]) + row("failed", gFailed[g]);
    if (gParent[g] >= 0) h += row("in", groupLink(gParent[g]));
    h += "</table>";
    h += '<p><button class="gk-btn" data-expand="' + g + '">' + (collapsed[g] ? "Open" : "Close") + "</button></p></section>";
    var kernels = new Map(), firstFail = -1;
    for (var n = 0; n < N; n++) {
      if (nGroup[n] < 0 || gChain[nGroup[n]].indexOf(g) < 0) continue;
      if (nKind[n] === "kernel") kernels.set(nOp[n], (kernels.get(nOp[n]) || 0) + 1);
      if (firstFail < 0 && nStatus[n] && nStatus[n] !== UPSTREAM) firstFail = n;
    }
    if (firstFail >= 0) h += "<section><h3>Failure</h3>" + link(firstFail) + " \u2014 " + esc(statusName(nStatus[firstFail])) + "</section>";
    if (colouring.stat) {
      var m = colouring.measure(), w = m.gWorst[g];
      if (w >= 0) h += '<section data-testid="panel-worst"><h3>Worst inside, by ' + esc(colouring.label) + "</h3>" + link(w) + " " + esc(valuesLine(w)) + "</section>";
    }
    if (kernels.size) {
      h += "<section><h3>Kernels</h3><table>";
      kernels.forEach(function (cnt, name) { h += row(name, "\u00D7" + cnt); });
      h += "</table></section>";
    }
    if (gChildren[g].length) {
      h += "<section><h3>Modules</h3><table>";
      gChildren[g].slice(0, 40).forEach(function (c2) { h += row(gLabel[c2], groupLink(c2) + ' <span class="gk-dim">' + esc(gClass[c2]) + "</span>"); });
      h += "</table></section>";
    }
    return h;
  }
  panel.addEventListener("click", function (ev) {
    var t = ev.target;
    if (t.classList.contains("gk-close")) { select(-1); return; }
    if (t.dataset.node !== undefined) { focusNode(+t.dataset.node); return; }
    if (t.dataset.group !== undefined) { focusGroup(+t.dataset.group); return; }
    if (t.dataset.source !== undefined) {
      panel.querySelectorAll(".gk-tab").forEach(function (b) { b.classList.toggle("on", b === t); });
      panel.querySelectorAll("pre[data-backend]").forEach(function (p) { p.hidden = p.dataset.backend !== t.dataset.source; });
      return;
    }
    if (t.dataset.expand !== undefined) { var g = +t.dataset.expand; setCollapsed(g, !collapsed[g]); select(groupKey(g)); }
  });
  function focusNode(n, ms) {
    reveal(n);
    select(n);   // first, so the view is centred in the canvas that the open panel leaves
    var p = anchorPoint(n);
    if (p) { var u = L.unitOfKey.get(n); centerOn(p[0], p[1] + (u !== undefined ? L.h[u] / 2 : 0), Math.max(transform.k, 0.9), ms === undefined ? 350 : ms); }
  }
  function focusGroup(g) {
    var changed = false;
    gChain[g].slice(0, -1).forEach(function (a) { if (collapsed[a]) { collapsed[a] = 0; changed = true; } });
    if (changed) relayout(-1);
    select(groupKey(g));
    var u = L.unitOfKey.get(groupKey(g));
    if (u !== undefined) { centerOn(L.x[u], L.y[u] + L.h[u] / 2, Math.max(transform.k, 0.9), 300); return; }
    var f = L.frameOf.get(g);
    if (f) {
      var k = Math.max(Math.min(cssW / (f.w + 40), cssH / (f.h + 40), 1.2), READABLE);
      centerOn(f.x + f.w / 2, Math.min(f.y + f.h / 2, f.y - 20 + cssH / 2 / k), k, 300);
    }
  }

  // ------------------------------------------------------------------ search
  var search = document.getElementById("gk-search"), results = document.getElementById("gk-results");
  var countEl = document.getElementById("gk-search-count");
  var hay = new Array(N);
  for (i = 0; i < N; i++) {
    var dd = det(i);
    hay[i] = (nId[i] + "\u0001" + nLabel[i] + "\u0001" + nOp[i] + "\u0001" + scopeOf(i) + "\u0001" + (dd.kernel || "") + "\u0001" + (dd.weight ? dd.weight[0] : "")).toLowerCase();
  }
  var lastQuery = null;
  function runSearch(q) {
    q = q.trim().toLowerCase();
    lastQuery = q;
    matches = new Uint8Array(N); matchList = []; matchCursor = -1;
    if (q) {
      var exact = [], n;
      for (n = 0; n < N; n++) if (hay[n].indexOf(q) >= 0) { matches[n] = 1; (nId[n].toLowerCase() === q ? exact : matchList).push(n); }
      matchList = exact.concat(matchList);
    }
    refreshMatches();
    countEl.textContent = q ? matchList.length + " found" : "";
    var html = "";
    for (var j = 0; j < Math.min(matchList.length, 60); j++) {
      n = matchList[j];
      html += '<div class="gk-result" data-node="' + n + '"><b class="gk-mono">' + esc(nId[n]) + "</b><span>" + esc(nOp[n] || nKind[n]) + (scopeOf(n) ? " \u00B7 " + esc(scopeOf(n)) : "") + "</span></div>";
    }
    if (matchList.length > 60) html += '<div class="gk-result"><span>\u2026 ' + (matchList.length - 60) + " more (Enter steps through them)</span></div>";
    if (q && !matchList.length) html = '<div class="gk-result"><span>no node matches</span></div>';
    results.innerHTML = html;
    results.classList.toggle("open", !!q);
    requestDraw();
    return matchList.map(function (n2) { return nId[n2]; });
  }
  // a match hidden as a weight lights up the node that reads it; one in a closed module, the box
  function refreshMatches() {
    if (!L) return;
    L.uMatch = new Uint8Array(L.U);
    for (var q = 0; q < matchList.length; q++) {
      var n = matchList[q], k = dOfNode[n];
      if (k >= 0) { L.uMatch[L.unitOfDn[k]] = 1; continue; }
      for (var z = 0; z < outE[n].length; z++) { var t = eDst[outE[n][z]]; if (dOfNode[t] >= 0) L.uMatch[L.unitOfDn[dOfNode[t]]] = 1; }
    }
  }
  var searchTimer = 0;
  search.addEventListener("input", function () { clearTimeout(searchTimer); searchTimer = setTimeout(function () { runSearch(search.value); }, 80); });
  search.addEventListener("search", function () { if (!search.value) runSearch(""); });   // the clear button
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
    if (ev.target === search || ev.target.tagName === "SELECT") return;
    if (ev.key === "/") { ev.preventDefault(); search.focus(); search.select(); }
    else if (ev.key === "Escape") select(-1);
    else if (ev.key === "f") fitAll(300);
    else if (ev.key === "m") treeBtn.click();
    else if (ev.key === "w") weightsBox.click();
    else if ((ev.key === "ArrowUp" || ev.key === "ArrowDown") && selected >= 0) {
      // follow the data: to the first input's producer, or to the first consumer (past weights)
      var list = (ev.key === "ArrowUp" ? inE[selected] : outE[selected]).filter(function (e2) {
        return showWeights || !nWeight[ev.key === "ArrowUp" ? eSrc[e2] : eDst[e2]];
      });
      if (list.length) { ev.preventDefault(); focusNode(ev.key === "ArrowUp" ? eSrc[list[0]] : eDst[list[0]], 150); }
    }
  });

  // ------------------------------------------------------------------ toolbar
  document.getElementById("gk-fit").addEventListener("click", function () { fitAll(300); });
  var depthSel = document.getElementById("gk-depth");
  var maxDepth = 0; for (g = 0; g < G; g++) maxDepth = Math.max(maxDepth, gDepth[g] + 1);
  function option(sel, value, text) { var o = document.createElement("option"); o.value = value; o.textContent = text; sel.appendChild(o); }
  option(depthSel, "auto", "one box per layer");
  option(depthSel, "-1", "open all modules");
  for (var dpt = 0; dpt < maxDepth; dpt++) option(depthSel, String(dpt), dpt ? "open " + dpt + " level" + (dpt > 1 ? "s" : "") : "close all modules");
  depthSel.addEventListener("change", function () { setDepth(depthSel.value === "auto" ? "auto" : +depthSel.value); });
  if (!G) depthSel.style.display = "none";
  var weightsBox = document.getElementById("gk-weights");
  var anyWeights = false; for (i = 0; i < N && !anyWeights; i++) anyWeights = !!nWeight[i];
  if (!anyWeights) document.getElementById("gk-weights-label").style.display = "none";
  weightsBox.addEventListener("change", function () {
    showWeights = weightsBox.checked;
    relayout();
  });
  var colourSel = document.getElementById("gk-colour");
  Object.keys(COLOURINGS).forEach(function (name) { option(colourSel, name, "colour: " + COLOURINGS[name].label); });
  if (Object.keys(COLOURINGS).length < 2) colourSel.style.display = "none";
  colourSel.addEventListener("change", function () { setColouring(colourSel.value); });
  function setColouring(name) {
    if (!COLOURINGS[name]) throw new Error("no colouring " + name);
    colouring = COLOURINGS[name];
    colourSel.value = name;
    renderLegend();
    if (selected !== -1) select(selected);   // the panel names the worst value by this colouring
    buildMinimap();
    requestDraw();
  }
  var legend = document.getElementById("gk-legend");
  // items: [fill, border, text, dashed border, a ring] or a ramp {ramp: scale, title}
  function renderLegend() {
    var failed = colouring.stat ? "#ffffff" : FAILED_FILL, upstream = colouring.stat ? "#ffffff" : UPSTREAM_FILL;
    var items = colouring.legend().concat([[failed, "#dc2626", "failed"], [upstream, "#ef4444", "downstream of a failure", true]]);
    if (diff) items.push(["#ffffff", "#22c55e", "added"], ["#ffffff", "#f59e0b", "changed"]);
    legend.innerHTML = items.map(function (it) {
      if (!it) return "";
      if (it.ramp) return rampHtml(it.title, it.ramp, it.rows);
      return '<span><i style="background:' + it[0] + ";border-color:" + it[1] + (it[3] ? ";border-style:dashed" : "") +
        (it[4] ? ";border-width:3px;border-radius:4px" : "") + '"></i>' + esc(it[2]) + "</span>";
    }).join("");
  }
  // a scale's range, written once, and its ramp; with rows ([scale, what] on the same range), a
  // bar per row, stacked, and a key naming each
  function rampHtml(title, sc, rows) {
    if (sc.lo === sc.hi && !rows) {   // one value: one swatch
      return '<span class="gk-ramp" data-testid="legend-ramp"><i class="gk-swatch" style="background:' + sc.colour(sc.hi) + '"></i><b>' + esc(title) + "</b>" +
        '<em data-testid="ramp-lo">' + esc(fmt(sc.lo)) + "</em></span>";
    }
    function bar(s, what) {
      var tip = what ? ' title="' + esc(what) + '"' : "";
      if (s.lo === s.hi) return '<i class="gk-swatch" style="background:' + s.colour(s.hi) + '"' + tip + "></i>";
      var stops = rampOf(s.ramp).map(function (c, q) { return c + " " + (100 * q / STEPS).toFixed(1) + "%"; });
      return '<i style="background:linear-gradient(90deg,' + stops.join(",") + ')"' + tip + "></i>";
    }
    var h = '<span class="gk-ramp" data-testid="legend-ramp"><b>' + esc(title) + "</b>" +
      '<em data-testid="ramp-lo">' + (sc.zero && sc.log ? "\u2264 " : "") + esc(fmt(sc.lo)) + "</em>";
    h += rows ? '<span class="gk-bars">' + rows.map(function (r) { return bar(r[0], r[1]); }).join("") + "</span>" : bar(sc, "");
    if (sc.lo !== sc.hi) h += '<em data-testid="ramp-hi">' + esc(fmt(sc.hi)) + "</em>" + (sc.log ? '<small title="logarithmic scale">log</small>' : "");
    if (rows) {
      h += '<span class="gk-keys">' + rows.map(function (r) {
        return '<span><i class="gk-swatch" style="background:' + rampOf(r[0].ramp)[STEPS / 2] + '"></i>' + esc(r[1]) + "</span>";
      }).join("") + "</span>";
    }
    return h + "</span>";
  }
  // numbers as people read them: 4 significant digits, exponents outside [1e-3, 1e5)
  function fmt(x) {
    if (x === null || x === undefined) return "\u2013";
    x = numberOf(x);
    if (isNaN(x)) return "NaN";
    if (!isFinite(x)) return x > 0 ? "\u221E" : "\u2212\u221E";
    if (x === 0) return "0";
    var a = Math.abs(x);
    var t = a >= 1e5 || a < 1e-3 ? x.toExponential(2).replace("e+", "e") : String(+x.toPrecision(4));
    return t.replace("-", "\u2212");
  }
  function count(x) { return Number(x).toLocaleString("en-US"); }

  // ------------------------------------------------------------------ module tree
  var tree = document.getElementById("gk-tree"), treeBtn = document.getElementById("gk-modules");
  var treeOpen = new Uint8Array(G), treeBuilt = false;
  function treeRow(g2) {
    var dot = gRootFail[g2] ? "#dc2626" : gFailed[g2] ? "#fca5a5" : "transparent";
    return '<div class="gk-trow" data-g="' + g2 + '" style="padding-left:' + (4 + 14 * gDepth[g2]) + 'px">' +
      '<span class="tw">' + (gChildren[g2].length ? (treeOpen[g2] ? "\u25BE" : "\u25B8") : "") + "</span>" +
      '<span class="dot" style="background:' + dot + '"></span>' +
      '<span class="nm" title="' + esc(gPath[g2]) + '">' + esc(gLabel[g2]) + (gClass[g2] ? ' <span class="gk-dim">' + esc(gClass[g2]) + "</span>" : "") + '</span><span class="ct">' + (gOps[g2] + gKernels[g2]) + "</span>" +
      '<button class="fold" title="close or open in the graph">' + (collapsed[g2] ? "open" : "close") + "</button></div>";
  }
  function treeHtml(list) {
    var h = "";
    list.forEach(function (g2) { h += treeRow(g2); if (treeOpen[g2]) h += treeHtml(gChildren[g2]); });
    return h;
  }
  function renderTree() {
    if (!tree.classList.contains("open")) return;
    var top = tree.scrollTop;
    tree.innerHTML = G ? treeHtml(topGroups) : '<div class="gk-trow"><span class="nm">no module scopes</span></div>';
    tree.scrollTop = top;
    treeBuilt = true;
  }
  treeBtn.addEventListener("click", function () { tree.classList.toggle("open"); renderTree(); resize(); });
  tree.addEventListener("click", function (ev) {
    var rowEl = ev.target.closest(".gk-trow");
    if (!rowEl || rowEl.dataset.g === undefined) return;
    var g2 = +rowEl.dataset.g;
    if (ev.target.classList.contains("tw")) { treeOpen[g2] = treeOpen[g2] ? 0 : 1; renderTree(); }
    else if (ev.target.classList.contains("fold")) { setCollapsed(g2, !collapsed[g2]); renderTree(); }
    else focusGroup(g2);
  });

  // ------------------------------------------------------------------ banners
  var banner = document.getElementById("gk-banner");
  if (roots.length) {
    var parts = roots.slice(0, 3).map(function (n) {
      var cnt = downstreamOf(n);
      return '<a data-node="' + n + '">' + esc(nId[n]) + "</a>" + (scopeOf(n) ? " in " + esc(scopeOf(n)) : "") + " failed with " + esc(statusName(nStatus[n])) + " \u2014 " + cnt + " node" + (cnt === 1 ? "" : "s") + " downstream";
    });
    banner.innerHTML = "\u2716 " + parts.join("; ") + (roots.length > 3 ? "; and " + (roots.length - 3) + " more" : "");
    banner.classList.add("show");
    banner.addEventListener("click", function (ev) { if (ev.target.dataset.node !== undefined) focusNode(+ev.target.dataset.node); });
  }
  if (diff) {
    var bar = document.getElementById("gk-diffbar");
    bar.innerHTML = esc(diff.title) + ": <b>+" + diff.added.length + "</b> added, <b>\u2212" + diff.removed.length + "</b> removed, <b>~" + Object.keys(diff.changed).length + "</b> changed &nbsp; <a id=\"gk-difftoggle\">details</a><div id=\"gk-difflist\"></div>";
    var dl = document.getElementById("gk-difflist"), lines = [];
    diff.added.forEach(function (n) { lines.push('<div>+ <a data-node="' + n + '">' + esc(nId[n]) + "</a> " + esc(nOp[n] || nKind[n]) + (scopeOf(n) ? " [" + esc(scopeOf(n)) + "]" : "") + "</div>"); });
    diff.removed.forEach(function (r2) { lines.push("<div>\u2212 <span class=\"gk-mono\">" + esc(r2[0]) + "</span> " + esc(r2[1]) + (r2[2] ? " [" + esc(r2[2]) + "]" : "") + "</div>"); });
    Object.keys(diff.changed).forEach(function (n) { lines.push('<div>~ <a data-node="' + n + '">' + esc(nId[+n]) + "</a> " + esc(diff.changed[n].map(function (c2) { return c2[0]; }).join(", ")) + "</div>"); });
    dl.innerHTML = lines.join("") || "<div>no differences</div>";
    bar.classList.add("show");
    bar.addEventListener("click", function (ev) {
      if (ev.target.id === "gk-difftoggle") { dl.classList.toggle("open"); resize(); }
      else if (ev.target.dataset.node !== undefined) focusNode(+ev.target.dataset.node);
    });
  }

  // gk.compare: the summary, the first divergence, every row as a table on request. The summary's
  // first line heads the bar; the first divergence (or "no divergence") is written here, as a
  // link, so the summary leaves out its own sentence of it; its other lines follow
  if (cmp) {
    var cbar = document.getElementById("gk-comparebar"), fr = firstNode >= 0 ? cmp.rows[cmp.first] : null;
    var head = '<b>' + esc(cmp.title) + "</b>";
    if (cmp.summary.length) head += ": " + esc(cmp.summary[0].replace(/^compare .*?: /, ""));
    if (fr) head += ' \u00B7 first divergence <a data-node="' + fr[0] + '">' + esc(nId[fr[0]]) + "</a> (" + esc(fr[4].replace(" -> ", " \u2192 ")) + ")" +
      (fr[5] ? " in " + esc(fr[5]) : "") + ": max abs " + esc(fmt(fr[9])) + ", max rel " + esc(fmt(fr[10])) + (fr[13] ? " (" + esc(fr[13]) + ")" : "");
    else if (cmp.first === null || cmp.first === undefined) head += " \u00B7 no divergence";
    cbar.innerHTML = head + (cmp.rows.length ? ' &nbsp; <a id="gk-cmptoggle">table</a>' : "") +
      (cmp.summary.length > 1 ? '<div class="gk-dim">' + cmp.summary.slice(1).map(esc).join("<br>") + "</div>" : "") +
      '<div id="gk-cmplist"></div>';
    cbar.classList.add("show");
    var cl = document.getElementById("gk-cmplist");
    cbar.addEventListener("click", function (ev) {
      var t = ev.target.closest("[data-node]");
      if (ev.target.id === "gk-cmptoggle") {
        if (!cl.innerHTML) cl.innerHTML = compareTable();
        cl.classList.toggle("open"); resize();
        if (cl.classList.contains("open")) { var fe = document.getElementById("first"); if (fe) cl.scrollTop = Math.max(0, fe.offsetTop - 40); }
      } else if (t && +t.dataset.node >= 0) focusNode(+t.dataset.node);
    });
  }
  function compareTable() {
    var h = "<table><thead><tr><th>node a</th><th>node b</th><th>op</th><th>scope</th><th>shape</th><th>dtypes</th><th>max abs</th><th>max rel</th><th>beyond tol.</th><th></th></tr></thead><tbody>";
    cmp.rows.forEach(function (r, j) {
      var cls = j === cmp.first ? "first" : r[12] === false ? "bad" : r[12] === null ? "na" : "";
      h += '<tr class="' + cls + '"' + (j === cmp.first ? ' id="first"' : "") + ' data-node="' + r[0] + '"><td>' + esc(r[2]) + "</td><td>" + esc(r[0] >= 0 ? nId[r[0]] : "") +
        "</td><td>" + esc(r[4]) + "</td><td>" + esc(r[5]) + "</td><td>" + esc(r[6] ? "[" + r[6].join(", ") + "]" : "") + "</td><td>" + esc(r[7] + (r[8] && r[8] !== r[7] ? " / " + r[8] : "")) +
        "</td><td>" + fmt(r[9]) + "</td><td>" + fmt(r[10]) + "</td><td>" + (r[11] === null || r[11] === undefined ? "" : count(r[11])) + "</td><td>" +
        (r[12] === true ? "ok" : r[12] === false ? "diverged" : esc(r[13])) + "</td></tr>";
    });
    h += "</tbody></table>";
    if (cmp.checks.length) {
      h += "<h4>Kernels against their references, on the inputs they received</h4><table><thead><tr><th>side</th><th>node</th><th>kernel</th><th>scope</th><th>backend</th><th>max abs</th><th>max rel</th><th></th></tr></thead><tbody>";
      cmp.checks.forEach(function (k) {
        h += '<tr class="' + (k[8] ? "" : "bad") + '" data-node="' + k[2] + '"><td>' + esc(k[0]) + "</td><td>" + esc(k[1]) + "</td><td>" + esc(k[3]) + "</td><td>" + esc(k[4]) + "</td><td>" + esc(k[5]) +
          "</td><td>" + fmt(k[6]) + "</td><td>" + fmt(k[7]) + "</td><td>" + (k[8] ? "ok" : "off") + "</td></tr>";
      });
      h += "</tbody></table>";
    }
    return h;
  }

  // ------------------------------------------------------------------ start
  var start = D.options && D.options.collapse_depth != null ? D.options.collapse_depth : "auto";
  showWeights = weightsBox.checked = !!(D.options && D.options.show_weights);
  applyDepth(start);
  depthSel.value = String(start);
  if (depthSel.value !== String(start)) depthSel.value = "auto";
  renderLegend();
  layout();
  resize();
  window.addEventListener("resize", resize);
  if (roots.length && !L.unitOfKey.has(roots[0]) && dOfNode[roots[0]] < 0) reveal(roots[0]);
  firstView(0);
  if (roots.length) {   // a failure is what the reader came for: keep it on screen
    var rp = anchorPoint(roots[0]), ru = L.unitOfDn[dOfNode[roots[0]]];
    if (rp) {
      var sx = rp[0] * transform.k + transform.x, sy = (rp[1] + L.h[ru] / 2) * transform.k + transform.y;
      if (sx < 0 || sx > cssW || sy < 0 || sy > cssH) centerOn(rp[0], rp[1] + L.h[ru] / 2, Math.max(transform.k, 0.9), 0);
    }
  }
  colourSel.value = Object.keys(COLOURINGS).filter(function (k) { return COLOURINGS[k] === colouring; })[0];
  if (firstNode >= 0) focusNode(firstNode, 0);   // a comparison opens on where it parts ways
  draw();

  // ------------------------------------------------------------------ API (tests, console)
  function nodeIndex(id) { var n = idIndex.get(id); if (n === undefined) throw new Error("no node " + id); return n; }
  function groupIndex(path) { var g2 = gPath.indexOf(path); if (g2 < 0) throw new Error("no group " + path); return g2; }
  function unitOfNode(n) { var k = dOfNode[n]; return k >= 0 ? L.unitOfDn[k] : -1; }
  function screenRect(x0, y0, w, h) {
    var k = transform.k, rc = canvas.getBoundingClientRect();
    return { x: rc.left + x0 * k + transform.x, y: rc.top + y0 * k + transform.y, width: w * k, height: h * k };
  }
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
    selected: function () { return selected >= 0 ? nId[selected] : selected === -1 ? null : gPath[keyGroup(selected)]; },
    collapse: function (path, on) { setCollapsed(groupIndex(path), on !== false); },
    expand: function (path) { setCollapsed(groupIndex(path), false); },
    collapseToDepth: function (d) { setDepth(d); },
    showWeights: function (on) { if (weightsBox.checked !== !!on) weightsBox.click(); },
    focusGroup: function (path) { focusGroup(groupIndex(path)); },
    screenBox: function (id) {
      var u = unitOfNode(nodeIndex(id));
      return u < 0 ? null : screenRect(L.x[u] - L.w[u] / 2, L.y[u], L.w[u], L.h[u]);
    },
    groupBox: function (path) {   // a closed module's box, or an open one's frame
      var g2 = groupIndex(path), u = L.unitOfKey.get(groupKey(g2));
      if (u !== undefined) return screenRect(L.x[u] - L.w[u] / 2, L.y[u], L.w[u], L.h[u]);
      var f = L.frameOf.get(g2);
      return f ? screenRect(f.x, f.y, f.w, f.h) : null;
    },
    groupState: function (path) {
      var g2 = groupIndex(path);
      return { collapsed: !!collapsed[g2], box: L.unitOfKey.has(groupKey(g2)), frame: L.frameOf.has(g2), failed: gRootFail[g2] > 0 };
    },
    nodeState: function (id) {
      var n = nodeIndex(id), u = unitOfNode(n);
      return {
        visible: u >= 0 && L.uBox[u] < 0 && dNode[L.uRef[u]] === n, weight: !!nWeight[n],
        box: u >= 0 && L.uBox[u] >= 0 ? gPath[L.uBox[u]] : null,
        style: u >= 0 ? unitStyle(u) : "attribute", status: statusName(nStatus[n]),
        failed: nStatus[n] !== 0 && nStatus[n] !== UPSTREAM, upstream: nStatus[n] === UPSTREAM,
        rootCause: nRoot[n] >= 0 ? nId[nRoot[n]] : null, match: !!matches[n], selected: selected === n,
        text: u >= 0 ? unitText(u) : null
      };
    },
    // every drawn box and frame, for checks that nothing overlaps
    boxes: function () {
      var out = [];
      for (var u = 0; u < L.U; u++) out.push({ key: L.uBox[u] >= 0 ? gPath[L.uBox[u]] : nId[dNode[L.uRef[u]]], x: L.x[u] - L.w[u] / 2, y: L.y[u], w: L.w[u], h: L.h[u], parent: containerChain2(u) });
      return out;
    },
    frames: function () { return L.frames.map(function (f) { return { path: gPath[f.g], x: f.x, y: f.y, w: f.w, h: f.h, parent: gParent[f.g] >= 0 ? gPath[gParent[f.g]] : "" }; }); },
    transform: function () { return { x: transform.x, y: transform.y, k: transform.k }; },
    fit: function () { firstView(0); },
    zoomTo: function (k) { var c = toWorld(cssW / 2, cssH / 2); centerOn(c[0], c[1], k, 0); },   // about the view's centre
    fitAll: fitAll,
    redraw: draw,
    painted: painted,   // a Promise: the canvas has been redrawn since the last change
    drawnLabels: function () { return lastPlaced.map(function (p) { return { kind: p[4], x: p[0], y: p[1], w: p[2] - p[0], h: p[3] - p[1], path: p[5] || "" }; }); },
    colourBy: function (name) { setColouring(name); draw(); },
    colouring: function () { return colourSel.value; },
    colourings: function () { return Object.keys(COLOURINGS); },
    fillOf: function (id) {   // the fill a node, or the module box holding it, is drawn with
      var u = unitOfNode(nodeIndex(id));
      return u < 0 ? null : unitLook(u)[0];
    },
    groupFill: function (path) { return colouring.group(groupIndex(path)); },
    // the current colouring's scales (quiet range, loud range) and the fixed fills
    scales: function () {
      if (!colouring.stat) return [];
      return colouring.measure().scales.map(function (sc) { return sc ? { lo: sc.lo, hi: sc.hi, log: sc.log, colours: rampOf(sc.ramp) } : null; });
    },
    palette: { none: NONE_FILL, nonfinite: NONFINITE_FILL, finite: FINITE_FILL, limit: LIMIT_FILL },
    relayoutMs: function () { var t = performance.now(); layout(); draw(); return performance.now() - t; }
  };
  function containerChain2(u) { var g2 = L.uBox[u] >= 0 ? gParent[L.uBox[u]] : dGroup[L.uRef[u]]; return g2 >= 0 ? gPath[g2] : ""; }
  document.body.setAttribute("data-ready", "1");
})();
