#!/usr/bin/env bash
# Regenerates the committed Python protobuf/gRPC code under api/.
# Run from anywhere; add new protos to PROTOS. Generated with `-I .` from the repo root so the
# generated imports are package-absolute (`from api.deviceplugin.v1beta1 import api_pb2`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-${ROOT}/.venv/bin/python}"

PROTOS=(
  api/deviceplugin/v1beta1/api.proto
  api/plugin/v1/plugin.proto
)

cd "${ROOT}"
for proto in "${PROTOS[@]}"; do
  "${PYTHON}" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    "${proto}"
  echo "generated ${proto}"
done
