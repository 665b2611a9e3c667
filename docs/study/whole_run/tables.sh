#!/usr/bin/env bash
# Renders the whole-run study's tables and curves from the runs' JSON (examples/study_lm_scale.py --table):
#   bash docs/study/whole_run/tables.sh
# writes docs/study/whole_run/table-<workload>.md and curves-<workload>.png for each workload directory, and
# real.md from the real-process runs (docs/study/whole_run/run_real.sh).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-.venv/bin/python}
D=docs/study/whole_run
for w in llama-perlpod gpt2-copyright llama-vimdoc; do
  [ -f "$D/$w/runs.jsonl" ] || continue
  $PY examples/study_lm_scale.py --table "$D/$w" --write "$D/table-$w.md" --plot "$D/curves-$w.png" > /dev/null
done
# table_of_rows NAME: the table of the study rows on stdin (JSON lines) as $D/table-NAME.md
table_of_rows() {
  local tmp
  tmp=$(mktemp -d)
  cat > "$tmp/runs.jsonl"
  $PY examples/study_lm_scale.py --table "$tmp" --write "$D/table-$1.md" > /dev/null
  rm -r "$tmp"
}
# the runs with the senders' squares, beside the same workload's fp32 runs (the same batches per seed)
if [ -f "$D/llama-perlpod-squares/runs.jsonl" ]; then
  { grep '"method": "none"' "$D/llama-perlpod/runs.jsonl"; cat "$D/llama-perlpod-squares/runs.jsonl"; } |
    table_of_rows llama-perlpod-squares
fi
# the owner-step study (examples/owner_step.py) beside fp32 and the default at the same lr
if [ -f "$D/llama-perlpod-owner/runs.jsonl" ]; then
  { grep '"method": "none"' "$D/llama-perlpod/runs.jsonl" | grep '"lr": 0.004'
    grep '"lr": 0.004' "$D/llama-perlpod-squares/runs.jsonl"; cat "$D/llama-perlpod-owner/runs.jsonl"; } |
    table_of_rows llama-perlpod-owner
fi
# the owner-step runs on the second workload, beside its fp32 and default runs (an fp32 lr bracket of its own)
if [ -f "$D/gpt2-copyright-owner/runs.jsonl" ]; then
  $PY examples/study_lm_scale.py --table "$D/gpt2-copyright,$D/gpt2-copyright-owner" \
      --write "$D/table-gpt2-copyright-owner.md" > /dev/null
fi
# the first stage rounded to 3 or 4 levels on the third workload, beside its fp32 and default runs
if [ -f "$D/llama-vimdoc-levels/runs.jsonl" ]; then
  $PY examples/study_lm_scale.py --table "$D/llama-vimdoc,$D/llama-vimdoc-levels" \
      --write "$D/table-llama-vimdoc-levels.md" > /dev/null
fi
# the product's four-level first stage (TernGradConfig(levels=4)) on the first two workloads, at fp32's best lr,
# beside fp32 there, the default (ternary first stage) and owner-step on the ternary one
if [ -f "$D/llama-perlpod-levels/runs.jsonl" ]; then
  { grep '"method": "none"' "$D/llama-perlpod/runs.jsonl" | grep '"lr": 0.004'
    grep -h '"lr": 0.004' "$D/llama-perlpod-squares/runs.jsonl" "$D/llama-perlpod-owner/runs.jsonl"
    cat "$D/llama-perlpod-levels/runs.jsonl"; } | table_of_rows llama-perlpod-levels
fi
if [ -f "$D/gpt2-copyright-levels/runs.jsonl" ]; then
  { cat "$D/gpt2-copyright/runs.jsonl" "$D/gpt2-copyright-owner/runs.jsonl" | grep '"lr": 0.008'
    cat "$D/gpt2-copyright-levels/runs.jsonl"; } | table_of_rows gpt2-copyright-levels
