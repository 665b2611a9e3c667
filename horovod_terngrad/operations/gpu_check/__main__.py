"""``python -m horovod_terngrad.operations.gpu_check``: the check, its table and its exit status."""
import sys

from .cli import main

sys.exit(main())
