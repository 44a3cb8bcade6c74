#!/usr/bin/env bash
# Optional extra: build llama.cpp (the real engine that judges our GGUF exports) into the
# draftsmith cache. Idempotent: a finished build is reused and only its location is printed.
#
# The source is llama.cpp's whole MIT tree as vendored in the PyPI sdist llama-cpp-python
# (vendor/llama.cpp); nothing else is downloaded. Needs cmake and a C++ compiler
# (Debian: apt-get install -y cmake g++). About 5 minutes on 2 cores.
#
#   bash scripts/install_llamacpp.sh            # build (or find) it, print its bin/ folder
#   DRAFTSMITH_LLAMACPP=/path/to/bin pytest     # tests and `draftsmith` use this build
#
# Tools built: llama-server, llama-speculative-simple, llama-completion, llama-tokenize.
set -euo pipefail
VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
CACHE=${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}
ROOT="$CACHE/llama.cpp/llama-cpp-python-$VERSION"
BIN="$ROOT/build/bin"
TOOLS=(llama-server llama-speculative-simple llama-completion llama-tokenize)
JOBS=${JOBS:-$(nproc)}

have_all() { for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
if have_all; then echo "$BIN"; exit 0; fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "install_llamacpp: '$tool' not found; on Debian: apt-get install -y cmake g++" >&2; exit 1; }
done
PY=${PYTHON:-python3}
[ -x "$(dirname "$0")/../.venv/bin/python" ] && PY="$(dirname "$0")/../.venv/bin/python"

mkdir -p "$ROOT"
SRC="$ROOT/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  dl=$(mktemp -d "$ROOT/.download-XXXXXX")
  trap 'rm -rf "$dl"' EXIT
  echo "install_llamacpp: fetching the llama-cpp-python==$VERSION sdist (source only, ~75 MB)" >&2
  # --no-binary names only this package: its build backend (scikit-build-core, for pip's metadata step)
  # may come as a wheel, which saves building it and its own backends from source first
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -d "$dl"
  tar -xzf "$dl"/llama_cpp_python-"$VERSION".tar.gz -C "$dl"
  rm -rf "$SRC"
  mv "$dl/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
fi

echo "install_llamacpp: building ${TOOLS[*]} with $JOBS jobs (about 5 min on 2 cores)" >&2
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DGGML_NATIVE=ON >"$ROOT/cmake-configure.log" 2>&1 ||
  { tail -30 "$ROOT/cmake-configure.log" >&2; exit 1; }
cmake --build "$ROOT/build" -j "$JOBS" --target "${TOOLS[@]}" >"$ROOT/cmake-build.log" 2>&1 ||
  { tail -30 "$ROOT/cmake-build.log" >&2; exit 1; }
have_all || { echo "install_llamacpp: build finished but a tool is missing under $BIN" >&2; exit 1; }
echo "$BIN"
