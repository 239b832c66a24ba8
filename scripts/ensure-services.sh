#!/usr/bin/env bash
# Make sure the local Redis, PostgreSQL, MariaDB and RabbitMQ answer; start the machine's own services when
# they are installed but stopped (a previous test run may have restarted them).
set -u
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; }
pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q >/dev/null 2>&1; }
mariadb_up() { mysqladmin --protocol=tcp -h 127.0.0.1 -P 3306 -u root ping >/dev/null 2>&1; }

if ! redis_up && command -v redis-server >/dev/null; then
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log >/dev/null 2>&1 || true
  for _ in $(seq 1 50); do redis_up && break; sleep 0.1; done
fi
if ! pg_up && command -v pg_ctlcluster >/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start >/dev/null 2>&1 || true
  for _ in $(seq 1 100); do pg_up && break; sleep 0.1; done
fi
if ! mariadb_up && [ -x /etc/init.d/mariadb ]; then
  # No systemd in CI containers: the Debian package's init script starts mariadbd.
  /etc/init.d/mariadb start >/dev/null 2>&1 || true
  for _ in $(seq 1 300); do mariadb_up && break; sleep 0.1; done
fi
rabbit_up() { timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672' >/dev/null 2>&1; }
if ! rabbit_up && command -v rabbitmq-server >/dev/null; then
  rabbitmq-server -detached >/dev/null 2>&1 || true
  for _ in $(seq 1 300); do rabbit_up && break; sleep 0.2; done
fi
# The admin's browser tests drive Debian's Chromium (never a browser Playwright downloads).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "chromium: missing, installing the Debian package (apt-get install -y chromium)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq chromium >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } || true
fi
# The PgBouncer test runs a throwaway pgbouncer of its own; only the Debian binary is needed (its own
# service is not started here).
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ] && command -v apt-get >/dev/null \
  && [ "$(id -u)" = 0 ]; then
  echo "pgbouncer: missing, installing the Debian package (apt-get install -y pgbouncer)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq pgbouncer >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq pgbouncer >/dev/null 2>&1; } || true
fi
redis_up && echo "redis: 127.0.0.1:6379 up" || echo "redis: NOT reachable (install: apt-get install redis-server)"
pg_up && echo "postgresql: 127.0.0.1:5432 up" || echo "postgresql: NOT reachable (install: apt-get install postgresql)"
mariadb_up && echo "mariadb: 127.0.0.1:3306 up" || echo "mariadb: NOT reachable (install: apt-get install mariadb-server)"
rabbit_up && echo "rabbitmq: 127.0.0.1:5672 up" || echo "rabbitmq: NOT reachable (install: apt-get install rabbitmq-server)"
command -v chromium >/dev/null && echo "chromium: $(command -v chromium)" \
  || echo "chromium: NOT installed (install: apt-get install chromium)"
{ command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ]; } && echo "pgbouncer: installed" \
  || echo "pgbouncer: NOT installed (install: apt-get install pgbouncer)"
exit 0
