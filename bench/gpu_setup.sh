# Sourced by bench/gpu_check.sh and bench/gpu_archs_check.sh (the GPU machine's start of every run): stop the
# background test processes with the script; an empty Triton cache unless one is given (every run meets what a
# fresh machine meets: compiles at start-up, none inside a CUDA-graph capture or a first request); OUT; the wheels
# the machine lacks from .whl/ (bench/fetch_wheels.sh) and the project itself, without dependencies; what it runs on.
trap 'trap - TERM INT; kill $(jobs -p) 2>/dev/null; exit 143' TERM INT
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d /tmp/triton-cache-XXXX)}
OUT=${OUT:-/tmp/replayllm-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
