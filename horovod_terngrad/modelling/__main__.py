"""``python -m horovod_terngrad.modelling [hsdp] ...``: the performance model's tables and figures (cli.py)."""
import sys

from .cli import main

sys.exit(main())
