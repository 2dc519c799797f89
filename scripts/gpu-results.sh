#!/usr/bin/env bash
# The study on a time-limited CUDA machine (docs/results/study.md) in one call, with nothing
# there but python3 with torch and Triton (no make, no Hydra, offline):
#
#   bash scripts/gpu-results.sh [NAME] [-- more arguments of tools.study]
#
# Parts in priority order (tools/study/study_plan.py: PRIORITY, then the rest while time remains);
# parts complete under docs/results/*/parts/ for a GPU are skipped (-- --remeasure PARTS).
# NAME: the study's folder (default <date>_<gpu>). Reads Hydra's wheels from $WHL (default
# .whl/, git-ignored: put Hydra's wheels there and take the folder along). Writes
# $OUT/study.tar.gz (raw results and part records, packed again after every part) and
# $OUT/study.log. DEADLINE (s, default 480) is the whole call's, installs included.
# MEMTRAIN_COMMIT names the commit where the copy has no git history.
set -euo pipefail
cd "$(dirname "$0")/.."
name=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  case $1 in
    -*) echo "gpu-results: usage: bash scripts/gpu-results.sh [NAME] [-- ARGS], not '$1'" >&2
        exit 2 ;;
  esac
  name=$1; shift
fi
[ "${1:-}" = "--" ] && shift
PY=${PY:-python3}
WHL=${WHL:-.whl}
: "${OUT:?OUT: the folder whose files come back}"
if ! compgen -G "$WHL/*.whl" >/dev/null; then
  echo "gpu-results: no wheels in $WHL/ (put Hydra's wheels there: docs/results/study.md)" >&2
  exit 2
fi
WHL=$(cd "$WHL" && pwd)
mkdir -p "$OUT"

study() {
  # Hydra and its plugins beside the box's packages, never over them (--target, --no-deps)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WHL/site" \
    "$WHL"/*.whl
  # memtrain editable (its package-dir mapping, memtrain.kernels, needs the install);
  # --no-build-isolation builds with the box's setuptools instead of fetching one
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  export PYTHONPATH="$WHL/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  "$PY" -c "import hydra, memtrain.kernels, torch, triton; print('gpu-results: torch', \
torch.__version__, 'triton', triton.__version__, 'hydra', hydra.__version__)"
  # the driver's deadline is what the installs left of the call's; no view on the box (it is
  # made from the archive afterwards: make results PARTS=report)
  local left=$(( ${DEADLINE:-480} - SECONDS ))
  echo "gpu-results: installs took ${SECONDS} s; the study gets ${left} s"
  "$PY" -m tools.study ${name:+--name "$name"} --no-report --deadline-s "$left" \
    --archive "$OUT/study.tar.gz" "$@"
}
study "$@" 2>&1 | tee "$OUT/study.log"  # pipefail: the study's status is the script's
