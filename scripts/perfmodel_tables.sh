#!/usr/bin/env bash
# Regenerates the performance model's committed tables in docs/perfmodel/ (docs/perfmodel.md links them), so a
# change of the model or of the defaults shows in one diff.  Pure arithmetic: seconds, no network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
M="$PY -m horovod_terngrad.modelling"
D=docs/perfmodel
$M --png $D/fig5.png > /dev/null
$M > $D/fig5-tables.txt          # and reternarized-hsdp.md below: scripts/render_docs.py checks both
{ $M --model vgga; $M --model alexnet; } > $D/reternarized-horovod.txt
{ $M --gpus-per-node 8 --model vgga; $M --gpus-per-node 8 --model alexnet; } > $D/default-8gpu-horovod.txt
{ echo '`python -m horovod_terngrad.modelling --model vgga --scheduled` and `--model alexnet --scheduled` (both clusters, 1-512 GPUs; fraction of linear scaling in brackets = compute alone / step; `default`: what `TernGradConfig()` picks, `auto`: `exchange="auto"`)'
  echo; $M --model vgga --scheduled; $M --model alexnet --scheduled; } > $D/scheduled-horovod.md
{ echo '`python -m horovod_terngrad.modelling --gpus-per-node 8 --model vgga --scheduled` and `--model alexnet` (nodes of 8 GPUs)'
  echo; $M --gpus-per-node 8 --model vgga --scheduled; $M --gpus-per-node 8 --model alexnet --scheduled; } > $D/default-8gpu-scheduled-horovod.md
$M hsdp --markdown > $D/reternarized-hsdp.md
{ echo '`python -m horovod_terngrad.modelling hsdp --scheduled --markdown`'; echo; $M hsdp --scheduled --markdown; } > $D/scheduled-hsdp.md
{ echo '`python -m horovod_terngrad.modelling hsdp --gpus-per-node 8 --markdown` and `--scheduled` (nodes of 8 GPUs)'
  echo; $M hsdp --gpus-per-node 8 --markdown; echo; echo 'Scheduled:'; echo
  $M hsdp --gpus-per-node 8 --scheduled --markdown; } > $D/default-8gpu-hsdp.md
echo "wrote $D/*.txt, *.md, fig5.png"
