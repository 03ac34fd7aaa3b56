"""Running ops on a device: the interpreter over a backend's namespace, graph replay, sizes and holdings.

``interpreter`` executes a session's messages in order; ``replay`` and ``graph_cache`` register and
replay recurring op groups; ``backends`` and ``adapters`` make each device's namespace answer exactly
what the client inferred; ``aten`` (with ``rnn_cells``) runs the vetted ATen overloads of a torch
device; ``sizes`` predicts outputs so ``holdings`` can charge them before they exist. It imports
``guard`` (budgets) and ``telemetry`` (the probe), never the session layer above it.
"""
