"""Layer 4.7, modelling: the models of a training step, in one place, built on the runtime's own plans and sizes.

* ``perfmodel``: the analytic step model (alpha-beta, the paper's Fig. 5 clusters), pricing each exchange with
  ``exchange.cost`` (the runtime cost model, which stays beside the engine that decides with it);
* ``hsdp``: the same for FSDP2 sharded inside a node with each shard averaged across nodes (a GPT's step);
* ``timeline``: the scheduled step model (the engine's collectives in the order it issues them, overlap with
  backward, measured codec rates);
* ``gpu_profile``: the codec's rates measured on a GPU (``scripts/gpu_check.sh``'s JSON), for ``perfmodel``;
* ``simulate``: N data-parallel workers in one process with the real exchange engines (accuracy at any N);
* ``plots``: figures of the above (matplotlib, loaded only by the CLI when a figure is asked for);
* ``cli``: ``python -m horovod_terngrad.modelling [hsdp] ...``, the tables and figures.

Nothing on the training path imports this package (tests/test_layers.py checks it); operations/ (benchmarks,
launcher, metrics, data sets) may.
"""
