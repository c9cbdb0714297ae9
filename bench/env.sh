# Sourced by the GPU scripts (bench/gpu_check.sh, bench/gpu_scale.sh) from the repository root: the
# wheels brought along (WHEELS=DIR) installed without network into /tmp/site, and nla from the tree.
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
