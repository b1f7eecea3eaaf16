# Sourced by run_train.sh and run_tests.sh. Sets PYTHON to an interpreter that has the project and its
# dependencies, creating .venv and installing into it on the first run.
#   ensure_env EXTRAS MODULES   e.g. ensure_env "" "torch torchdata"  or  ensure_env "[dev]" "pytest"
# pip's output goes to the log; the console gets a line at most every 10 s saying what pip is at, so a first
# install (a minute or more) visibly progresses. Its status is pip's (pipefail).
_install_progress() {
    local log="$1" line last=0 now
    : >"$log"
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        case "$line" in
            Collecting*|Downloading*|"Installing collected"*|"Building"*|Successfully*)
                now=$(date +%s)
                if [ $((now - last)) -ge 10 ] || [ "${line#Successfully}" != "$line" ]; then
                    echo "[setup] ${line:0:100}"
                    last=$now
                fi ;;
        esac
    done
}

ensure_env() {
    local extras="$1" modules="$2" root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if [ -z "${PYTHON:-}" ]; then
        if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
    fi
    # find_spec only locates the packages (no import): the check costs milliseconds, not seconds.
    local check="import importlib.metadata as m, importlib.util as u; m.version('llm-trainer')"
    for mod in torch torchdata torchao tokenizers tensorboard safetensors $modules; do
        check="$check; assert u.find_spec('$mod'), '$mod'"
    done
    if "$PYTHON" -c "$check" >/dev/null 2>&1; then return 0; fi

    echo "[setup] installing the project into .venv (log: .venv/install.log)..."
    [ -x "$root/.venv/bin/python" ] || python3 -m venv "$root/.venv" || return 1
    PYTHON="$root/.venv/bin/python"
    local constraints=()
    # No GPU: pin the CPU build of torch so pip never pulls a multi-GB CUDA build.
    if ! command -v nvidia-smi >/dev/null 2>&1; then constraints=(-c "$root/constraints.txt"); fi
    # pip byte-compiles what it installs on one core; compileall does the same on every core afterwards (the
    # compiled files are what makes importing torch and the rest take seconds, not three times as long).
    if ! { "$PYTHON" -m pip install --upgrade pip \
            && "$PYTHON" -m pip install --no-compile "${constraints[@]}" -e "$root$extras"; } \
            2>&1 | _install_progress "$root/.venv/install.log"; then
        tail -n 30 "$root/.venv/install.log"
        echo "[setup] installation failed; full log in .venv/install.log" >&2
        return 1
    fi
    echo "[setup] byte-compiling the installed packages..."
    # (a few files in some packages are not Python 3 and fail to compile, as they do under pip: not an error)
    "$PYTHON" -m compileall -q -j 0 "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >>"$root/.venv/install.log" 2>&1 || true
    echo "[setup] done."
}
