#!/bin/sh
# MPICH hydra's launcher for test hosts (tools/testhosts.py): called as ssh would be, `netns_exec.sh
# [-x] HOST CMD...`, with HOST a test-host address 10.213.0.I; runs CMD inside namespace dpsgdt-hI.
while [ "${1#-}" != "$1" ]; do shift; done  # ssh options hydra adds (-x)
host="$1"; shift
exec ip netns exec "dpsgdt-h${host##*.}" sh -c "$*"
