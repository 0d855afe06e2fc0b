#!/usr/bin/env bash
# Installs the Debian packages given (with sudo unless root), quietly; does
# nothing without arguments. Used by scripts/test.sh.
set -euo pipefail
(($#)) || exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
echo "== installing $*"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
