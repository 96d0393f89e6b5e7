#!/usr/bin/env bash
# Install o3edge as a systemd service: the Python package, the unit, its sysusers/tmpfiles
# snippets, optional drop-ins, and the example config (an existing config is never overwritten).
#
#   sudo systemd/install.sh                       # venv in /opt/o3edge, unit in /etc/systemd/system
#   sudo systemd/install.sh --rapl                # also let o3edged read RAPL energy counters
#   DESTDIR=/tmp/pkg PREFIX=/usr systemd/install.sh --no-pip   # packaging: stage files only
#   systemd/install.sh --dry-run                  # print what would be done
#
# Variables: PREFIX (default /opt/o3edge; the daemon is $PREFIX/bin/o3edged), DESTDIR (staging
# root; nothing is run against the live system when set), SYSCONFDIR (/etc), UNITDIR, SYSUSERSDIR,
# TMPFILESDIR (vendor dirs under /usr/lib when PREFIX=/usr, else /etc), DOCDIR, BINDIR (where
# o3edge-cli is linked for a venv install, /usr/local/bin), PYTHON (python3), PIP_OPTS.
set -euo pipefail

usage() {
    sed -n '2,14s/^# \{0,1\}//p' "$0"
    echo "Options: --dry-run --no-pip --rapl --jetson --no-jetson --help"
}

DRY_RUN=0 PIP=1 RAPL=0 JETSON=auto
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --no-pip) PIP=0 ;;
        --rapl) RAPL=1 ;;
        --jetson) JETSON=1 ;;
        --no-jetson) JETSON=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $arg" >&2; usage >&2; exit 2 ;;
    esac
done

SRC=$(cd "$(dirname "$0")/.." && pwd)
DESTDIR=${DESTDIR:-}
PREFIX=${PREFIX:-/opt/o3edge}
PREFIX=${PREFIX%/}
SYSCONFDIR=${SYSCONFDIR:-/etc}
if [ "$PREFIX" = /usr ]; then vendor=/usr/lib; else vendor=$SYSCONFDIR; fi
UNITDIR=${UNITDIR:-$vendor/systemd/system}
SYSUSERSDIR=${SYSUSERSDIR:-$vendor/sysusers.d}
TMPFILESDIR=${TMPFILESDIR:-$vendor/tmpfiles.d}
DROPINDIR=$SYSCONFDIR/systemd/system/o3edge.service.d
DOCDIR=${DOCDIR:-$PREFIX/share/doc/o3edge}
BINDIR=${BINDIR:-/usr/local/bin}
PYTHON=${PYTHON:-python3}
PIP_OPTS=${PIP_OPTS:-}
CONFIG=$SYSCONFDIR/o3edge/o3edge.toml

case "$PREFIX" in /usr|/usr/local) VENV=0 ;; *) VENV=1 ;; esac
if [ "$JETSON" = auto ]; then
    # Auto-detect only on the target itself, never on a packaging host.
    if [ -z "$DESTDIR" ] && { [ -e /etc/nv_tegra_release ] || [ -e /dev/nvmap ]; }; then
        JETSON=1
    else
        JETSON=0
    fi
fi

run() {  # print, then run unless --dry-run
    echo "+ $*"
    if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

put() {  # put MODE SRC DEST: install a file (SRC may be /dev/stdin)
    local mode=$1 src=$2 dest=$DESTDIR$3
    echo "+ install -m $mode $([ "$src" = /dev/stdin ] && echo '<generated>' || echo "$src") $dest"
    if [ "$DRY_RUN" = 0 ]; then
        mkdir -p "$(dirname "$dest")"
        cat "$src" > "$dest.tmp.$$" && chmod "$mode" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest"
    else
        cat "$src" > /dev/null
    fi
}

render_unit() {  # the shipped unit with this install's paths
    sed -e "s|^ExecStart=/usr/bin/o3edged --config /etc/o3edge/o3edge.toml|ExecStart=$PREFIX/bin/o3edged --config $CONFIG|" \
        -e "s|^Documentation=file:/usr/share/doc/o3edge/service.md|Documentation=file:$DOCDIR/service.md|" \
        "$SRC/systemd/o3edge.service"
}

render_jetson() {  # keep only the DeviceAllow= lines whose node exists (all of them when packaging)
    while IFS= read -r line; do
        case "$line" in
            DeviceAllow=*)
                node=${line#DeviceAllow=}; node=${node%% *}
                if [ -n "$DESTDIR" ] || [ -e "$node" ]; then echo "$line"; fi ;;
            *) echo "$line" ;;
        esac
    done < "$SRC/systemd/jetson.conf"
}

if ! grep -q "^ExecStart=$PREFIX/bin/o3edged --config $CONFIG\$" <<< "$(render_unit)"; then
    echo "install.sh: cannot adapt ExecStart= in systemd/o3edge.service" >&2
    exit 1
fi

# 1. The Python package.
if [ "$PIP" = 1 ]; then
    if [ -n "$DESTDIR" ]; then
        run "$PYTHON" -m pip install --root "$DESTDIR" --prefix "$PREFIX" --no-warn-script-location $PIP_OPTS "$SRC"
    elif [ "$VENV" = 1 ]; then
        [ -x "$PREFIX/bin/python" ] || run "$PYTHON" -m venv "$PREFIX"
        run "$PREFIX/bin/python" -m pip install $PIP_OPTS "$SRC"
        run mkdir -p "$BINDIR"
        run ln -sf "$PREFIX/bin/o3edge-cli" "$BINDIR/o3edge-cli"
    else
        run "$PYTHON" -m pip install --prefix "$PREFIX" $PIP_OPTS "$SRC"
    fi
fi

# 2. Files.
render_unit | put 0644 /dev/stdin "$UNITDIR/o3edge.service"
put 0644 "$SRC/systemd/o3edge.sysusers" "$SYSUSERSDIR/o3edge.conf"
put 0644 "$SRC/systemd/o3edge.tmpfiles" "$TMPFILESDIR/o3edge.conf"
put 0644 "$SRC/systemd/o3edge.toml" "$SYSCONFDIR/o3edge/o3edge.toml.example"
if [ -e "$DESTDIR$CONFIG" ]; then
    echo "= keeping existing $DESTDIR$CONFIG (the new example is o3edge.toml.example)"
else
    put 0644 "$SRC/systemd/o3edge.toml" "$CONFIG"
fi
if [ -e "$SRC/docs/service.md" ]; then put 0644 "$SRC/docs/service.md" "$DOCDIR/service.md"; fi
if [ "$RAPL" = 1 ]; then put 0644 "$SRC/systemd/rapl.conf" "$DROPINDIR/rapl.conf"; fi
if [ "$JETSON" = 1 ]; then render_jetson | put 0644 /dev/stdin "$DROPINDIR/jetson.conf"; fi

# 3. Apply on the live system (never when staging into DESTDIR).
if [ -z "$DESTDIR" ]; then
    if command -v systemd-sysusers > /dev/null; then run systemd-sysusers "$SYSUSERSDIR/o3edge.conf"; fi
    if command -v systemd-tmpfiles > /dev/null; then run systemd-tmpfiles --create "$TMPFILESDIR/o3edge.conf"; fi
    if [ -d /run/systemd/system ]; then
        run systemctl daemon-reload
        echo "Installed. Start it with: systemctl enable --now o3edge"
    else
        echo "Installed; systemd is not running here, so nothing was reloaded."
    fi
fi
