"""The renderers of scripts/render_docs.py, one module per page or family of blocks.

``pages`` says which function renders which page and block (``block_makers``, ``page_makers``) and renders them all
(``rendered_pages``); ``common`` holds what they share (paths, the benchmarks' JSON, number formats); ``measured``
and ``modelled`` compute the figures several blocks show, once per process.  The pages' own modules: ``headline``
(README, the home page), ``choosing``, ``whole_run``, ``adam``, ``model_blocks`` (perfmodel.md, scale.md), ``fsdp``,
``cluster``, ``ddp``, ``ddp_studies``, ``mixed_precision``, ``realshapes``, ``gpu``, ``reference``
(docs/reference.md) and ``troubleshooting``.  They import ``horovod_terngrad``: scripts/render_docs.py puts the
repository first on ``sys.path``.
"""
