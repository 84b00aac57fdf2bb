#!/bin/sh
# pdctl-unitctl SERVICE VERB [GROUP K]: the only actions pdctl's scaler takes on a worker host.
#   states            one line per unit of SERVICE: "<group> <k> <ActiveState> <config label or ->"
#   start GROUP K     start the slot's unit
#   stop GROUP K      stop it (the unit's ExecStop drains the worker)
#   why GROUP K       its ActiveState= and NRestarts= lines, "--", then the last lines its own
#                     processes wrote to the journal, the service's secret values masked (***)
#   stop-now GROUP K SECONDS
#                     stop it without waiting on a drain: what is left after SECONDS is killed
#                     (a hung worker never finishes one); prints the unit's state after
#   fence GROUP K SECONDS
#                     disable it (it no longer starts at boot), then stop-now: a replica that was
#                     replaced while its host was away
# Installed by the pd_worker role; the scaler's SSH key may run nothing else (authorized_keys
# command=...), so every argument is checked against a strict pattern before use.
#
# As an SSH forced command (`command="pdctl-unitctl --ssh SERVICE"` in the scaler user's
# authorized_keys) it takes the requested words from SSH_ORIGINAL_COMMAND, checks them, and
# runs itself through sudo, which allows exactly this script for this service.
#
# A Jinja2 template: the pd_worker role renders it with the plan's layout (pdctl/layout.py),
# unitctl (where it is installed), config_root (the services' config directories) and
# secrets_env (the name of a service's secrets file in its config directory).
set -eu
self={{ unitctl }}
if [ "${1:-}" = "--ssh" ]; then
    [ "$#" -eq 2 ] || { echo "usage: pdctl-unitctl --ssh SERVICE" >&2; exit 2; }
    allowed=$2
    set -f  # no globbing of the client's words
    # shellcheck disable=SC2086 # splitting into words is the point; each is checked
    set -- ${SSH_ORIGINAL_COMMAND:-}
    set +f
    if [ "$#" -lt 3 ] || [ "${1##*/}" != pdctl-unitctl ] || [ "$2" != "$allowed" ]; then
        echo "pdctl-unitctl: not allowed: ${SSH_ORIGINAL_COMMAND:-(nothing)}" >&2
        exit 2
    fi
    shift
    exec sudo -n "$self" "$@"
fi
[ "$#" -ge 2 ] || { echo "usage: pdctl-unitctl SERVICE states|start|stop|stop-now|fence|why [GROUP K [SECONDS]]" >&2; exit 2; }
service=$1 verb=$2
case "$service" in *[!a-z0-9-]* | "" ) echo "bad service name" >&2; exit 2 ;; esac

slot_args() {
    [ "$#" -eq 2 ] || { echo "$verb needs GROUP K" >&2; exit 2; }
    case "$1" in prefill|decode) ;; *) echo "bad group: $1" >&2; exit 2 ;; esac
    case "$2" in *[!0-9]* | "" ) echo "bad slot: $2" >&2; exit 2 ;; esac
    unit="pd-$service-$1@$2.service"
    container="pd-$service-$1-$2"
}

runtime() {
    if command -v podman >/dev/null 2>&1; then echo podman; else echo docker; fi
}

# Copy stdin to stdout with each value of the secrets file $1 (NAME=value lines, root's, 0600)
# replaced by ***: the journal lines leave this host, the only one that knows the values,
# masked (the scaler keeps them in its own journal on the router host). Values are read as
# data (getline, index, substr: no pattern, no escape), longest first; shorter than 4 are left.
mask_secrets() {
    awk -v file="$1" '
        BEGIN {
            while ((getline line < file) > 0) {
                at = index(line, "=")
                value = substr(line, at + 1)
                if (at > 0 && length(value) >= 4) secret[++n] = value
            }
            for (i = 1; i <= n; i++)
                for (j = i + 1; j <= n; j++)
                    if (length(secret[j]) > length(secret[i])) {
                        t = secret[i]; secret[i] = secret[j]; secret[j] = t
                    }
        }
        {
            text = $0
            for (i = 1; i <= n; i++) {
                out = ""
                while ((at = index(text, secret[i])) > 0) {
                    out = out substr(text, 1, at - 1) "***"
                    text = substr(text, at + length(secret[i]))
                }
                text = out text
            }
            print text
        }'
}

unit_state() {
    systemctl show -p ActiveState --value "$unit"
}

# The unit gone within SECONDS (its ExecStop asks the worker to drain), else killed: the unit's
# processes, then the container (podman and docker may run it outside the unit's cgroup).
stop_now() {
    case "$1" in *[!0-9]* | "" ) echo "bad seconds: $1" >&2; exit 2 ;; esac
    [ "$1" -le 3600 ] || { echo "bad seconds: $1" >&2; exit 2; }
    systemctl stop --no-block "$unit"
    waited=0
    while [ "$waited" -lt "$1" ]; do
        case $(unit_state) in inactive|failed) break ;; esac
        sleep 1; waited=$((waited + 1))
    done
    case $(unit_state) in
        inactive|failed) ;;
        *)
            systemctl kill --signal=SIGKILL "$unit" 2>/dev/null || true
            rt=$(runtime)
            "$rt" kill --signal KILL "$container" >/dev/null 2>&1 || true
            "$rt" rm -f "$container" >/dev/null 2>&1 || true
            waited=0
            while [ "$waited" -lt 20 ]; do
                case $(unit_state) in inactive|failed) break ;; esac
                sleep 0.5; waited=$((waited + 1))
            done
            ;;
    esac
    systemctl reset-failed "$unit" 2>/dev/null || true
    state=$(unit_state)
    echo "$state"
    case "$state" in inactive|failed) ;; *) exit 1 ;; esac
}

case "$verb" in
    states)
        rt=$(runtime)
        for env in {{ config_root }}/"$service"/prefill-*.env {{ config_root }}/"$service"/decode-*.env; do
            [ -e "$env" ] || continue
            base=${env##*/}; base=${base%.env}; group=${base%-*}; k=${base##*-}
            state=$(systemctl show -p ActiveState --value "pd-$service-$group@$k.service")
            config=$("$rt" inspect --format '{% raw %}{{ index .Config.Labels "pdctl.config" }}{% endraw %}' \
                "pd-$service-$group-$k" 2>/dev/null || echo -)
            echo "$group $k $state ${config:--}"
        done
        ;;
    start) shift 2; slot_args "$@"; exec systemctl start "$unit" ;;
    stop) shift 2; slot_args "$@"; exec systemctl stop "$unit" ;;
    stop-now)
        shift 2; [ "$#" -eq 3 ] || { echo "stop-now needs GROUP K SECONDS" >&2; exit 2; }
        slot_args "$1" "$2"; stop_now "$3"
        ;;
    fence)
        shift 2; [ "$#" -eq 3 ] || { echo "fence needs GROUP K SECONDS" >&2; exit 2; }
        slot_args "$1" "$2"
        systemctl disable --quiet "$unit" 2>/dev/null || true
        stop_now "$3"
        ;;
    why)
        shift 2; slot_args "$@"
        systemctl show --property=ActiveState,NRestarts "$unit"
        echo --
        journalctl "_SYSTEMD_UNIT=$unit" --lines 15 --no-pager --output cat \
            | mask_secrets {{ config_root }}/"$service"/{{ secrets_env }}
        ;;
    *) echo "unknown verb: $verb" >&2; exit 2 ;;
esac
