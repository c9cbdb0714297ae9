#!/usr/bin/env bash
# The GPU check: the default world's RL on CUDA in bf16 (local backend), as one prepared command
# on the lent GPU machine (its own python3 and packages, no network, no install step).
#
#   bash bench/gpu_check.sh                      # OUT=$OUT or runs/gpu_check; STEPS=20
#   DEVICE=cpu PRESET=tiny bash bench/gpu_check.sh   # the same flow on a CPU (how it is tested here)
#   FROM_RUN=runs/quickstart-default bash bench/gpu_check.sh   # skip step 1: time RL from a run made
#                                                # elsewhere (carry its datagen, av, ar and rl/rl_config.yaml)
#
# What it needs there: python3 with torch, transformers >= 5.0, tokenizers, safetensors, pyarrow,
# numpy, pyyaml, tqdm and matplotlib. The lent machine's image has all of them (torch 2.11,
# transformers 5.17), so nothing is installed: nla runs from the working tree (PYTHONPATH). Where
# one is missing, the preflight names it; download it as wheels on a machine with the package index
# (`pip download --only-binary=:all: --python-version 3.12 -d .whl NAME==VERSION`), copy `.whl` to
# the GPU machine beside the tree and set WHEELS=.whl: they are installed into /tmp/site without
# network before anything runs.
#
# Steps (with FROM_RUN, 3 minutes on an H200: BENCHMARKS.md, "The GPU check on the H200"):
# 1. `nla quickstart --preset $PRESET` builds the world, the data and the warm-started pair (every
#    stage on the GPU where it has one) and runs its own RL and evaluations;
# 2. the RL stage again from its rl_config.yaml for $STEPS steps on $DEVICE in $DTYPE (bf16
#    where supported);
# 3. the same RL run with LoRA on the AV (lora.r=16, lr 2e-3: nla.core.lora, needs peft, which the
#    image has; LORA=0 skips it);
# 4. one table, a column per run: median step time (step 1 dropped: warm-up and the step-0
#    guard), samples/s, peak GPU memory, and the final eval FVE; then the quickstart's headline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/gpu_check}
STEPS=${STEPS:-20}
PRESET=${PRESET:-default}
DEVICE=${DEVICE:-cuda}
LORA=${LORA:-1}
. bench/env.sh

"$PY" - "$DEVICE" "$LORA" <<'PYEOF'
import importlib, sys
missing = [m for m in ("torch", "transformers", "tokenizers", "safetensors", "pyarrow", "numpy", "yaml", "tqdm",
                       "matplotlib") + (("peft",) if sys.argv[2] == "1" else ())
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing packages: {', '.join(missing)}; bring them as wheels (see the top of bench/gpu_check.sh)")
import torch, transformers
if sys.argv[1].startswith("cuda") and not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch; DEVICE=cpu runs the same flow on the CPU")
print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}")
PYEOF
if [ "${DEVICE%%:*}" = cuda ]; then
  DTYPE=${DTYPE:-$("$PY" -c "import torch; print('bfloat16' if torch.cuda.is_bf16_supported() else 'float32')")}
  echo "GPU: $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
else
  DTYPE=${DTYPE:-float32}
fi
echo "preset $PRESET, RL $STEPS steps on $DEVICE in $DTYPE -> $OUT"

T0=$(date +%s)
if [ -n "${FROM_RUN:-}" ]; then
  # A quickstart run made elsewhere (carried): its warm-started pair and data, its RL config; only
  # the RL runs below are timed here. Its headline is the other machine's.
  QS=$FROM_RUN
  echo "using the quickstart run $QS (made elsewhere; step 1 skipped)"
else
  QS=$OUT/quickstart
  "$PY" -m nla.cli quickstart --preset "$PRESET" --out "$QS" --no-progress
fi
T1=$(date +%s)
CFG="$QS/rl/rl_config.yaml"
test -f "$CFG" || { echo "missing $CFG: the quickstart did not reach its RL stage" >&2; exit 1; }
rm -rf "$OUT/rl" "$OUT/rl_lora"
RL_ARGS=(--steps "$STEPS" --set device="$DEVICE" --set dtype="$DTYPE" --set progress=false
         --set checkpointing.save_every="$STEPS" --set eval_every="$STEPS" --set log_every=1)
"$PY" -m nla.cli rl --config "$CFG" --out "$OUT/rl" "${RL_ARGS[@]}"
T2=$(date +%s)
RUNS="rl"
if [ "$LORA" = 1 ]; then
  "$PY" -m nla.cli rl --config "$CFG" --out "$OUT/rl_lora" "${RL_ARGS[@]}" --set lora.r=16 --set optimiser.lr=2e-3
  RUNS="rl rl_lora"
fi
T3=$(date +%s)

"$PY" - "$OUT" "$QS" "${FROM_RUN:+carried}" "$DTYPE" "$DEVICE" "$((T1 - T0))" "$((T2 - T1))" "$((T3 - T2))" $RUNS <<'PYEOF'
import json, statistics, sys
from pathlib import Path

import yaml

out, qs, carried, dtype, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "carried", sys.argv[4], sys.argv[5]
qs_s, rl_s, lora_s, runs = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]), sys.argv[9:]
cfg = yaml.safe_load((qs / "rl" / "rl_config.yaml").read_text())
samples = cfg["rollout"]["rollout_batch_size"] * cfg["rollout"]["n_samples_per_prompt"]


def measures(run: str) -> dict[str, str]:
    recs = [json.loads(line) for line in (out / run / "rl.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "time_step" in r]
    steady = recs[1:] or recs
    step = statistics.median(r["time_step"] for r in steady)
    gen = statistics.median(r.get("time_generate", float("nan")) for r in steady)
    peak = max((r.get("gpu_mem_peak_gib", float("nan")) for r in recs), default=float("nan"))
    fve = next((r["eval_fve_nrm"] for r in reversed(recs) if "eval_fve_nrm" in r), float("nan"))
    return {"RL steps": str(len(recs)), "median RL step, s": f"{step:.3f}",
            "median generation per step, s": f"{gen:.3f}", "rollout samples/s (whole step)": f"{samples / step:.1f}",
            "peak GPU memory, GiB": f"{peak:.2f}", "eval FVE after these steps": f"{fve:.3f}",
            "run wall, s": str(rl_s if run == "rl" else lora_s)}


cols = {run: measures(run) for run in runs}
names = {"rl": "full fine-tuning", "rl_lora": "LoRA r=16"}
print(f"\n| measure ({device}, {dtype}, {samples} samples per step) | " + " | ".join(names[r] for r in runs) + " |")
print("|---|" + "---|" * len(runs))
for key in cols[runs[0]]:
    print(f"| {key} | " + " | ".join(cols[r][key] for r in runs) + " |")
head = json.loads((qs / "report.json").read_text())["headline"]
print("\nthe quickstart run was made elsewhere (FROM_RUN); its figures:" if carried else
      f"\nquickstart wall {qs_s} s (world, data, warm-starts, its RL, evals);", end="")
print(" round-trip FVE warm -> RL "
      f"{head['round_trip_fve_warmstart']:.3f} -> {head['round_trip_fve_rl']:.3f}; recall / precision after RL "
      f"{head['recall_rl']:.3f} / {head['precision_rl']:.3f}")
PYEOF
