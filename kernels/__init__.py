"""Device ops behind plain functions. Each op has a torch reference (CPU; the test oracle) and
optional accelerated backends chosen at run time with `backend="auto"`. Knows nothing of requests.
"""
