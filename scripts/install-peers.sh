#!/usr/bin/env bash
# Installs the Debian packages of the benchmark's peers when they are missing (as
# root; otherwise says what to install). Used by scripts/bench.sh and scripts/test.sh.
set -euo pipefail
need_apt=()
[ -x /usr/bin/etcd ] || need_apt+=(etcd-server)
[ -f /usr/share/java/zookeeper.jar ] || need_apt+=(zookeeper)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-sentinel >/dev/null || need_apt+=(redis-sentinel)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
command -v mariadbd >/dev/null || need_apt+=(mariadb-server)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "missing: ${need_apt[*]} (install them, or run as root to install automatically)" >&2
    exit 1
  fi
fi
