"""Runs the exported demo page (index.html) in headless Chromium and writes what it found:
demo.md (the ladder and kernel tables), demo.json (window.normkitDemo as the page left it) and
demo.png (a screenshot of the page). Called by `normkit export-web DIR --demo`.
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from .browser import BrowserError, Chromium, find_chromium, serve

WAIT_S = 900  # the full ladder on a software adapter takes a minute or two

DONE = """new Promise((resolve) => {
    const poll = () => (window.normkitDemo && window.normkitDemo.done) ? resolve(true) : setTimeout(poll, 100);
    poll();
})"""


def _num(v, digits=3):
    return "" if v is None else f"{v:.{digits}g}"


def _check(c):
    if not c:
        return ""
    return f"{_num(c['maxErr'], 2)} ({'all close' if c['ok'] else str(c['bad']) + ' not close'})"


def markdown(data: dict, browser: str, command: str) -> str:
    a = data.get("adapter") or {}
    f = data.get("features") or {}
    shape = data.get("ladderShape", {})
    lines = [
        "# normkit web demo", "",
        f"- browser: {browser}; adapter: {' / '.join(str(v) for v in (a.get('vendor'), a.get('architecture'), a.get('description')) if v)}; "
        f"subgroups: {'size ' + str(f.get('subgroupSize')) if f.get('subgroups') else 'no'}; shader-f16: {'yes' if f.get('f16') else 'no'}",
        f"- normkit {data.get('version')}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; command: `{command}`",
        f"- ladder: LayerNorm forward, f32, {shape.get('rows')} x {shape.get('n')}, weight and bias, "
        f"{data.get('workgroupSize')} invocations per workgroup (one per row); GB/s counts x read + y "
        "written (1e9 bytes/s), from the wall time of back-to-back dispatches in one submission (median of samples); "
        "max |err| against a float64 reference in JavaScript; 'all close': |y - ref| <= 1e-5 (1 + |ref|) everywhere", "",
        "| variant | GB/s | of copy | max abs err, random rows | max abs err, rows + 1e4 | ms per call [min, max] |",
        "|---|---|---|---|---|---|",
    ]
    for r in data.get("progression", []):
        if r.get("skipped"):
            lines.append(f"| {r['variant']} | n/a: {r['skipped']} | | | | |")
            continue
        t = r["time"]
        of_copy = f"{100 * r['ofCopy']:.2g}%" if "ofCopy" in r else ""
        lines.append(f"| {r['variant']} | {_num(r['gbs'])} | {of_copy} | "
                     f"{_check(r.get('check'))} | {_check(r.get('offsetCheck'))} | "
                     f"{_num(t['median'] * 1e3)} [{_num(t['min'] * 1e3)}, {_num(t['max'] * 1e3)}] |")
    kernels = data.get("kernels", [])
    ran = [k for k in kernels if k.get("check")]
    lines += ["", f"Every kernel: {len(ran)} ran, {sum(k['check']['ok'] for k in ran)} all close to the float64 reference, "
              f"{len(kernels) - len(ran)} not available on this adapter.", "",
              "| op | shape | variant | dtype | activation | max abs err | check |", "|---|---|---|---|---|---|---|"]
    for k in kernels:
        if k.get("skipped"):
            lines.append(f"| {k['op']} | {k['shape']} | {k['variant']} | {k['dtype']} | {k['activation']} | n/a: {k['skipped']} | |")
        else:
            c = k["check"]
            lines.append(f"| {k['op']} | {k['shape']} | {k['variant']} | {k['dtype']} | {k['activation']} | "
                         f"{_num(c['maxErr'], 2)} | {'all close' if c['ok'] else str(c['bad']) + ' not close'} |")
    if data.get("error"):
        lines += ["", f"The page failed: {data['error']}"]
    return "\n".join(lines) + "\n"


def run(folder: Path, out: Path, quick: bool = False, query: str = "") -> int:
    """query: extra URL options for the page (e.g. "rows=512&wg=64")."""
    path, why = find_chromium()
    if path is None:
        print(f"normkit export-web --demo: {why}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    command = "normkit export-web DIR --demo" + (" --quick" if quick else "") + (f" --query '{query}'" if query else "")
    options = "&".join(o for o in ("quick" if quick else "", query) if o)
    try:
        with serve(folder) as url, Chromium(path) as browser:
            browser.open(f"{url}/index.html" + (f"?{options}" if options else ""))
            browser.evaluate(DONE, timeout=WAIT_S)
            data = browser.evaluate("window.normkitDemo")
            browser.screenshot(out / "demo.png")
            version = browser.version
    except BrowserError as e:
        print(f"normkit export-web --demo: {e}", file=sys.stderr)
        return 2
    (out / "demo.json").write_text(json.dumps(data, indent=1) + "\n")
    text = markdown(data, version, command)
    (out / "demo.md").write_text(text)
    print(text)
    print(f"wrote demo.md, demo.json and demo.png to {out}")
    if not data.get("ok"):
        print(f"the demo found failures: {data.get('failed') or data.get('error')}", file=sys.stderr)
        return 1
    return 0
