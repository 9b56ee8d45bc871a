# Shared by the recipes' scripts (sourced after they set `repo`): the data check, one CPU-scale
# run, and the start of a paper-scale run.
python=${PYTHON:-$repo/.venv/bin/python}

# require_data "<command that writes the data>" FILE...: stop, naming that command, if a file is missing.
require_data() {
  local prep=$1; shift
  for file in "$@"; do
    [[ -f $file ]] || { echo "error: $file is missing; run: $prep" >&2; exit 1; }
  done
}

# The CPU recipes train on the built-in arithmetic task (tools/data/arithmetic.py) and validate
# every 10 of 60 steps on its test set and shifted sets. use_arithmetic_data [NAME [TOOL_ARG...]]
# sets `data` (DATA_DIR, else ~/data/NAME, default arithmetic), written by the tool with those args.
use_arithmetic_data() {
  data=${DATA_DIR:-$HOME/data/${1:-arithmetic}}
  require_data "$python tools/data/arithmetic.py --out-dir $data${2:+ ${*:2}}" "$data"/{train,test,shifted}.parquet
}

# cpu_run NAME OVERRIDE...: one run of a CPU recipe into $out/NAME, with the recipe's `common`
# overrides, then the given ones.
cpu_run() {
  local name=$1; shift
  echo "== $name"
  (cd "$repo" && "$python" -m hybrid_rl.main \
      data.train_files="$data/train.parquet" data.val_files="[$data/test.parquet,$data/shifted.parquet]" \
      data.val_max_samples=-1 data.max_prompt_length=128 trainer.total_training_steps=60 trainer.test_freq=10 \
      trainer.logger='[console,jsonl]' trainer.progress_bar=false trainer.final_model_dir=null \
      "${common[@]}" trainer.experiment_name="$name" trainer.default_local_dir="$out/$name" "$@")
}

# start_paper_run SCRIPT_ARG...: with --cfg, print the config composed from `overrides` and start
# nothing; otherwise check `data_files` (naming the command `data_prep`) and start the job on the
# SLURM allocation's nodes (tools/cluster/slurm_ray.sbatch).
start_paper_run() {
  if [[ ${1:-} == --cfg ]]; then
    exec python -m hybrid_rl.main "${overrides[@]}" "$@"
  fi
  require_data "$data_prep" "${data_files[@]}"
  exec bash "$repo/tools/cluster/slurm_ray.sbatch" "${overrides[@]}" "$@"
}
