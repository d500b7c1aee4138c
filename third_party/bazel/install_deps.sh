#!/usr/bin/env bash
# Installs what `make bazel-test` needs from the system's package manager when it is missing: Bazel (Debian's
# bazel-bootstrap 4.2.3, which pulls a headless JDK) and GoogleTest (libgtest-dev). Apt only; elsewhere it says
# what to install.
set -euo pipefail
BAZEL="${BAZEL:-bazel}"
need=()
command -v "$BAZEL" >/dev/null 2>&1 || need+=(bazel-bootstrap)
compgen -G "/usr/lib/*/libgtest.a" >/dev/null && [ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "make bazel-test needs Bazel (4.2.x tested; WORKSPACE mode) and GoogleTest (static libgtest.a and" >&2
  echo "libgtest_main.a under /usr/lib/<triplet>/, headers under /usr/include/gtest). Install them, e.g. on" >&2
  echo "Debian/Ubuntu: apt-get install ${need[*]}" >&2
  exit 1
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo=(sudo); else
    echo "make bazel-test: run as root or install: apt-get install ${need[*]}" >&2
    exit 1
  fi
fi
echo "installing ${need[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
# A fresh machine has no package lists yet; a failing update (offline mirror) still lets a cached install work.
"${sudo[@]}" apt-get update -qq || true
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}"
