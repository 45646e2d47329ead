#!/usr/bin/env bash
#
# One instance of a PostgreSQLCluster (the Capstan PostgreSQL plugin): its entrypoint,
# the agent that keeps it in the role the plugin decided, and its probes.
#
#   entrypoint.sh          start the instance and stay its main process (the agent)
#   entrypoint.sh ready    readiness: postgres answers, in the role this instance adopted
#   entrypoint.sh live     liveness: fails only for a primary that a newer topology
#                          deposed and that has not stepped down (a stuck agent), or a
#                          server that no longer answers at all
#
# The plugin decides the roles and writes them to the topology file (a ConfigMap the
# kubelet mounts): an epoch, the primary of that epoch, how many standbys must confirm
# a commit, and every member's address. Following it needs no API rights and no clock
# shared with the other instances (the reports below use the Pod's token, which may
# patch one ConfigMap and nothing else). It only ever moves forward: the highest epoch it
# adopted is kept on the volume (beside PGDATA), and a file that shows an older epoch
# (a kubelet that has not caught up) or another primary for an epoch already adopted is
# ignored.
#
# What the agent does when it adopts epoch E with primary P:
# - P is this instance and it is a standby: it promotes itself, once
#   1. the previous primary no longer takes writes (it does not answer, or answers as a
#      standby);
#   2. enough standbys no longer follow the previous primary: with synchronous
#      replication (k standbys confirm each commit) every instance but the previous
#      primary and k-1 others must have adopted E, so that one of them holds every
#      commit that was acknowledged, and the previous primary can no longer have one
#      acknowledged;
#   3. it has caught up with the most advanced of them (it streams from that one);
#   4. PROMOTE_HOLD seconds have passed since it adopted E (its readiness probe fails
#      meanwhile, so that its kubelet reports it not ready: the plugin takes it for the
#      primary only once its readiness has changed since it named it);
#   then it promotes, and asks its standbys for k confirmations per commit.
# - P is another instance and this one is a standby: it follows P.
# - This instance runs as a primary and the new epoch is not one it was promoted in: it
#   stops postgres and starts again (the same process, from the top). Its data last
#   served as a primary, so it is rewound onto the new primary's timeline with pg_rewind
#   (or copied from the new primary again when pg_rewind cannot work, keeping the old
#   data aside), and it follows.
#
# Everything comes from the environment, so the same script runs in the StatefulSet and
# in the plugin's loopback test:
#   POD_NAME              this instance's member name (the Pod name)         (required)
#   PGDATA                the data directory                                 (required)
#   TOPOLOGY_FILE         the topology the plugin writes                     (required)
#   APP_USER, APP_PASSWORD, APP_DATABASE
#                         the application role and the database it owns      (required)
#   REPLICATION_USER, REPLICATION_PASSWORD
#                         the role standbys and the agents connect as        (required)
#   PG_PORT               the port to listen on                              (5432)
#   PG_LISTEN_ADDRESSES   listen_addresses                                   (*)
#   PG_SOCKET_DIR         directory of the Unix socket                       (/var/run/postgresql)
#   WAL_KEEP_SIZE         WAL the primary keeps for standbys that lag        (256MB)
#   BASEBACKUP_ATTEMPTS   tries to copy the primary, 5 s apart               (60)
#   AGENT_INTERVAL        seconds between two looks at the topology          (1)
#   PEER_TIMEOUT          seconds to wait for another instance's answer      (3)
#   PROMOTE_HOLD          seconds between adopting an epoch that names this
#                         instance and promoting it (see step 4 above)       (0)
#   REPORT_CONFIGMAP      the ConfigMap this instance reports its role, timeline
#                         and WAL position to, as key POD_NAME, in POD_NAMESPACE,
#                         with the Pod's service account token (curl); unset:
#                         no reports                                         ()
#   REPORT_INTERVAL       seconds between two reports that only move the WAL
#                         position (a new role, timeline or epoch is at once) (10)
#
# The topology file, one setting per line (members repeat):
#   epoch=3
#   primary=demo-1
#   synchronous=1                       standbys that confirm each commit; 0: none
#   member=demo-0 demo-0.demo 5432      name, host, port
#
# Needs PostgreSQL 13 or later and bash, timeout and sleep (coreutils); the official
# postgres images have them. Passwords never reach a command line, a log line or a file
# other than a 0600 password file next to the data directory.

set -euo pipefail
umask 077

