#!/usr/bin/env bash
# Regenerates the committed protobuf/gRPC code: Python under api/, and Go for the plugin protocol
# under sidecar-go/pkg/pluginv1/ (the Go shim's client).
# Run from anywhere; add new protos to PROTOS (Python) or GO_PROTOS (Go). Generated with `-I .` from
# the repo root so the generated imports are package-absolute
# (`from api.deviceplugin.v1beta1 import api_pb2`).
# The Go plugins are built from the versions pinned in sidecar-go/go.mod (its `tool` block) into
# $TESSERA_CACHE/bin, so regeneration needs no separately installed protoc or plugins.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-${ROOT}/.venv/bin/python}"
TESSERA_CACHE="${TESSERA_CACHE:-${HOME}/.cache/tessera}"
BIN_DIR="${TESSERA_CACHE}/bin"
export GOCACHE="${GOCACHE:-${TESSERA_CACHE}/go-build}"
export GOMODCACHE="${GOMODCACHE:-${TESSERA_CACHE}/gomod}"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

PROTOS=(
  api/deviceplugin/v1beta1/api.proto
  api/podresources/v1/api.proto
  api/plugin/v1/plugin.proto
)

cd "${ROOT}"
for proto in "${PROTOS[@]}"; do
  "${PYTHON}" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    "${proto}"
  echo "generated ${proto}"
done

# Go: each proto's go_package (tessera/sidecar-go/...) places its output inside sidecar-go/.
GO_MODULE=tessera/sidecar-go
GO_PROTOS=(
  api/plugin/v1/plugin.proto
)
mkdir -p "${BIN_DIR}"
(cd "${ROOT}/sidecar-go" && go build -mod=readonly -o "${BIN_DIR}/" \
    google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc)
for proto in "${GO_PROTOS[@]}"; do
  "${PYTHON}" -m grpc_tools.protoc -I . \
    --plugin=protoc-gen-go="${BIN_DIR}/protoc-gen-go" \
    --plugin=protoc-gen-go-grpc="${BIN_DIR}/protoc-gen-go-grpc" \
    --go_out=sidecar-go --go_opt=module="${GO_MODULE}" \
    --go-grpc_out=sidecar-go --go-grpc_opt=module="${GO_MODULE}" \
    "${proto}"
  echo "generated ${proto} (Go)"
done
