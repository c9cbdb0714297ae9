#!/usr/bin/env bash
# RL of the quickstart *default* preset on one NVIDIA GPU, local vs ray backend, as one table.
#
#   bash bench/gpu_rl.sh                 # OUT=runs/gpu_rl STEPS=20 by default
#   STEPS=60 OUT=/tmp/gpu_rl bash bench/gpu_rl.sh
#
# 1. `nla quickstart --preset default` builds (or reuses, stages are cached) the world, the
#    datasets and the warm-started AV/AR; its own RL stage runs on the local backend.
# 2. The RL stage is re-run from the resolved rl_config.yaml with both backends on CUDA
#    (bf16 when the GPU supports it, else fp32). The ray backend starts a local Ray with the
#    GPU: 1 policy rank + 1 reconstructor rank share it (0.5 GPU each), NCCL per group.
# 3. A table of median step times (step 1 dropped: warm-up and the step-0 guard) and the
#    final reward / eval FVE of each run.
set -euo pipefail
cd "$(dirname "$0")/.."
NLA=${NLA:-.venv/bin/nla}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_rl}
STEPS=${STEPS:-20}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
DTYPE=$("$PY" -c "import torch; print('bfloat16' if torch.cuda.is_bf16_supported() else 'float32')")
echo "GPU: $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))"), dtype $DTYPE, $STEPS RL steps"

"$NLA" quickstart --preset default --backend local --out "$OUT/quickstart" --no-progress
CFG="$OUT/quickstart/rl/rl_config.yaml"
test -f "$CFG" || { echo "missing $CFG: the quickstart did not reach its RL stage" >&2; exit 1; }

for BACKEND in local ray; do
  rm -rf "$OUT/$BACKEND"
  "$NLA" rl --config "$CFG" --out "$OUT/$BACKEND" --backend "$BACKEND" --steps "$STEPS" \
    --set device=cuda --set dtype="$DTYPE" --set progress=false --set checkpointing.save_every="$STEPS" \
    --set eval_every="$STEPS" --set backend.num_policy_workers=1 --set backend.num_reconstructor_workers=1
done

"$PY" - "$OUT" "$DTYPE" <<'PYEOF'
import json, statistics, sys
from pathlib import Path

out, dtype = Path(sys.argv[1]), sys.argv[2]
keys = ["time_step", "time_generate", "time_reward", "time_policy", "time_ar"]
rows = {}
for backend in ("local", "ray"):
    recs = [json.loads(l) for l in (out / backend / "rl.jsonl").read_text().splitlines() if l.strip()]
    recs = [r for r in recs if "time_step" in r]
    med = {k: statistics.median(r[k] for r in recs[1:] or recs) for k in keys}
    med["reward"] = recs[-1]["reward_mean"]
    med["eval_fve"] = next((r["eval_fve_nrm"] for r in reversed(recs) if "eval_fve_nrm" in r), float("nan"))
    rows[backend] = med
print(f"\nRL default preset on one GPU ({dtype}); median over steps 2..N")
print(f"{'backend':<8} {'step s':>8} {'vs local':>9} {'gen s':>7} {'reward s':>9} {'policy s':>9} {'ar s':>7} "
      f"{'reward':>8} {'eval fve':>9}")
for b, m in rows.items():
    print(f"{b:<8} {m['time_step']:8.3f} {m['time_step'] / rows['local']['time_step']:8.2f}x "
          f"{m['time_generate']:7.3f} {m['time_reward']:9.3f} {m['time_policy']:9.3f} {m['time_ar']:7.3f} "
          f"{m['reward']:8.3f} {m['eval_fve']:9.3f}")
PYEOF
