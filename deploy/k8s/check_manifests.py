"""Check kvd's Kubernetes manifests: well-formed YAML and the fields the
deployment relies on (probes, grace period above the drain deadline,
resource requests, selectors that match their pods)."""
import sys

import yaml

DRAIN_SECONDS = 30  # server.drain_timeout in configmap.yaml
errors = []


def need(cond, what):
    if not cond:
        errors.append(what)


def dig(d, *path):
    for p in path:
        if isinstance(d, dict):
            d = d.get(p)
        elif isinstance(d, list) and isinstance(p, int) and p < len(d):
            d = d[p]
        else:
            return None
    return d


def check_deployment(doc, name):
    spec = dig(doc, "spec", "template", "spec")
    labels = dig(doc, "spec", "template", "metadata", "labels") or {}
    sel = dig(doc, "spec", "selector", "matchLabels") or {}
    need(sel and all(labels.get(k) == v for k, v in sel.items()),
         f"{name}: selector does not match pod labels")
    containers = dig(spec, "containers") or []
    need(containers, f"{name}: no containers")
    for c in containers:
        need(c.get("readinessProbe"), f"{name}/{c.get('name')}: readinessProbe missing")
        need(c.get("livenessProbe"), f"{name}/{c.get('name')}: livenessProbe missing")
        need(dig(c, "resources", "requests", "memory"), f"{name}: memory request missing")
    if dig(doc, "metadata", "name") == "kvd":
        grace = dig(spec, "terminationGracePeriodSeconds") or 0
        need(grace > DRAIN_SECONDS, f"{name}: terminationGracePeriodSeconds {grace} "
             f"must exceed the drain deadline {DRAIN_SECONDS}s")
        c = containers[0]
        need(dig(c, "readinessProbe", "httpGet", "path") == "/health",
             f"{name}: readiness must use /health")
        live = c.get("livenessProbe") or {}
        need((live.get("failureThreshold") or 3) * (live.get("periodSeconds") or 10) >= 60,
             f"{name}: liveness would kill a busy pod within a minute")


def check(doc, name):
    for key in ("apiVersion", "kind", "metadata"):
        need(key in doc, f"{name}: {key} missing")
    kind = doc.get("kind")
    if kind == "Deployment":
        check_deployment(doc, name)
    elif kind == "Service":
        need(dig(doc, "spec", "selector"), f"{name}: selector missing")
        need(dig(doc, "spec", "ports"), f"{name}: ports missing")
    elif kind == "PodDisruptionBudget":
        need(dig(doc, "spec", "selector"), f"{name}: selector missing")
    elif kind == "ConfigMap":
        need(dig(doc, "data"), f"{name}: data missing")


kinds = set()
for path in sys.argv[1:]:
    try:
        docs = [d for d in yaml.safe_load_all(open(path)) if d]
    except yaml.YAMLError as e:
        errors.append(f"{path}: not valid YAML: {e}")
        continue
    for i, doc in enumerate(docs):
        kinds.add(doc.get("kind"))
        check(doc, f"{path}#{i} {doc.get('kind')}/{dig(doc, 'metadata', 'name')}")
for k in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget"):
    need(k in kinds, f"no {k} among the manifests")
for e in errors:
    print("  " + e)
sys.exit(1 if errors else 0)
