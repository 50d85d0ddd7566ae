"""deploy/: the Kubernetes and compose files parse, use images and commands the Dockerfiles provide,
and probe endpoints the servers have. Docker is not run here; the files are checked against each other,
pyproject.toml, the CLI and the server's routes."""
from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import tomllib

import yaml   # a dev dependency: a failed import fails the run, never skips the deploy tests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
COMPOSE = os.path.join(DEPLOY, "compose", "docker-compose.yaml")
HLOSERVE_IMAGES = {"hloserve/server-cpu", "hloserve/server-tpu"}
TF_SERVING_IMAGE = "hloserve/tf-serving"
EXPECTED_SERVER_ROUTES = {"/health", "/ready", "/metrics", "/v1/completions", "/v1/chat/completions", "/v1/models",
                          "/v1/models/{name}:predict"}   # at least these (checked against the app's source below)


MULTIHOST = "hloserve-tpu-multihost.yaml"


# -- readers ----------------------------------------------------------------------------------------
def read_dockerfile(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, continuations joined, comments dropped."""
    out, buf = [], ""
    with open(path) as f:
        for line in f:
            s = line.rstrip("\n")
            if not buf and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if s.endswith("\\"):
                buf += s[:-1] + " "
                continue
            buf += s
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def dockerfiles() -> dict[str, list[tuple[str, str]]]:
    d = os.path.join(DEPLOY, "docker")
    return {name: read_dockerfile(os.path.join(d, name)) for name in sorted(os.listdir(d)) if name.startswith("Dockerfile")}


def built_images() -> dict[str, str]:
    """image name (no tag) -> Dockerfile, from the `docker build -f ... -t ...` lines of build.sh."""
    images = {}
    with open(os.path.join(DEPLOY, "docker", "build.sh")) as f:
        for line in f:
            if line.strip().startswith("docker build"):
                words = shlex.split(line)
                dockerfile, tag = words[words.index("-f") + 1], words[words.index("-t") + 1]
                images[tag.rsplit(":", 1)[0]] = os.path.basename(dockerfile)
                assert os.path.exists(os.path.join(REPO, dockerfile)), dockerfile
    return images


def last(instrs, word):
    found = [rest for w, rest in instrs if w == word]
    return exec_form(found[-1]) if found else None


def k8s_docs() -> dict[str, list[dict]]:
    docs = {}
    for name in sorted(os.listdir(K8S)):
        if name.endswith(".yaml") and name != "kustomization.yaml":
            with open(os.path.join(K8S, name)) as f:
                docs[name] = [d for d in yaml.safe_load_all(f) if d is not None]
    return docs


def deployments() -> list[dict]:
    return [d for docs in k8s_docs().values() for d in docs if d["kind"] == "Deployment"]


def containers() -> list[tuple[dict, dict]]:
    return [(dep, c) for dep in deployments() for c in dep["spec"]["template"]["spec"]["containers"]]


def image_name(image: str) -> str:
    return image.rsplit(":", 1)[0]


def server_routes() -> set[str]:
    """Paths registered in server/http/ (FastAPI decorators or add_api_route)."""
    routes = set()
    http = os.path.join(REPO, "server", "http")
    for name in sorted(os.listdir(http)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(http, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in {"get", "post", "put", "delete", "api_route", "add_api_route", "route"}
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("/")):
                routes.add(node.args[0].value)
    assert EXPECTED_SERVER_ROUTES <= routes, f"server/http/ lacks {sorted(EXPECTED_SERVER_ROUTES - routes)}"
    return routes


def route_matches(path: str, routes: set[str]) -> bool:
    for r in routes:
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(r))
        if re.fullmatch(pattern, path):
            return True
    return False


def pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


# -- tests --------------------------------------------------------------------------------------------
def test_every_yaml_file_parses_as_kubernetes_objects():
    docs = k8s_docs()
    assert set(docs) == {"hloserve-cpu.yaml", "hloserve-tpu.yaml", "tf-serving.yaml", "models-pvc.yaml", MULTIHOST}
    for name, objs in docs.items():
        for d in objs:
            assert {"apiVersion", "kind", "metadata"} <= set(d), name
    for app in ("hloserve-cpu.yaml", "hloserve-tpu.yaml", "tf-serving.yaml"):
        assert sorted(d["kind"] for d in docs[app]) == ["Deployment", "HorizontalPodAutoscaler", "Service"], app
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    assert sorted(kust["resources"]) == sorted(set(docs) - {MULTIHOST})   # it needs the LWS controller
    with open(COMPOSE) as f:
        compose = yaml.safe_load(f)
    assert set(compose["services"]) == {"hloserve", "tf-serving"}


def test_services_and_autoscalers_point_at_deployments():
    for name, objs in k8s_docs().items():
        if name == MULTIHOST:
            continue   # a LeaderWorkerSet: test_multihost_tpu_slice_is_one_leader_worker_set
        deps = {d["metadata"]["name"]: d for d in objs if d["kind"] == "Deployment"}
        for d in objs:
            if d["kind"] == "Service":
                dep = next(iter(deps.values()))
                labels = dep["spec"]["template"]["metadata"]["labels"]
                assert d["spec"]["selector"].items() <= labels.items(), d["metadata"]["name"]
                assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
                ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
                assert {p["targetPort"] for p in d["spec"]["ports"]} <= ports
            if d["kind"] == "HorizontalPodAutoscaler":
                ref = d["spec"]["scaleTargetRef"]
                assert ref["kind"] == "Deployment" and ref["name"] in deps
                assert 1 <= d["spec"]["minReplicas"] <= d["spec"]["maxReplicas"]


def test_images_are_built_by_the_dockerfiles():
    images = built_images()
    assert set(images.values()) == set(dockerfiles()), "every Dockerfile is built by build.sh"
    used = {image_name(c["image"]) for _, c in containers()}
    with open(COMPOSE) as f:
        services = yaml.safe_load(f)["services"]
    used |= {image_name(s["image"]) for s in services.values()}
    assert used == set(images), f"images used {sorted(used)} vs built {sorted(images)}"
    for s in services.values():
        assert os.path.basename(s["build"]["dockerfile"]) == images[image_name(s["image"])]
        assert os.path.normpath(os.path.join(os.path.dirname(COMPOSE), s["build"]["context"])) == REPO
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        assert {i["name"] for i in yaml.safe_load(f)["images"]} == set(images)


def test_dockerfiles_copy_every_package_and_install_the_cli():
    project = pyproject()
    package_dirs = set(project["tool"]["setuptools"]["package-dir"].values())
    assert project["project"]["scripts"]["hloserve"] == "hloserve.server.cli:run"
    assert "tpu" in project["project"]["optional-dependencies"]
    for name, instrs in dockerfiles().items():
        copied = set()
        for word, rest in instrs:
            if word == "COPY" and "--from" not in rest:
                *sources, _dest = exec_form(rest)
                for s in sources:
                    assert os.path.exists(os.path.join(REPO, s)), f"{name}: COPY {s} does not exist"
                    copied.add(s.rstrip("/"))
        if name != "Dockerfile.tf-serving":
            assert package_dirs <= copied, f"{name} misses packages {package_dirs - copied}"
            installs = " ".join(rest for w, rest in instrs if w == "RUN")
            assert "hloserve-*.whl" in installs
            if name == "Dockerfile.tpu":
                assert "[tpu]" in installs


def test_hloserve_containers_run_the_dockerfile_command():
    images = built_images()
    files = dockerfiles()
    cli_commands = _cli_subcommands()
    for dep, c in containers():
        if image_name(c["image"]) not in HLOSERVE_IMAGES:
            continue
        instrs = files[images[image_name(c["image"])]]
        entry = last(instrs, "ENTRYPOINT")
        assert entry == ["hloserve", "serve"]
        assert c.get("command", entry) == entry
        args = [str(a) for a in c.get("args", last(instrs, "CMD"))]
        _check_serve_args(args, c, dep, cli_commands)
    with open(COMPOSE) as f:
        svc = yaml.safe_load(f)["services"]["hloserve"]
    args = [str(a) for a in svc["command"]]
    assert args[args.index("--port") + 1] == svc["ports"][0].split(":")[1]
    if "--grpc-port" in args:
        assert args[args.index("--grpc-port") + 1] in [p.split(":")[1] for p in svc["ports"]]
    artifact_mounts = [v.split(":")[1] for v in svc["volumes"]]
    assert any(args[0].startswith(m + "/") for m in artifact_mounts)


def _cli_subcommands() -> set[str]:
    from hloserve.server.cli import build_parser
    parser = build_parser(None)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)


def _check_serve_args(args: list[str], c: dict, dep: dict, cli_commands: set[str]) -> None:
    name = dep["metadata"]["name"]
    port = args[args.index("--port") + 1]
    assert args[args.index("--host") + 1] == "0.0.0.0", name
    assert int(port) in {p["containerPort"] for p in c["ports"]}, name
    if "--grpc-port" in args:   # TF Serving's gRPC API: the container port named grpc
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == int(args[args.index("--grpc-port") + 1])
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert any(args[0].startswith(m + "/") for m in mounts), f"{name}: artifact {args[0]} is not under a mount"
    assert "serve" in cli_commands
    from hloserve.server.cli import build_parser
    parsed = build_parser("serve").parse_args(["serve", *args])   # exits (fails the test) on unknown options
    assert parsed.command == "serve"


def test_probes_and_metrics_hit_server_routes():
    routes = server_routes()
    for dep, c in containers():
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(ann["prometheus.io/port"]) in ports.values()
        if image_name(c["image"]) in HLOSERVE_IMAGES:
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert ann["prometheus.io/path"] == "/metrics"
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = c[probe]["httpGet"]["path"]
                assert route_matches(path, routes), f"{probe} {path} is not a server route {sorted(routes)}"
                assert c[probe]["httpGet"]["port"] in ports
            assert route_matches(ann["prometheus.io/path"], routes)
    assert route_matches("/v1/models/minilm:predict", routes)


def test_tf_serving_command_configs_and_probes_agree():
    images = built_images()
    instrs = dockerfiles()[images[TF_SERVING_IMAGE]]
    entry = last(instrs, "ENTRYPOINT")
    assert entry[0] == "tensorflow_model_server"
    flags = dict(f[2:].split("=", 1) for f in entry[1:])
    assert flags["xla_cpu_compilation_enabled"] == "true" and flags["enable_batching"] == "true"
    copied = {}
    for word, rest in instrs:
        if word == "COPY":
            *sources, dest = exec_form(rest)
            copied.update({os.path.join(dest, os.path.basename(s)): os.path.join(REPO, s) for s in sources})
    for key in ("model_config_file", "batching_parameters_file", "monitoring_config_file"):
        assert flags[key] in copied, f"--{key}={flags[key]} is not copied into the image"
    with open(copied[flags["model_config_file"]]) as f:
        config = f.read()
    models = dict(re.findall(r'name:\s*"([^"]+)"\s*base_path:\s*"([^"]+)"', config))
    assert models == {"minilm": "/models/minilm"}
    with open(copied[flags["monitoring_config_file"]]) as f:
        metrics_path = re.search(r'path:\s*"([^"]+)"', f.read()).group(1)
    with open(copied[flags["batching_parameters_file"]]) as f:
        batching = f.read()
    sizes = [int(s) for s in re.findall(r"allowed_batch_sizes:\s*(\d+)", batching)]
    max_batch = int(re.search(r"max_batch_size\s*{\s*value:\s*(\d+)", batching).group(1))
    assert sizes == sorted(sizes) and sizes[-1] == max_batch   # TF Serving requires the last to equal the max

    (dep, c), = [(d, c) for d, c in containers() if image_name(c["image"]) == TF_SERVING_IMAGE]
    assert "command" not in c and "args" not in c, "the Dockerfile's ENTRYPOINT is the command"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": int(flags["port"]), "http": int(flags["rest_api_port"])}
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == metrics_path and int(ann["prometheus.io/port"]) == ports["http"]
    assert c["readinessProbe"]["httpGet"]["path"] in {f"/v1/models/{m}" for m in models}
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert all(any(p.startswith(m + "/") for m in mounts) for p in models.values())


def test_gke_tpu_selectors_match_the_tpu_request():
    tpu = [(d, c) for d, c in containers() if image_name(c["image"]) == "hloserve/server-tpu"]
    assert tpu
    for dep, c in tpu:
        sel = dep["spec"]["template"]["spec"]["nodeSelector"]
        assert sel["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
        chips = math.prod(int(n) for n in sel["cloud.google.com/gke-tpu-topology"].split("x"))
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert int(req["google.com/tpu"]) == int(lim["google.com/tpu"]) == chips
        assert {"name": "JAX_PLATFORMS", "value": "tpu"} in c["env"]
    for dep, c in containers():
        if image_name(c["image"]) != "hloserve/server-tpu":
            assert "nodeSelector" not in dep["spec"]["template"]["spec"]
            assert "google.com/tpu" not in c["resources"].get("requests", {})


def test_docs_show_the_exact_commands_and_request_bodies():
    with open(os.path.join(REPO, "docs", "deploy.md")) as f:
        doc = f.read()
    entry = last(dockerfiles()[built_images()[TF_SERVING_IMAGE]], "ENTRYPOINT")
    assert " \\\n    ".join(entry) in doc, "docs/deploy.md must show the tensorflow_model_server command verbatim"
    for name in sorted(os.listdir(os.path.join(DEPLOY, "tf_serving", "requests"))):
        with open(os.path.join(DEPLOY, "tf_serving", "requests", name)) as f:
            body = f.read().strip()
        assert f"deploy/tf_serving/requests/{name}" in doc
        assert body in doc, f"docs/deploy.md must show {name} verbatim"


def test_multihost_tpu_slice_is_one_leader_worker_set():
    """Every pod of a group runs the same `hloserve serve --distributed` (parsed by the real CLI) on a
    slice whose chips, per-pod TPU requests and tensor-parallel size agree; jax's three variables come
    from LWS; the Service reaches the leaders only, on a port the leader serves and probes."""
    from hloserve.server.cli import build_parser
    lws, svc = k8s_docs()[MULTIHOST]
    assert lws["kind"] == "LeaderWorkerSet" and svc["kind"] == "Service"
    group = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    args = []
    for spec in (leader, worker):
        (c,) = spec["containers"]
        assert image_name(c["image"]) == "hloserve/server-tpu"
        argv = [*c["command"][1:], *c["args"]]
        parsed = build_parser(argv[0]).parse_args(argv)
        assert parsed.distributed and parsed.artifact == "/models/llm-artifact"
        args.append((parsed.artifact, parsed.tensor_parallel_size))
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["JAX_COORDINATOR_ADDRESS"].startswith("$(LWS_LEADER_ADDRESS):")
        assert env["JAX_NUM_PROCESSES"] == "$(LWS_GROUP_SIZE)" and env["JAX_PROCESS_ID"] == "$(LWS_WORKER_INDEX)"
        sel = spec["nodeSelector"]
        chips = math.prod(int(n) for n in sel["cloud.google.com/gke-tpu-topology"].split("x"))
        per_pod = int(c["resources"]["requests"]["google.com/tpu"])
        assert per_pod == int(c["resources"]["limits"]["google.com/tpu"]) and per_pod * group["size"] == chips
        assert parsed.tensor_parallel_size == chips
    assert args[0] == args[1]                       # leader and workers run the same step
    port = int(env["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in leader["containers"][0]["ports"]}
    assert port in ports.values()
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    probes = [leader["containers"][0][k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe")]
    assert all(route_matches(p, server_routes()) for p in probes)
