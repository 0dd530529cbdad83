#!/bin/sh
# Like the official image: a bare `redis-server` listens on all interfaces with protected mode off
# (Debian's build keeps it on). A password (--requirepass) protects it either way.
if [ "$1" = redis-server ]; then shift; exec redis-server "$@" --protected-mode no; fi
exec "$@"
