"""normkit in the browser: the JavaScript module over the WGSL kernels (normkit.js, exported with
the .wgsl files inlined by `normkit export-web`), its TypeScript declarations, the demo page, and a
headless-Chromium driver (browser.py) that runs the demo (demo.py) and the browser tests."""
