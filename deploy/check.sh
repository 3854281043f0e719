#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI check of deploy/ (registered as the CTest test integration.deploy).
#
#   1. Kubernetes: renders base, every overlay and compositions with the
#      components with `kubectl kustomize`, runs the README's registry sed,
#      and checks the objects line up: NetworkPolicies evaluated over the
#      rendered pods, HPA, PDB, GPU rollouts, RDMA, model cache, monitors,
#      Secrets; probes on ports and paths that exist,
#      Service selectors and targetPorts, headless Services that pdproxy's
#      PDPROXY_PREFILL / PDPROXY_DECODE URLs name, preStop and grace period
#      against the drain settings, security contexts, resources, every
#      PDPROXY_* key a real pdproxy flag (and the values accepted by
#      `pdproxy --print-config`), engine-sim args accepted by engine-sim,
#      vLLM's NixlConnector settings; then validates every object against
#      Kubernetes' OpenAPI schemas and the Prometheus Operator CRDs' (npm
#      kubernetes-models, @kubernetes-models/prometheus-operator, when node
#      is here).
#   2. Grafana: deploy/dashboards/*.json parse, panels are well formed and
#      every PromQL expression uses only pdproxy's, vLLM's or engine-sim's
#      metrics.
#   3. Docker (no engine here): reads deploy/Dockerfile, runs its build steps
#      (deploy/docker/build-steps.sh) into a scratch prefix, runs the
#      installed binaries, and proves with ldd + dpkg that the runtime
#      stage's package list provides every shared library they load; the
#      same for the pdkv image (components/pdkv/Dockerfile: vLLM +
#      libkvconnector) with deploy/docker/pdkv-check.py, whose build runs
#      with only the build stage's packages visible to pkg-config.
#   4. wrk: starts engine-sim prefill + decode and pdproxy on free loopback
#      ports, runs each deploy/wrk/*.lua for 2 s (wrk -t1 -c4) and requires
#      requests, no non-2xx answers and well-formed bodies; also probes the
#      live endpoints the manifests' probes use, and the Docker HEALTHCHECK.
#
# Binaries: $PX_BIN_DIR (CTest), else build-deploy/bin, else build/bin.
# DEPLOY_CHECK_PREFIX=DIR skips the image build and checks DIR/bin instead
# (for iterating on this script; CI never sets it).
# Needs kubectl 1.22 or later (its kustomize renders components), python3 with yaml (python3-yaml),
# wrk, dpkg, ldd, curl: deploy/local/install-deps.sh installs them.
# Loopback only; every wait is bounded.  Exits non-zero on the first failing
# section, after printing every problem found in it.
set -euo pipefail

