"""Mixture-of-Experts routing (gating: top-k and grouped top-k); dispatch/combine across EP
ranks and EPLB land here later. Light: importing the package imports nothing heavy."""
