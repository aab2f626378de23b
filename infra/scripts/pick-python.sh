#!/usr/bin/env bash
# Prints the interpreter a new .venv is made with: of the Python 3.10-3.12 interpreters on PATH
# that can make a virtual environment, the one that runs Python code fastest; the first on PATH
# unless another is more than 10% faster. Says on stderr which it took and why.
#
# Builds of one Python version differ more than versions do. pyenv's default build (libpython
# as a shared library, no profile-guided or link-time optimisation) ran the loop below in
# 0.034-0.044 s where the distribution's build of Python 3.11 (static, optimised) took
# 0.023-0.030 s, and imported the pipeline's stack with 14-20% more CPU; a run of the pipeline or
# of the tests starts hundreds of Python processes. docs/benchmarks.md, "The interpreter".
set -euo pipefail

# min of 5 runs of a small loop of what imports and the pipeline's Python do (calls, dicts, str)
read -r -d '' BENCH <<'EOF' || true
import sys, time
if not (3, 10) <= sys.version_info[:2] < (3, 13):
    sys.exit(1)
import ensurepip, venv  # noqa: F401 - a venv is made with it (Debian splits these out)
def work(n):
    d = {}
    for i in range(n):
        d[i % 997] = str(i) + "x"
    return len(d)
best = float("inf")
for _ in range(5):
    t = time.perf_counter()
    work(200_000)
    best = min(best, time.perf_counter() - t)
print(f"{best:.4f} {sys.version.split()[0]} {getattr(sys, '_base_executable', sys.executable)}")
EOF

seen=" "
first="" first_s="" best="" best_s="" rows=""
for name in python3 python3.12 python3.11 python3.10; do
  while read -r exe; do
    [ -n "$exe" ] || continue
    out=$("$exe" -c "$BENCH" 2>/dev/null) || continue
    read -r seconds version real <<<"$out"
    real=$(readlink -f "$real")
    case "$seen" in *" $real "*) continue ;; esac
    seen="$seen$real "
    rows="$rows  $real ($version): ${seconds} s"$'\n'
    if [ -z "$first" ]; then first=$real first_s=$seconds; fi
    if [ -z "$best" ] || awk -v a="$seconds" -v b="$best_s" 'BEGIN { exit !(a < b) }'; then best=$real best_s=$seconds; fi
  done < <(type -ap "$name" 2>/dev/null || true)
done

if [ -z "$first" ]; then
  echo "error: no Python 3.10-3.12 on PATH that can make a virtual environment (python3 -m venv): install one, or name it with make PYTHON=..." >&2
  exit 1
fi
pick=$first
if awk -v a="$best_s" -v b="$first_s" 'BEGIN { exit !(a < 0.9 * b) }'; then pick=$best; fi
{
  echo "The interpreter for the new .venv: $pick (a loop of Python code, best of 5):"
  printf '%s' "$rows"
  echo "  (the first on PATH unless another is more than 10% faster; make PYTHON=... chooses)"
} >&2
echo "$pick"