root=${PX_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
deploy=$root/deploy
bin=${PX_BIN_DIR:-}
if [ -z "$bin" ]; then
    for d in "$root/build-deploy/bin" "$root/build/bin"; do
        if [ -x "$d/pdproxy" ]; then bin=$d; break; fi
    done
fi
t0=$(date +%s)

# Flags the manifests may use that pdproxy does not implement yet, and
# endpoints they probe or scrape that it does not serve yet: space-separated,
# for work in progress only.  Empty: everything the manifests use exists.
# (A listed flag that --help shows is reported, so the list can shrink.)
COMING_FLAGS=""
COMING_ENDPOINTS=""

work=$(mktemp -d "${TMPDIR:-/tmp}/deploy-check.XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for _ in $(seq 1 50); do   # up to 5 s for a graceful exit, then SIGKILL
        alive=0
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

die() { echo "deploy/check: FAIL: $*" >&2; exit 1; }
section() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }

# ------------------------------------------------------------------ tools
[ -n "$bin" ] && [ -x "$bin/pdproxy" ] && [ -x "$bin/engine-sim" ] ||
    die "pdproxy/engine-sim not found (set PX_BIN_DIR or build into build-deploy/)"
command -v kubectl >/dev/null ||
    die "kubectl not found: install Debian's kubernetes-client (deploy/local/install-deps.sh)"
kubectl kustomize --help >/dev/null 2>&1 || die "this kubectl has no 'kustomize' subcommand"
# components/ and replacements need kustomize 4.1 or later (kubectl 1.22 or
# later); Debian bookworm's kubernetes-client (1.20) bundles kustomize 2.0.3.
kver=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
read -r kmaj kmin <<<"${kver:-0 0}"
if [ "$kmaj" -lt 4 ] || { [ "$kmaj" -eq 4 ] && [ "$kmin" -lt 1 ]; }; then
    die "kubectl's kustomize is ${kver:-older than v4} (need v4.1 or later, i.e. kubectl 1.22 or later, for components/ and replacements); install a current kubectl (Kubernetes' own apt repository, pkgs.k8s.io)"
fi
PY=
for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import yaml' 2>/dev/null; then PY=$p; break; fi
done
[ -n "$PY" ] || die "no python3 with the yaml module: install python3-yaml"
for t in wrk dpkg dpkg-query ldd curl; do
    command -v "$t" >/dev/null || die "$t not found (deploy/local/install-deps.sh)"
done

"$bin/pdproxy" --help >"$work/pdproxy.help" 2>&1 || die "pdproxy --help failed"
"$bin/engine-sim" --help >"$work/engine-sim.help" 2>&1 || die "engine-sim --help failed"

# ------------------------------------------------------------------ 1. Kubernetes
section "kubernetes: kubectl kustomize"
kubectl version --client 2>/dev/null | head -1 | sed 's/^/   /' || true
mkdir -p "$work/k8s"
overlays=(base)
for o in "$deploy"/k8s/overlays/*/; do overlays+=("overlays/$(basename "$o")"); done
[ ${#overlays[@]} -ge 4 ] || die "expected overlays sim, vllm and vllm-rdma under deploy/k8s/overlays"
# Components are rendered inside the overlays that list them and in these
# compositions, built in a copy of deploy/k8s (kustomize refuses absolute
# paths): overlay + components, each as a user would write it.
cp -r "$deploy/k8s" "$work/k8s-src"
compose() {  # name overlay component...  (namespace: $NS, default pdproxy)
    local name=$1 ov=$2; shift 2
    mkdir -p "$work/k8s-src/compose/$name"
    { echo "namespace: ${NS:-pdproxy}"; echo "resources:"; echo "  - ../../overlays/$ov"
      echo "components:"; for c in "$@"; do echo "  - ../../components/$c"; done
    } >"$work/k8s-src/compose/$name/kustomization.yaml"
    overlays+=("compose/$name")
}
compose sim-monitoring sim monitoring
compose vllm-monitoring vllm monitoring
compose vllm-keda vllm monitoring keda
# Another namespace: nothing may assume "pdproxy" (KEDA's queries).
NS=inference compose vllm-keda-inference vllm monitoring keda
compose vllm-k8s-discovery vllm k8s-discovery
NS=inference compose vllm-k8s-discovery-inference vllm k8s-discovery
compose vllm-pdkv vllm pdkv
compose vllm-rdma-multus vllm-rdma rdma-multus monitoring
compose sim-config-file sim config-file
for c in "$deploy"/k8s/components/*/; do
    c=$(basename "$c")
    grep -rqs -- "components/$c\$" "$work/k8s-src/overlays" "$work/k8s-src/compose" ||
        die "component $c is rendered by no overlay or composition in deploy/check.sh"
done
for o in "${overlays[@]}"; do
    out=$work/k8s/$(echo "$o" | tr / _).yaml
    if ! timeout 60 kubectl kustomize "$work/k8s-src/$o" >"$out" 2>"$out.err"; then
        cat "$out.err" >&2; die "kubectl kustomize deploy/k8s/$o failed"
    fi
    cat "$out.err" >&2
    echo "   rendered deploy/k8s/$o: $(grep -c '^kind:' "$out") objects"
done

section "kubernetes: the decode-pod sidecar (deploy/k8s/sidecar)"
# Not an overlay of base/ (no proxy Deployment of its own): rendered on its
# own, its pdproxy arguments must be accepted by pdproxy and turn the
# sidecar mode on with an allowlist and a loopback decode.
timeout 60 kubectl kustomize "$work/k8s-src/sidecar" >"$work/k8s/sidecar.yaml" ||
    die "kubectl kustomize deploy/k8s/sidecar failed"
mapfile -t sidecar_args < <("$PY" - "$work/k8s/sidecar.yaml" <<'PY'
import sys, yaml
for d in yaml.safe_load_all(open(sys.argv[1])):
    if d and d.get("kind") == "Deployment":
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["image"].split(":")[0].split("/")[-1] == "pdproxy" and "command" not in c:
                for a in c.get("args", []):
                    print(a)
PY
)
[ ${#sidecar_args[@]} -gt 0 ] || die "deploy/k8s/sidecar: no pdproxy container with args"
sc=$("$bin/pdproxy" "${sidecar_args[@]}" --print-config) || die "deploy/k8s/sidecar: pdproxy refuses its args"
grep -q '^prefiller-from-header: true$' <<<"$sc" || die "deploy/k8s/sidecar: --prefiller-from-header is off"
grep -q '^decode: \["http://127.0.0.1:' <<<"$sc" || die "deploy/k8s/sidecar: decode is not the local engine"
echo "   sidecar: pdproxy accepts ${#sidecar_args[@]} arguments; header mode on, decode on loopback"

section "kubernetes: images point at a registry with the documented command"
# deploy/README.md documents one sed over `kubectl kustomize` that points
# every image at the operator's registry; run that very expression.
rewrite=$(sed -n 's/^ *| sed -E "\(s#(image: .*#\)" .*/\1/p' "$deploy/README.md" | head -1)
[ -n "$rewrite" ] || die "deploy/README.md: no '| sed -E \"s#(image: ...\"' registry command found"
for f in "$work"/k8s/*.yaml; do
    n=$(grep -c '^ *image: ' "$f" || true)
    [ "$n" -gt 0 ] || die "$f: no image"
    REGISTRY=mirror.test.invalid/team
    bad=$(sed -E "${rewrite//'$REGISTRY'/$REGISTRY}" "$f" | grep '^ *image: ' | grep -v "image: $REGISTRY/" || true)
    [ -z "$bad" ] || die "$(basename "$f"): the README's sed leaves images elsewhere: $bad"
done
echo "   every image of every rendering moves to \$REGISTRY/... with: sed -E \"$rewrite\""

section "kubernetes: objects line up"
DEPLOY_README=$deploy/README.md "$PY" - "$work" "$bin/pdproxy" "$COMING_FLAGS" "${overlays[@]}" <<'PY'
import json, os, re, subprocess, sys, yaml

work, pdproxy, coming = sys.argv[1], sys.argv[2], sys.argv[3].split()
overlays = sys.argv[4:]
errors = []
def err(where, msg):
    errors.append("%s: %s" % (where, msg))

def help_flags(path):
    flags = set()
    for line in open(path, encoding="utf-8", errors="replace"):
        # A flag opens its line with two spaces (pdproxy's wrapped descriptions
        # are indented further); aliases follow "/" (engine-sim) or "also" (pdproxy).
        m = re.match(r"^  (--[a-z0-9][a-z0-9-]*(?:/--[a-z0-9][a-z0-9-]*)*)", line)
        if m:
            flags.update(f[2:] for f in m.group(1).split("/"))
        # engine-sim's help also lists "--help, --version" on one line
        m = re.match(r"^\s+--help, --version", line)
        if m:
            flags.update(("help", "version"))
    return flags

px_flags = help_flags(os.path.join(work, "pdproxy.help"))
sim_flags = help_flags(os.path.join(work, "engine-sim.help"))
if not {"port", "host", "threads"} <= px_flags:
    err("pdproxy --help", "could not read its flags: %s" % sorted(px_flags))
if not {"role", "port", "kv-host", "kv-port"} <= sim_flags:
    err("engine-sim --help", "could not read its flags: %s" % sorted(sim_flags))
done_now = [f for f in coming if f in px_flags]
if done_now:
    print("   note: implemented now, can leave COMING_FLAGS in deploy/check.sh: %s" % " ".join(done_now))
known_px = px_flags | set(coming)
ENUMS = {
    "PDPROXY_PREFILL_POLICY": {"round_robin", "least_inflight", "power_of_two", "prefix_affinity", "load_aware"},
    "PDPROXY_DECODE_POLICY": {"round_robin", "least_inflight", "power_of_two", "prefix_affinity", "load_aware"},
    "PDPROXY_LOG_FORMAT": {"json", "logfmt"},
    "PDPROXY_LOG_LEVEL": {"debug", "info", "warn", "error"},
}
DEFAULTS = {"PDPROXY_DRAIN_DELAY": 5, "PDPROXY_DRAIN_TIMEOUT": 60}
# Paths each kind of container serves (probe targets must be among them).
SERVES = {
    "pdproxy": {"/health", "/ready", "/healthcheck", "/metrics", "/v1/models"},
    "engine-sim": {"/health", "/metrics", "/v1/models"},
    "vllm": {"/health", "/metrics", "/v1/models", "/ping"},
}

def kind_of(c):
    cmd = (c.get("command") or [])
    image = c.get("image", "")
    if cmd[:1] == ["engine-sim"]:
        return "engine-sim"
    if "vllm" in image:
        return "vllm"
    if image.split(":")[0].split("/")[-1] == "pdproxy":
        return "pdproxy"
    return "other"

def port_of(c, ref):
    """containerPort number a probe/targetPort reference names, else None."""
    for p in c.get("ports") or []:
        if ref == p.get("name") or ref == p.get("containerPort"):
            return p["containerPort"]
    return None

VARREF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Field names of the objects typos hide in (the schema validation after this
# one accepts unknown fields; the API server would drop them silently).
FIELDS = {
    "container": {"name", "image", "command", "args", "workingDir", "ports", "envFrom", "env",
                  "resources", "resizePolicy", "restartPolicy", "volumeMounts", "volumeDevices",
                  "livenessProbe", "readinessProbe", "startupProbe", "lifecycle",
                  "terminationMessagePath", "terminationMessagePolicy", "imagePullPolicy",
                  "securityContext", "stdin", "stdinOnce", "tty"},
    "probe": {"exec", "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "timeoutSeconds",
              "periodSeconds", "successThreshold", "failureThreshold", "terminationGracePeriodSeconds"},
    "httpGet": {"path", "port", "host", "scheme", "httpHeaders"},
    "securityContext": {"capabilities", "privileged", "seLinuxOptions", "windowsOptions", "runAsUser",
                        "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "allowPrivilegeEscalation",
                        "procMount", "seccompProfile", "appArmorProfile"},
    "podSecurityContext": {"seLinuxOptions", "windowsOptions", "runAsUser", "runAsGroup", "runAsNonRoot",
                           "supplementalGroups", "supplementalGroupsPolicy", "fsGroup", "sysctls",
                           "fsGroupChangePolicy", "seccompProfile", "appArmorProfile", "seLinuxChangePolicy"},
    "resources": {"limits", "requests", "claims"},
    "lifecycle": {"postStart", "preStop", "stopSignal"},
}
def unknown_fields(kind, obj):
    return sorted(set(obj or {}) - FIELDS[kind])
total_checks = [0]
alert_metrics = set()   # metrics the PrometheusRule alerts use (checked live later)

for ov in overlays:
    path = os.path.join(work, "k8s", ov.replace("/", "_") + ".yaml")
    try:
        docs = [d for d in yaml.safe_load_all(open(path)) if d]
    except yaml.YAMLError as e:
        err(ov, "rendered YAML does not parse: %s" % e)
        continue
    objs = {}
    for d in docs:
        for k in ("apiVersion", "kind", "metadata"):
            if k not in d:
                err(ov, "object without %s: %s" % (k, str(d)[:80]))
        md = d.get("metadata") or {}
        if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", md.get("name", "")):
            err(ov, "%s has a bad name %r" % (d.get("kind"), md.get("name")))
        key = (d.get("kind"), md.get("namespace"), md.get("name"))
        if key in objs:
            err(ov, "duplicate object %s" % (key,))
        objs[key] = d
    def get(kind, ns, name):
        return objs.get((kind, ns, name))

    # k8s:// backends (components/k8s-discovery): the Service exists and
    # selects the role's pods, the port is one of its named ports, and the
    # pod's service account may list and watch EndpointSlices there (and
    # nothing more: a Role, verbs list/watch, endpointslices only).
    def check_k8s_url(cw, k, url, ns, want_role, pod):
        m = re.fullmatch(r"k8s://([a-z0-9.-]*)/([a-z0-9.-]+)(?:\?port=([a-z0-9-]+))?", url)
        if not m:
            err(cw, "%s: %r is not k8s://[NAMESPACE]/SERVICE[?port=NAME] (a selector is not cross-checked)" % (k, url))
            return
        sns = m.group(1) or ns
        s = get("Service", sns, m.group(2))
        if s is None:
            err(cw, "%s: Service %s in namespace %s is not rendered" % (k, m.group(2), sns))
            return
        if (s["spec"].get("selector") or {}).get("app.kubernetes.io/component") != want_role:
            err(cw, "%s: Service %s does not select %s pods" % (k, m.group(2), want_role))
        pnames = [p.get("name") for p in s["spec"].get("ports") or []]
        if m.group(3) and m.group(3) not in pnames:
            err(cw, "%s: port %s is not a named port of Service %s (%s)" % (k, m.group(3), m.group(2), pnames))
        if not pod.get("automountServiceAccountToken", True):
            err(cw, "%s: k8s:// backends need the service account's token (automountServiceAccountToken)" % k)
        sa = pod.get("serviceAccountName", "default")
        if get("ServiceAccount", ns, sa) is None and sa != "default":
            err(cw, "%s: ServiceAccount %s is not rendered" % (k, sa))
        granted = set()
        for (kk, rns, rn), rb in objs.items():
            if kk not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(sub.get("kind") == "ServiceAccount" and sub.get("name") == sa
                       and sub.get("namespace", rns) == ns for sub in rb.get("subjects") or []):
                continue
            ref = rb.get("roleRef") or {}
            if kk == "ClusterRoleBinding" or ref.get("kind") != "Role":
                err(cw, "%s/%s gives pdproxy's service account a cluster-wide role: a Role in its namespace is enough" % (kk, rn))
                continue
            role = get("Role", rns, ref.get("name"))
            if role is None:
                err(cw, "RoleBinding/%s names Role %s, which is not rendered" % (rn, ref.get("name")))
                continue
            for rule in role.get("rules") or []:
                extra = set(rule.get("verbs") or []) - {"list", "watch"}
                if extra or set(rule.get("resources") or []) != {"endpointslices"} \
                        or set(rule.get("apiGroups") or []) != {"discovery.k8s.io"}:
                    err(cw, "Role/%s grants more than list/watch on endpointslices: %s" % (ref.get("name"), rule))
                else:
                    granted |= set(rule.get("verbs")) if rns == sns else set()
        if granted != {"list", "watch"}:
            err(cw, "%s: service account %s may not list and watch endpointslices in namespace %s (granted: %s)"
                % (k, sa, sns, sorted(granted)))
        total_checks[0] += 1
    deps = [d for (k, _, _), d in objs.items() if k == "Deployment"]
    svcs = [d for (k, _, _), d in objs.items() if k == "Service"]
    cms = {(ns, n): d for (k, ns, n), d in objs.items() if k == "ConfigMap"}
    namespaces = {n for (k, _, n) in objs if k == "Namespace"}
    if not deps:
        err(ov, "no Deployment rendered")

    for d in objs.values():
        ns = d["metadata"].get("namespace")
        if d["kind"] not in ("Namespace",) and not ns:
            err(ov, "%s/%s has no namespace" % (d["kind"], d["metadata"]["name"]))
        if ns and ns not in namespaces:
            err(ov, "%s/%s is in namespace %s, which is not rendered" % (d["kind"], d["metadata"]["name"], ns))

    # ---- Deployments
    for dep in deps:
        name, ns = dep["metadata"]["name"], dep["metadata"].get("namespace")
        w = "%s Deployment/%s" % (ov, name)
        spec = dep.get("spec") or {}
        tpl = spec.get("template") or {}
        labels = (tpl.get("metadata") or {}).get("labels") or {}
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            err(w, "selector %s does not match pod labels %s" % (sel, labels))
        pod = tpl.get("spec") or {}
        psc = pod.get("securityContext") or {}
        vols = {v["name"] for v in pod.get("volumes") or []}
        ann = (tpl.get("metadata") or {}).get("annotations") or {}
        if not pod.get("containers"):
            err(w, "no containers")
        for c in pod.get("containers") or []:
            cw = "%s container %s" % (w, c.get("name"))
            kind = kind_of(c)
            for fk, obj in (("container", c), ("securityContext", c.get("securityContext")),
                            ("resources", c.get("resources")), ("lifecycle", c.get("lifecycle")),
                            ("podSecurityContext", psc)):
                for f in unknown_fields(fk, obj):
                    err(cw, "unknown field %r in %s" % (f, fk))
            for pk in ("livenessProbe", "readinessProbe", "startupProbe"):
                if c.get(pk):
                    for f in unknown_fields("probe", c[pk]):
                        err(cw, "unknown field %r in %s" % (f, pk))
                    for f in unknown_fields("httpGet", c[pk].get("httpGet")):
                        err(cw, "unknown field %r in %s.httpGet" % (f, pk))
            image = c.get("image", "")
            if ":" not in image.split("/")[-1] or image.endswith(":latest"):
                err(cw, "image %r has no pinned tag" % image)
            ports = c.get("ports") or []
            names = [p.get("name") for p in ports if p.get("name")]
            if len(names) != len(set(names)):
                err(cw, "duplicate port names %s" % names)
            if not any(p.get("name") == "http" for p in ports):
                err(cw, "no containerPort named http")
            # probes
            probes = {k: c.get(k) for k in ("livenessProbe", "readinessProbe", "startupProbe") if c.get(k)}
            for need in ("livenessProbe", "readinessProbe"):
                if need not in probes:
                    err(cw, "has no %s" % need)
            for pk, pr in probes.items():
                hg = pr.get("httpGet")
                if not hg:
                    err(cw, "%s is not an httpGet probe" % pk)
                    continue
                if port_of(c, hg.get("port")) is None:
                    err(cw, "%s targets port %r, which is no containerPort" % (pk, hg.get("port")))
                if kind in SERVES and hg.get("path") not in SERVES[kind]:
                    err(cw, "%s path %r is not served by %s" % (pk, hg.get("path"), kind))
                if (pr.get("timeoutSeconds") or 1) > (pr.get("periodSeconds") or 10):
                    err(cw, "%s timeoutSeconds > periodSeconds" % pk)
                total_checks[0] += 1
            if kind == "pdproxy":
                if ((probes.get("livenessProbe") or {}).get("httpGet") or {}).get("path") != "/health":
                    err(cw, "liveness must be GET /health")
                if ((probes.get("readinessProbe") or {}).get("httpGet") or {}).get("path") != "/ready":
                    err(cw, "readiness must be GET /ready")
            if kind == "vllm":
                sp = probes.get("startupProbe")
                if not sp:
                    err(cw, "vLLM needs a startupProbe (model download and load take minutes)")
                elif (sp.get("failureThreshold") or 3) * (sp.get("periodSeconds") or 10) < 600:
                    err(cw, "startupProbe allows under 10 minutes to start")
            if "prometheus.io/port" in ann and port_of(c, int(ann["prometheus.io/port"])) is None:
                err(cw, "prometheus.io/port %s is no containerPort" % ann["prometheus.io/port"])
            # security
            csc = c.get("securityContext") or {}
            if csc.get("allowPrivilegeEscalation") is not False:
                err(cw, "allowPrivilegeEscalation must be false")
            if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
                err(cw, "capabilities must drop ALL")
            seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
            if seccomp != "RuntimeDefault":
                err(cw, "seccompProfile must be RuntimeDefault (pod or container)")
            if kind in ("pdproxy", "engine-sim"):
                if not (csc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
                    err(cw, "runAsNonRoot must be true")
                uid = csc.get("runAsUser", psc.get("runAsUser"))
                if not isinstance(uid, int) or uid == 0:
                    err(cw, "runAsUser must be a non-zero uid, got %r" % uid)
                if csc.get("readOnlyRootFilesystem") is not True:
                    err(cw, "readOnlyRootFilesystem must be true")
            # resources
            res = c.get("resources") or {}
            req, lim = res.get("requests") or {}, res.get("limits") or {}
            if "cpu" not in req or "memory" not in req:
                err(cw, "resources.requests needs cpu and memory")
            if "memory" not in lim:
                err(cw, "resources.limits needs memory")
            for m in c.get("volumeMounts") or []:
                if m["name"] not in vols:
                    err(cw, "volumeMount %s has no volume" % m["name"])
            # environment and $(VAR) references
            env = c.get("env") or []
            env_names = set()
            for e in env:
                if "value" in e:
                    for ref in VARREF.findall(str(e["value"])):
                        if ref not in env_names:
                            err(cw, "env %s uses $(%s), not defined before it" % (e["name"], ref))
                vf = e.get("valueFrom") or {}
                if "configMapKeyRef" in vf:
                    r = vf["configMapKeyRef"]
                    cm = cms.get((ns, r["name"]))
                    if not r.get("optional") and (cm is None or r["key"] not in (cm.get("data") or {})):
                        err(cw, "env %s: ConfigMap %s has no key %s" % (e["name"], r["name"], r["key"]))
                if "secretKeyRef" in vf and not vf["secretKeyRef"].get("optional") \
                        and not get("Secret", ns, vf["secretKeyRef"]["name"]):
                    err(cw, "env %s: Secret %s is not rendered and not optional" % (e["name"], vf["secretKeyRef"]["name"]))
                if "fieldRef" in vf and vf["fieldRef"].get("fieldPath") not in (
                        "status.podIP", "status.hostIP", "metadata.name", "metadata.namespace", "spec.nodeName"):
                    err(cw, "env %s: unexpected fieldRef %s" % (e["name"], vf["fieldRef"]))
                env_names.add(e["name"])
            envfrom = {}
            for ef in c.get("envFrom") or []:
                r = ef.get("configMapRef")
                if r:
                    cm = cms.get((ns, r["name"]))
                    if cm is None:
                        err(cw, "envFrom ConfigMap %s is not rendered" % r["name"])
                    else:
                        envfrom.update(cm.get("data") or {})
            all_env = env_names | set(envfrom)
            for a in (c.get("command") or []) + (c.get("args") or []):
                for ref in VARREF.findall(str(a)):
                    if ref not in all_env:
                        err(cw, "argument %r uses $(%s), which the container's env does not define" % (a, ref))
            def env_value(n):
                for e in env:
                    if e["name"] == n:
                        return e.get("value"), e.get("valueFrom")
                return None, None
            def is_pod_ip(n):
                v, vf = env_value(n)
                if vf and (vf.get("fieldRef") or {}).get("fieldPath") == "status.podIP":
                    return True
                m = VARREF.fullmatch(v or "")
                return bool(m) and is_pod_ip(m.group(1))
            args = [str(a) for a in (c.get("args") or [])]
            def argmap(args):
                out, i = {}, 0
                while i < len(args):
                    a = args[i]
                    if a.startswith("--"):
                        if "=" in a:
                            k, v = a[2:].split("=", 1)
                        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                            k, v = a[2:], args[i + 1]; i += 1
                        else:
                            k, v = a[2:], None
                        out[k] = v
                    i += 1
                return out
            am = argmap(args)
            role = labels.get("app.kubernetes.io/component")

            if kind == "pdproxy":
                for a in am:
                    if a not in known_px:
                        err(cw, "argument --%s is not a pdproxy flag" % a)
                cm_names = [ef["configMapRef"]["name"] for ef in c.get("envFrom") or [] if ef.get("configMapRef")]
                if not cm_names:
                    err(cw, "settings must come from a ConfigMap through envFrom")
                for k, v in envfrom.items():
                    if not k.startswith("PDPROXY_"):
                        err(cw, "ConfigMap key %s is not a PDPROXY_* setting" % k)
                        continue
                    flag = k[len("PDPROXY_"):].lower().replace("_", "-")
                    if flag not in known_px:
                        err(cw, "ConfigMap key %s names no pdproxy flag (--%s)" % (k, flag))
                    if k in ENUMS and v not in ENUMS[k]:
                        err(cw, "%s=%r, expected one of %s" % (k, v, sorted(ENUMS[k])))
                    total_checks[0] += 1
                host = envfrom.get("PDPROXY_HOST", "127.0.0.1")
                if host not in ("0.0.0.0", "::", "[::]"):
                    err(cw, "PDPROXY_HOST=%s: the Service cannot reach a pod listening there" % host)
                if port_of(c, "http") != int(envfrom.get("PDPROXY_PORT", 8000)):
                    err(cw, "containerPort http %s != PDPROXY_PORT %s" % (port_of(c, "http"), envfrom.get("PDPROXY_PORT", 8000)))
                # drain: preStop sleep == drain delay; grace covers all of it
                delay = float(envfrom.get("PDPROXY_DRAIN_DELAY", DEFAULTS["PDPROXY_DRAIN_DELAY"]))
                dto = float(envfrom.get("PDPROXY_DRAIN_TIMEOUT", DEFAULTS["PDPROXY_DRAIN_TIMEOUT"]))
                pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
                sleep_s = None
                if "sleep" in pre:
                    sleep_s = float(pre["sleep"].get("seconds", 0))
                elif "exec" in pre:
                    cmd = pre["exec"].get("command") or []
                    if cmd and cmd[0] in ("sleep", "/bin/sleep", "/usr/bin/sleep") and len(cmd) == 2:
                        sleep_s = float(cmd[1])
                if sleep_s is None:
                    err(cw, "needs a preStop sleep (exec [sleep, N] or sleep action)")
                elif sleep_s != delay:
                    err(cw, "preStop sleeps %gs but PDPROXY_DRAIN_DELAY is %gs" % (sleep_s, delay))
                grace = pod.get("terminationGracePeriodSeconds", 30)
                need = (sleep_s or 0) + delay + dto + 5
                if grace < need:
                    err(w, "terminationGracePeriodSeconds %s < preStop %g + drain delay %g + drain timeout %g + 5 s margin"
                        % (grace, sleep_s or 0, delay, dto))
                # backends: in overlays, URLs naming rendered headless Services
                if ov != "base":
                    for k, want_role in (("PDPROXY_PREFILL", "prefill"), ("PDPROXY_DECODE", "decode")):
                        v = envfrom.get(k)
                        if not v:
                            err(cw, "%s is not set" % k)
                            continue
                        for url in re.split(r"[,\s]+", v.strip()):
                            if url.startswith("k8s://"):
                                check_k8s_url(cw, k, url, ns, want_role, pod)
                                continue
                            m = re.fullmatch(r"(https?)://([a-z0-9.-]+?)(?:\.(svc(?:\.cluster\.local)?\.?))?:(\d+)/?", url)
                            if not m:
                                err(cw, "%s: %r is not http(s)://host:port" % (k, url))
                                continue
                            parts = m.group(2).split(".")
                            if not m.group(3) and len(parts) == 1:
                                parts.append(ns)  # a Service of pdproxy's own namespace
                            elif not m.group(3):
                                continue  # another host: nothing to cross-check
                            if len(parts) != 2:
                                err(cw, "%s: %r is not <service>.<namespace>.svc..." % (k, url))
                                continue
                            s = get("Service", parts[1], parts[0])
                            if s is None:
                                err(cw, "%s: Service %s in namespace %s is not rendered" % (k, parts[0], parts[1]))
                                continue
                            if s["spec"].get("clusterIP") != "None":
                                err(cw, "%s: Service %s must be headless (clusterIP: None) so every pod is a backend" % (k, parts[0]))
                            if int(m.group(4)) not in [p.get("port") for p in s["spec"].get("ports") or []]:
                                err(cw, "%s: port %s is not a port of Service %s" % (k, m.group(4), parts[0]))
                            if (s["spec"].get("selector") or {}).get("app.kubernetes.io/component") != want_role:
                                err(cw, "%s: Service %s does not select %s pods" % (k, parts[0], want_role))
                            total_checks[0] += 1

            elif kind == "engine-sim":
                for a in am:
                    if a not in sim_flags:
                        err(cw, "argument --%s is not an engine-sim flag" % a)
                if am.get("role") not in ("prefill", "decode", "both"):
                    err(cw, "--role %r" % am.get("role"))
                elif role and am["role"] != role:
                    err(cw, "--role %s but the pod is labelled component=%s" % (am["role"], role))
                if am.get("host") not in ("0.0.0.0", "::"):
                    err(cw, "--host must be 0.0.0.0 (engine-sim listens on 127.0.0.1 by default)")
                if str(port_of(c, "http")) != str(am.get("port")):
                    err(cw, "--port %s != containerPort http %s" % (am.get("port"), port_of(c, "http")))
                if str(port_of(c, "kv")) != str(am.get("kv-port")):
                    err(cw, "--kv-port %s != containerPort kv %s" % (am.get("kv-port"), port_of(c, "kv")))
                m = VARREF.fullmatch(am.get("kv-host") or "")
                if not m or not is_pod_ip(m.group(1)):
                    err(cw, "--kv-host must be $(VAR) with VAR from the downward API status.podIP")

            elif kind == "vllm":
                cmdline = (c.get("command") or []) + args
                if "serve" not in cmdline:
                    err(cw, "expected `vllm serve MODEL ...`")
                if str(port_of(c, "http")) != str(am.get("port")):
                    err(cw, "--port %s != containerPort http %s" % (am.get("port"), port_of(c, "http")))
                try:
                    ktc = json.loads(am.get("kv-transfer-config") or "")
                    side = {"NixlConnector": "VLLM_NIXL_SIDE_CHANNEL",
                            "PdkvConnector": "PDKV_SIDE_CHANNEL"}.get(ktc.get("kv_connector"))
                    if side is None or ktc.get("kv_role") != "kv_both":
                        err(cw, "--kv-transfer-config must name NixlConnector or PdkvConnector with kv_role kv_both: %s" % ktc)
                        side = side or "VLLM_NIXL_SIDE_CHANNEL"
                    # libkvconnector's plugin (components/pdkv): the module
                    # vLLM imports, the library and the cluster secret.
                    if side == "PDKV_SIDE_CHANNEL":
                        if ktc.get("kv_connector_module_path") != "pdkv.connector":
                            err(cw, "PdkvConnector needs kv_connector_module_path pdkv.connector: %s" % ktc)
                        for k in ("PDKV_LIBRARY", "PDKV_SECRET_FILE"):
                            if env_value(k)[0] is None:
                                err(cw, "PdkvConnector without %s" % k)
                    # What a failed KV load does is a decision to state, not
                    # a default to rely on (it changed in vLLM's PR #34896).
                    if ktc.get("kv_load_failure_policy") not in ("fail", "recompute"):
                        err(cw, "--kv-transfer-config must state kv_load_failure_policy (fail or recompute): %s" % ktc)
                except ValueError:
                    err(cw, "--kv-transfer-config is not JSON: %r" % am.get("kv-transfer-config"))
                    side = "VLLM_NIXL_SIDE_CHANNEL"
                if not is_pod_ip(side + "_HOST"):
                    err(cw, "%s_HOST must come from the pod IP" % side)
                v, _ = env_value(side + "_PORT")
                if v is None or port_of(c, int(v)) is None:
                    err(cw, "%s_PORT %r is no containerPort" % (side, v))
                if env_value("UCX_NET_DEVICES")[0] is None:
                    err(cw, "UCX_NET_DEVICES not set")
                # Shutdown: vLLM aborts requests in flight on SIGTERM unless
                # --shutdown-timeout is set (default 0 since v0.18); a preStop
                # sleep lets pdproxy drop the pod first, and the grace period
                # covers both.
                try:
                    sdt = float(am.get("shutdown-timeout") or 0)
                except ValueError:
                    sdt = 0
                if sdt <= 0:
                    err(cw, "needs --shutdown-timeout=N > 0 (vLLM's default 0 aborts requests in flight on SIGTERM)")
                pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
                vsleep = None
                if "sleep" in pre:
                    vsleep = float(pre["sleep"].get("seconds", 0))
                elif "exec" in pre:
                    cmd = pre["exec"].get("command") or []
                    if cmd and cmd[0] in ("sleep", "/bin/sleep", "/usr/bin/sleep") and len(cmd) == 2:
                        vsleep = float(cmd[1])
                if vsleep is None or vsleep < 10:
                    err(cw, "needs a preStop sleep of at least 10 s (pdproxy re-resolves backends every PDPROXY_DNS_REFRESH, 10 s)")
                vgrace = pod.get("terminationGracePeriodSeconds", 30)
                if vgrace < (vsleep or 0) + sdt + 5:
                    err(w, "terminationGracePeriodSeconds %s < preStop %g + --shutdown-timeout %g + 5 s margin"
                        % (vgrace, vsleep or 0, sdt))
                if str(lim.get("nvidia.com/gpu", "0")) in ("0", "") or str(req.get("nvidia.com/gpu", lim.get("nvidia.com/gpu"))) != str(lim.get("nvidia.com/gpu")):
                    err(cw, "needs nvidia.com/gpu in limits (and equal requests)")
                if role and role not in name:
                    err(cw, "Deployment name %s does not carry its role %s" % (name, role))

    # ---- Services
    for s in svcs:
        name, ns = s["metadata"]["name"], s["metadata"].get("namespace")
        w = "%s Service/%s" % (ov, name)
        sel = s["spec"].get("selector") or {}
        if not sel:
            err(w, "no selector")
            continue
        matched = [d for d in deps if d["metadata"].get("namespace") == ns and
                   all(((d["spec"]["template"].get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in sel.items())]
        if not matched:
            err(w, "selector %s matches no Deployment's pods" % sel)
        if len(matched) > 1:
            err(w, "selector %s matches pods of several Deployments: %s" % (sel, [d["metadata"]["name"] for d in matched]))
        for p in s["spec"].get("ports") or []:
            tp = p.get("targetPort", p.get("port"))
            for d in matched:
                if not any(port_of(c, tp) for c in d["spec"]["template"]["spec"]["containers"]):
                    err(w, "port %s targets %r, which Deployment/%s's containers do not expose" % (p.get("name"), tp, d["metadata"]["name"]))
            total_checks[0] += 1

    # ---- PodDisruptionBudgets
    for (k, ns, n), pdb in objs.items():
        if k != "PodDisruptionBudget":
            continue
        sel = (pdb["spec"].get("selector") or {}).get("matchLabels") or {}
        if not any(d["metadata"].get("namespace") == ns and all(d["spec"]["template"]["metadata"]["labels"].get(a) == b for a, b in sel.items()) for d in deps):
            err("%s PodDisruptionBudget/%s" % (ov, n), "selector matches no Deployment's pods")

    # ---- selectors, evaluated as the API server does
    def sel_match(sel, labels):
        if sel is None:
            return False
        for k, v in (sel.get("matchLabels") or {}).items():
            if labels.get(k) != v:
                return False
        for e in sel.get("matchExpressions") or []:
            k, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
            if op == "In" and labels.get(k) not in vals: return False
            if op == "NotIn" and k in labels and labels[k] in vals: return False
            if op == "Exists" and k not in labels: return False
            if op == "DoesNotExist" and k in labels: return False
            if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
                err(ov, "selector operator %r" % op)
        return True
    def pod_labels(d):
        return (d["spec"]["template"].get("metadata") or {}).get("labels") or {}
    def pods_of(sel, ns):
        return [d for d in deps if d["metadata"].get("namespace") == ns and sel_match(sel, pod_labels(d))]
    def cports(d):
        return [p for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports") or []]
    def role_of(d):
        names = {kind_of(c) for c in d["spec"]["template"]["spec"]["containers"]}
        return "proxy" if "pdproxy" in names else "engine" if names & {"engine-sim", "vllm"} else "other"
    NP_FIELDS = {"spec": {"podSelector", "policyTypes", "ingress", "egress"}, "rule": {"from", "to", "ports"},
                 "peer": {"podSelector", "namespaceSelector", "ipBlock"}, "port": {"port", "protocol", "endPort"}}
    netpols = [d for (k, _, _), d in objs.items() if k == "NetworkPolicy"]
    for np in netpols:
        w = "%s NetworkPolicy/%s" % (ov, np["metadata"]["name"])
        ns = np["metadata"].get("namespace")
        spec = np.get("spec") or {}
        for f in set(spec) - NP_FIELDS["spec"]:
            err(w, "unknown field %r in spec" % f)
        sel = spec.get("podSelector")
        if sel is None:
            err(w, "no podSelector")
            continue
        targets = pods_of(sel, ns)
        if sel and not targets:
            err(w, "podSelector %s matches no Deployment's pods" % sel)
        for rule in spec.get("ingress") or []:
            for f in set(rule) - NP_FIELDS["rule"]:
                err(w, "unknown field %r in an ingress rule" % f)
            for peer in rule.get("from") or []:
                for f in set(peer) - NP_FIELDS["peer"]:
                    err(w, "unknown field %r in a peer" % f)
                if "podSelector" in peer and "namespaceSelector" not in peer and peer["podSelector"] \
                        and not pods_of(peer["podSelector"], ns):
                    err(w, "from.podSelector %s matches no Deployment's pods" % peer["podSelector"])
            for pp in rule.get("ports") or []:
                for f in set(pp) - NP_FIELDS["port"]:
                    err(w, "unknown field %r in a port" % f)
                if isinstance(pp.get("port"), str):
                    for d in targets:
                        if not any(p.get("name") == pp["port"] for p in cports(d)):
                            err(w, "port %r is no named port of Deployment/%s" % (pp["port"], d["metadata"]["name"]))
        total_checks[0] += 1

    def allowed(src_labels, src_ns, dst, port):
        """May a pod (src_labels in namespace src_ns) open TCP `port` on dst's pods?"""
        ns = dst["metadata"].get("namespace")
        pols = [p for p in netpols if p["metadata"].get("namespace") == ns
                and "Ingress" in ((p["spec"].get("policyTypes")) or ["Ingress"])
                and sel_match(p["spec"].get("podSelector"), pod_labels(dst))]
        if not pols:
            return True
        ns_labels = {"kubernetes.io/metadata.name": src_ns}
        for p in pols:
            for rule in p["spec"].get("ingress") or []:
                peers = rule.get("from")
                def peer_ok(peer):
                    if "ipBlock" in peer:
                        return False
                    if "namespaceSelector" in peer:
                        if not sel_match(peer["namespaceSelector"], ns_labels):
                            return False
                    elif src_ns != ns:
                        return False
                    return "podSelector" not in peer or sel_match(peer["podSelector"], src_labels)
                if peers and not any(peer_ok(x) for x in peers):
                    continue
                ports = rule.get("ports")
                def port_ok(pp):
                    if (pp.get("protocol") or "TCP") != "TCP":
                        return False
                    want = pp.get("port")
                    if want is None:
                        return True
                    if isinstance(want, str):
                        return any(x.get("name") == want and x["containerPort"] == port for x in cports(dst))
                    return want <= port <= pp.get("endPort", want)
                if ports and not any(port_ok(x) for x in ports):
                    continue
                return True
        return False

    if netpols:
        proxies = [d for d in deps if role_of(d) == "proxy"]
        engines = [d for d in deps if role_of(d) == "engine"]
        outsider = ({"app": "anything"}, "default")
        monitoring = ({"app.kubernetes.io/name": "prometheus"}, "monitoring")
        def expect(src, dst, port, want, what):
            total_checks[0] += 1
            if allowed(src[0], src[1], dst, port) != want:
                err("%s NetworkPolicies" % ov, "%s: %s port %d of Deployment/%s"
                    % (what, "should reach" if want else "must not reach", port, dst["metadata"]["name"]))
        for d in deps:
            metrics_port = port_of(d["spec"]["template"]["spec"]["containers"][0], "http")
            expect(monitoring, d, metrics_port, True, "Prometheus in namespace monitoring")
        for d in proxies:
            expect(outsider, d, port_of(d["spec"]["template"]["spec"]["containers"][0], "http"), True,
                   "a client from another namespace")
        for e in engines:
            http = port_of(e["spec"]["template"]["spec"]["containers"][0], "http")
            side = [p["containerPort"] for p in cports(e) if p.get("name") != "http"]
            if not side:
                err("%s Deployment/%s" % (ov, e["metadata"]["name"]), "no side-channel containerPort")
            for px_ in proxies:
                expect((pod_labels(px_), px_["metadata"]["namespace"]), e, http, True, "pdproxy")
                for sp in side:
                    expect((pod_labels(px_), px_["metadata"]["namespace"]), e, sp, False, "pdproxy")
            expect(outsider, e, http, False, "a pod in another namespace")
            for sp in side + [40000]:  # 40000: one of UCX's ephemeral TCP ports
                expect(outsider, e, sp, False, "a pod in another namespace")
                expect(monitoring, e, sp, False, "Prometheus")
                for e2 in engines:
                    if role_of(e2) == "engine" and kind_of(e2["spec"]["template"]["spec"]["containers"][0]) == \
                            kind_of(e["spec"]["template"]["spec"]["containers"][0]):
                        expect((pod_labels(e2), e2["metadata"]["namespace"]), e, sp, True,
                               "engine Deployment/%s" % e2["metadata"]["name"])
    elif ov != "base" or deps:
        err(ov, "no NetworkPolicy rendered (SECURITY.md relies on them for the engines' ports)")

    # ---- PodDisruptionBudgets, HorizontalPodAutoscalers
    for (k, ns, n), pdb in objs.items():
        if k == "PodDisruptionBudget" and pdb["spec"].get("unhealthyPodEvictionPolicy") != "AlwaysAllow":
            err("%s PodDisruptionBudget/%s" % (ov, n), "unhealthyPodEvictionPolicy must be AlwaysAllow "
                "(else a node drain blocks while the pods are unhealthy)")
    for (k, ns, n), hpa in objs.items():
        if k != "HorizontalPodAutoscaler":
            continue
        w = "%s HorizontalPodAutoscaler/%s" % (ov, n)
        ref = hpa["spec"].get("scaleTargetRef") or {}
        dep = get(ref.get("kind"), ns, ref.get("name"))
        if dep is None or ref.get("kind") != "Deployment":
            err(w, "scaleTargetRef %s names no rendered Deployment" % ref)
            continue
        if "replicas" in dep["spec"]:
            err(w, "Deployment/%s sets replicas, which every kubectl apply would reset under the autoscaler" % ref["name"])
        if (hpa["spec"].get("minReplicas") or 1) < 2:
            err(w, "minReplicas < 2: the PodDisruptionBudget and rollouts need two")
        for mt in hpa["spec"].get("metrics") or []:
            r = (mt.get("resource") or {})
            if r.get("name") == "cpu" and (r.get("target") or {}).get("type") == "Utilization":
                for c in dep["spec"]["template"]["spec"]["containers"]:
                    if "cpu" not in ((c.get("resources") or {}).get("requests") or {}):
                        err(w, "CPU utilization needs a CPU request on container %s" % c["name"])
        total_checks[0] += 1
    if any(role_of(d) == "proxy" for d in deps) and not any(k == "HorizontalPodAutoscaler" for (k, _, _) in objs):
        err(ov, "no HorizontalPodAutoscaler for pdproxy")

    # ---- GPU Deployments: rollouts and start-up, model cache, RDMA
    for dep in deps:
        w = "%s Deployment/%s" % (ov, dep["metadata"]["name"])
        pod = dep["spec"]["template"]["spec"]
        gpu = any("nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {}) for c in pod["containers"])
        if not gpu:
            continue
        ru = ((dep["spec"].get("strategy") or {}).get("rollingUpdate")) or {}
        if str(ru.get("maxSurge", "25%")) not in ("0", "0%"):
            err(w, "GPU Deployment rolls with maxSurge %r: needs a spare GPU per rollout (use 0)" % ru.get("maxSurge", "25%"))
        for c in pod["containers"]:
            sp = c.get("startupProbe") or {}
            budget = (sp.get("initialDelaySeconds") or 0) + (sp.get("failureThreshold") or 3) * (sp.get("periodSeconds") or 10)
            pds = dep["spec"].get("progressDeadlineSeconds", 600)
            if pds < budget + 300:
                err(w, "progressDeadlineSeconds %s < the startup probe's %s s + 300 s (image pull, readiness)" % (pds, budget))
            mounts = {m["name"]: m for m in c.get("volumeMounts") or []}
            cache = [m for m in mounts.values() if "huggingface" in m.get("mountPath", "")]
            if not cache:
                err(w, "no model cache mounted at ~/.cache/huggingface")
            for m in cache:
                vol = next((v for v in pod.get("volumes") or [] if v["name"] == m["name"]), {})
                claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
                pvc = get("PersistentVolumeClaim", dep["metadata"].get("namespace"), claim)
                if pvc is None:
                    err(w, "model cache %s is not a rendered PersistentVolumeClaim (weights would download again on every restart)" % m["name"])
                    continue
                size = ((pvc["spec"].get("resources") or {}).get("requests") or {}).get("storage")
                want = ((cms.get((pvc["metadata"].get("namespace"), "vllm-config")) or {}).get("data") or {}).get("MODEL_CACHE_SIZE")
                if want and size != want:
                    err(w, "PVC %s requests %s, vllm-config says MODEL_CACHE_SIZE=%s" % (claim, size, want))
                if (dep["spec"].get("replicas") or 1) > 1 or len([d for d in deps if "vllm" in d["metadata"]["name"]]) > 1:
                    if "ReadWriteMany" not in (pvc["spec"].get("accessModes") or []):
                        err(w, "PVC %s is shared by several pods but not ReadWriteMany" % claim)
            envs = {e["name"]: e.get("value") for e in c.get("env") or []}
            tls = (envs.get("UCX_TLS") or "").split(",")
            res = c.get("resources") or {}
            rdma_req = {k: v for k, v in (res.get("requests") or {}).items() if k.startswith("rdma/")}
            rdma_lim = {k: v for k, v in (res.get("limits") or {}).items() if k.startswith("rdma/")}
            caps = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
            if set(caps) - {"IPC_LOCK"}:
                err(w, "capabilities added beyond IPC_LOCK: %s" % caps)
            rdma = bool({"rc", "rc_x", "rc_v", "dc", "dc_x", "ud", "ib"} & set(tls))
            if not envs.get("UCX_TLS"):
                err(w, "UCX_TLS not set: say which transport the KV takes")
            if rdma:
                if not rdma_lim or rdma_req != rdma_lim:
                    err(w, "UCX_TLS %s is RDMA but the container requests no rdma/* device (equal requests and limits)" % envs["UCX_TLS"])
                if "IPC_LOCK" not in caps:
                    err(w, "RDMA needs capability IPC_LOCK to pin memory")
                if envs.get("UCX_NET_DEVICES") in (None, "all"):
                    err(w, "RDMA: UCX_NET_DEVICES should name the HCA port (mlx5_0:1), not %r" % envs.get("UCX_NET_DEVICES"))
                if "tcp" in tls:
                    err(w, "RDMA variant lists tcp in UCX_TLS: a missing device would fall back silently")
                shm = next((v for v in pod.get("volumes") or [] if v["name"] in mounts and mounts[v["name"]].get("mountPath") == "/dev/shm"), None)
                if not shm or (shm.get("emptyDir") or {}).get("medium") != "Memory":
                    err(w, "RDMA: /dev/shm must be a memory-backed emptyDir")
            else:
                if rdma_lim or rdma_req or caps:
                    err(w, "TCP variant (UCX_TLS %s) requests RDMA devices or capabilities" % envs.get("UCX_TLS"))
            if "rdma" in ov and not rdma:
                err(w, "overlay %s renders a vLLM without RDMA transports (UCX_TLS %s)" % (ov, envs.get("UCX_TLS")))
            multus = ((dep["spec"]["template"].get("metadata") or {}).get("annotations") or {}).get("k8s.v1.cni.cncf.io/networks")
            if "multus" in ov and not multus:
                err(w, "composition %s: no Multus networks annotation" % ov)
            total_checks[0] += 1

    # ---- Secrets the operator creates, mounted read-only
    readme = open(os.environ["DEPLOY_README"]).read()
    for dep in deps:
        w = "%s Deployment/%s" % (ov, dep["metadata"]["name"])
        pod = dep["spec"]["template"]["spec"]
        for v in pod.get("volumes") or []:
            sec = v.get("secret")
            if not sec:
                continue
            name = sec.get("secretName")
            if not get("Secret", dep["metadata"].get("namespace"), name) and not sec.get("optional") \
                    and "kubectl -n pdproxy create secret generic %s" % name not in readme:
                err(w, "Secret %s is not rendered and deploy/README.md does not say how to create it" % name)
            for c in pod["containers"]:
                for m in c.get("volumeMounts") or []:
                    if m["name"] == v["name"] and not m.get("readOnly"):
                        err(w, "Secret volume %s mounted writable in %s" % (v["name"], c["name"]))
        for c in pod["containers"]:
            if kind_of(c) != "engine-sim":
                continue
            envs = {e["name"]: e.get("value") for e in c.get("env") or []}
            f = envs.get("KVC_SECRET_FILE")
            if not f:
                err(w, "engine-sim without KVC_SECRET_FILE (the KV side channel's shared secret)")
                continue
            ok = False
            for m in c.get("volumeMounts") or []:
                vol = next((v for v in pod.get("volumes") or [] if v["name"] == m["name"]), {})
                if vol.get("secret") and m.get("readOnly") and f.startswith(m["mountPath"].rstrip("/") + "/"):
                    key = f[len(m["mountPath"].rstrip("/")) + 1:]
                    items = vol["secret"].get("items")
                    ok = items is None or any(i.get("path") == key for i in items)
            if not ok:
                err(w, "KVC_SECRET_FILE %s is no file of a read-only Secret mount" % f)
            total_checks[0] += 1

    # ---- Prometheus Operator monitors
    for (k, ns, n), mon in objs.items():
        if k not in ("ServiceMonitor", "PodMonitor"):
            continue
        w = "%s %s/%s" % (ov, k, n)
        sel = mon["spec"].get("selector") or {}
        if k == "ServiceMonitor":
            matched = [s for s in svcs if s["metadata"].get("namespace") == ns and sel_match(sel, s["metadata"].get("labels") or {})]
            if len(matched) != 1:
                err(w, "selector %s matches %d Services, want 1" % (sel, len(matched)))
            for ep in mon["spec"].get("endpoints") or []:
                for s in matched:
                    if ep.get("port") not in [p.get("name") for p in s["spec"].get("ports") or []]:
                        err(w, "endpoint port %r is no port name of Service/%s" % (ep.get("port"), s["metadata"]["name"]))
                if ep.get("path", "/metrics") != "/metrics":
                    err(w, "scrapes %s, not /metrics" % ep.get("path"))
        else:
            matched = pods_of(sel, ns)
            if not matched:
                err(w, "selector %s matches no Deployment's pods" % sel)
            for ep in mon["spec"].get("podMetricsEndpoints") or []:
                for d in matched:
                    if ep.get("port") not in [p.get("name") for p in cports(d)]:
                        err(w, "port %r is no named port of Deployment/%s" % (ep.get("port"), d["metadata"]["name"]))
                if ep.get("path", "/metrics") != "/metrics":
                    err(w, "scrapes %s, not /metrics" % ep.get("path"))
        total_checks[0] += 1
    if any(k in ("ServiceMonitor", "PodMonitor") for (k, _, _) in objs):
        scraped = set()
        for (k, ns, n), mon in objs.items():
            if k == "PodMonitor":
                scraped |= {d["metadata"]["name"] for d in pods_of(mon["spec"].get("selector") or {}, ns)}
            if k == "ServiceMonitor":
                for s in svcs:
                    if sel_match(mon["spec"].get("selector") or {}, s["metadata"].get("labels") or {}):
                        scraped |= {d["metadata"]["name"] for d in pods_of({"matchLabels": s["spec"].get("selector") or {}}, ns)}
        for d in deps:
            if d["metadata"]["name"] not in scraped:
                err(ov, "no ServiceMonitor/PodMonitor scrapes Deployment/%s" % d["metadata"]["name"])

    # ---- KEDA ScaledObjects (components/keda): each scales a rendered
    # Deployment that sets no replicas of its own, on its own pool's
    # vllm:num_requests_waiting from Prometheus.
    for (k, ns, n), so in objs.items():
        if k != "ScaledObject":
            continue
        w = "%s ScaledObject/%s" % (ov, n)
        ref = so["spec"].get("scaleTargetRef") or {}
        target = [d for d in deps if d["metadata"]["name"] == ref.get("name") and d["metadata"].get("namespace") == ns]
        if ref.get("kind", "Deployment") != "Deployment" or not target:
            err(w, "scaleTargetRef %s names no rendered Deployment" % ref)
        elif "replicas" in target[0]["spec"]:
            err(w, "Deployment/%s sets replicas, which kubectl apply would reset under the autoscaler" % ref.get("name"))
        # Prometheus unreachable: the pool keeps at least what it has (a
        # "static" fallback scales a scaled-out pool down to `replicas`).
        fb = so["spec"].get("fallback")
        if fb and fb.get("behavior", "static") not in ("currentReplicas", "currentReplicasIfHigher") \
                and int(fb.get("replicas", 0)) < int(so["spec"].get("maxReplicaCount", 100)):
            err(w, "fallback %s shrinks a scaled-out pool to %s replicas when the metrics are unreachable"
                   " (behavior: currentReplicasIfHigher keeps what it has)" % (fb, fb.get("replicas")))
        if not (1 <= int(so["spec"].get("minReplicaCount", 0)) <= int(so["spec"].get("maxReplicaCount", 100))):
            err(w, "needs 1 <= minReplicaCount <= maxReplicaCount (a pool scaled to 0 cannot serve)")
        for t in so["spec"].get("triggers") or []:
            md = t.get("metadata") or {}
            q = md.get("query", "")
            if t.get("type") != "prometheus" or "vllm:num_requests_waiting" not in q:
                err(w, "trigger must be prometheus on vllm:num_requests_waiting: %s" % t)
            m = re.search(r'namespace="([^"]*)"', q)
            if m and m.group(1) != ns:
                err(w, "query %r selects namespace %s, not the ScaledObject's %s" % (q, m.group(1), ns))
            if md.get("ignoreNullValues", "true") != "false":
                err(w, "trigger without ignoreNullValues: \"false\": a query that answers nothing reads as an empty queue and scales the pool down")
            m = re.search(r'pod=~"([^"]*)"', q)
            if not m or not re.fullmatch(m.group(1), ref.get("name", "") + "-abc12-xyz34"):
                err(w, "query %r does not select the pods of Deployment/%s" % (q, ref.get("name")))
            try:
                float(md.get("threshold", ""))
            except ValueError:
                err(w, "threshold %r is not a number" % md.get("threshold"))
        total_checks[0] += 1

    # ---- PrometheusRule alerts: the ones the guide promises, each with an
    # expression, a severity and a summary; their metrics are checked
    # against live /metrics pages later (alert-metrics.txt).
    want_alerts = {"PdproxyNoReadyPrefill", "PdproxyNoReadyDecode", "PdproxyHighErrorRatio",
                   "PdproxyHighTimeToFirstByte", "PdproxyKVBlocksStranded", "PdproxyPanicRouting",
                   "PdproxyDNSFailures"}
    for (k, ns, n), pr in objs.items():
        if k != "PrometheusRule":
            continue
        w = "%s PrometheusRule/%s" % (ov, n)
        seen_alerts = set()
        for g in pr["spec"].get("groups") or []:
            for r in g.get("rules") or []:
                a = r.get("alert")
                if not a:
                    continue
                seen_alerts.add(a)
                expr = r.get("expr", "")
                if not expr or expr.count("(") != expr.count(")"):
                    err(w, "alert %s: empty or unbalanced expr %r" % (a, expr))
                if (r.get("labels") or {}).get("severity") not in ("critical", "warning", "info"):
                    err(w, "alert %s: severity label missing" % a)
                if not (r.get("annotations") or {}).get("summary"):
                    err(w, "alert %s: no summary annotation" % a)
                for mname in re.findall(r"\b((?:pdproxy|engine_sim|process)_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr):
                    alert_metrics.add(re.sub(r"_bucket$", "", mname))
                    # Alerts are for production: a metric only engine-sim
                    # has never fires in front of vLLM.
                    if mname.startswith("engine_sim_"):
                        err(w, "alert %s uses %s, which only engine-sim exposes (vLLM has no such series)" % (a, mname))
        for a in sorted(want_alerts - seen_alerts):
            err(w, "no alert %s" % a)
        total_checks[0] += 1

    # ---- the ConfigMap's values through pdproxy's own parser
    for (ns, n), cm in cms.items():
        data = cm.get("data") or {}
        if not any(key.startswith("PDPROXY_") for key in data):
            continue
        env = {key: v for key, v in os.environ.items() if not key.startswith("PDPROXY_")}
        for key, v in data.items():
            flag = key[len("PDPROXY_"):].lower().replace("_", "-")
            if flag not in px_flags:
                continue
            if flag in ("prefill", "decode"):
                # cluster DNS names do not resolve here: keep the syntax, not the host
                v = re.sub(r"(https?://)[^:/\s,]+", r"\g<1>127.0.0.1", v)
            env[key] = v
        r = subprocess.run([pdproxy, "--print-config"], env=env, capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            err("%s ConfigMap/%s" % (ov, n), "pdproxy --print-config rejects it: %s" % (r.stderr.strip() or r.stdout.strip()))
        else:
            printed = dict(l.split(" = ", 1) for l in r.stdout.splitlines() if " = " in l)
            for key, v in data.items():
                flag = key[len("PDPROXY_"):].lower().replace("_", "-")
                if flag in px_flags and flag in printed and flag not in ("prefill", "decode") \
                        and not re.search(r"[\s,]", v):
                    p = printed[flag].strip()
                    try:
                        same = float(p) == float(v)
                    except ValueError:
                        same = p == v
                    if not same:
                        err("%s ConfigMap/%s" % (ov, n), "%s=%s but pdproxy --print-config says %s = %s" % (key, v, flag, p))
        total_checks[0] += 1

    print("   %s: %d objects (%s)" % (ov, len(objs), ", ".join(sorted("%s/%s" % (k, n) for (k, _, n) in objs))))

open(os.path.join(work, "alert-metrics.txt"), "w").write("".join(m + "\n" for m in sorted(alert_metrics)))
if not alert_metrics:
    err("components/monitoring", "no PrometheusRule alert rendered anywhere")
if errors:
    for e in errors:
        print("deploy/check: FAIL: " + e, file=sys.stderr)
    sys.exit(1)
print("   kubernetes: %d overlays consistent (%d probe/port/key checks)" % (len(overlays), total_checks[0]))
PY

section "kubernetes: API schemas (npm kubernetes-models, offline)"
# Kubernetes' OpenAPI schemas as compiled validators (deploy/k8s/schema/:
# package.json + lock, validate.mjs), installed once per build directory
# from the npm registry and then used offline: types, required fields, enums.
schema_src=$deploy/k8s/schema
if command -v node >/dev/null && command -v npm >/dev/null; then
    cache=${DEPLOY_CHECK_CACHE:-${PX_BUILD_DIR:-$root/build-deploy}/deploy-check-npm}
    want=$(sha256sum "$schema_src/package-lock.json" | cut -d' ' -f1)
    if [ "$(cat "$cache/.lock-sha256" 2>/dev/null)" != "$want" ] ||
       [ ! -f "$cache/node_modules/kubernetes-models/package.json" ]; then
        rm -rf "$cache" && mkdir -p "$cache"
        cp "$schema_src/package.json" "$schema_src/package-lock.json" "$cache/"
        if ! (cd "$cache" && timeout 240 npm ci --no-audit --no-fund --loglevel=error) >"$work/npm.log" 2>&1; then
            cat "$work/npm.log" >&2; die "npm ci of deploy/k8s/schema failed (needs the npm registry once)"
        fi
        echo "$want" >"$cache/.lock-sha256"
        echo "   installed kubernetes-models into $cache"
    fi
    cp "$schema_src/validate.mjs" "$cache/validate.mjs"
    "$PY" - "$work"/k8s/*.yaml <<'PY'
import json, sys, yaml
for path in sys.argv[1:]:
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    json.dump(docs, open(path[:-5] + ".json", "w"))
PY
    timeout 120 node "$cache/validate.mjs" "$work"/k8s/*.json || die "rendered objects fail the Kubernetes API schemas"
else
    echo "   note: node/npm not installed: API schema validation skipped (the checks above still ran)"
fi

# ------------------------------------------------------------------ 2. Grafana
section "grafana dashboards"
"$PY" - "$work/dashboard-metrics.txt" "$deploy"/dashboards/*.json <<'PY'
import json, re, sys
out_names = sys.argv.pop(1)
all_used = set()
label_uses = {}   # metric -> labels the dashboard groups or filters it by
TARGET_LABELS = {"instance", "job", "namespace", "pod", "le", "__name__"}  # added by Prometheus, or histogram buckets
# pdproxy's and the process metrics are checked against a live /metrics page
# below (section 5: each one the dashboard uses must be exposed, and each one
# exposed must have a panel), not against a list kept here.
HISTOGRAMS = {"pdproxy_request_duration_seconds", "pdproxy_time_to_first_byte_seconds",
              "pdproxy_prefill_duration_seconds", "pdproxy_queue_wait_seconds",
              "pdproxy_decode_kv_wait_seconds", "pdproxy_latency_model_ttft_error"}
REQUIRED = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "engine_sim_kv_blocks_expired_total"}
WORDS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
         "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
         "bool", "and", "or", "unless", "offset", "inf", "nan", "le", "atan2"}
errors = []

def metrics_of(expr):
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # strings
    e = re.sub(r"\{[^}]*\}", "", e)                         # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                        # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", " ", e)   # Grafana variables
    e = re.sub(r"\b\d+(\.\d+)?([eE][-+]?\d+)?[smhdwy]?\b", " ", e)  # numbers, durations
    out = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        tail = e[m.end():].lstrip()
        if tail.startswith("("):
            continue  # a function call
        if m.group(0).lower() in WORDS:
            continue
        out.append(m.group(0))
    return out

def allowed(name):
    if name.startswith(("pdproxy_", "process_", "vllm:", "engine_sim_")):
        return True
    for h in HISTOGRAMS:
        if name in (h + "_bucket", h + "_sum", h + "_count"):
            return True
    return False

if len(sys.argv) < 2:
    sys.exit("deploy/check: FAIL: no dashboards in deploy/dashboards")
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except ValueError as e:
        print("deploy/check: FAIL: %s does not parse: %s" % (path, e), file=sys.stderr)
        sys.exit(1)
    for k in ("title", "uid", "panels", "schemaVersion", "templating"):
        if k not in d:
            errors.append("%s: no %s" % (path, k))
    seen_ids, used, nexpr = set(), set(), 0
    var_names = {v.get("name") for v in (d.get("templating") or {}).get("list", [])}
    def walk(panels):
        global nexpr
        for p in panels:
            pid = p.get("id")
            if pid in seen_ids:
                errors.append("%s: duplicate panel id %s" % (path, pid))
            seen_ids.add(pid)
            gp = p.get("gridPos") or {}
            if not all(isinstance(gp.get(k), int) for k in ("x", "y", "w", "h")) or gp.get("x", 0) + gp.get("w", 0) > 24:
                errors.append("%s: panel %r has a bad gridPos %s" % (path, p.get("title"), gp))
            if p.get("type") == "row":
                walk(p.get("panels") or [])
                continue
            if not p.get("title"):
                errors.append("%s: panel %s has no title" % (path, pid))
            targets = p.get("targets") or []
            if not targets:
                errors.append("%s: panel %r has no query" % (path, p.get("title")))
            for t in targets:
                expr = t.get("expr", "")
                if not expr:
                    errors.append("%s: panel %r has an empty expr" % (path, p.get("title")))
                if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}") or expr.count("[") != expr.count("]"):
                    errors.append("%s: panel %r: unbalanced brackets in %s" % (path, p.get("title"), expr))
                for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr):
                    if not v.startswith("__") and v not in var_names:
                        errors.append("%s: panel %r uses undefined variable $%s" % (path, p.get("title"), v))
                ms = {re.sub(r"_(bucket|sum|count)$", "", m) if re.sub(r"_(bucket|sum|count)$", "", m) in HISTOGRAMS else m
                      for m in metrics_of(expr)}
                if len(ms) == 1:
                    labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"", expr))
                    for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                        labels.update(l.strip() for l in grp.split(",") if l.strip())
                    label_uses.setdefault(ms.pop(), set()).update(labels - TARGET_LABELS)
                # Ratios of pdproxy_requests_total by code count API requests
                # only: probes and scrapes (/ready's 503 while draining,
                # /metrics) are not client traffic.
                if re.search(r'code\s*=~?\s*"[45]', expr):
                    for sel in re.findall(r"pdproxy_requests_total(\{[^}]*\})?", expr):
                        if not re.search(r'endpoint\s*=~\s*"/v1/', sel or ""):
                            errors.append("%s: panel %r: error ratio over pdproxy_requests_total%s counts "
                                          "non-API paths (add endpoint=~\"/v1/.*\")" % (path, p.get("title"), sel))
                # Time to first byte means something only per kind of answer.
                if "pdproxy_time_to_first_byte_seconds" in expr and "stream" not in expr:
                    errors.append("%s: panel %r mixes streamed and whole answers' time to first byte "
                                  "(group or filter by stream): %s" % (path, p.get("title"), expr))
                for m in metrics_of(expr):
                    used.add(re.sub(r"_(bucket|sum|count)$", "", m) if re.sub(r"_(bucket|sum|count)$", "", m) in HISTOGRAMS else m)
                    if not allowed(m):
                        errors.append("%s: panel %r uses unknown metric %s in: %s" % (path, p.get("title"), m, expr))
                globals()["nexpr"] += 1
    nexpr = 0
    walk(d.get("panels") or [])
    for v in (d.get("templating") or {}).get("list", []):
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        for m in re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", q):
            if not allowed(m):
                errors.append("%s: variable %s queries unknown metric %s" % (path, v.get("name"), m))
    if "pdproxy.json" in path:
        for m in sorted(REQUIRED - used):
            errors.append("%s: no panel shows %s" % (path, m))
    all_used |= used
    print("   %s: %d panels, %d queries, %d metrics" % (path.split("/deploy/")[-1], len(seen_ids), nexpr, len(used)))
open(out_names, "w").write("\n".join(sorted(all_used)) + "\n")
json.dump({m: sorted(l) for m, l in label_uses.items()}, open(out_names + ".labels.json", "w"))
if errors:
    for e in errors:
        print("deploy/check: FAIL: " + e, file=sys.stderr)
    sys.exit(1)
PY

# ------------------------------------------------------------------ 3. Docker build steps
section "docker: Dockerfile and its build steps"
df=$deploy/Dockerfile
[ -f "$df" ] || die "deploy/Dockerfile missing"
arg_list() { sed -n "s/^ARG $1=\"\\(.*\\)\"\$/\\1/p" "$df"; }
build_pkgs=$(arg_list BUILD_PACKAGES)
runtime_pkgs=$(arg_list RUNTIME_PACKAGES)
[ -n "$build_pkgs" ] || die "Dockerfile: no ARG BUILD_PACKAGES=\"...\" line"
[ -n "$runtime_pkgs" ] || die "Dockerfile: no ARG RUNTIME_PACKAGES=\"...\" line"
# Base images are build arguments, defaulting to Debian bookworm's public ones.
grep -q '^ARG BUILD_BASE=debian:bookworm$' "$df" || die "Dockerfile: ARG BUILD_BASE=debian:bookworm missing (before the first FROM)"
grep -q '^ARG RUNTIME_BASE=debian:bookworm-slim$' "$df" || die "Dockerfile: ARG RUNTIME_BASE=debian:bookworm-slim missing"
grep -q '^FROM ${BUILD_BASE} AS build$' "$df" || die "Dockerfile: build stage must be FROM \${BUILD_BASE} AS build"
grep -q '^FROM ${RUNTIME_BASE} AS runtime$' "$df" || die "Dockerfile: runtime stage must be FROM \${RUNTIME_BASE} AS runtime"
[ "$(grep -n '^ARG BUILD_BASE=' "$df" | cut -d: -f1)" -lt "$(grep -n '^FROM ' "$df" | head -1 | cut -d: -f1)" ] ||
    die "Dockerfile: ARG BUILD_BASE must come before the first FROM to be usable there"
grep -Eq '^USER +[1-9][0-9]*' "$df" || die "Dockerfile: USER must be a numeric non-root uid"
grep -Eq '^EXPOSE +8000' "$df" || die "Dockerfile: EXPOSE 8000 missing"
grep -q '^HEALTHCHECK' "$df" || die "Dockerfile: HEALTHCHECK missing"
grep -q '^ENTRYPOINT \["pdproxy"\]' "$df" || die "Dockerfile: ENTRYPOINT [\"pdproxy\"] missing"
grep -q 'build-steps.sh build ' "$df" || die "Dockerfile: the build stage must run build-steps.sh build"
# No parser directive: `# syntax=` makes BuildKit fetch a frontend image from a
# registry, and nothing here needs one.
! grep -qi '^# *syntax *=' "$df" || die "Dockerfile: drop the '# syntax=' directive (it needs a registry at build time)"
# OCI labels: source, version (CMake's), revision, licenses (LICENSE's).
for l in source version revision licenses; do
    grep -q "org.opencontainers.image.$l=" "$df" || die "Dockerfile: LABEL org.opencontainers.image.$l missing"
done
grep -q 'org.opencontainers.image.licenses="Apache-2.0"' "$df" && grep -q 'Apache License' "$root/LICENSE" &&
    grep -q 'Version 2.0, January 2004' "$root/LICENSE" ||
    die "Dockerfile: org.opencontainers.image.licenses must be LICENSE's Apache-2.0"
cmake_version=$(sed -n 's/^project(pdproxy VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
grep -q "^ARG VERSION=$cmake_version\$" "$df" || die "Dockerfile: ARG VERSION is not CMakeLists.txt's $cmake_version"
# The documented reload (`kubectl exec POD -- kill -HUP 1`) needs a kill
# binary: procps ships /bin/kill; the slim base has none.
if grep -rq 'kill -HUP 1' "$deploy/README.md" "$root/README.md"; then
    case " $runtime_pkgs " in *" procps "*) ;; *) die "Dockerfile: the docs reload with 'kill -HUP 1' but RUNTIME_PACKAGES has no procps (/bin/kill)" ;; esac
fi
# .dockerignore at the context's root keeps build directories out of the
# upload, and excludes no COPY source.
di=$root/.dockerignore
[ -f "$di" ] || die ".dockerignore missing at the repository root (the build context)"
for want in 'build*/' '.git/'; do
    grep -qxF "$want" "$di" || die ".dockerignore does not exclude $want"
done
while read -r src; do
    while read -r pat; do
        case "$pat" in ''|'#'*) continue ;; esac
        pat=${pat%/}
        # shellcheck disable=SC2254
        case "$src" in $pat|$pat/*) die ".dockerignore pattern $pat excludes COPY source $src" ;; esac
    done <"$di"
done < <(awk '/^COPY / && !/--from=/ { for (i = 2; i < NF; i++) print $i }' "$df")
# every COPY source from the context exists
while read -r src; do
    [ -e "$root/$src" ] || die "Dockerfile: COPY source $src does not exist"
done < <(awk '/^COPY / && !/--from=/ { for (i = 2; i < NF; i++) print $i }' "$df")
# the build stage installs to the prefix the runtime stage copies from
prefix=$(sed -n 's/.*build-steps.sh build [^ ]* [^ ]* \([^ ]*\).*/\1/p' "$df" | head -1)
grep -q "COPY --from=build $prefix/bin/pdproxy $prefix/bin/engine-sim " "$df" ||
    die "Dockerfile: runtime stage does not copy pdproxy and engine-sim from $prefix/bin"
# the package lists name Debian packages (installed here: CI built with them)
for p in $build_pkgs $runtime_pkgs; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        apt-cache show "$p" >/dev/null 2>&1 || die "Dockerfile names package $p, unknown to apt"
        echo "   note: $p is not installed here (known to apt)"
    fi
done
echo "   build packages: $build_pkgs"
echo "   runtime packages: $runtime_pkgs"

section "docker: build-steps.sh build (cmake configure, build, install)"
# The build context holds only what the build stage COPYs into its WORKDIR,
# so a source directory the Dockerfile forgets fails here, as in the image.
ctx=$work/context
mkdir -p "$ctx"
while read -r src dst; do
    case "$dst" in
        /*) continue ;;                       # tools copied outside WORKDIR
        ./|.) dst=$(basename "$src") ;;
        */) dst=$dst$(basename "$src") ;;
    esac
    mkdir -p "$(dirname "$ctx/$dst")"
    cp -a "$root/$src" "$ctx/$dst"
done < <(awk '/^FROM /{stage=($0 ~ / AS build$/)} stage && /^COPY / && !/--from=/ && NF == 3 {print $2, $3}' "$df")
# What .dockerignore keeps out of the context is not in the image either.
while read -r pat; do
    case "$pat" in ''|'#'*|'**'*|'build*/'|'.git/') continue ;; esac
    rm -rf "${ctx:?}/${pat%/}"
