#!/usr/bin/env bash
# The main job: train the built-in potential on the bundled EMT data set.
# Extra arguments go to `nvalchemi-training quickstart` (e.g. --minutes 2, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${NVALCHEMI_VENV:-.venv}/bin/nvalchemi-training" quickstart "$@"
