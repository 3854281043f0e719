#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Docker HEALTHCHECK: GET /health (liveness) on the local port.  pdproxy by
# default; set HEALTHCHECK_PORT when the container runs engine-sim.
exec curl -fsS -o /dev/null --max-time 2 \
    "http://127.0.0.1:${HEALTHCHECK_PORT:-${PDPROXY_PORT:-8000}}/health"
