#!/usr/bin/env bash
# Writes `fsdptrace analyze --format json` (and its exit status) for every sample trace, and
# for every run dir found under the ROOTs given (e.g. a test session's recordings,
# <basetemp>/recordings), into OUT_DIR, without the version fields, so two checkouts can be
# compared with `diff -r`:
#   tools/sample_json.sh /tmp/before [ROOT...] && (switch checkout) && tools/sample_json.sh /tmp/after [ROOT...]
#   diff -r /tmp/before /tmp/after && echo identical
set -u
# The console script `fsdptrace` is `fsdptrace_cli.main:main`; run it through the interpreter,
# so the checkout on PYTHONPATH is the one measured, installed or not.
python=${PYTHON:-python}
out=$(realpath -m "${1:?usage: tools/sample_json.sh OUT_DIR [ROOT...]}")
shift
roots=()
for root in "$@"; do roots+=("$(realpath "$root")"); done
mkdir -p "$out"
cd "$(dirname "$0")/.."
run_dirs() {
    printf '%s\n' sample_traces/*/
    # A run dir holds a meta/ table folder; a launch-NNN inside one is analyzed with it.
    for root in "${roots[@]}"; do
        find "$root" -type d -name meta -printf '%h\n' | grep -v '/launch-[0-9]*$' | sort -u
    done
}
run_dirs | while read -r dir; do
    name=$(echo "${dir%/}" | sed 's|^/||; s|/|__|g')
    "$python" -m fsdptrace_cli.main analyze --format json "$dir" 2>"$out/$name.stderr" \
        | grep -v '"fsdptrace_version":' >"$out/$name.json"
    echo "exit ${PIPESTATUS[0]}" >"$out/$name.exit"
done