log() { printf '%s entrypoint: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }
die() {
	log "$*"
	exit 1
}
# Starts the instance again from the top, in this process (no container restart, so no
# kubelet back-off); postgres must be stopped.
start_again() {
	log "$1: starting again"
	sleep "${2:-1}"
	exec bash "$SCRIPT" run
}
# Seconds since boot: this machine's monotonic clock, compared with itself only.
uptime_seconds() {
	local up _
	read -r up _ </proc/uptime
	printf '%s' "${up%.*}"
}

PG_PORT=${PG_PORT:-5432}
PG_LISTEN_ADDRESSES=${PG_LISTEN_ADDRESSES:-*}
PG_SOCKET_DIR=${PG_SOCKET_DIR:-/var/run/postgresql}
# Where local_sql connects: the server's socket, or the maintenance server's.
SQL_SOCKET_DIR=$PG_SOCKET_DIR
maintenance_socket_dir=$PG_SOCKET_DIR/maintenance
WAL_KEEP_SIZE=${WAL_KEEP_SIZE:-256MB}
BASEBACKUP_ATTEMPTS=${BASEBACKUP_ATTEMPTS:-60}
AGENT_INTERVAL=${AGENT_INTERVAL:-1}
PEER_TIMEOUT=${PEER_TIMEOUT:-3}
PROMOTE_HOLD=${PROMOTE_HOLD:-0}
REPORT_INTERVAL=${REPORT_INTERVAL:-10}
SCRIPT=${BASH_SOURCE[0]}

# Data is prepared beside PGDATA and moved into place when complete, so a crash halfway
# through leaves PGDATA absent and the next start simply begins again. The agent's own
# state lives beside it on the same volume, outside what pg_basebackup and pg_rewind copy.
staging="${PGDATA:-}.staging"
passfile="${PGDATA:-}.pgpass"
adopted_file="${PGDATA:-}.topology"
promoted_file="${PGDATA:-}.primary-epoch"
diverged="${PGDATA:-}.diverged"
# The settings the agent changes while postgres runs, included from postgresql.conf.
agent_conf=capstan.conf

# --- the topology --------------------------------------------------------------------

# Reads a topology file into T_EPOCH, T_PRIMARY, T_SYNC, T_PREVIOUS and T_MEMBERS (name
# -> "host port"), T_ORDER (names in file order). Fails on a file that is not one.
read_topology() {
	local file=$1 key value name host port
	T_EPOCH='' T_PRIMARY='' T_SYNC=0 T_PREVIOUS=''
	T_MEMBERS=()
	T_ORDER=()
	[ -r "$file" ] || return 1
	while IFS='=' read -r key value; do
		case $key in
		epoch) T_EPOCH=$value ;;
		primary) T_PRIMARY=$value ;;
		synchronous) T_SYNC=$value ;;
		previous) T_PREVIOUS=$value ;;
		member)
			read -r name host port <<<"$value"
			[ -n "$port" ] || return 1
			T_MEMBERS[$name]="$host $port"
			T_ORDER+=("$name")
			;;
		esac
	done <"$file"
	case $T_EPOCH in '' | *[!0-9]*) return 1 ;; esac
	case $T_SYNC in '' | *[!0-9]*) return 1 ;; esac
	[ -n "$T_PRIMARY" ] && [ -n "${T_MEMBERS[$T_PRIMARY]:-}" ]
}
declare -A T_MEMBERS=()
T_ORDER=()

# The topology this instance acts on: the adopted one, or the file's when it is newer
# (then it is adopted: the new epoch is written to the volume before anything acts on it).
# Sets the T_* variables and ADOPTED_NOW=1 when the epoch changed.
current_topology() {
	ADOPTED_NOW=0
	local a_epoch=0 a_primary='' a_previous=''
	if read_topology "$adopted_file"; then
		a_epoch=$T_EPOCH a_primary=$T_PRIMARY a_previous=$T_PREVIOUS
	fi
	if ! read_topology "$TOPOLOGY_FILE"; then
		# No usable file (yet): keep what was adopted, if anything.
		read_topology "$adopted_file" || die "no usable topology in $TOPOLOGY_FILE"
		return 0
	fi
	if [ "$T_EPOCH" -gt "$a_epoch" ]; then
		local tmp="$adopted_file.tmp"
		{
			grep -v '^previous=' "$TOPOLOGY_FILE"
			# The primary this epoch replaces: the one to fence and to catch up from.
			printf 'previous=%s\n' "$a_primary"
		} >"$tmp"
		sync "$tmp" 2>/dev/null || true
		mv "$tmp" "$adopted_file"
		read_topology "$adopted_file" || die "cannot read back $adopted_file"
		ADOPTED_NOW=1
		ADOPTED_AT=$(uptime_seconds)
		log "adopted epoch $T_EPOCH: primary $T_PRIMARY, $T_SYNC synchronous standby(s), ${#T_ORDER[@]} member(s)"
	elif [ "$T_EPOCH" -eq "$a_epoch" ]; then
		# Same epoch: its primary is fixed once adopted; members and synchronous may change.
		if [ "$T_PRIMARY" != "$a_primary" ]; then
			waiting "ignoring primary $T_PRIMARY for epoch $T_EPOCH: this instance adopted $a_primary for it"
			T_PRIMARY=$a_primary
		fi
		T_PREVIOUS=$a_previous
	else
		# The file is older than what was adopted (the kubelet has not caught up).
		read_topology "$adopted_file" || die "cannot read $adopted_file"
	fi
}

