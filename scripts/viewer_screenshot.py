"""The README's picture of the HTML viewer: a random-weight 8-layer mlx-lm llama, patched onto
graphkern kernels and traced, opened in headless Chromium at 1600x1000 with one decoder layer
open and its input norm's kernel (the residual add before it fused in) selected.

    python scripts/viewer_screenshot.py [--out docs/viewer.png] [--layers 8]

Needs mlx-lm, playwright and a Chromium (``$GRAPHKERN_CHROMIUM``, else ``chromium`` on the PATH,
else /usr/bin/chromium). The tests call ``screenshot`` with their own browser.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1600, 1000


def page_html(layers: int = 8) -> str:
    """The viewer page of a patched, traced random-weight llama with ``layers`` layers."""
    import mlx.core as mx

    import graphkern as gk
    from graphkern.models.tiny import TINY_CONFIGS, random_model

    model = random_model({**TINY_CONFIGS["llama"], "num_hidden_layers": layers})
    gk.patch(model)
    graph = gk.trace(model, mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]))
    return graph.to_html(title=f"llama, {layers} layers, patched — graphkern")


def screenshot(browser: Any, out: str | os.PathLike[str], layers: int = 8) -> Path:
    """Open the page in ``browser`` (a playwright Browser), open layer 1, select its input
    RMSNorm kernel and write the picture to ``out``. Returns the path."""
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "viewer.html"
        path.write_text(page_html(layers), encoding="utf-8")
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        try:
            page.goto(path.as_uri())
            page.wait_for_function("window.gk && window.gk.ready", timeout=30_000)
            page.evaluate("""() => {
                gk.expand('model.layers.1');
                const kernel = gk.search('model.layers.1.input_layernorm')
                    .find(id => id.startsWith('gk_add_rms_norm'));
                gk.search('');
                gk.focus(kernel);
            }""")
            page.wait_for_timeout(300)
            page.screenshot(path=str(out))
        finally:
            page.close()
    return out


def chromium() -> str:
    return os.environ.get("GRAPHKERN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "viewer.png"))
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            print(screenshot(browser, args.out, args.layers))
        finally:
            browser.close()


if __name__ == "__main__":
    main()
