#!/bin/sh
# The container image's install steps, in one place: deploy/container/Dockerfile runs
# them, and `tox -e dist` replays them outside a container (.ci/distcheck/image.py):
# the same wheels, the same install, then a storage node and a server started from it.
#
#   sh deploy/container/install-waltz.sh wheels DIR
#       in the root of a checkout: the wheel of every distribution the image holds
#   sh deploy/container/install-waltz.sh install DIR VENV
#       a fresh venv VENV from DIR's wheels (their dependencies from PyPI): both roles
#       (the command decides), the server and the storage node with the default
#       plugins (fs engine, ZooKeeper, ZeroMQ, the lock tables, `local`), etcd, the
#       client and every `waltz` command of these;
#       fails unless `waltz plugins list` shows each plugin the image promises
set -eu
PYTHON=${PYTHON:-python3}

case "${1:-}" in
wheels)
    # ./ before each: a path, never a name pip would look up on PyPI
    "$PYTHON" -m pip wheel --no-deps --wheel-dir "$2" \
        ./packages/waltz-api ./packages/waltz-cli \
        ./packages/waltz-storage-fs \
        ./packages/waltz-client ./packages/waltz-server ./packages/waltz-storage-node \
        ./packages/waltz-coord-zk ./packages/waltz-coord-etcd \
        ./packages/waltz-coord-local ./packages/waltz-transport-zmq
    ;;
install)
    "$PYTHON" -m venv "$3"
    "$3/bin/pip" install --find-links "$2" "waltz-server[default,etcd]" "waltz-storage-node[default]"
    listed=$("$3/bin/waltz" plugins list)
    for plugin in fs zk etcd local zmq hwm-array exact; do
        if ! printf '%s\n' "$listed" | grep -Eq "^  $plugin +waltz-"; then
            echo "install-waltz.sh: the plugin $plugin is not installed in $3" >&2
            exit 1
        fi
    done
    ;;
*)
    echo "usage: install-waltz.sh wheels DIR | install DIR VENV" >&2
    exit 2
    ;;
esac
