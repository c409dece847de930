#!/usr/bin/env bash
# Remove what deploy/install.sh installed:
#
#   sudo bash deploy/uninstall.sh [--purge] [--no-reset] [--force] [--root DIR]
#
# Point the kubelet back at the runtime's socket and restart it FIRST (docs/install.md,
# "Removing it"): a kubelet left on the shim's socket cannot create or stop pods. This script
# refuses while the kubelet uses the shim's socket, or is configured to (its command line, its
# KubeletConfiguration's containerRuntimeEndpoint, kubeadm-flags.env, /etc/default/kubelet),
# unless --force. Then:
# - systemctl stop memqos-shim;
# - memqos-shim reset --config /etc/memqos-shim/config.yaml: the pod/QoS/node memory.min and
#   memory.low the shim wrote back to 0 (--no-reset: leave them);
# - systemctl disable, the unit file removed, daemon-reload; /opt/memqos-shim removed;
# - /etc/memqos-shim kept (--purge: removed, with the unit's drop-ins and /var/log/memqos-shim).
#
# --root DIR  remove below DIR instead of / (as install.sh --root): no systemctl, no reset, the
#             kubelet's files looked for below DIR, no process checked. For tests.
# Exit codes: 0 removed (or nothing to remove); 1 failed or refused; 2 bad arguments.
set -euo pipefail
unit_name=memqos-shim.service

die() { echo "uninstall.sh: $*" >&2; exit 1; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

root=""
purge=0
force=0
reset=1
while [ $# -gt 0 ]; do
    case "$1" in
        --purge) purge=1; shift ;;
        --force) force=1; shift ;;
        --no-reset) reset=0; shift ;;
        --root) [ $# -ge 2 ] || { usage >&2; exit 2; }; root=$(realpath -m "$2"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "uninstall.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done
prefix=$root/opt/memqos-shim
unit_file=$root/etc/systemd/system/$unit_name
conf_dir=$root/etc/memqos-shim
config=$conf_dir/config.yaml
if [ -z "$root" ]; then
    [ "$(id -u)" = 0 ] || die "needs root (run it with sudo), or --root DIR"
fi

# -- 1. is the kubelet still on the shim? ------------------------------------------------------
# the shim's socket, as the config names it (default: the unit's runtime directory)
listen=""
[ -f "$config" ] && listen=$(sed -n 's/^listen:[[:space:]]*\([^[:space:]#]*\).*/\1/p' "$config" | head -1)
sock=${listen:-unix:///run/memqos-shim/memqos-shim.sock}
sock=${sock#unix://}
sock=${sock#/var}          # /var/run is /run: match either spelling
sock=${sock#/}
uses=()
kubelet_files=("$root/var/lib/kubelet/kubeadm-flags.env" "$root/etc/default/kubelet" "$root/etc/sysconfig/kubelet"
               "$root/var/lib/kubelet/config.yaml" "$root/etc/kubernetes/kubelet.conf.d")
if [ -z "$root" ]; then
    for pid in $(pgrep -x kubelet 2>/dev/null || true); do
        args=$(tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null || true)
        if grep -qF -- "$sock" <<<"$args"; then
            uses+=("the running kubelet (pid $pid): $(grep -F -- "$sock" <<<"$args" | head -1)")
        fi
        # its KubeletConfiguration file: --config=FILE or --config FILE
        kc=$(awk 'p { print; exit } /^--config=/ { sub(/^--config=/, ""); print; exit } /^--config$/ { p = 1 }' <<<"$args")
        [ -n "$kc" ] && kubelet_files+=("$kc")
    done
fi
for f in "${kubelet_files[@]}"; do
    [ -e "$f" ] || continue
    hit=$(grep -rsHF -- "$sock" "$f" | grep -v '^[^:]*:[[:space:]]*#' | head -1 || true)
    [ -n "$hit" ] && uses+=("$hit")
done
if [ ${#uses[@]} -gt 0 ]; then
    {
        echo "uninstall.sh: the kubelet uses the shim's socket ($sock):"
        printf '  %s\n' "${uses[@]}"
        echo "Point it back at the runtime's socket and restart the kubelet first (docs/install.md, \"Removing it\"),"
        echo "or pass --force (the kubelet then cannot create or stop pods until it is switched back)."
    } >&2
    [ "$force" = 1 ] || exit 1
    echo "uninstall.sh: --force: removing anyway" >&2
fi

# -- 2. stop, reset, disable -------------------------------------------------------------------
if [ -z "$root" ]; then
    if systemctl cat "$unit_name" >/dev/null 2>&1; then
        systemctl stop "$unit_name" || die "systemctl stop $unit_name failed"
        echo "== stopped"
    fi
fi
if [ "$reset" = 1 ] && [ -z "$root" ] && [ -x "$prefix/bin/memqos-shim" ]; then
    args=()
    [ -f "$config" ] && args=(--config "$config")
    # the audit of the reset goes to the journal of this command, not the shim's audit file
    if "$prefix/bin/memqos-shim" reset "${args[@]+"${args[@]}"}" --audit-log -; then
        echo "== memqos-shim reset: pod/QoS/node memory.min and memory.low back to 0"
    else
        die "memqos-shim reset failed (above); nothing removed yet. Run again with --no-reset to remove without it"
    fi
elif [ "$reset" = 1 ] && [ -n "$root" ]; then
    echo "== --root $root: memqos-shim reset not run"
fi
if [ -z "$root" ]; then
    systemctl disable "$unit_name" >/dev/null 2>&1 || true
fi

# -- 3. files ----------------------------------------------------------------------------------
rm -f "$unit_file"
[ "$purge" = 1 ] && rm -rf "$unit_file.d"
if [ -z "$root" ]; then
    systemctl daemon-reload
    systemctl reset-failed "$unit_name" >/dev/null 2>&1 || true
fi
echo "== unit removed"
if [ -e "$prefix" ]; then
    [ -f "$prefix/pyvenv.cfg" ] || die "$prefix is not a virtual environment made by install.sh: not removed"
    rm -rf "$prefix"
    echo "== $prefix removed"
fi
if [ "$purge" = 1 ]; then
    rm -rf "$conf_dir" "$root/var/log/memqos-shim"
    echo "== $conf_dir and $root/var/log/memqos-shim removed (--purge)"
elif [ -d "$conf_dir" ]; then
    echo "== $conf_dir kept (--purge removes it)"
fi
