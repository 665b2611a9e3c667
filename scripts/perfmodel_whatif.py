"""What would lift Horovod AlexNet / VGG-A to 0.90 of linear at 512 GPUs on InfiniBand (docs/perfmodel.md, "What
dominates where a goal is not met"): the default's fraction of linear scaling, additive and scheduled, on 4- and
8-GPU nodes, as the model stands, with the cross-node collectives' latency count made log-depth (a what-if: the
model's stage count for a cross-node link replaced by ceil(log2 M), the bytes unchanged; no such transport is
built), and, for the scheduled model, without Horovod's negotiation wait.  Pure arithmetic, seconds:

    python scripts/perfmodel_whatif.py
"""
import math
from dataclasses import replace
from unittest import mock

from horovod_terngrad.exchange import cost
from horovod_terngrad.modelling import perfmodel as pm
from horovod_terngrad.modelling import timeline as tl

_linear_stages = cost._stages


_INTRA_NODE = pm.CLUSTERS["infiniband"].network.intra_node.name


def _log_depth_across_nodes(workers, link):
    """ceil(log2 N) message rounds on a cross-node link (one rank per link, no intra-node link of its own, not the
    intra-node link itself), else as now."""
    if link.intra_node is None and link.ranks_per_node == 1 and link.name != _INTRA_NODE:
        return math.ceil(math.log2(workers)) if workers > 1 else 0
    return _linear_stages(workers, link)


def fractions(model: str, gpus_per_node: int, negotiation: bool = True) -> tuple[float, float]:
    cl = pm.CLUSTERS["infiniband"]
    cl = replace(cl, network=replace(cl.network, ranks_per_node=gpus_per_node))
    spec, d = pm.MODELS[model], pm.TERNGRAD_DEFAULT
    add = pm.predict_scaling(spec, cl, workers=[512], methods=(d,))[0][d]
    sch = tl.scheduled_scaling(spec, cl, [512], methods=(d,), negotiation=negotiation)[0][d]
    return add.scaling_efficiency, sch.compute_s / sch.step_s


def main():
    print("| model | nodes | today: additive / scheduled | log-depth cross stages: additive / scheduled "
          "| scheduled without negotiation: today / log-depth |")
    print("|---|---|---|---|---|")
    for model in ("alexnet", "vgga"):
        for g in (4, 8):
            now = fractions(model, g)
            now_free = fractions(model, g, negotiation=False)[1]
            with mock.patch.object(cost, "_stages", _log_depth_across_nodes):
                log = fractions(model, g)
                log_free = fractions(model, g, negotiation=False)[1]
            print(f"| {pm.MODELS[model].name} | {g} GPUs | {now[0]:.3f} / {now[1]:.3f} | {log[0]:.3f} / {log[1]:.3f} "
                  f"| {now_free:.3f} / {log_free:.3f} |")


if __name__ == "__main__":
    main()
