#!/usr/bin/env bash
# Install Debian's `prometheus` package (the Prometheus server and promtool) into a virtual environment, without root
# and without touching the system: apt-get, with a package list of its own, downloads the .deb (apt checks it against
# Debian's signed index) and dpkg -x unpacks it under VENV/opt/prometheus; VENV/bin/prometheus and VENV/bin/promtool
# link to the binaries (static Go builds that need only libc). Idempotent: does nothing when they already run.
#
#   bash deploy/prometheus/install-prometheus.sh .venv
set -euo pipefail

venv=${1:?usage: install-prometheus.sh VENV}
venv=$(cd "$venv" && pwd)
prefix="$venv/opt/prometheus"

if "$venv/bin/prometheus" --version >/dev/null 2>&1 && "$venv/bin/promtool" --version >/dev/null 2>&1; then
    touch "$prefix/.installed"   # make's target
    exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
    echo "install-prometheus: apt-get and dpkg are needed (a Debian or Ubuntu machine): install Prometheus 2.x" \
         "yourself and link its prometheus and promtool binaries into $venv/bin" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
apt_opts=(-q -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "Debug::NoLocking=1"
          -o "APT::Sandbox::User=$(id -un)")
apt-get "${apt_opts[@]}" update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; exit 1; }
(cd "$work" && apt-get "${apt_opts[@]}" download prometheus) >"$work/download.log" 2>&1 \
    || { cat "$work/download.log" >&2; exit 1; }

rm -rf "$prefix"
mkdir -p "$prefix"
dpkg -x "$work"/prometheus_*.deb "$prefix"
ln -sfn ../opt/prometheus/usr/bin/prometheus "$venv/bin/prometheus"  # relative: the venv may move
ln -sfn ../opt/prometheus/usr/bin/promtool "$venv/bin/promtool"
"$venv/bin/prometheus" --version | head -1
touch "$prefix/.installed"