host_of() { local m=${T_MEMBERS[$1]:-}; printf '%s' "${m% *}"; }
port_of() { local m=${T_MEMBERS[$1]:-}; printf '%s' "${m#* }"; }

conninfo_of() {
	printf 'host=%s port=%s user=%s passfile=%s application_name=%s' \
		"$(host_of "$1")" "$(port_of "$1")" "$REPLICATION_USER" "$passfile" "$POD_NAME"
}

# ANY k ("a","b") over the members but this one, or '' when k is 0.
sync_names() {
	local k=$T_SYNC names='' m
	[ "$k" -gt 0 ] || return 0
	for m in "${T_ORDER[@]}"; do
		[ "$m" = "$POD_NAME" ] || names+="${names:+,}\"$m\""
	done
	[ -n "$names" ] || return 0
	printf 'ANY %s (%s)' "$k" "$names"
}

# --- talking to postgres -------------------------------------------------------------

# psql as the superuser through this instance's socket.
local_sql() {
	timeout "$PEER_TIMEOUT" psql -X -q -At -v ON_ERROR_STOP=1 -h "$SQL_SOCKET_DIR" -p "$PG_PORT" \
		-U postgres -d postgres -c "$1"
}

# psql as the replication role on another member; fails when it does not answer in time.
peer_sql() {
	timeout "$PEER_TIMEOUT" psql -X -q -At -v ON_ERROR_STOP=1 \
		-d "host=$(host_of "$1") port=$(port_of "$1") user=$REPLICATION_USER dbname=postgres passfile=$passfile connect_timeout=$PEER_TIMEOUT" \
		-c "$2" 2>/dev/null
}

in_recovery() { [ "$(local_sql 'SELECT pg_is_in_recovery()')" = t ]; }

# Whether LSN $1 is beyond LSN $2 (asked of the local server).
lsn_after() { [ "$(local_sql "SELECT pg_wal_lsn_diff('$1', '$2') > 0")" = t ]; }

# The furthest WAL this instance holds: received or replayed.
my_lsn() {
	local_sql "SELECT greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())"
}

# What a member says of itself: epoch|in recovery|furthest LSN|host:port it streams from.
peer_state() {
	peer_sql "$1" "SELECT coalesce(nullif(current_setting('capstan.epoch', true), ''), '0'),
		pg_is_in_recovery(),
		CASE WHEN pg_is_in_recovery()
		     THEN coalesce(greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::text, '0/0')
		     ELSE pg_current_wal_lsn()::text END,
		coalesce((SELECT sender_host || ':' || sender_port FROM pg_stat_wal_receiver
		          WHERE status = 'streaming'), '')"
}

