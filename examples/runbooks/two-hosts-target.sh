#!/bin/sh
# Two hosts: the target side of examples/runbooks/two-hosts.yaml. Run on host A:
#   sh examples/runbooks/two-hosts-target.sh                 # serves on 0.0.0.0:7400
#   LISTEN=10.0.0.1:7400 sh examples/runbooks/two-hosts-target.sh --serve-for 10m
#   sh examples/runbooks/two-hosts-target.sh --metadata etcd://10.0.0.3:2379 --segment bench-a
# Bound to 0.0.0.0 it advertises this host's interface addresses (--advertise HOST picks
# one) and prints the initiator command for host B.
# Extra arguments go to 'kvctl bench transfer'. The segment is sized for the runbook's sweep
# (1 MiB x 32 requests); change both together.
exec kvctl bench transfer --role target --listen "${LISTEN:-0.0.0.0:7400}" \
    --block-size 64KiB,1MiB --batch-size 32 "$@"
