#!/usr/bin/env bash
# The system programs the test suite starts for real, installed before pytest starts:
# Prometheus (prometheus, promtool), Alertmanager (prometheus-alertmanager, amtool),
# PostgreSQL's server (initdb, pg_ctl, postgres) and Chromium (chromium: the run report's
# headless-browser tests, driven by playwright without its own browser download). Each is
# checked by its own binary, so a machine that has one package and not the other gets the
# missing one. Debian/Ubuntu only; elsewhere (or without root) it names what is missing and
# exits 1.
set -euo pipefail

declare -A PACKAGE_OF=(
  [prometheus]=prometheus [promtool]=prometheus
  [prometheus-alertmanager]=prometheus-alertmanager [amtool]=prometheus-alertmanager
  [initdb]=postgresql [pg_ctl]=postgresql [postgres]=postgresql
  [chromium]=chromium
)

have() {  # PostgreSQL's server programs live outside PATH on Debian
  command -v "$1" >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/$1" >/dev/null
}

missing_packages() {
  local tool
  for tool in "${!PACKAGE_OF[@]}"; do have "$tool" || echo "${PACKAGE_OF[$tool]}"; done | sort -u
}

mapfile -t packages < <(missing_packages)
[ ${#packages[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-test-tools: missing ${packages[*]}; install them (Debian/Ubuntu:" \
       "sudo apt-get install -y --no-install-recommends ${packages[*]}) and rerun" >&2
  exit 1
fi

echo "install-test-tools: installing ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d answering 101 tells maintainer scripts to start no service during the install.
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
  created_policy=1
fi
trap '[ $created_policy -eq 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
log=$(mktemp)
if ! apt-get install -y --no-install-recommends "${packages[@]}" >"$log" 2>&1; then
  apt-get update >"$log" 2>&1 || true  # stale package lists on a fresh machine
  if ! apt-get install -y --no-install-recommends "${packages[@]}" >"$log" 2>&1; then
    echo "install-test-tools: apt-get install ${packages[*]} failed:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
fi

mapfile -t still < <(missing_packages)
if [ ${#still[@]} -ne 0 ]; then
  echo "install-test-tools: still missing after the install: ${still[*]}" >&2
  exit 1
fi
