#!/usr/bin/env bash
# The first run of hf-mars's vLLM >= 0.34 path (hf_mars/vllm/speculator*.py, NOT YET RUN before this script), on
# one GPU in at most 8 minutes: a fresh venv with vLLM 0.34 + hf-mars, a toy MARS checkpoint (hf-mars demo
# --quick), the contracts, tests/test_vllm.py, and MARS against plain vLLM (benchmarks/engines/vllm_mars.py).
# Every step has its own time limit inside one overall deadline; a step that runs out is recorded, not fatal.
# The outcome: ${OUT:-runs/gpu-check}/gpu_check.json (and logs/ next to it).
#
#   bash benchmarks/gpu_check.sh            # needs an NVIDIA GPU, and pip access to vLLM's wheels
#   bash benchmarks/gpu_check.sh --dry-run  # prints the steps and writes the JSON of the plan; runs nothing
#
# Environment: OUT (where the JSON and logs go), VLLM_SPEC (default vllm==0.34.0), WHEELS (a folder of wheels:
# install offline from it), PYTHON (default python3), GPU_CHECK_SECONDS (overall deadline, default 480).
# With the venv already built (.venv-gpu-check, vLLM and hf-mars importable) the install step is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT="${OUT:-runs/gpu-check}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm==0.34.0}"
VENV=.venv-gpu-check
DEMO=runs/gpu-check
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-480} ))
LOGS=$(mktemp -d)  # moved under $OUT at the end: the demo refuses an output folder it did not make
STEPS="$LOGS/steps.tsv"
: > "$STEPS"
CORE="contracts_hold or lossless_batch_1 or acceptance_metrics or mask_token_never or refusals"

step() {  # step NAME SECONDS CMD...: run CMD with at most SECONDS (less if the deadline is nearer)
    local name=$1 want=$2 budget=$2 left status rc start
    shift 2
    left=$(( DEADLINE - $(date +%s) ))
    (( budget > left )) && budget=$left
    if (( DRY_RUN )); then
        printf '%-12s <= %4ss  %s\n' "$name" "$budget" "$*"
        printf '%s\t%s\t%s\t%s\n' "$name" "" 0 "planned" >> "$STEPS"
        return 0
    fi
    if (( budget < want && budget < 15 )); then
        printf '%s\t%s\t%s\t%s\n' "$name" "" 0 "skipped: out of time" >> "$STEPS"
        return 1
    fi
    echo "== $name (<= ${budget}s)"
    start=$(date +%s)
    timeout "$budget" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    status=ok
    (( rc == 124 )) && status="timed out after ${budget}s"
    (( rc != 0 && rc != 124 )) && status=failed
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$status" >> "$STEPS"
    echo "   $status (rc $rc); log: $OUT/logs/$name.log"
    return "$rc"
}

install_venv() {  # run by `timeout` through bash -c, hence exported with what it reads
    if "$VENV/bin/python" -c "import vllm, hf_mars" 2>/dev/null; then
        echo "reusing $VENV"
        return 0
    fi
    local pip="$VENV/bin/pip"
    "$PYTHON" -m venv "$VENV" \
        && "$pip" install -q ${WHEELS:+--no-index --find-links "$WHEELS"} "$VLLM_SPEC" \
        && "$pip" install -q ${WHEELS:+--no-index --find-links "$WHEELS"} -e ".[vllm,demo]" "pytest>=8" \
            "pytest-timeout>=2.3"
}
export -f install_venv
export VENV PYTHON VLLM_SPEC WHEELS="${WHEELS:-}"

PY="$VENV/bin/python"
if ! step gpu 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
    (( DRY_RUN )) || { echo "no NVIDIA GPU: nothing to check"; DEADLINE=0; }  # later steps: skipped
fi
step install 150 bash -c install_venv
step contracts 45 "$PY" -c "import json, vllm; from hf_mars.vllm import _patches as p; r = p.uses_registration(); \
print(json.dumps({'vllm': vllm.__version__, 'path': 'registered' if r else 'custom_class', \
'problems': (p.check_contracts_v2 if r else p.check_contracts)()}))"
step demo 75 "$VENV/bin/hf-mars" demo --quick --output-dir "$DEMO"
export HF_MARS_VLLM_GPU_MEMORY=0.15  # the tests start up to three engines in one process
step tests-core 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm_speculator.py tests/test_vllm.py \
    -k "$CORE" --timeout 110 --junitxml "$LOGS/tests-core.xml"
step benchmark 110 "$PY" benchmarks/engines/vllm_mars.py --model "$DEMO/mars-checkpoint" --settings plain mars \
    --requests 16 --out "$LOGS/vllm_mars.json" --logs "$LOGS/vllm"
step tests-rest 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm.py -k "not ($CORE)" --timeout 140 \
    --junitxml "$LOGS/tests-rest.xml"

mkdir -p "$OUT"
rm -rf "$OUT/logs"
cp -r "$LOGS" "$OUT/logs"
rm -rf "$LOGS"
"$PYTHON" - "$OUT" "$DRY_RUN" <<'EOF'
"""gpu_check.json: each step's outcome, the contracts, the test counts and MARS against plain vLLM."""
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, dry_run = Path(sys.argv[1]), sys.argv[2] == "1"
logs = out / "logs"
steps = {}
for line in (logs / "steps.tsv").read_text().splitlines():
    name, rc, seconds, status = line.split("\t")
    steps[name] = {"rc": int(rc) if rc else None, "seconds": int(seconds), "status": status}


def tail(name, lines=1):
    path = logs / f"{name}.log"
    return path.read_text(errors="replace").strip().splitlines()[-lines:] if path.is_file() else []


def tests(name):
    path = logs / f"{name}.xml"
    if not path.is_file():
        return None
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None
                        or c.find("error") is not None]
    return counts


contracts = None
if tail("contracts") and tail("contracts")[0].startswith("{"):
    contracts = json.loads(tail("contracts")[0])
bench = None
if (logs / "vllm_mars.json").is_file():
    report = json.loads((logs / "vllm_mars.json").read_text())
    bench = {name: {scenario: {k: r.get(k) for k in ("acceptance_length", "requests_per_s", "same_as_plain", "lost")}
                    for scenario, r in res.items()} for name, res in report["results"].items()}
    bench["requests"] = report["requests"]
summary = {"dry_run": dry_run, "gpu": tail("gpu"), "steps": steps, "contracts": contracts,
           "tests_core": tests("tests-core"), "tests_rest": tests("tests-rest"), "benchmark": bench}
mars = (bench or {}).get("mars", {})
summary["mars_lossless"] = bool(mars) and all(r["same_as_plain"] == bench["requests"] for r in mars.values())
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: summary[k] for k in ("steps", "contracts", "mars_lossless")}, indent=1))
print(f"written: {out / 'gpu_check.json'}")
EOF
# exit 0 only when every step ran and passed
! grep -qv $'\tok$' "$OUT/logs/steps.tsv" || (( DRY_RUN ))
