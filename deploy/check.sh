#!/bin/sh
# deploy/check.sh - validate what can be validated without a cluster or a
# Docker engine: HAProxy configs (haproxy -c), the systemd unit
# (systemd-analyze verify), the Kubernetes manifests (well-formed YAML and
# the fields the deployment relies on), the kvd.conf files shipped in them
# (kvd check-config), and the Dockerfile's required instructions.
# Usage: deploy/check.sh PATH_TO_KVD_BINARY
set -eu
kvd=${1:?usage: deploy/check.sh KVD_BINARY}
kvd=$(cd "$(dirname "$kvd")" && pwd)/$(basename "$kvd")
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
ok() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

# --- HAProxy ------------------------------------------------------------------
if haproxy -c -q -f deploy/haproxy/kvd.cfg; then ok "haproxy -c deploy/haproxy/kvd.cfg"
else bad "haproxy -c deploy/haproxy/kvd.cfg"; fi

# The Kubernetes ConfigMap's haproxy.cfg (and kvd.conf) extracted to files.
/usr/bin/python3 - "$tmp" <<'PY'
import sys, yaml
out = sys.argv[1]
for doc in yaml.safe_load_all(open("deploy/k8s/haproxy.yaml")):
    if doc and doc.get("kind") == "ConfigMap":
        open(out + "/haproxy.cfg", "w").write(doc["data"]["haproxy.cfg"])
for doc in yaml.safe_load_all(open("deploy/k8s/configmap.yaml")):
    if doc and doc.get("kind") == "ConfigMap":
        open(out + "/kvd.conf", "w").write(doc["data"]["kvd.conf"])
PY
# parse-resolv-conf needs no cluster DNS to pass the check; init-addr none
# lets the servers resolve later.
if haproxy -c -q -f "$tmp/haproxy.cfg"; then ok "haproxy -c (k8s ConfigMap haproxy.cfg)"
else bad "haproxy -c (k8s ConfigMap haproxy.cfg)"; fi

# --- systemd --------------------------------------------------------------------
# verify checks that ExecStart exists: point it at the binary just built.
sed "s|/usr/local/bin/kvd|$kvd|" deploy/systemd/kvd.service > "$tmp/kvd.service"
if out=$(systemd-analyze verify "$tmp/kvd.service" 2>&1) && [ -z "$out" ]; then
    ok "systemd-analyze verify deploy/systemd/kvd.service"
else
    printf '%s\n' "$out"; bad "systemd-analyze verify deploy/systemd/kvd.service"
fi
grep -q '^ExecReload=.*-HUP' deploy/systemd/kvd.service && ok "unit reloads with SIGHUP" \
    || bad "unit lacks ExecReload sending SIGHUP"

# --- Kubernetes manifests -------------------------------------------------------
if /usr/bin/python3 deploy/k8s/check_manifests.py deploy/k8s/*.yaml; then ok "k8s manifests"
else bad "k8s manifests"; fi

# --- kvd.conf files shipped with the deployments ----------------------------------
for conf in "$tmp/kvd.conf" deploy/docker/kvd.conf; do
    if "$kvd" check-config "$conf" > "$tmp/check.out" 2>&1; then ok "kvd check-config $conf"
    else cat "$tmp/check.out"; bad "kvd check-config $conf"; fi
done

# --- Dockerfile -------------------------------------------------------------------
# Instructions continued over several lines (a backslash at the end) are joined
# first, so a HEALTHCHECK whose CMD sits on the next line is one line here.
sed -e ':a' -e '/\\$/N; s/\\\n//; ta' Dockerfile > "$tmp/Dockerfile.joined"
for want in '^FROM debian:12 AS build' '^FROM debian:12-slim' '^ARG ARCH=' '^USER kvd' \
            '^HEALTHCHECK .*/health' '^STOPSIGNAL SIGTERM' '^VOLUME'; do
    grep -q "$want" "$tmp/Dockerfile.joined" || bad "Dockerfile lacks $want"
done
[ $fail -eq 0 ] && ok "Dockerfile instructions"
exit $fail
