"""Mixture-of-Experts: routing (gating.py: top-k and grouped top-k), expert parallelism
(expert_parallel.py: placement, all-to-all dispatch/combine, load counters) and the load
balancer (eplb.py: `rebalance_experts`). Light: importing the package imports nothing heavy."""
