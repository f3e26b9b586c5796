#!/bin/sh
# MPICH hydra's launcher for test hosts (tools/testhosts.py): called as ssh would be, `netns_exec.sh
# [-x] HOST CMD...`, with HOST a test-host address 10.213.S.I; runs CMD inside namespace dpsgdh-S-hI.
while [ "${1#-}" != "$1" ]; do shift; done  # ssh options hydra adds (-x)
host="$1"; shift
set_host="${host#10.213.}"  # S.I
exec ip netns exec "dpsgdh-${set_host%.*}-h${set_host#*.}" sh -c "$*"