# Quotes a value for postgresql.conf: inside '...', quote and backslash are doubled.
conf_quote() {
	local v=${1//\\/\\\\}
	printf "'%s'" "${v//\'/\'\'}"
}

# Writes the settings the agent owns: whom to stream from ('' = nobody), the
# synchronous standbys, and the epoch (read by the other agents).
write_agent_conf() {
	local follow=$1 tmp="$PGDATA/$agent_conf.tmp"
	{
		printf '# Written by the PostgreSQL plugin'"'"'s agent: edits are lost.\n'
		printf 'primary_conninfo = %s\n' "$(conf_quote "$follow")"
		printf 'synchronous_standby_names = %s\n' "$(conf_quote "$(sync_names)")"
		printf 'capstan.epoch = %s\n' "$(conf_quote "$T_EPOCH")"
	} >"$tmp"
	mv "$tmp" "$PGDATA/$agent_conf"
	grep -qx "include_if_exists = '$agent_conf'" "$PGDATA/postgresql.conf" ||
		printf "\ninclude_if_exists = '%s'\n" "$agent_conf" >>"$PGDATA/postgresql.conf"
}

reload() { local_sql 'SELECT pg_reload_conf()' >/dev/null; }

# --- setup ---------------------------------------------------------------------------

# Arguments of the server proper, for either role. What the agent changes at run time
# (primary_conninfo, synchronous_standby_names) is in capstan.conf: a -c would win over it.
server_args() {
	SERVER_ARGS=(
		-D "$PGDATA"
		-p "$PG_PORT"
		-c "listen_addresses=$PG_LISTEN_ADDRESSES"
		-c "unix_socket_directories=$PG_SOCKET_DIR"
		-c wal_level=replica
		-c max_wal_senders=10
		-c "wal_keep_size=$WAL_KEEP_SIZE"
		-c hot_standby=on
		# pg_rewind needs it to rejoin a deposed primary to the new timeline.
		-c wal_log_hints=on
	)
}

# Quotes a value for psql's \set: inside '...', backslash and quote are escaped.
psql_quote() {
	local v=${1//\\/\\\\}
	printf "'%s'" "${v//\'/\\\'}"
}

# Quotes a field of a password file: backslash and colon are escaped.
pgpass_quote() {
	local v=${1//\\/\\\\}
	printf '%s' "${v//:/\\:}"
}

write_passfile() {
	printf '*:*:*:%s:%s\n' "$(pgpass_quote "$REPLICATION_USER")" \
		"$(pgpass_quote "$REPLICATION_PASSWORD")" >"$passfile"
}

write_hba() {
	cat >"$1/pg_hba.conf" <<EOF
# Written by the PostgreSQL plugin's entrypoint on every start: edits are lost.
# TYPE  DATABASE     USER                 ADDRESS  METHOD
local   all          all                           trust
host    replication  "$REPLICATION_USER"  all      scram-sha-256
host    all          all                  all      scram-sha-256
EOF
}

# Starts a server on $1 reachable only through the Unix socket, for setup. No standby
# can reach it, so its commits must not wait for one.
# A server for maintenance (roles, passwords): no TCP, and its socket in a directory of
# its own, so that neither clients nor the readiness probe reach it (a primary would
# otherwise be ready while it is about to stop and start again).
start_local() {
	mkdir -p "$maintenance_socket_dir"
	SQL_SOCKET_DIR=$maintenance_socket_dir
	pg_ctl -D "$1" -w -t 300 -s \
		-o "-p $PG_PORT -c listen_addresses= -c unix_socket_directories='$maintenance_socket_dir' -c synchronous_standby_names=" start
}

stop_local() {
	pg_ctl -D "$1" -w -t 300 -s -m fast stop
	SQL_SOCKET_DIR=$PG_SOCKET_DIR
}

# PostgreSQL refuses a data directory that its group can write, and the kubelet gives
# the volume's files to the Pod's fsGroup (group rwx, setgid) when it mounts it; the
# official image's entrypoint sets the mode back on every start, and so does this one.
own_pgdata() {
	chmod 0700 "$PGDATA"
}

# PGDATA holds no cluster: remove it if it is an empty directory, refuse anything else.
expect_no_pgdata() {
	if [ -e "$PGDATA" ]; then
		rmdir "$PGDATA" 2>/dev/null ||
			die "$PGDATA is not empty but holds no PostgreSQL cluster (no PG_VERSION); move it away"
	fi
}

# Creates the roles and the database when missing and sets the passwords. Idempotent.
# The SQL comes through stdin, so that the passwords are on no command line. The
# replication role may also read what pg_rewind and the agents need (statistics of the
# WAL receiver, and files of the data directory), nothing else.
ensure_roles() {
	{
		printf '\\set app_user %s\n' "$(psql_quote "$APP_USER")"
		printf '\\set app_password %s\n' "$(psql_quote "$APP_PASSWORD")"
		printf '\\set app_database %s\n' "$(psql_quote "$APP_DATABASE")"
		printf '\\set replication_user %s\n' "$(psql_quote "$REPLICATION_USER")"
		printf '\\set replication_password %s\n' "$(psql_quote "$REPLICATION_PASSWORD")"
		cat <<'SQL'
-- A failing statement would be logged with its text, passwords included.
SET log_min_error_statement = panic;
SET log_statement = none;
SET password_encryption = 'scram-sha-256';
SELECT format('CREATE ROLE %I', :'app_user')
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'app_user') \gexec
ALTER ROLE :"app_user" WITH LOGIN NOSUPERUSER PASSWORD :'app_password';
SELECT format('CREATE ROLE %I', :'replication_user')
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'replication_user') \gexec
ALTER ROLE :"replication_user" WITH LOGIN REPLICATION NOSUPERUSER PASSWORD :'replication_password';
GRANT pg_read_all_stats TO :"replication_user";
GRANT EXECUTE ON FUNCTION pg_catalog.pg_ls_dir(text, boolean, boolean) TO :"replication_user";
GRANT EXECUTE ON FUNCTION pg_catalog.pg_stat_file(text, boolean) TO :"replication_user";
GRANT EXECUTE ON FUNCTION pg_catalog.pg_read_binary_file(text) TO :"replication_user";
GRANT EXECUTE ON FUNCTION pg_catalog.pg_read_binary_file(text, bigint, bigint, boolean) TO :"replication_user";
SELECT format('CREATE DATABASE %I OWNER %I', :'app_database', :'app_user')
  WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'app_database') \gexec
SQL
	} | psql -X -q -v ON_ERROR_STOP=1 -h "$SQL_SOCKET_DIR" -p "$PG_PORT" -U postgres -d postgres >/dev/null
}

initialize() {
	expect_no_pgdata
	log "initializing a new cluster in $PGDATA"
	rm -rf "$staging"
	initdb -D "$staging" --username=postgres --auth-local=trust --auth-host=scram-sha-256 \
		--no-instructions --encoding=UTF8 >&2
	write_hba "$staging"
	start_local "$staging"
	ensure_roles
	stop_local "$staging"
	# Recorded before the data is in place: a crash in between leaves no data, and the
	# next start initializes again.
	printf '1\n' >"$promoted_file"
	mv "$staging" "$PGDATA"
}

