#!/bin/sh
# What pdctl's roles left on a lab host, one line each ("unit: ...", "path: ...", ...), nothing
# when the host is clean. With --remove, remove it all first (units stopped, then files,
# containers and the scaler's user). Run as root, on the host.
#
# A lab shared by several users hands its hosts on only when this prints nothing: molecule's
# scenarios on one lab (PDCTL_MOLECULE_WORKSPACE: create.yml checks, destroy.yml removes) and the
# test session's shared lab (tests/shared_lab.py checks, after each module destroyed its services).
# What a host keeps for any service is not a leftover: the model cache (/var/lib/pdctl/models)
# and the worker images.
set -u

units() {  # loaded pd-* units (a not-found one is only a name systemd still remembers)
  systemctl list-units --all --plain --no-legend 'pd-*' | awk '$2 != "not-found" {print $1}'
}
unit_files() {  # unit files, drop-ins and enablement links
  find /etc/systemd/system -name 'pd-*'
}
containers() {
  command -v podman >/dev/null 2>&1 || return 0
  # Only names on stdout: podman warns there of what it mends itself ("Found incomplete
  # layer ..., deleting it", after a load was killed). A podman that fails is a finding.
  names=$(podman ps -a --format '{{.Names}}' 2>/dev/null) || { echo "(podman ps failed)"; return 0; }
  printf '%s\n' "$names" | grep '^pd-'
}
paths() {
  for path in /etc/pdctl /opt/pdctl /run/pdctl /usr/local/libexec/pdctl-unitctl \
    /var/lib/pdctl-scaler /etc/sudoers.d/pdctl-*; do
    [ -e "$path" ] && echo "$path"
  done
  find /var/lib/pdctl -mindepth 1 -maxdepth 1 ! -name models 2>/dev/null
}
user() {
  id pdctl-scaler >/dev/null 2>&1 && echo pdctl-scaler
}

if [ "${1:-}" = --remove ]; then
  units | xargs -r systemctl stop
  containers | xargs -r podman rm -f -t 0 >/dev/null 2>&1  # what stays is listed below
  unit_files | xargs -r rm -rf
  systemctl daemon-reload
  systemctl reset-failed 'pd-*' 2>/dev/null
  paths | xargs -r rm -rf
  user | xargs -r userdel -r -f 2>/dev/null
fi

units | sed 's/^/unit: /'
unit_files | sed 's/^/unit file: /'
containers | sed 's/^/container: /'
paths | sed 's/^/path: /'
user | sed 's/^/user: /'
exit 0
