#!/usr/bin/env bash
# Tools for the drawing tests: Graphviz (DOT -> SVG/PNG) and a headless Chromium that playwright
# drives. `playwright install` downloads browsers, which cannot happen here, so Debian's chromium
# is used (tests/test_viz_browser.py launches it through executable_path=/usr/bin/chromium, or
# $GRAPHKERN_CHROMIUM). Run inside the CI virtualenv (it pip-installs playwright there).
set -euo pipefail
need=()
command -v dot >/dev/null 2>&1 || need+=(graphviz)
if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then need+=(chromium); fi
fc-list 2>/dev/null | grep -qi dejavu || need+=(fonts-dejavu-core)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
python -c "import playwright" 2>/dev/null || python -m pip install -q "playwright>=1.45"
python -c "import graphviz" 2>/dev/null || python -m pip install -q "graphviz>=0.20"
dot -V
chromium --version 2>/dev/null || /usr/bin/chromium --version
# With CI set, tests/test_viz_browser.py fails (instead of skipping) when any of this is missing.
