#!/usr/bin/env bash
# The main job until the local cluster schedules for real: run Tessera's scheduling core on the
# shipped examples and print where each pod goes, and why not where it can't.
set -euo pipefail
cd "$(dirname "$0")/.."
tessera=.venv/bin/tessera
run() {
  echo
  echo "== $1"
  "$tessera" simulate --cluster "examples/$2" --pods "examples/$3" --output table
}
run "Seed node-score example, binpack (node scores 19.75 vs 10.50)" seed-node-score/cluster.yaml seed-node-score/pods-binpack.yaml
run "Seed node-score example, spread" seed-node-score/cluster.yaml seed-node-score/pods-spread.yaml
run "Seed GPU-score example, spread (GPU scores 9.75 vs 24.75)" seed-gpu-score/cluster.yaml seed-gpu-score/pods.yaml
run "Seed GPU-score example, binpack" seed-gpu-score/cluster.yaml seed-gpu-score/pods-binpack.yaml
run "Dynamic MIG: gpu 2 x 8000 MiB on an empty A100-PCIE-40GB" dynamic-mig/cluster.yaml dynamic-mig/pods.yaml
run "MIG fragmentation: the pod stays Pending and says why" mig-fragmentation/cluster.yaml mig-fragmentation/pods.yaml
