"""Training predicts serving: the target's own held-out continuations (continuations.py) and
the simulation of serving beside the loop itself (serving_parity.py; docs/architecture.md,
"Training predicts serving"). The walk both share is the loop's, inference/metrics.py.
"""
