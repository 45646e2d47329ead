#!/usr/bin/env bash
#
# Writes a logical dump of a PostgreSQLCluster's application database (the Capstan
# PostgreSQL plugin's CronJob runs it). This is pg_dump in its custom format: a
# consistent snapshot of one database at one moment, restored with pg_restore. It is
# not a physical backup: there is no WAL archive and no point-in-time recovery, and
# roles and other databases are not in it.
#
# The dump is written under a hidden name and renamed when complete, so a file named
# <prefix>-<UTC time>.dump is always a whole dump. Then only the newest DUMP_KEEP
# complete dumps are kept.
#
# Everything comes from the environment, so the same script runs in the CronJob and in
# the plugin's loopback test:
#   DUMP_HOST             the server to dump, the primary's Service     (required)
#   DUMP_PORT             its port                                      (5432)
#   APP_USER, APP_PASSWORD, APP_DATABASE
#                         who to connect as, and the database to dump   (required)
#   DUMP_DIR              where dumps go                                (required)
#   DUMP_PREFIX           file name prefix, the cluster's name          (required)
#   DUMP_KEEP             how many dumps to keep                        (7)

set -euo pipefail
umask 077

log() { printf '%s dump: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }
die() {
	log "$*"
	exit 1
}

for var in DUMP_HOST APP_USER APP_PASSWORD APP_DATABASE DUMP_DIR DUMP_PREFIX; do
	[ -n "${!var:-}" ] || die "$var is not set"
done
DUMP_PORT=${DUMP_PORT:-5432}
DUMP_KEEP=${DUMP_KEEP:-7}
case $DUMP_KEEP in '' | *[!0-9]* | 0) die "DUMP_KEEP must be a positive number, not '$DUMP_KEEP'" ;; esac
[ -d "$DUMP_DIR" ] || die "$DUMP_DIR is not a directory"

stamp=$(date -u +%Y%m%dT%H%M%SZ)
final="$DUMP_DIR/$DUMP_PREFIX-$stamp.dump"
partial="$DUMP_DIR/.$DUMP_PREFIX-$stamp.dump.partial"
[ ! -e "$final" ] || die "$final already exists"
trap 'rm -f "$partial"' EXIT

log "dumping database $APP_DATABASE from $DUMP_HOST:$DUMP_PORT"
PGPASSWORD=$APP_PASSWORD pg_dump --format=custom --no-password \
	-h "$DUMP_HOST" -p "$DUMP_PORT" -U "$APP_USER" -d "$APP_DATABASE" -f "$partial"
mv "$partial" "$final"
log "wrote $final ($(wc -c <"$final") bytes)"

# Glob results are sorted, and the UTC time stamps sort by age: oldest first.
shopt -s nullglob
dumps=("$DUMP_DIR/$DUMP_PREFIX"-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]T[0-9][0-9][0-9][0-9][0-9][0-9]Z.dump)
excess=$((${#dumps[@]} - DUMP_KEEP))
for ((i = 0; i < excess; i++)); do
	log "removing old dump ${dumps[i]}"
	rm -f -- "${dumps[i]}"
done