done <"$root/.dockerignore"
[ -f "$ctx/CMakeLists.txt" ] || die "Dockerfile: the build stage does not COPY CMakeLists.txt into its WORKDIR"
prefix_dir=$work/image/opt/pdproxy
if [ -n "${DEPLOY_CHECK_PREFIX:-}" ]; then
    prefix_dir=$DEPLOY_CHECK_PREFIX
    echo "   DEPLOY_CHECK_PREFIX set: not building, using $prefix_dir"
elif ! timeout 480 "$deploy/docker/build-steps.sh" build "$ctx" "$work/image-build" "$prefix_dir" \
        >"$work/image-build.log" 2>&1; then
    tail -n 40 "$work/image-build.log" >&2; die "build-steps.sh build failed"
fi
timeout 20 "$deploy/docker/build-steps.sh" smoke "$prefix_dir" | sed 's/^/   /' ||
    die "build-steps.sh smoke failed"

section "docker: runtime packages cover the binaries' shared libraries"
for b in pdproxy engine-sim; do
    ldd "$prefix_dir/bin/$b" >"$work/ldd.$b" || die "ldd $b failed"
    ! grep -q "not found" "$work/ldd.$b" || { cat "$work/ldd.$b" >&2; die "$b: shared library not found"; }
done
"$PY" "$deploy/docker/runtime-libs.py" "$runtime_pkgs" "$work/ldd.pdproxy" "$work/ldd.engine-sim" ||
    die "the runtime stage's packages do not provide every shared library"

