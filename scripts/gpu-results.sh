#!/usr/bin/env bash
# The GPU study on a time-limited CUDA machine (docs/results/study.md), one third per call,
# with nothing there but python3 with torch and Triton (no make, no Hydra, offline):
#
#   bash scripts/gpu-results.sh CALL [NAME] [-- more arguments of tools.study]
#
# CALL 1, 2 or 3: the parts of `python -m tools.study --call CALL`; NAME: the study's
# folder (default <date>_<gpu>; give the first call's to a call on a later UTC date).
# Reads Hydra's wheels from $WHL (default .whl/, git-ignored: put Hydra's wheels there
# and take the folder along). Writes $OUT/studyCALL.tar.gz (raw results and view, after every part)
# and $OUT/studyCALL.log. DEADLINE (s, default 480) keeps the call inside a 600 s command limit.
set -euo pipefail
cd "$(dirname "$0")/.."
call=${1:?usage: bash scripts/gpu-results.sh 1|2|3 [NAME] [-- ARGS]}
case $call in
  1|2|3) shift ;;
  *) echo "gpu-results: CALL is 1, 2 or 3 (tools.study --call), not '$call'" >&2
     exit 2 ;;
esac
name=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then name=$1; shift; fi
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
  "$PY" -m tools.study --call "$call" ${name:+--name "$name"} \
    --deadline-s "${DEADLINE:-480}" --archive "$OUT/study$call.tar.gz" "$@"
}
study "$@" 2>&1 | tee "$OUT/study$call.log"  # pipefail: the study's status is the script's
