"""The network the policy prices with where no link was measured, read from the environment: HOROVOD_TERNGRAD_GBPS
(default 1) and HOROVOD_TERNGRAD_ALPHA_US (default 50) between nodes, which the launcher's profiles set, and inside
a node HOROVOD_TERNGRAD_INTRA_GBPS (default 100), HOROVOD_TERNGRAD_INTRA_ALPHA_US (default 5) and
HOROVOD_TERNGRAD_INTRA_LINKS (default 1; 3 for four NVLink-connected GPUs).

Apart from cost.py, which prices whatever network it is given: the policy, the engines (link.py, hierarchical.py)
and the performance model read the configured network here, and cost.py's functions fall back to it only where
their caller gives no network.  ``cost.Network`` is imported where a network is built, not at the top, so that
cost.py can import this module at its own top (and ``cost.configured_network`` stays what it was).
"""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=8)
def _network(gbps: float, alpha_us: float, ranks_per_node: int = 1, intra_gbps: float = 0.0,
             intra_alpha_us: float = 0.0, intra_links: int = 1):
    from .cost import Network
    intra = (Network.from_gbps("configured intra-node", intra_gbps, intra_alpha_us, peer_links=intra_links)
             if intra_gbps else None)
    return Network.from_gbps("configured", gbps, alpha_us, ranks_per_node, intra)


def configured_network(ranks_per_node: int = 1):
    """The network (``cost.Network``) the policy prices with where no link was measured: HOROVOD_TERNGRAD_GBPS /
    HOROVOD_TERNGRAD_ALPHA_US between nodes (default 1 Gbit/s, 50 us), and inside a node
    HOROVOD_TERNGRAD_INTRA_GBPS / HOROVOD_TERNGRAD_INTRA_ALPHA_US (default 100 Gbit/s, a PCIe-class
    switch or shared memory, and 5 us) per link, and HOROVOD_TERNGRAD_INTRA_LINKS links from each GPU to
    its peers (``Network.peer_links``; default 1, one port; 3 for four GPUs fully connected by NVLink).
    Allreduces are charged the cheaper of ring and tree (``Network.allreduce`` "auto")."""
    return _network(_env_number("HOROVOD_TERNGRAD_GBPS", "1", float, 0.0, positive=True),
                    _env_number("HOROVOD_TERNGRAD_ALPHA_US", "50", float, 0.0), int(ranks_per_node),
                    _env_number("HOROVOD_TERNGRAD_INTRA_GBPS", "100", float, 0.0),
                    _env_number("HOROVOD_TERNGRAD_INTRA_ALPHA_US", "5", float, 0.0),
                    _env_number("HOROVOD_TERNGRAD_INTRA_LINKS", "1", int, 1))


def _env_number(name: str, default: str, kind, least, positive: bool = False):
    """A number from the environment, or a ValueError that names the variable and what it takes."""
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value != value or value < least or (positive and value <= 0):
        what = "an integer" if kind is int else "a number"
        bound = "> 0" if positive else f">= {least:g}"
        raise ValueError(f"TernGrad: {name}={raw!r} is not {what} {bound}")
    return value
