#!/usr/bin/env bash
# Issue 24, point 6 ("a compiled piece only if the numbers demand it"), measured: compile
# the load path's modules with mypyc into a scratch copy of the package, then alternate
# scripts/load_loop.py between that copy and the interpreted package. Nothing here is
# part of the install: the copy lives under $DIR. mypyc cannot compile source.py (an
# async generator), transports/nixl.py (its base class is interpreted) or layout.py as
# they are written, so those stay interpreted; CopyPlan.mapping's "object" annotation
# becomes Any in the copy (mypyc rejects it in a slotted dataclass).
# Usage: bash scripts/mypyc_probe.sh [ROUNDS] [LOADS]   (needs mypy and a C compiler;
#   DIR: the scratch directory, default ~/xavier_mypyc; it must not lie under a
#   directory holding an __init__.py, or mypy takes that directory for a package)
set -euo pipefail
ROUNDS=${1:-3}; LOADS=${2:-20000}; DIR=${DIR:-$HOME/xavier_mypyc}
here=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$DIR" && mkdir -p "$DIR"
(cd "$here" && git archive HEAD xavier_async pyproject.toml) | tar -x -C "$DIR"
cd "$DIR"
sed -i 's/^    mapping: object$/    mapping: Any/; s/^from dataclasses import dataclass$/from dataclasses import dataclass\nfrom typing import Any/' xavier_async/channel.py
mods="protocol decision planning stages fairpool sizes recvslabs channel packing receiver scheduling shielded endpoint runtime peers merging snapshots transports/nixl_copies"
mypyc $(for m in $mods; do echo xavier_async/$m.py; done) > build.log 2>&1 || { tail -20 build.log; exit 1; }
cd "$here"
for i in $(seq "$ROUNDS"); do
  echo -n "compiled:    "; PYTHONPATH="$DIR" python3 scripts/load_loop.py "$LOADS" 2>/dev/null | tail -1
  echo -n "interpreted: "; python3 scripts/load_loop.py "$LOADS" 2>/dev/null | tail -1
done