# Copies the primary of the topology, re-reading it between attempts.
clone() {
	local attempt=1
	until
		current_topology
		[ "$T_PRIMARY" != "$POD_NAME" ] || die "epoch $T_EPOCH names this instance primary, but it has no data to serve"
		rm -rf "$staging"
		log "copying the primary $T_PRIMARY (attempt $attempt of $BASEBACKUP_ATTEMPTS)"
		pg_basebackup -D "$staging" -d "$(conninfo_of "$T_PRIMARY")" -X stream -c fast --no-password >&2
	do
		[ "$attempt" -lt "$BASEBACKUP_ATTEMPTS" ] || die "cannot copy the primary after $attempt attempts"
		attempt=$((attempt + 1))
		sleep 5
	done
	rm -f "$promoted_file"
	touch "$staging/standby.signal"
	mv "$staging" "$PGDATA"
}

# Data of a deposed primary: rewinds it onto the timeline of the topology's primary,
# once that one answers as a primary. When pg_rewind cannot, the data is moved aside
# (to $diverged, replacing an older one) and the primary copied again.
rejoin() {
	local attempt=1
	while :; do
		current_topology
		# Named primary meanwhile: start again, and decide from the start.
		[ "$T_PRIMARY" != "$POD_NAME" ] || start_again "epoch $T_EPOCH names this instance primary while it rejoins"
		if [ "$(peer_sql "$T_PRIMARY" 'SELECT pg_is_in_recovery()' || true)" = f ]; then
			break
		fi
		[ $((attempt % 10)) -ne 1 ] || log "waiting for $T_PRIMARY to serve as primary before rejoining it"
		attempt=$((attempt + 1))
		sleep 2
	done
	log "rewinding onto the timeline of $T_PRIMARY"
	if pg_rewind --target-pgdata="$PGDATA" --progress \
		--source-server="host=$(host_of "$T_PRIMARY") port=$(port_of "$T_PRIMARY") user=$REPLICATION_USER dbname=postgres passfile=$passfile" >&2; then
		rm -f "$promoted_file"
		touch "$PGDATA/standby.signal"
		return 0
	fi
	log "pg_rewind failed: keeping the old data in $diverged and copying $T_PRIMARY again"
	rm -rf "$diverged"
	mv "$PGDATA" "$diverged"
	rm -f "$promoted_file"
	clone
}

# --- the agent -----------------------------------------------------------------------

PG_PID=''
WAITING=''
ADOPTED_AT=$(uptime_seconds)

# Logs a waiting reason once, until it changes.
waiting() {
	[ "$WAITING" = "$*" ] || log "$*"
	WAITING="$*"
}

start_postgres() {
	server_args
	postgres "${SERVER_ARGS[@]}" &
	PG_PID=$!
}

stop_postgres() {
	[ -n "$PG_PID" ] || return 0
	pg_ctl -D "$PGDATA" -m fast -w -t 50 -s stop 2>/dev/null || kill -INT "$PG_PID" 2>/dev/null || true
	wait "$PG_PID" 2>/dev/null || true
	PG_PID=''
}

on_term() {
	log "stopping"
	stop_postgres
	exit 0
}

wait_started() {
	local i
	for i in $(seq 1 600); do
		pg_isready -q -h "$PG_SOCKET_DIR" -p "$PG_PORT" && return 0
		kill -0 "$PG_PID" 2>/dev/null || return 1
		sleep 0.5
	done
	return 1
}