section "docker: the pdkv image (deploy/k8s/components/pdkv/Dockerfile)"
# vLLM + libkvconnector: its packages known to apt, its cmake command
# configured and built with only its build stage's packages, and its runtime
# stage's packages providing every library libkvconnector loads.
"$PY" "$deploy/docker/pdkv-check.py" "$deploy/k8s/components/pdkv/Dockerfile" "$work/pdkv" ||
    die "deploy/k8s/components/pdkv/Dockerfile"

# ------------------------------------------------------------------ 4. wrk through pdproxy
section "wrk: engine-sim prefill + decode, pdproxy, deploy/wrk/*.lua"
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(free_port); D=$(free_port); X=$(free_port)
export UCX_TLS=tcp,self UCX_WARN_UNUSED_ENV_VARS=n
"$bin/engine-sim" --role prefill --port "$P" --log-level warn --layers 2 --block-bytes 4096 \
    --num-blocks 4096 2>"$work/prefill.log" & pids+=($!)
"$bin/engine-sim" --role decode --port "$D" --log-level warn --layers 2 --block-bytes 4096 \
    --num-blocks 4096 2>"$work/decode.log" & pids+=($!)
# Flags pdproxy may not have yet: used only when its --help lists them.
px_extra=()
px_has() { grep -Eq -- "(^|[ /])--$1( |/|\$)" "$work/pdproxy.help"; }
px_has drain-delay && px_extra+=(--drain-delay 0)
px_has health-interval && px_extra+=(--health-interval 1)
# Backends the way the ConfigMaps give them (URLs) once pdproxy has
# --prefill/--decode, else with the toy proxy's flags.
if px_has prefill && px_has decode; then
    backends=(--prefill "http://127.0.0.1:$P" --decode "http://127.0.0.1:$D")