fi
$PY - <<'PYEOF'
import glob, json, os, re, statistics
D = "docs/study/whole_run"
runs = {}
for path in sorted(glob.glob(os.path.join(D, "real", "*.json"))):
    m = re.match(r"(.+)\.s(\d+)\.json$", os.path.basename(path))
    if m:
        runs.setdefault(m.group(1), {})[int(m.group(2))] = json.load(open(path))
if runs:
    base = statistics.mean(r["held_out_loss"] for r in runs["ddp8-fp32"].values()) if "ddp8-fp32" in runs else None
    lines = ["| run | frontend | ranks | seeds | held-out per seed | mean | spread | vs fp32 (DDP 8 ranks) mean | worst seed "
             "| bits per element sent (ternarized / all) | identical parameters |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for tag in sorted(runs, key=lambda t: (not t.endswith("fp32"), t)):
        rs = [runs[tag][s] for s in sorted(runs[tag])]
        vals = [r["held_out_loss"] for r in rs]
        mean = statistics.mean(vals)
        gap = f"{100 * (mean / base - 1):+.2f}%" if base else "-"
        worst = f"{100 * (max(vals) / base - 1):+.2f}%" if base else "-"
        bits = f"{statistics.mean(r['bits_per_element_ternarized'] for r in rs):.2f} / " \
               f"{statistics.mean(r['bits_per_element_overall'] for r in rs):.2f}"
        same = "yes" if all(r["params_identical"] for r in rs) else "NO"
        lines.append(f"| {tag} | {rs[0]['frontend']} | {rs[0]['ranks']} | {len(rs)} | "
                     f"{' / '.join(f'{v:.4f}' for v in vals)} | {mean:.4f} | {max(vals) - min(vals):.4f} | {gap} | "
                     f"{worst} | {bits} | {same} |")
    open(os.path.join(D, "real.md"), "w").write("\n".join(lines) + "\n")
# adam_floor.jsonl: the estimate's whole sum (no senders' squares); adam_floor_squares.jsonl: with them;
# adam_floor_owner.jsonl: OwnerStepOptimizer's arithmetic (the owners' exact averages, the first stage's estimate)
# adam_floor_levels.jsonl: the level-rounding harness on the third workload (examples/level_rounding.py)
floors = [(os.path.join(D, f), what) for f, what in (("adam_floor_squares.jsonl", "with the senders' squares"),
                                                      ("adam_floor_owner.jsonl", "first stage's, with the squares"),
                                                      ("adam_floor.jsonl", "whole sum, no squares"),
                                                      ("adam_floor_levels.jsonl",
                                                       "independent draws', with the squares"))]
if any(os.path.exists(f) for f, _ in floors):
    lines = ["| workload | exchange | noise estimate | N | steps | lr | share of elements at the floor "
             "| median (v - n) / v | median step vs fp32 AdamW's: optim.AdamW "
             "| the same with torch's AdamW (no estimate) | held-out (64 windows) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for floor, what in floors:
        for r in ([json.loads(line) for line in open(floor) if line.strip()] if os.path.exists(floor) else []):
            est = "the owner's s'²·\\|t'\\|" if r["method"].startswith("reternarized") else what
            work = f"{r.get('model', 'llama 2x64')} {r.get('corpus', 'perlpod')}"
            lines.append(f"| {work} | {r['method']} | {est} | {r['N']} | {r['steps']} | {r['lr']:g} | "
                         f"{100 * r['share_at_floor']:.0f}% | {r['median_v_minus_n_over_v']:.2f} | "
                         f"{r['median_step_vs_fp32_adamw']:.2f}x | {r['median_step_vs_fp32_adamw_torch_adamw']:.2f}x | "
                         f"{r['held_out']:.4f} |")
    open(os.path.join(D, "adam_floor.md"), "w").write("\n".join(lines) + "\n")
PYEOF
echo "wrote $D/table-*.md, curves-*.png, real.md"