# Promotes this instance for epoch $T_EPOCH when it is safe (see the top of the file);
# otherwise says what it waits for and returns, to be called again.
promote_step() {
	local previous=$T_PREVIOUS members=${#T_ORDER[@]} sync=$T_SYNC
	local me_addr="$(host_of "$POD_NAME"):$(port_of "$POD_NAME")"
	local previous_addr=''
	[ -z "$previous" ] || [ -z "${T_MEMBERS[$previous]:-}" ] ||
		previous_addr="$(host_of "$previous"):$(port_of "$previous")"
	# 1. The previous primary takes no more writes.
	if [ -n "$previous" ] && [ "$previous" != "$POD_NAME" ] && [ -n "$previous_addr" ]; then
		local state
		if state=$(peer_state "$previous") && [ "$(cut -d'|' -f2 <<<"$state")" = f ]; then
			waiting "epoch $T_EPOCH: waiting for $previous to stop serving as primary"
			return 0
		fi
	fi
	# 2. Enough instances no longer follow it; find the most advanced.
	local with=1 best=$POD_NAME best_lsn m state epoch recovering lsn sender
	best_lsn=$(my_lsn)
	for m in "${T_ORDER[@]}"; do
		# The previous primary counts too once it follows this epoch as a standby.
		[ "$m" != "$POD_NAME" ] || continue
		state=$(peer_state "$m") || continue
		IFS='|' read -r epoch recovering lsn sender <<<"$state"
		[ "$recovering" = t ] || continue
		if [ "$sync" -gt 0 ] || [ "$m" = "$previous" ]; then
			[ "$epoch" -ge "$T_EPOCH" ] || continue
			[ -z "$previous_addr" ] || [ "$sender" != "$previous_addr" ] || continue
		fi
		with=$((with + 1))
		if lsn_after "$lsn" "$best_lsn"; then
			best=$m best_lsn=$lsn
		fi
	done
	local need=1
	[ "$sync" -eq 0 ] || need=$((members - sync))
	if [ "$with" -lt "$need" ]; then
		waiting "epoch $T_EPOCH: $with of the $need instances needed follow this epoch; waiting for more before promoting"
		return 0
	fi
	# 3. Catch up with the most advanced, streaming from it.
	if [ "$best" != "$POD_NAME" ]; then
		write_agent_conf "$(conninfo_of "$best")"
		reload
		waiting "epoch $T_EPOCH: catching up with $best (at $best_lsn) before promoting"
		return 0
	fi
	# 4. Hold until this instance's kubelet has seen it not ready, then stop streaming,
	# record the promotion and promote.
	local held=$(($(uptime_seconds) - ADOPTED_AT))
	if [ "$held" -lt "$PROMOTE_HOLD" ]; then
		waiting "epoch $T_EPOCH: caught up; promoting once not ready for ${PROMOTE_HOLD}s"
		return 0
	fi
	write_agent_conf ''
	reload
	printf '%s\n' "$T_EPOCH" >"$promoted_file"
	log "promoting for epoch $T_EPOCH at $best_lsn ($with instance(s) surveyed, ${sync} synchronous)"
	[ "$(local_sql 'SELECT pg_promote(true, 60)')" = t ] || die "pg_promote did not complete"
	log "serving as primary for epoch $T_EPOCH: $(local_sql "SELECT 'timeline ' || timeline_id || ', WAL at ' || pg_current_wal_lsn() FROM pg_control_checkpoint()")"
	WAITING=''
}

# Whether this data served as a primary and was not rewound onto another's timeline
# since: promoted (or initialized) here, or a primary from before the agent existed.
served_as_primary() {
	[ -e "$promoted_file" ] || [ ! -e "$PGDATA/standby.signal" ]
}

# Whether the topology's primary answers as a primary.
primary_serving() {
	[ "$(peer_sql "$T_PRIMARY" 'SELECT pg_is_in_recovery()' || true)" = f ]
}

# Whether this instance was promoted (or initialized) for the epoch in T_EPOCH. Data of
# epoch 1 without the record was initialized before the agent existed: instance 0 was
# the only primary there ever was.
primary_of_epoch() {
	if [ -e "$promoted_file" ]; then
		[ "$(cat "$promoted_file")" = "$T_EPOCH" ]
	else
		[ "$T_EPOCH" -eq 1 ]
	fi
}

# --- reports to the plugin -----------------------------------------------------------

# This instance as the plugin sees it (docs/postgresql.md, Reports), on one line:
#   epoch=3 role=primary timeline=2 lsn=0/5000060 lag=demo-0:0,demo-2:8192
#   epoch=3 role=standby timeline=2 lsn=0/5000060
# A primary's lsn is where its WAL ends, with each streaming standby's replay lag in
# bytes; a standby's is how far it has replayed.
report_line() {
	local line
	line=$(local_sql "SELECT CASE WHEN pg_is_in_recovery()
		THEN format('role=standby timeline=%s lsn=%s', (SELECT timeline_id FROM pg_control_checkpoint()),
			coalesce(pg_last_wal_replay_lsn()::text, '0/0'))
		ELSE format('role=primary timeline=%s lsn=%s lag=%s', (SELECT timeline_id FROM pg_control_checkpoint()),
			pg_current_wal_lsn(),
			coalesce((SELECT string_agg(application_name || ':' ||
				coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint::text, '-1'), ',' ORDER BY application_name)
				FROM pg_stat_replication WHERE state = 'streaming'), ''))
		END") || return 1
	printf 'epoch=%s %s' "$T_EPOCH" "$line"
}

REPORTED_AT=-100000
REPORTED_KEY=''
REPORT_ERROR=''

# Sends the report when its role, timeline or epoch changed, else every REPORT_INTERVAL
# (this machine's uptime, compared with itself only). A report that fails is tried
# again at the next change or interval, and logged once per distinct error.
report_maybe() {
	[ -n "${REPORT_CONFIGMAP:-}" ] || return 0
	local line key now
	line=$(report_line 2>/dev/null) || return 0
	key=${line%% lsn=*}
	now=$(uptime_seconds)
	[ "$key" != "$REPORTED_KEY" ] || [ $((now - REPORTED_AT)) -ge "$REPORT_INTERVAL" ] || return 0
	REPORTED_AT=$now
	local error
	if error=$(send_report "$line"); then
		REPORTED_KEY=$key
		[ -z "$REPORT_ERROR" ] || log "reports to $REPORT_CONFIGMAP go through again"
		REPORT_ERROR=''
	elif [ "$error" != "$REPORT_ERROR" ]; then
		REPORT_ERROR=$error
		log "cannot report to $REPORT_CONFIGMAP (tried again in ${REPORT_INTERVAL}s): $error"
	fi
}

# PATCHes this instance's key of REPORT_CONFIGMAP with `line`; says why on stdout when
# it cannot.
send_report() {
	local account=/var/run/secrets/kubernetes.io/serviceaccount host status
	command -v curl >/dev/null || { echo "curl is not in the image"; return 1; }
	[ -r "$account/token" ] || { echo "no service account token in $account"; return 1; }
	host=${KUBERNETES_SERVICE_HOST:-}
	[ -n "$host" ] || { echo "KUBERNETES_SERVICE_HOST is not set"; return 1; }
	case $host in *:*) host="[$host]" ;; esac
	status=$(curl -sS --max-time "$PEER_TIMEOUT" --cacert "$account/ca.crt" \
		-H "Authorization: Bearer $(cat "$account/token")" \
		-H 'Content-Type: application/merge-patch+json' -X PATCH \
		--data "{\"data\":{\"$POD_NAME\":\"$1\"}}" -o /dev/null -w '%{http_code}' \
		"https://$host:${KUBERNETES_SERVICE_PORT:-443}/api/v1/namespaces/${POD_NAMESPACE:-default}/configmaps/$REPORT_CONFIGMAP" 2>&1) ||
		{ echo "${status:-curl failed}"; return 1; }
	[ "$status" = 200 ] || { echo "the API server answered $status"; return 1; }
}

