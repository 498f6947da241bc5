"""`normkit export-web DIR`: normkit for the browser, as a folder that is also an npm package.

DIR/normkit.js    the ES module (no dependencies): normkit/web/normkit.js with normkit's .wgsl files
                  and kernel tables inlined (shaders.web_data()), so it builds the very text the
                  Python backend compiles
DIR/normkit.d.ts  its TypeScript declarations
DIR/package.json  makes DIR an npm package
DIR/index.html    the demo page (with demo.js): every kernel against a float64 reference, and seed
                  000's ladder as a table and a bar chart
DIR/README.md     how to use the module

With --demo it then serves DIR on localhost, runs the demo in headless Chromium (normkit.web.demo)
and writes its table, JSON and a screenshot under --out.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..backends.webgpu import shaders

HERE = Path(__file__).resolve().parent
COPIED = ("normkit.d.ts", "index.html", "demo.js", "README.md")  # copied as they are
MARKER = "/* normkit:data */"


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="folder to write normkit.js, normkit.d.ts, package.json and the demo into")
    parser.add_argument("--demo", action="store_true",
                        help="then run the demo page in headless Chromium and write its results (needs chromium)")
    parser.add_argument("--out", default=None, help="with --demo: folder for demo.md, demo.json and demo.png (default DIR/demo-results)")
    parser.add_argument("--quick", action="store_true", help="with --demo: smaller shapes and shorter timing")
    parser.add_argument("--query", default="", help="with --demo: more URL options for the page, e.g. 'rows=512&n=1024&wg=64'")


def _version() -> str:
    from .. import __version__

    return __version__


def _js_string(name: str, text: str) -> str:
    # a raw template literal keeps the WGSL readable in the module; WGSL never has these
    if "`" in text or "${" in text or "\\" in text:
        raise ValueError(f"{name}: a backtick, backslash or '${{' cannot go into a JavaScript template literal")
    return f"String.raw`{text}`"


def module_source() -> str:
    """normkit.js with the WGSL and the tables from shaders.web_data() in place of the marker."""
    data = shaders.web_data()
    wgsl = data.pop("wgsl")
    files = ",\n".join(f"    {json.dumps(name)}: {_js_string(name, text)}" for name, text in wgsl.items())
    tables = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items())
    block = f"const DATA = {{\n  wgsl: {{\n{files},\n  }},\n{tables},\n}};"
    template = (HERE / "normkit.js").read_text()
    if template.count(MARKER) != 1:
        raise ValueError(f"normkit/web/normkit.js: expected the line {MARKER!r} exactly once")
    return template.replace(MARKER, block).replace("__NORMKIT_VERSION__", _version())


def package_json() -> str:
    return json.dumps({
        "name": "normkit",
        "version": _version(),
        "description": "LayerNorm, RMSNorm and GroupNorm (+ SiLU, Mish, GELU, ReLU) forward kernels for WebGPU, "
                       "numerically exact on rows with large offsets",
        "type": "module",
        "main": "./normkit.js",
        "module": "./normkit.js",
        "types": "./normkit.d.ts",
        "exports": {".": {"types": "./normkit.d.ts", "default": "./normkit.js"}},
        "files": ["normkit.js", "normkit.d.ts", "README.md"],
        "sideEffects": False,
        "license": "MIT",
        "keywords": ["webgpu", "wgsl", "layernorm", "rmsnorm", "groupnorm", "normalization"],
    }, indent=2) + "\n"


def export(out: Path) -> list[Path]:
    """Writes the package into out; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "normkit.js", out / "package.json"]
    written[0].write_text(module_source())
    written[1].write_text(package_json())
    for name in COPIED:
        shutil.copyfile(HERE / name, out / name)
        written.append(out / name)
    return written


def run(args) -> int:
    out = Path(args.dir)
    written = export(out)
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
    if not args.demo:
        print(f"serve it on localhost (WebGPU needs a secure context), e.g. python -m http.server -d {out}, "
              "and open index.html")
        return 0
    from . import demo

    return demo.run(out, Path(args.out) if args.out else out / "demo-results", quick=args.quick, query=args.query)
