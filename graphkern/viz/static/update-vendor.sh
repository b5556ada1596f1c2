#!/usr/bin/env bash
# Refresh the JavaScript that the HTML viewer inlines (d3-zoom and what it needs), from npm.
# The viewer works offline: these files are copied into every HTML page graphkern writes.
# Usage: bash graphkern/viz/static/update-vendor.sh   (needs node/npm; run from anywhere)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm init -y >/dev/null
npm install --no-audit --no-fund --silent d3-zoom@3.0.0
# load order matters: each UMD bundle extends the global d3 with what the next ones need
order="d3-dispatch d3-selection d3-drag d3-color d3-interpolate d3-timer d3-ease d3-transition d3-zoom"
: > "$here/vendor-LICENSES.txt"
echo "[" > "$here/vendor-manifest.json"
sep=""
for pkg in $order; do
  version="$(node -p "require('./node_modules/$pkg/package.json').version")"
  license="$(node -p "require('./node_modules/$pkg/package.json').license")"
  cp "node_modules/$pkg/dist/$pkg.min.js" "$here/$pkg.min.js"
  sha="$(sha256sum "$here/$pkg.min.js" | cut -d' ' -f1)"
  printf '%s  {"package": "%s", "version": "%s", "license": "%s", "file": "%s.min.js", "sha256": "%s"}' \
    "$sep" "$pkg" "$version" "$license" "$pkg" "$sha" >> "$here/vendor-manifest.json"
  sep=$',\n'
  { echo "== $pkg $version ($license) =="; cat "node_modules/$pkg/LICENSE"; echo; } >> "$here/vendor-LICENSES.txt"
done
printf '\n]\n' >> "$here/vendor-manifest.json"
echo "vendored into $here"
