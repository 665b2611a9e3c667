"""Layer 5, operations: what runs around training rather than inside it.

Benchmarks (``bench``), training metrics (``metrics``), the launcher and its preflight (``launcher``,
``preflight``), the offline data sets (``datasets``), model builders (``models``), the DDP baselines' hooks
(``ddp_hooks``) and the examples' ``--device`` decision (``devices``).  The models of a step (performance model,
timeline, simulator, plots) live in ``horovod_terngrad.modelling``.  Nothing on the training path imports this
package (tests/test_layers.py checks it).
"""
