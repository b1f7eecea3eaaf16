# Sourced by run_train.sh and run_tests.sh. Sets PYTHON to an interpreter that has the project and its
# dependencies, creating .venv and installing into it on the first run.
#   ensure_env EXTRAS MODULES   e.g. ensure_env "" "torch torchdata"  or  ensure_env "[dev]" "pytest"
# TORCH_VERSION=X (e.g. 2.14.1) uses its own environment, .venv-torchX, with torch==X and the same other
# packages, so a newer torch can be tried without touching .venv (which keeps the pinned torch).
# pip's output goes to the log; the console gets a line at most every 10 s saying what pip is at, so a first
# install (a minute or more) visibly progresses. Its status is pip's (pipefail).
_install_progress() {
    local log="$1" line last=0 now
    : >"$log"
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        case "$line" in
            Collecting*|Downloading*|"Installing collected"*|"Building"*|Successfully*|Resolved*|Installed*|*uv*)
                now=$(date +%s)
                if [ $((now - last)) -ge 10 ] || [ "${line#Successfully}" != "$line" ] || [ "${line#Installed}" != "$line" ]; then
                    echo "[setup] ${line:0:100}"
                    last=$now
                fi ;;
        esac
    done
}

# Installs the project (editable) and its dependencies into the venv $1: $2 is the project with its extras,
# the rest pip-style requirement arguments (-c FILE, torch==X). uv, itself a small wheel from the registry,
# downloads and installs in parallel (about 15 s against pip's minute for [dev]) and resolves the same
# versions; it does not read pip's configuration, so pip's find-links (where local wheels such as a CPU build
# of torch lie) are passed on. Without uv (no registry for it), pip does the same, slower, and says so.
_install() {
    local venv="$1" project="$2" links=() link
    shift 2
    if "$venv/bin/python" -m pip install --no-compile uv >/dev/null 2>&1 && [ -x "$venv/bin/uv" ]; then
        for link in ${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null)}; do
            links+=(--find-links "$link")
        done
        "$venv/bin/uv" pip install --python "$venv/bin/python" "${links[@]}" "$@" -e "$project"
    else
        echo "[setup] uv could not be installed; installing with pip (slower)"
        "$venv/bin/python" -m pip install --upgrade pip && "$venv/bin/python" -m pip install --no-compile "$@" -e "$project"
    fi
}

ensure_env() {
    local extras="$1" modules="$2" root venv torch_req=()
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    venv="$root/.venv"
    local check="import importlib.metadata as m, importlib.util as u; m.version('llm-trainer')"
    if [ -n "${TORCH_VERSION:-}" ]; then
        # The version asked for decides the interpreter (a PYTHON set for .venv would test the pinned torch).
        venv="$root/.venv-torch$TORCH_VERSION"
        PYTHON="$venv/bin/python"
        torch_req=("torch==$TORCH_VERSION")
        check="$check; assert m.version('torch').split('+')[0] == '$TORCH_VERSION', 'torch'"
    elif [ -z "${PYTHON:-}" ]; then
        if [ -x "$venv/bin/python" ]; then PYTHON="$venv/bin/python"; else PYTHON=python3; fi
    fi
    # find_spec only locates the packages (no import): the check costs milliseconds, not seconds.
    for mod in torch torchdata torchao tokenizers tensorboard safetensors $modules; do
        check="$check; assert u.find_spec('$mod'), '$mod'"
    done
    if "$PYTHON" -c "$check" >/dev/null 2>&1; then return 0; fi

    local name=${venv##*/}
    echo "[setup] installing the project into $name (log: $name/install.log)..."
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || return 1
    PYTHON="$venv/bin/python"
    local constraints=()
    # No GPU: pin the CPU build of torch so pip never pulls a multi-GB CUDA build. A TORCH_VERSION is
    # installed as asked (a release without a CPU build, e.g. 2.14.1, comes as its CUDA build, which runs
    # on CPU too).
    if [ -z "${TORCH_VERSION:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
        constraints=(-c "$root/constraints.txt")
    fi
    if ! _install "$venv" "$root$extras" "${constraints[@]}" "${torch_req[@]}" 2>&1 | _install_progress "$venv/install.log"
    then
        tail -n 30 "$venv/install.log"
        echo "[setup] installation failed; full log in $name/install.log" >&2
        return 1
    fi
    # Neither installer byte-compiles (--no-compile; uv never does): Python writes each module's compiled file
    # at its first import. torch is compiled ahead on every core, since every process imports a large part of
    # it, often several processes at once; importing the trainer then compiles the rest of what every
    # process imports (sympy, numpy, ...). The other 70 % of the installed files (transformers, lm-eval, ...)
    # are compiled when a command first imports them, instead of all of them here (40 CPU-s saved).
    echo "[setup] byte-compiling torch and what the trainer imports..."
    # (a few files in some packages are not Python 3 and fail to compile, as they do under pip: not an error)
    "$PYTHON" -m compileall -q -j 0 "$("$PYTHON" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("torch").origin))')" \
        >>"$venv/install.log" 2>&1 || true
    "$PYTHON" -c "import trainer.train, trainer.cli" >>"$venv/install.log" 2>&1 || true
    echo "[setup] done."
}
