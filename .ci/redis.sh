#!/usr/bin/env bash
# Make sure a redis-server binary exists for the remote-tier tests. The tests start and
# stop their own servers on free loopback ports; this script only installs the binary.
# Failure is not fatal: without redis-server those tests skip and say why.
#
# Use: .ci/redis.sh            (or: source .ci/redis.sh && ensure_redis_server)

ensure_redis_server() {
    if command -v redis-server >/dev/null 2>&1; then
        return 0
    fi
    echo "redis-server not found; installing it" >&2
    local sudo=""
    if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then
        sudo="sudo -n"
    fi
    if command -v apt-get >/dev/null 2>&1 \
        && $sudo apt-get update -qq >/dev/null 2>&1 \
        && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null 2>&1 \
        && command -v redis-server >/dev/null 2>&1; then
        echo "installed $(redis-server --version | cut -d' ' -f1-3)" >&2
        return 0
    fi
    echo "could not install redis-server; the remote-tier tests will be skipped" >&2
    return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    ensure_redis_server
fi
