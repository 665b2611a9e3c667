"""The node-aware exchange's CPU work with bf16 inside the node (exchange/hierarchical.py), a straightforward way
(an fp32 copy of everything received, fresh buffers every step) beside the way the exchange does it, on one tensor
of GPT-2's embedding size (25.7M elements) at one thread, for G = 2 ranks per node.  Prints milliseconds (best of 5) and checks that both give the same bits.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_bf16_wire.py [--numel N]

* rounding to the wire: ``.to(bfloat16)`` into a fresh buffer each step, against into the buffer kept from the
  last step (a fresh one is page-faulted in anew);
* the node sum of G received shards: widen everything to fp32 first, then add, against widening each shard as it
  is added;
* the members' results: widen the gathered averages to fp32, then copy them into the member, against widening
  them as they are written into it;
* the noise estimate's buffer: a fresh tensor of the member's size each step, against the reused one.

The "now" column calls the exchange's own functions (exchange/node_wire.py: ``to_wire``, ``wire_values``,
``node_sum``); the "before" column is the code they replaced.
"""
import argparse
import time

import torch

from horovod_terngrad.exchange.node_wire import node_sum, to_wire, wire_values


def best_ms(f, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=25_700_000)
    args = p.parse_args()
    torch.set_num_threads(1)
    n, G = args.numel, 2
    shard = n // G
    n = shard * G
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    raw = to_wire(g)                     # what arrives: G shards of bf16, back to back, as bytes
    wire = wire_values(raw)
    kept_wire = torch.empty(n, dtype=torch.bfloat16)
    node = torch.empty(shard)
    out = torch.empty(n)
    kept_noise = torch.empty(n)

    def sum_before():
        parts = wire.to(torch.float32).view(G, shard)
        torch.add(parts[0], parts[1], out=node)
        node.div_(G)

    def sum_now():
        node_sum(wire.view(G, shard), node, True)

    def result_before():
        values = wire.to(torch.float32)
        out[:shard] = values[:shard]
        out[shard:] = values[shard:]

    def result_now():
        out[:shard] = wire[:shard]
        out[shard:] = wire[shard:]

    sum_before()
    a = node.clone()
    sum_now()
    assert torch.equal(a, node), "node sums differ"
    result_before()
    a = out.clone()
    result_now()
    assert torch.equal(a, out), "results differ"
    assert torch.equal(raw, to_wire(g, into=kept_wire)), "roundings differ"
    rows = [("rounding to the wire", lambda: g.to(torch.bfloat16).view(torch.uint8),
             lambda: to_wire(g, into=kept_wire)),
            ("node sum of the received shards", sum_before, sum_now),
            ("members' results from the gathered averages", result_before, result_now),
            ("noise estimate buffer, filled", lambda: torch.empty_like(g).copy_(g), lambda: kept_noise.copy_(g))]
    print(f"{n} elements, G = {G}, 1 thread: best of 5, ms (same bits both ways)")
    print("| step | before | now |")
    print("|---|---|---|")
    for name, before, now in rows:
        print(f"| {name} | {best_ms(before):.1f} | {best_ms(now):.1f} |")


if __name__ == "__main__":
    main()
