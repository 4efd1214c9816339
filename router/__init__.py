"""deepinfer's router: an OpenAI-compatible HTTP proxy in front of worker replicas.

Light on purpose: it never imports torch or the engine (DESIGN.md), so `deepinfer router`
starts in well under a second. `router.app.build_app(config)` builds the FastAPI app,
`router.cli.main` is `deepinfer router`. README.md beside this file lists every worker endpoint
the router calls.
"""
