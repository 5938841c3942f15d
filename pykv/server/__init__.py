"""The OpenAI-compatible HTTP server over pykv.api.engine (pykv serve), its load generator
(pykv bench-serve) and its Ray Serve deployment; needs the serve extra (pip install pykv[serve])."""
