#!/usr/bin/env bash
# Download, on a machine with network, the wheels scripts/gpu_check.sh installs on the GPU machine,
# which has no network and whose image lacks the server's and the SDKs' packages.
#
#     bash scripts/gpu_wheels.sh            # writes .whl/ (about 10 MB); git must ignore it
#
# What goes in: the packages imp_jax, scripts/smoke_server.py and the GGUF loader import that the
# H200 image does not hold (quart, flask, hypercorn, pydantic, openai, anthropic, gguf and their
# missing dependencies; llguidance, regex, prometheus-client and the OpenTelemetry SDK and exporter
# chain, which the server imports at start-up), a few it holds but whose version there is unknown while the packages above
# need a floor (anyio, idna, h11, typing-extensions, werkzeug), and a wheel of this project built
# with --no-deps (its metadata gives /info its version; the code itself is imported from the
# working tree). Versions are the ones installed here, where the test suite passes. The GPU image
# runs CPython 3.12 on x86-64, so binary wheels (pydantic-core, jiter) are fetched for cp312.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY=${PYTHON:-python3}

if ! git check-ignore -q "$DEST/x.whl"; then
  echo "error: git does not ignore $DEST/; add '/$DEST/' to .git/info/exclude first" >&2
  exit 1
fi

NAMES=(
  quart flask hypercorn blinker itsdangerous h2 hpack hyperframe priority wsproto     # the HTTP server
  pydantic pydantic-core annotated-types typing-inspection                           # request models
  openai anthropic httpx2 httpcore2 truststore jiter sniffio docstring-parser        # the two SDKs
  llguidance regex prometheus-client                                                 # the server's own imports
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions             # tracing (--otlp-endpoint)
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
  opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport
  opentelemetry-proto protobuf googleapis-common-protos requests urllib3 charset-normalizer certifi
  gguf                                                                               # GGUF reading
  xxhash                                                                             # KV disk tier checksums
  anyio idna h11 typing-extensions werkzeug                                          # version floors
)
mapfile -t PINNED < <("$PY" - "${NAMES[@]}" <<'EOF'
import importlib.metadata as md, sys
missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"not installed here, so no tested version to pin: {' '.join(missing)}")
EOF
)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DEST" "${PINNED[@]}"
# the project wheel is built from a copy of the working tree, so setuptools' build/ stays out of it
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$src"

count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne $(( ${#PINNED[@]} + 1 )) ]; then
  echo "error: expected $(( ${#PINNED[@]} + 1 )) wheels in $DEST, found $count" >&2
  exit 1
fi
echo "$count wheels, $(du -sh "$DEST" | cut -f1), in $DEST:"
ls "$DEST"
