#!/usr/bin/env bash
# Installs the Debian packages given (with sudo unless root), quietly; does
# nothing without arguments. Used by scripts/test.sh.
set -euo pipefail
(($#)) || exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
echo "== installing $*"
# Packages with a service (openssh-server) must not start it: the tests
# start their own daemons, inside network namespaces. Where no
# policy-rc.d forbids it already (containers have one), one does during
# the install.
policy=/usr/sbin/policy-rc.d
made_policy=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  made_policy=1
fi
trap '[ -z "$made_policy" ] || $sudo rm -f "$policy"' EXIT
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
