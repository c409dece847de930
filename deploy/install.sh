#!/usr/bin/env bash
# Install memqos-shim on a host as a systemd service (proxy mode), or upgrade it in place:
#
#   sudo bash deploy/install.sh [--wheel FILE] [--find-links DIR] [--no-index] [--no-start]
#                               [--python PYTHON] [--root DIR]
#
# - the shim in its own virtual environment, /opt/memqos-shim (python3 -m venv: nothing is
#   installed into the system's Python, so PEP 668 distributions such as Debian 12 and
#   Ubuntu 24.04 are fine); from the wheel given with --wheel, or a wheel built from this
#   checkout. Its dependencies come from the package index, or only from a wheelhouse with
#   --find-links DIR --no-index (a machine without network; docs/install.md says how to make one).
#   An existing, working /opt/memqos-shim is upgraded in place (pip install --upgrade);
# - deploy/memqos-shim.service as /etc/systemd/system/memqos-shim.service (replaced on
#   upgrade: local changes belong in a drop-in, `systemctl edit memqos-shim`);
# - deploy/config.yaml as /etc/memqos-shim/config.yaml, only when there is none (an existing
#   config is never overwritten; the shipped one is always written beside it as
#   config.yaml.example);
# - systemctl daemon-reload, enable --now (--no-start: enable only); on an upgrade of a
#   running unit, restart.
# The kubelet is not touched: pointing it at the shim is the next step (docs/install.md).
#
# --python PYTHON  the interpreter the virtual environment is made from (default python3, >= 3.10)
# --root DIR       install below DIR instead of / (the virtual environment then runs only from
#                  DIR/opt/memqos-shim); no systemctl calls and no root needed. For tests and
#                  staging.
# Exit codes: 0 installed; 1 failed (the message says what to do); 2 bad arguments.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
checkout=$(cd "$here/.." && pwd)
unit_name=memqos-shim.service

die() { echo "install.sh: $*" >&2; exit 1; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

wheel=""
python=python3
root=""
start=1
pip_opts=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) [ $# -ge 2 ] || { usage >&2; exit 2; }; wheel=$2; shift 2 ;;
        --find-links) [ $# -ge 2 ] || { usage >&2; exit 2; }; pip_opts+=(--find-links "$(realpath -m "$2")"); shift 2 ;;
        --no-index) pip_opts+=(--no-index); shift ;;
        --no-start) start=0; shift ;;
        --python) [ $# -ge 2 ] || { usage >&2; exit 2; }; python=$2; shift 2 ;;
        --root) [ $# -ge 2 ] || { usage >&2; exit 2; }; root=$(realpath -m "$2"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

prefix=$root/opt/memqos-shim
unit_dir=$root/etc/systemd/system
conf_dir=$root/etc/memqos-shim

# -- what the install needs ------------------------------------------------------------------
if [ -z "$root" ]; then
    [ "$(id -u)" = 0 ] || die "needs root (run it with sudo), or --root DIR to install below DIR"
    [ -d /run/systemd/system ] || die "systemd is not running on this machine (PID 1 is $(ps -o comm= -p 1 2>/dev/null || echo unknown)); the service needs it"
fi
for f in "$here/memqos-shim.service" "$here/config.yaml"; do
    [ -f "$f" ] || die "missing $f: run this script from a memqos-shim checkout or release tree"
done
if [ -n "$wheel" ]; then
    [ -f "$wheel" ] || die "--wheel $wheel: no such file"
    case "$wheel" in *.whl) ;; *) die "--wheel $wheel: not a wheel (*.whl)" ;; esac
    wheel=$(realpath "$wheel")
fi
command -v "$python" >/dev/null 2>&1 || die "no $python: install Python >= 3.10 (Debian/Ubuntu: apt-get install python3 python3-venv)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "memqos-shim needs Python >= 3.10; $python is $("$python" --version 2>&1)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/memqos-shim-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
log=$tmp/pip.log
pip() { "$prefix/bin/python" -m pip --disable-pip-version-check --no-input "$@" >>"$log" 2>&1; }
pip_failed() { tail -25 "$log" >&2; die "$1"; }

# -- 1. the virtual environment --------------------------------------------------------------
t0=$(date +%s)
upgrade=0
if [ -x "$prefix/bin/python" ] && "$prefix/bin/python" -c 'import pip' >/dev/null 2>&1; then
    upgrade=1
    echo "== upgrading the virtual environment in $prefix ($("$prefix/bin/python" --version 2>&1))"
