#!/bin/sh
# pdctl-unitctl SERVICE VERB [GROUP K]: the only actions pdctl's scaler takes on a worker host.
#   states            one line per unit of SERVICE: "<group> <k> <ActiveState> <config label or ->"
#   start GROUP K     start the slot's unit
#   stop GROUP K      stop it (the unit's ExecStop drains the worker)
# Installed by the pd_worker role; the scaler's SSH key may run nothing else (authorized_keys
# command=...), so every argument is checked against a strict pattern before use.
set -eu
[ "$#" -ge 2 ] || { echo "usage: pdctl-unitctl SERVICE states|start|stop [GROUP K]" >&2; exit 2; }
service=$1 verb=$2
case "$service" in *[!a-z0-9-]* | "" ) echo "bad service name" >&2; exit 2 ;; esac

slot_args() {
    [ "$#" -eq 2 ] || { echo "$verb needs GROUP K" >&2; exit 2; }
    case "$1" in prefill|decode) ;; *) echo "bad group: $1" >&2; exit 2 ;; esac
    case "$2" in *[!0-9]* | "" ) echo "bad slot: $2" >&2; exit 2 ;; esac
    unit="pd-$service-$1@$2.service"
}

runtime() {
    if command -v podman >/dev/null 2>&1; then echo podman; else echo docker; fi
}

case "$verb" in
    states)
        rt=$(runtime)
        for env in /etc/pdctl/"$service"/prefill-*.env /etc/pdctl/"$service"/decode-*.env; do
            [ -e "$env" ] || continue
            base=${env##*/}; base=${base%.env}; group=${base%-*}; k=${base##*-}
            state=$(systemctl show -p ActiveState --value "pd-$service-$group@$k.service")
            config=$("$rt" inspect --format '{{ index .Config.Labels "pdctl.config" }}' \
                "pd-$service-$group-$k" 2>/dev/null || echo -)
            echo "$group $k $state ${config:--}"
        done
        ;;
    start) shift 2; slot_args "$@"; exec systemctl start "$unit" ;;
    stop) shift 2; slot_args "$@"; exec systemctl stop "$unit" ;;
    *) echo "unknown verb: $verb" >&2; exit 2 ;;
esac
