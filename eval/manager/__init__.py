"""The memory manager evaluated as served: the aux thread on held-out traces, the baseline arms, the calibrated
decode rule."""
