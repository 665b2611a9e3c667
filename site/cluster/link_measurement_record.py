"""Add a set of link_measurement.sh runs to docs/cluster/link_measurement.json (the rows the job prints as LINKROW,
as link_measurement.sh writes them: one JSON object per line).

    docs/cluster/link_measurement.sh 10 2 $PWD gloo > rows.jsonl
    python docs/cluster/link_measurement_record.py rows.jsonl SET_NAME COMMIT "COMMAND"

scripts/render_docs.py renders docs/cluster.md's table of the sets from the JSON.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def row(run: int, r: dict) -> dict:
    return {"run": run, "measured_across_gbps": round(r["measured_across_gbps"], 3),
            "measured_inside_gbps": round(r["measured_inside_gbps"], 3),
            "priced_across_gbps": r["priced_across_gbps"], "priced_inside_gbps": r["priced_inside_gbps"],
            "plan": r["plan"], "node_aware_fraction": r["node_aware_fraction"], "group_numels": r["group_numels"],
            "host0_eth0_MB_per_step_tx_rx": [round(r["host0_eth0_tx_MB_per_step"], 3),
                                             round(r["host0_eth0_rx_MB_per_step"], 3)],
            "probe_s": round(r["probe_s"], 3), "loadavg_1min": float(r["loadavg"][0]),
            "step_s": [round(s, 3) for s in r["step_s"]],
            "probe_times_ms_per_rank_world_small_large_node_small_large": r["probe_times_ms"]}


def main(argv=None) -> int:
    rows_path, name, commit, command = (argv or sys.argv[1:])[:4]
    path = os.path.join(HERE, "link_measurement.json")
    with open(path) as f:
        doc = json.load(f)
    with open(rows_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    doc["runs"][name] = [row(x["run"], x["row"]) for x in lines]
    doc.setdefault("sets", {})[name] = {"commit": commit, "command": command,
                                        "probe": "two sizes, agreed, priced on the grid"}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
