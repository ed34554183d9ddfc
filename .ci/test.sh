#!/usr/bin/env bash
# Sets up a fresh virtualenv and runs the test suite: the README's test command.
#   PYTHON   interpreter to build the venv from (default python3)
#   JAX_PIN  optional pip requirement for jax, e.g. "jax==0.10.2" (the oldest supported)
#   VENV     where to build it (default .venv)
#   EXTRAS   pip extras to install (default "test"; CI adds "compile-check" for the Triton
#            compile check, which skips cleanly without it)
# Extra arguments go to pytest (e.g. -m slow, -k routing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[${EXTRAS:-test}]" ${JAX_PIN:+"$JAX_PIN"}
"$VENV/bin/python" -c "import jax, flax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__)"
# worksteal: workers take tests from each other as they finish (durations are uneven). A test
# whose worker dies in native code (XLA:CPU now and then, in a different test each time) runs
# again in a fresh worker, up to twice; --only-rerun's pattern matches no message, so an ordinary failure is
# never rerun (the crash recovery ignores it).
exec "$VENV/bin/python" -m pytest -q -n 2 --dist worksteal --reruns 2 --only-rerun '(?!)' "$@"