else
    if [ -e "$prefix" ]; then
        # a broken environment (its Python gone after a distribution upgrade): made again
        [ -f "$prefix/pyvenv.cfg" ] || die "$prefix exists and is not a virtual environment: move it away first"
        echo "== $prefix does not run (its Python is gone?): making it again"
        rm -rf "$prefix"
    fi
    # Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a separate package
    if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        v=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        die "$python has no venv/ensurepip: install the package python3-venv (Debian/Ubuntu: apt-get install python3-venv, or python$v-venv)"
    fi
    echo "== creating the virtual environment $prefix ($("$python" --version 2>&1))"
    mkdir -p "$(dirname "$prefix")"
    "$python" -m venv "$prefix" >>"$log" 2>&1 || { rm -rf "$prefix"; pip_failed "$python -m venv $prefix failed"; }
fi

# -- 2. the wheel ----------------------------------------------------------------------------
if [ -z "$wheel" ]; then
    [ -f "$checkout/pyproject.toml" ] || die "no --wheel and no checkout at $checkout to build one from"
    echo "== building the wheel from $checkout"
    # built from a copy: the checkout gets no build/ or *.egg-info
    mkdir -p "$tmp/src" "$tmp/wheel"
    cp -r "$checkout/pyproject.toml" "$checkout/README.md" "$checkout/shim" "$tmp/src/"
    pip wheel --no-deps --wheel-dir "$tmp/wheel" "${pip_opts[@]+"${pip_opts[@]}"}" "$tmp/src" \
        || pip_failed "building the wheel failed (offline: the wheelhouse needs setuptools and wheel too, or pass --wheel)"
    wheel=$(ls "$tmp/wheel"/memqos_shim-*.whl)
fi

# -- 3. the package --------------------------------------------------------------------------
echo "== installing $(basename "$wheel")${pip_opts[*]+ (pip ${pip_opts[*]})}"
up=()
[ "$upgrade" = 1 ] && up=(--upgrade)
pip install "${up[@]+"${up[@]}"}" "${pip_opts[@]+"${pip_opts[@]}"}" "$wheel" \
    || pip_failed "pip install of $(basename "$wheel") failed (offline: does the wheelhouse hold every dependency? docs/install.md)"
if [ "$upgrade" = 1 ]; then
    # the same version number again (a rebuilt wheel): pip would keep the installed files
    pip install --force-reinstall --no-deps "$wheel" || pip_failed "pip install of $(basename "$wheel") failed"
fi
version=$("$prefix/bin/memqos-shim" --version 2>>"$log") || pip_failed "$prefix/bin/memqos-shim does not run"
version=${version##* }
echo "== memqos-shim $version in $prefix ($(( $(date +%s) - t0 )) s)"

# -- 4. the unit and the config --------------------------------------------------------------
mkdir -p "$unit_dir" "$conf_dir"
install -m 0644 "$here/memqos-shim.service" "$unit_dir/$unit_name"
echo "== unit $unit_dir/$unit_name"
install -m 0644 "$here/config.yaml" "$conf_dir/config.yaml.example"
if [ -e "$conf_dir/config.yaml" ]; then
    echo "== config $conf_dir/config.yaml kept (the shipped one: $conf_dir/config.yaml.example)"
else
    install -m 0644 "$here/config.yaml" "$conf_dir/config.yaml"
    echo "== config $conf_dir/config.yaml (from deploy/config.yaml: check upstream: for your runtime)"
fi

# -- 5. systemd ------------------------------------------------------------------------------
if [ -n "$root" ]; then
    echo "== --root $root: systemctl not called"
else
    systemctl daemon-reload
    if [ "$start" = 0 ]; then
        systemctl enable "$unit_name"
        echo "== enabled, not started (--no-start): systemctl start memqos-shim"
    elif [ "$upgrade" = 1 ] && systemctl is-active --quiet "$unit_name"; then
        systemctl enable "$unit_name"
        systemctl restart "$unit_name" || die "systemctl restart failed: journalctl -u memqos-shim -n 50"
        echo "== restarted: $(systemctl is-active "$unit_name")"
    else
        systemctl enable --now "$unit_name" || die "the unit did not start: journalctl -u memqos-shim -n 50"
        echo "== started: $(systemctl is-active "$unit_name")"
    fi
fi
listen=$(sed -n 's/^listen:[[:space:]]*\([^[:space:]#]*\).*/\1/p' "$conf_dir/config.yaml" | head -1)
echo "== done. Next: point the kubelet at ${listen:-the socket of $conf_dir/config.yaml} and restart it"
echo "   (docs/install.md, \"Switching the kubelet\"); check: $prefix/bin/memqos-shim doctor --config $conf_dir/config.yaml"
