#!/usr/bin/env bash
# Writes `fsdptrace analyze --format json` (and its exit status) for every sample trace into
# OUT_DIR, without the version fields, so two checkouts can be compared with `diff -r`:
#   tools/sample_json.sh /tmp/before && (switch checkout) && tools/sample_json.sh /tmp/after
#   diff -r /tmp/before /tmp/after && echo identical
set -u
# The console script `fsdptrace` is `fsdptrace_cli.main:main`; run it through the interpreter,
# so the checkout on PYTHONPATH is the one measured, installed or not.
python=${PYTHON:-python}
out=${1:?usage: tools/sample_json.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
for dir in sample_traces/*/; do
    name=$(basename "$dir")
    "$python" -m fsdptrace_cli.main analyze --format json "$dir" 2>"$out/$name.stderr" \
        | grep -v '"fsdptrace_version":' >"$out/$name.json"
    echo "exit ${PIPESTATUS[0]}" >"$out/$name.exit"
done
