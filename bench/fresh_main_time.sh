#!/usr/bin/env bash
# Time from a fresh clone to the main job's first progress line (issue 32): the README's
# fresh:main command in a new clone and venv, each output line stamped with seconds since the
# clone began. Usage: bench/fresh_main_time.sh [REPO] (default: this checkout). Prints
# install_s, the stamped lines up to "step 1/", then done.
set -u
t0=$(date +%s.%N)
work=$(mktemp -d -t freshmain-XXXXXX)
git clone -q "${1:-$(git rev-parse --show-toplevel)}" "$work/repo"
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
cd "$work/repo"
python -m pip install -q -e '.[torch]' > "$work/pip.log" 2>&1
t1=$(date +%s.%N)
echo "install_s $(echo "$t1 - $t0" | bc)"
rlengine train 2>&1 | while IFS= read -r line; do
  now=$(date +%s.%N)
  echo "$(echo "$now - $t0" | bc) $line"
  case "$line" in *"step 1"*|*"step 1/"*|*"step  1"*) break;; esac
done
echo "done $(echo "$(date +%s.%N) - $t0" | bc)"
rm -rf "$work"
