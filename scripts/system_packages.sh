#!/usr/bin/env bash
# install_system_package PACKAGE WHAT: installs a Debian/Ubuntu package with apt-get (as root,
# or through sudo) and says why; sourced by scripts/setup_env.sh and scripts/test.sh.
install_system_package() {
  local package=$1 what=$2 sudo=""
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup] $what: package $package not found and no apt-get here; install it by hand" >&2
    return 1
  fi
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "[setup] installing $package: $what"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "$package" >/dev/null
}