else
    backends=(--prefiller-hosts 127.0.0.1 --prefiller-ports "$P"
              --decoder-hosts 127.0.0.1 --decoder-ports "$D")
fi
"$bin/pdproxy" --port "$X" --threads 1 --log-level warn "${backends[@]}" \
    ${px_extra[@]+"${px_extra[@]}"} 2>"$work/pdproxy.log" & pids+=($!)
echo "   pdproxy ${backends[*]} ${px_extra[*]+${px_extra[*]}}"
for port in "$P" "$D" "$X"; do
    for i in $(seq 1 400); do
        curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$port/health" && break
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null ||
            { cat "$work"/*.log >&2; die "a process exited at start (port $port)"; }; done
        [ "$i" = 400 ] && { cat "$work"/*.log >&2; die "port $port never answered /health"; }
        sleep 0.05
    done
done

# the endpoints the manifests probe, live
for path in /health /ready; do
    # readiness may wait for the first health checks of the backends
    for i in $(seq 1 75); do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$X$path" || true)
        [ "$code" = 200 ] || [ "$code" = 404 ] && break
        sleep 0.2
    done
    if [ "$code" = 200 ]; then echo "   pdproxy GET $path: 200"
    elif [[ " $COMING_ENDPOINTS " == *" $path "* ]]; then echo "   note: pdproxy GET $path: $code (not implemented yet; allowed by COMING_ENDPOINTS)"
    else die "pdproxy GET $path answered $code"; fi
done
for port in "$P" "$D"; do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$port/health" || true)
    [ "$code" = 200 ] || die "engine-sim GET /health on $port answered $code"
done
# the Docker HEALTHCHECK script: healthy here, unhealthy on a closed port
HEALTHCHECK_PORT=$X "$deploy/docker/healthcheck.sh" || die "healthcheck.sh failed against a live pdproxy"
if HEALTHCHECK_PORT=$(free_port) "$deploy/docker/healthcheck.sh" 2>/dev/null; then
    die "healthcheck.sh succeeded against a closed port"
fi
echo "   docker healthcheck.sh: healthy on :$X, unhealthy on a closed port"

for s in completions chat chat_stream; do
    lua=$deploy/wrk/$s.lua
    [ -f "$lua" ] || die "$lua missing"
    out=$(timeout 30 wrk -t1 -c4 -d2s --timeout 5s -s "$lua" "http://127.0.0.1:$X" 2>&1) ||
        { echo "$out" >&2; die "wrk $s.lua failed"; }
    res=$(sed -n 's/^wrk-result //p' <<<"$out")
    [ -n "$res" ] || { echo "$out" >&2; die "wrk $s.lua printed no wrk-result line"; }
    "$PY" -c '
import json, sys
r = json.loads(sys.argv[1]); s = sys.argv[2]
bad = []
if r["requests"] <= 0: bad.append("no requests completed")
for k in ("non2xx", "bad_bodies", "connect_errors", "read_errors", "write_errors", "timeouts"):
    if r[k]: bad.append("%s=%d" % (k, r[k]))
print("   %-12s %6d requests in %.1fs, p50 %.2f ms, p99 %.2f ms%s" % (s, r["requests"], r["duration_s"],
      r["p50_ms"], r["p99_ms"], "" if not bad else "  <- " + ", ".join(bad)))
sys.exit(1 if bad else 0)' "$res" "$s" || { echo "$out" >&2; tail -n 5 "$work"/*.log >&2; die "wrk $s.lua"; }
done
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || { cat "$work"/*.log >&2; die "a process died under load"; }; done

section "metrics: the dashboard's metrics are exposed"
# After the load above every labelled series has children.  engine-sim
# exposes vLLM's router metrics under their vLLM names; pdproxy's /metrics
# may not exist yet (COMING_ENDPOINTS).
px_code=$(curl -s -o "$work/metrics.pdproxy" -w '%{http_code}' --max-time 5 "http://127.0.0.1:$X/metrics" || true)
curl -sf -o "$work/metrics.prefill" --max-time 5 "http://127.0.0.1:$P/metrics" || die "engine-sim /metrics failed"
curl -sf -o "$work/metrics.decode" --max-time 5 "http://127.0.0.1:$D/metrics" || die "engine-sim /metrics failed"
if [ "$px_code" != 200 ]; then
    [[ " $COMING_ENDPOINTS " == *" /metrics "* ]] || die "pdproxy GET /metrics answered $px_code"
    echo "   note: pdproxy GET /metrics: $px_code (not implemented yet; allowed by COMING_ENDPOINTS)"
    rm -f "$work/metrics.pdproxy"
fi
"$PY" - "$work" <<'PY'
import os, re, sys
work = sys.argv[1]
import json
labels_seen = {}   # metric family -> label names on its samples
def names(path):
    out = set()
    for line in open(path, errors="replace"):
        m = re.match(r"#\s*(?:HELP|TYPE)\s+(\S+)", line) or re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)[{\s]", line)
        if m:
            out.add(m.group(1))
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+\S", line)
        if m and not line.startswith("#"):
            fam = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
            labels_seen.setdefault(m.group(1), set())
            labels_seen.setdefault(fam, set())
        if m and not line.startswith("#") and m.group(2):
            fam = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
            for n in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2)):
                labels_seen.setdefault(m.group(1), set()).add(n)
                labels_seen.setdefault(fam, set()).add(n)
    return out
used = [l.strip() for l in open(os.path.join(work, "dashboard-metrics.txt")) if l.strip()]
engine = names(os.path.join(work, "metrics.prefill")) | names(os.path.join(work, "metrics.decode"))
px_path = os.path.join(work, "metrics.pdproxy")
px = names(px_path) if os.path.exists(px_path) else None
errors, checked = [], 0
for m in used:
    if m.startswith("vllm:") or m.startswith("engine_sim_"):
        checked += 1
        if m not in engine:
            errors.append("the dashboard uses %s, which engine-sim's /metrics does not expose" % m)
    elif px is not None:
        checked += 1
        if m not in px and m + "_bucket" not in px:
            errors.append("the dashboard uses %s, which pdproxy's /metrics does not expose" % m)
label_uses = json.load(open(os.path.join(work, "dashboard-metrics.txt.labels.json")))
nlabels = 0
for m, labels in sorted(label_uses.items()):
    live = m.startswith("vllm:") or m.startswith("engine_sim_") or px is not None
    if not live or m not in labels_seen:
        continue  # no samples to compare with (pdproxy's page absent, or no series yet)
    for l in labels:
        nlabels += 1
        if l not in labels_seen.get(m, set()):
            errors.append("the dashboard groups or filters %s by label %r, which its live samples do not carry (they have: %s)"
                          % (m, l, ", ".join(sorted(labels_seen.get(m, []))) or "no labels"))
# Every metric the alerts (components/monitoring/alerts.yaml) use is exposed
# by pdproxy or engine-sim, or is one of these vLLM metrics that engine-sim
# does not imitate: an alert on a misspelt metric never fires.
#   vllm:nixl_num_kv_expired_reqs: vLLM's docs/usage/metrics.md, "NIXL KV
#   Connector Metrics" (a counter, tracked on the prefill instance).
VLLM_ONLY = {"vllm:nixl_num_kv_expired_reqs_total"}
amp = os.path.join(work, "alert-metrics.txt")
nalert = 0
if not os.path.exists(amp):
    errors.append("no alert-metrics.txt from the kubernetes section")
else:
    for m in [l.strip() for l in open(amp) if l.strip()]:
        nalert += 1
        if m.startswith(("vllm:", "engine_sim_")):
            if m not in engine and m not in VLLM_ONLY:
                errors.append("an alert uses %s, which neither engine-sim's /metrics nor vLLM's "
                              "documented metrics (VLLM_ONLY here) have" % m)
        elif px is not None and m not in px and m + "_bucket" not in px:
            errors.append("an alert uses %s, which pdproxy's /metrics does not expose" % m)
# Every metric family pdproxy exposes has a panel: the list comes from the
# live page (its # TYPE lines), so a new metric without a panel fails here.
nfam = 0
if px is not None:
    fams = set()
    for line in open(px_path, errors="replace"):
        m = re.match(r"#\s*TYPE\s+(\S+)\s", line)
        if m:
            fams.add(m.group(1))
    nfam = len(fams)
    for f in sorted(fams - set(used)):
        errors.append("pdproxy's /metrics exposes %s, which no dashboard panel shows "
                      "(deploy/dashboards/pdproxy.json)" % f)
if errors:
    for e in errors:
        print("deploy/check: FAIL: " + e, file=sys.stderr)
    sys.exit(1)
print("   %d metric families on pdproxy's live /metrics, each with a panel; %d alert metrics exposed" % (nfam, nalert))
print("   %d label uses checked against live samples" % nlabels)
print("   %d of the dashboard's %d metrics found in live /metrics pages%s"
      % (checked, len(used), "" if px is not None else " (engines only)"))
PY

section "deploy/check: all passed"
