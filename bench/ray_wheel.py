"""Ray for the device machine, which has no network and takes at most 64 MiB of carried files: download the
ray wheel (and the jsonschema family it needs, absent there) for CPython 3.12, drop the parts replayllm never
loads (Java jars, RLlib, Tune, Train, Serve, Data, LLM, the dashboard's web client) and write the pruned wheel.

Usage (here, once; then pass carry=[".whl"] to the device call, bench/gpu_check.sh installs .whl/*.whl):
    echo /.whl/ >> .git/info/exclude; python3 bench/ray_wheel.py .whl      # ~45 MB in .whl/"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

RAY = "ray==2.60.0"
DEPS = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
DROP = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/serve/", "ray/data/", "ray/llm/",
        "ray/dashboard/client/")


def download(dest: str, *names: str, python: str = "3.12") -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "-d", dest, *names], check=True)


def prune(wheel: str, dest_dir: str) -> str:
    """Copy `wheel` into dest_dir without the DROP folders (pip installs what the archive holds)."""
    out = os.path.join(dest_dir, os.path.basename(wheel))
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if not info.filename.startswith(DROP):
                dst.writestr(info, src.read(info.filename))
    return out


def main() -> None:
    dest = sys.argv[1] if len(sys.argv) > 1 else ".whl"
    python = sys.argv[2] if len(sys.argv) > 2 else "3.12"
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        download(tmp, RAY, python=python)
        out = prune(glob.glob(os.path.join(tmp, "ray-*.whl"))[0], dest)
    download(dest, *DEPS, python=python)
    total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(dest, "*.whl")))
    print(f"{out}: {os.path.getsize(out) / 2**20:.1f} MiB; all wheels in {dest}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