agent_loop() {
	local recovering
	while :; do
		if ! kill -0 "$PG_PID" 2>/dev/null; then
			local rc=0
			wait "$PG_PID" || rc=$?
			die "postgres exited ($rc)"
		fi
		current_topology
		if recovering=$(local_sql 'SELECT pg_is_in_recovery()' 2>/dev/null); then
			if [ "$recovering" = f ]; then
				if [ "$T_PRIMARY" != "$POD_NAME" ] || ! primary_of_epoch; then
					log "epoch $T_EPOCH makes $T_PRIMARY primary: stepping down"
					stop_postgres
					start_again "stepped down"
				fi
				if [ "$ADOPTED_NOW" = 1 ] || ! grep -qF "capstan.epoch = '$T_EPOCH'" "$PGDATA/$agent_conf" ||
					! grep -qF "synchronous_standby_names = $(conf_quote "$(sync_names)")" "$PGDATA/$agent_conf"; then
					write_agent_conf ''
					reload
				fi
			elif served_as_primary; then
				# A deposed primary, detached until it can rejoin: its data may hold
				# what the others lack (they may catch up from it), and may have
				# diverged from the new timeline.
				if [ "$T_PRIMARY" = "$POD_NAME" ] || primary_serving; then
					stop_postgres
					start_again "epoch $T_EPOCH: $T_PRIMARY is the primary"
				fi
				if [ "$ADOPTED_NOW" = 1 ]; then
					write_agent_conf ''
					reload
				fi
			elif [ "$T_PRIMARY" = "$POD_NAME" ]; then
				[ "$ADOPTED_NOW" = 0 ] || {
					# Keep streaming from the previous primary for now: a primary that
					# stops cleanly sends its last WAL to its standbys (a switchover).
					sed -i "s/^capstan.epoch = .*/capstan.epoch = '$T_EPOCH'/" "$PGDATA/$agent_conf"
					reload
				}
				promote_step
			else
				local want
				want="primary_conninfo = $(conf_quote "$(conninfo_of "$T_PRIMARY")")"
				if [ "$ADOPTED_NOW" = 1 ] || ! grep -qxF "$want" "$PGDATA/$agent_conf" ||
					! grep -qF "capstan.epoch = '$T_EPOCH'" "$PGDATA/$agent_conf"; then
					log "following $T_PRIMARY (epoch $T_EPOCH)"
					write_agent_conf "$(conninfo_of "$T_PRIMARY")"
					reload
				fi
			fi
		fi
		report_maybe
		sleep "$AGENT_INTERVAL" &
		wait $! || true
	done
}

# Data that last served as a primary, now named primary for a newer epoch: it is the
# newest data only if no member runs on a later timeline. Unless every other member
# answers and none does, it starts again 10 s later (and is not ready meanwhile).
may_resume_as_primary() {
	local mine m state timeline
	mine=$(pg_controldata -D "$PGDATA" | sed -n "s/^Latest checkpoint's TimeLineID: *//p")
	for m in "${T_ORDER[@]}"; do
		[ "$m" != "$POD_NAME" ] || continue
		timeline=$(peer_sql "$m" 'SELECT timeline_id FROM pg_control_checkpoint()') ||
			start_again "epoch $T_EPOCH names this former primary primary again, but $m does not answer: it may hold newer data" 10
		[ "$timeline" -le "$mine" ] ||
			start_again "epoch $T_EPOCH names this former primary primary again, but $m is on timeline $timeline, after this data's $mine" 10
	done
}

