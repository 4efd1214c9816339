"""deepinfer's OpenAI-compatible HTTP server: `build_app(engine)` and the `deepinfer` CLI.

Light on purpose: importing `server` imports neither torch nor FastAPI; `server.app` and
`server.cli` load what they need.
"""
