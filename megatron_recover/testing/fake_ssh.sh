#!/bin/sh
# ssh stand-in for PRRTE on fake nodes (megatron_recover.testing.nodes; mpirun --prtemca
# plm_ssh_agent THIS): AGENT [ssh options] HOST COMMAND...
#
# Runs COMMAND inside fake node HOST's hostname, network and mount namespaces. Like an ssh client
# it stays on the launching machine while the remote command runs and exits with its status, or
# with 255 when HOST cannot be reached: its namespaces are gone (the node was lost) or its link
# is down. When HOST goes silent (link down while the command runs, HOST.silent present) it
# blocks like an ssh client whose peer vanished without closing the connection.
# State: $MEGATRON_RECOVER_FAKE_NODES/HOST.pid (the node's holder process), agents.log.
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host="$1"; shift
state="${MEGATRON_RECOVER_FAKE_NODES:?not a fake-node run}"
echo "host=$host pid=$$" >> "$state/agents.log"
holder=$(cat "$state/$host.pid" 2>/dev/null)
if [ -z "$holder" ] || ! kill -0 "$holder" 2>/dev/null || [ -e "$state/$host.silent" ]; then
  echo "ssh: connect to host $host port 22: No route to host" >&2
  exit 255
fi
nsenter -t "$holder" -u -n -m -- /bin/sh -c "$*"
rc=$?
[ -e "$state/$host.silent" ] && exec sleep 100000
exit $rc
