#!/usr/bin/env bash
# Five core claims must be caught by `make test-fast` (docs/testing.md): each break below is
# applied to the working tree in turn, the test-fast selection (-m "not slow") of the test file
# that holds the claim runs, it must fail, and the file is restored (also on Ctrl-C or error).
# Usage: scripts/check-breaks.sh   (a clean working tree for the files it touches; .venv)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
touched=""
restore() { [ -n "$touched" ] && git checkout -q -- $touched; touched=""; }
trap restore EXIT INT TERM

# break FILE OLD NEW TEST CLAIM: replace OLD by NEW in FILE (exactly once), run TEST
break_one() {
  local file=$1 old=$2 new=$3 test=$4 claim=$5
  if ! git diff --quiet -- "$file"; then echo "check-breaks: $file has changes; commit first"; exit 2; fi
  "$PY" - "$file" "$old" "$new" <<'EOF' || exit 2
import pathlib, sys
path, old, new = sys.argv[1:]
text = pathlib.Path(path).read_text()
if text.count(old) != 1:
    sys.exit(f"check-breaks: the text to break is not in {path} exactly once: {old!r}")
pathlib.Path(path).write_text(text.replace(old, new))
EOF
  touched=$file
  local out
  out=$(OMP_NUM_THREADS=1 TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
        "$test" 2>&1)
  local rc=$?
  restore
  local failed
  failed=$(printf '%s\n' "$out" | grep -E '^FAILED' | sed 's/ - .*//' | head -3 | tr '\n' ' ')
  if [ $rc -eq 1 ] && [ -n "$failed" ]; then
    echo "caught | $claim | $file: \`$(printf '%s\n' "$new" | head -1 | sed 's/^ *//' | cut -c1-72)\` | $failed"
  else
    echo "MISSED | $claim | $file | pytest exit $rc"
    printf '%s\n' "$out" | tail -5
    missed=1
  fi
}

missed=0
break_one memtrain/memory/measure.py \
  '            if key not in self._exclude and key[1] != 0 and not self._is_parameter(t):' \
  '            if key[1] != 0:' \
  tests/test_measure.py "saved-bytes accounting (parameters and the batch excluded)"
break_one memtrain/run/resume.py \
  '    shuffle_gen.set_state(rng["epoch_shuffle"])' \
  '    pass  # the shuffle state is not restored' \
  tests/test_survive.py "kill -9, then resume bit-identical"
break_one memtrain/methods/checkpoint/segments.py \
  '    saved = [(bn, [getattr(bn, k) for k in names]) for bn in bns if bn.track_running_stats]' \
  '    saved = []  # recomputation updates the running statistics a second time' \
  tests/test_checkpoint.py "checkpoint gradients and statistics equal none's"
break_one memtrain/run/runner.py \
  '        except Exception as e:  # a sweep records the failure and goes on' \
  '        except ZeroDivisionError as e:  # broken: other failures escape' \
  tests/test_survive.py "a failure becomes a row"
break_one memtrain/cli.py \
  '            _fail(2, f"error: {e}")
    # after the values are checked' \
  '            raise
    # after the values are checked' \
  tests/test_validate.py "an unknown option is one line with exit 2"
exit $missed
