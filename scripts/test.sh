#!/usr/bin/env bash
# Run the whole test suite (and ruff) in the project's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV="${NVALCHEMI_VENV:-.venv}"
"$VENV/bin/ruff" check nvalchemi tests benchmarks examples scripts
exec "$VENV/bin/python" -m pytest "$@"