run() {
	for var in POD_NAME PGDATA TOPOLOGY_FILE APP_USER APP_PASSWORD APP_DATABASE REPLICATION_USER REPLICATION_PASSWORD; do
		[ -n "${!var:-}" ] || die "$var is not set"
	done
	for var in APP_PASSWORD REPLICATION_PASSWORD; do
		case ${!var} in *$'\n'* | *$'\r'*) die "$var contains a line break" ;; esac
	done
	mkdir -p "$(dirname "$PGDATA")" "$PG_SOCKET_DIR"
	trap on_term TERM INT
	write_passfile
	current_topology
	if [ ! -s "$PGDATA/PG_VERSION" ]; then
		if [ "$T_PRIMARY" = "$POD_NAME" ]; then
			[ "$T_EPOCH" -eq 1 ] ||
				die "epoch $T_EPOCH names this instance primary, but it has no data: refusing to start an empty primary"
			initialize
		else
			expect_no_pgdata
			clone
		fi
	fi
	own_pgdata
	write_hba "$PGDATA"
	if served_as_primary; then
		if [ "$T_PRIMARY" != "$POD_NAME" ]; then
			if primary_serving; then
				rejoin
			else
				# Deposed before the new primary serves: a standby of nothing meanwhile
				# (the agent rejoins once the new primary serves).
				touch "$PGDATA/standby.signal"
				write_agent_conf ''
				log "starting the deposed primary $POD_NAME detached, until $T_PRIMARY serves (epoch $T_EPOCH)"
				start_postgres
				wait_started || die "postgres did not start"
				agent_loop
			fi
		elif ! primary_of_epoch; then
			may_resume_as_primary
			printf '%s\n' "$T_EPOCH" >"$promoted_file"
		fi
	fi
	if [ "$T_PRIMARY" = "$POD_NAME" ] && served_as_primary; then
		rm -f "$PGDATA/standby.signal"
		start_local "$PGDATA"
		ensure_roles
		stop_local "$PGDATA"
		write_agent_conf ''
		log "starting the primary $POD_NAME (epoch $T_EPOCH)"
	else
		# A standby, or the primary-to-be of this epoch, which promotes itself once safe.
		touch "$PGDATA/standby.signal"
		if [ "$T_PRIMARY" = "$POD_NAME" ]; then
			write_agent_conf ''
			log "starting $POD_NAME as a standby that epoch $T_EPOCH will promote"
		else
			write_agent_conf "$(conninfo_of "$T_PRIMARY")"
			log "starting the standby $POD_NAME, following $T_PRIMARY (epoch $T_EPOCH)"
		fi
	fi
	start_postgres
	wait_started || die "postgres did not start"
	agent_loop
}

# Readiness: answers, in the role of the adopted epoch (a deposed primary waiting to
# rejoin is not ready: it must not be routed to, nor promoted).
probe_ready() {
	pg_isready -q -h "$PG_SOCKET_DIR" -p "$PG_PORT" || exit 1
	read_topology "$adopted_file" || exit 1
	[ "$T_PRIMARY" = "$POD_NAME" ] || [ ! -e "$promoted_file" ] || exit 1
	local recovering
	recovering=$(local_sql 'SELECT pg_is_in_recovery()') || exit 1
	if [ "$T_PRIMARY" = "$POD_NAME" ]; then [ "$recovering" = f ]; else [ "$recovering" = t ]; fi
}

# Liveness: a server that does not answer within PEER_TIMEOUT (hung, or stopped by a
# signal) fails; so does a primary that a newer epoch in the file deposed (its agent
# should have stopped it). A server that refuses connections (starting, stopping) passes:
# the agent exits when postgres does.
probe_live() {
	local recovering rc=0
	recovering=$(local_sql 'SELECT pg_is_in_recovery()' 2>/dev/null) || rc=$?
	[ "$rc" -ne 124 ] || exit 1
	[ "$rc" -eq 0 ] && [ "$recovering" = f ] || exit 0
	local adopted=0
	read_topology "$adopted_file" && adopted=$T_EPOCH
	read_topology "$TOPOLOGY_FILE" || exit 0
	if [ "$T_EPOCH" -gt "$adopted" ] && [ "$T_PRIMARY" != "$POD_NAME" ]; then
		echo "a primary deposed by epoch $T_EPOCH ($T_PRIMARY) is still serving" >&2
		exit 1
	fi
}

case ${1:-run} in
run) run ;;
ready) probe_ready ;;
live) probe_live ;;
report)
	# What the agent would report now (for tests and for a look by hand).
	read_topology "$adopted_file" || exit 1
	report_line && echo
	;;
*) die "unknown command $1 (run, ready, live or report)" ;;
esac
