"""Readable torch references for the ops in `kernels/`: slow, obviously correct, the test oracle."""
