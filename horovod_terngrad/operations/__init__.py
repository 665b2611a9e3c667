"""Layer 5, operations: what runs around training rather than inside it.

Benchmarks (``bench``), the performance model (``perfmodel``, plots in ``plots``), the scheduled step
timeline (``timeline``), the N-worker simulator (``simulate``), training metrics (``metrics``), the
launcher and its preflight (``launcher``, ``preflight``) and the offline data sets (``datasets``).
Nothing on the training path imports this package (tests/test_layers.py checks it).
"""
