#!/usr/bin/env bash
# vllm-router over two vLLM replicas, each with our connector and the shared Redis tier
# (docs/router.md). Run each replica as:
#
#   vllm serve smollm2 --port 8000 --enable-prefix-caching \
#     --kv-transfer-config "$(cat configs/connector-shared-redis.json)" \
#     --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
#                          "endpoint": "tcp://*:5557"}'
#
# then this router. kv_aware with session affinity: a session's requests (X-Session-Id, sent
# by the sidecar) stay on the replica that served it; a new session goes where the load is
# lowest. The KV events feed its prefix credit for requests without a cache_salt (the router
# gives none to a salted request, and none to a chat it cannot tokenize: docs/router.md).
# --policy consistent_hash (on X-Session-Id) keeps sessions in place as well, without events.
#
# A replica that dies: the router's retries (5 by default) go to the same replica until its
# circuit breaker opens, after 10 failures by default -- so a session bound to it would fail.
# At 2 failures the breaker opens while retries are left, and they go to a live replica, which
# restores the session from the shared Redis tier (the sidecar resumes a stream the death cut:
# `balancer: true` in configs/router/sidecar.yaml). Health checks every 5 s take it out and,
# once it answers again, put it back.
set -euo pipefail
VLLM_1=${VLLM_1:-http://10.0.0.11:8000}
VLLM_2=${VLLM_2:-http://10.0.0.12:8000}
EVENTS_1=${EVENTS_1:-tcp://10.0.0.11:5557}   # each replica's --kv-events-config endpoint
EVENTS_2=${EVENTS_2:-tcp://10.0.0.12:5557}
# BLOCK_SIZE: vLLM's --block-size (128 on CPU); MODEL: the served model name
exec vllm-router --host 0.0.0.0 --port "${PORT:-8000}" \
  --worker-urls "$VLLM_1" "$VLLM_2" \
  --policy kv_aware \
  --kv-aware-session-affinity-ttl-secs 3600 \
  --kv-event-source "$VLLM_1=$EVENTS_1" --kv-event-source "$VLLM_2=$EVENTS_2" \
  --kv-event-model "${MODEL:-smollm2}" \
  --kv-event-block-size "${BLOCK_SIZE:-128}" \
  --cb-failure-threshold 2 --health-check-interval-secs 5 \
  --prometheus-port "${PROMETHEUS_PORT:-29000}"
