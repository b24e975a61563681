#!/usr/bin/env bash
# Another transformers release beside the installed one, for running the reference tests against it on this CPU:
#   bash bench/transformers_release.sh 5.17.0            (unpacks into /tmp/transformers-5.17.0/site)
#   PYTHONPATH=/tmp/transformers-5.17.0/site TRITON_INTERPRET=1 .venv/bin/python -m pytest -n 2 tests/models tests/diff
# The GPU machine's transformers is not ours (5.17 there in sessions 33-35): a test that passes here may meet another
# reference there, and a device call is scarce. Session 35 found that way why GPT-OSS's comparisons failed on the device
# (5.17 clamps its SwiGLU at a fixed 7.0). Each Requires-Dist the installed packages do not meet (huggingface-hub for
# 5.17) is unpacked beside it; the others (tokenizers, safetensors, ...) come from the environment.
set -euo pipefail
ver=${1:?usage: bash bench/transformers_release.sh VERSION [DIR]}
dir=${2:-/tmp/transformers-$ver}
py=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
mkdir -p "$dir/whl" "$dir/site"
"$py" -m pip download -q --no-deps "transformers==$ver" -d "$dir/whl"
wheel=$(ls "$dir"/whl/transformers-"$ver"-*.whl)
# Its requirements (not the extras') that the environment does not satisfy: fetched and unpacked too.
missing=$("$py" - "$wheel" <<'EOF'
import sys, zipfile
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if line.startswith("Requires-Dist:") and "extra ==" not in line:
        req = Requirement(line.split(":", 1)[1].strip())
        try:
            ok = req.specifier.contains(version(req.name), prereleases=True)
        except PackageNotFoundError:
            ok = False
        if not ok:
            print(str(req).replace(" ", ""))
EOF
)
for req in $missing; do
  echo "also unpacking $req (the environment's does not meet it)"
  "$py" -m pip download -q --no-deps --only-binary=:all: "$req" -d "$dir/whl"
done
for whl in "$dir"/whl/*.whl; do
  "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$whl" "$dir/site"
done
PYTHONPATH="$dir/site" "$py" -c "import transformers; print('transformers', transformers.__version__, 'from', transformers.__file__)"
