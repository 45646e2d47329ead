#!/usr/bin/env bash
#
# Starts one instance of a PostgreSQLCluster (the Capstan PostgreSQL plugin).
#
# Instance 0 is the primary. On an empty data directory it runs initdb and creates the
# application role, its database and the replication role. Every other instance is a
# streaming standby: on an empty data directory it copies the primary with
# pg_basebackup, then it starts read-only and streams WAL from the primary. There is
# no failover: a standby never promotes itself.
#
# On every start the primary sets the roles' passwords from the environment, so the
# Secret is the source of truth, and both roles rewrite pg_hba.conf. Then the script
# execs postgres, which becomes the container's main process.
#
# Everything comes from the environment, so the same script runs in the StatefulSet and
# in the plugin's loopback test:
#   POD_NAME              <cluster>-<ordinal>; ordinal 0 is the primary    (required)
#   PGDATA                the data directory                              (required)
#   APP_USER, APP_PASSWORD, APP_DATABASE
#                         the application role and the database it owns   (required)
#   REPLICATION_USER, REPLICATION_PASSWORD
#                         the role standbys connect as                    (required)
#   PRIMARY_HOST          the primary, for standbys            (required when ordinal > 0)
#   PRIMARY_PORT          its port                                        (5432)
#   PG_PORT               the port to listen on                           (5432)
#   PG_LISTEN_ADDRESSES   listen_addresses                                (*)
#   PG_SOCKET_DIR         directory of the Unix socket                    (/var/run/postgresql)
#   WAL_KEEP_SIZE         WAL the primary keeps for standbys that lag     (256MB)
#   BASEBACKUP_ATTEMPTS   tries to copy the primary, 5 s apart            (60)
#
# Needs PostgreSQL 13 or later (wal_keep_size) and bash; the official postgres images
# have both. Passwords never reach a command line, a log line or a file other than a
# 0600 password file next to the data directory.

set -euo pipefail
umask 077

log() { printf '%s entrypoint: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }
die() {
	log "$*"
	exit 1
}

for var in POD_NAME PGDATA APP_USER APP_PASSWORD APP_DATABASE REPLICATION_USER REPLICATION_PASSWORD; do
	[ -n "${!var:-}" ] || die "$var is not set"
done
for var in APP_PASSWORD REPLICATION_PASSWORD; do
	case ${!var} in *$'\n'* | *$'\r'*) die "$var contains a line break" ;; esac
done
PG_PORT=${PG_PORT:-5432}
PG_LISTEN_ADDRESSES=${PG_LISTEN_ADDRESSES:-*}
PG_SOCKET_DIR=${PG_SOCKET_DIR:-/var/run/postgresql}
PRIMARY_PORT=${PRIMARY_PORT:-5432}
WAL_KEEP_SIZE=${WAL_KEEP_SIZE:-256MB}
BASEBACKUP_ATTEMPTS=${BASEBACKUP_ATTEMPTS:-60}

ordinal=${POD_NAME##*-}
case $ordinal in '' | *[!0-9]*) die "POD_NAME $POD_NAME does not end in -<ordinal>" ;; esac
# Data is prepared beside PGDATA and moved into place when complete, so a crash halfway
# through leaves PGDATA absent and the next start simply begins again.
staging="$PGDATA.staging"
passfile="$PGDATA.pgpass"

# Arguments of the server proper, for either role.
server_args=(
	-D "$PGDATA"
	-p "$PG_PORT"
	-c "listen_addresses=$PG_LISTEN_ADDRESSES"
	-c "unix_socket_directories=$PG_SOCKET_DIR"
	-c wal_level=replica
	-c max_wal_senders=10
	-c "wal_keep_size=$WAL_KEEP_SIZE"
	-c hot_standby=on
)

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

write_hba() {
	cat >"$1/pg_hba.conf" <<EOF
# Written by the PostgreSQL plugin's entrypoint on every start: edits are lost.
# TYPE  DATABASE     USER                 ADDRESS  METHOD
local   all          all                           trust
host    replication  "$REPLICATION_USER"  all      scram-sha-256
host    all          all                  all      scram-sha-256
EOF
}

# Starts a server on $1 reachable only through the Unix socket, for setup.
start_local() {
	pg_ctl -D "$1" -w -t 300 -s \
		-o "-p $PG_PORT -c listen_addresses= -c unix_socket_directories='$PG_SOCKET_DIR'" start
}

stop_local() {
	pg_ctl -D "$1" -w -t 300 -s -m fast stop
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
# The SQL comes through stdin, so that the passwords are on no command line.
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
SELECT format('CREATE DATABASE %I OWNER %I', :'app_database', :'app_user')
  WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'app_database') \gexec
SQL
	} | psql -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCKET_DIR" -p "$PG_PORT" -U postgres -d postgres >/dev/null
}

run_primary() {
	if [ ! -s "$PGDATA/PG_VERSION" ]; then
		expect_no_pgdata
		log "initializing a new cluster in $PGDATA"
		rm -rf "$staging"
		initdb -D "$staging" --username=postgres --auth-local=trust --auth-host=scram-sha-256 \
			--no-instructions \
			--encoding=UTF8 >&2
		write_hba "$staging"
		start_local "$staging"
		ensure_roles
		stop_local "$staging"
		mv "$staging" "$PGDATA"
	else
		own_pgdata
		write_hba "$PGDATA"
		start_local "$PGDATA"
		ensure_roles
		stop_local "$PGDATA"
	fi
	log "starting the primary $POD_NAME"
	exec postgres "${server_args[@]}"
}

run_standby() {
	[ -n "${PRIMARY_HOST:-}" ] || die "PRIMARY_HOST is not set (needed by standby $POD_NAME)"
	printf '*:*:*:%s:%s\n' "$(pgpass_quote "$REPLICATION_USER")" \
		"$(pgpass_quote "$REPLICATION_PASSWORD")" >"$passfile"
	local conninfo="host=$PRIMARY_HOST port=$PRIMARY_PORT user=$REPLICATION_USER passfile=$passfile application_name=$POD_NAME"
	if [ ! -s "$PGDATA/PG_VERSION" ]; then
		expect_no_pgdata
		local attempt=1
		until
			rm -rf "$staging"
			log "copying the primary $PRIMARY_HOST:$PRIMARY_PORT (attempt $attempt of $BASEBACKUP_ATTEMPTS)"
			pg_basebackup -D "$staging" -d "$conninfo" -X stream -c fast --no-password >&2
		do
			[ "$attempt" -lt "$BASEBACKUP_ATTEMPTS" ] || die "cannot copy the primary after $attempt attempts"
			attempt=$((attempt + 1))
			sleep 5
		done
		mv "$staging" "$PGDATA"
	fi
	own_pgdata
	write_hba "$PGDATA"
	# Always: a standby must never start as a second primary.
	touch "$PGDATA/standby.signal"
	log "starting the standby $POD_NAME, streaming from $PRIMARY_HOST:$PRIMARY_PORT"
	exec postgres "${server_args[@]}" -c "primary_conninfo=$conninfo"
}

mkdir -p "$(dirname "$PGDATA")" "$PG_SOCKET_DIR"
if [ "$ordinal" -eq 0 ]; then
	run_primary
else
	run_standby
fi
