#!/usr/bin/env bash
# Submit the training job to a running Ray cluster through its Jobs API and follow its logs;
# the exit code is 0 when the job succeeded, non-zero when it failed or could not start.
#
#   RAY_ADDRESS=http://<head>:8265 bash tools/cluster/ray_job.sh trainer.nnodes=2 trainer.n_gpus_per_node=8 ...
#   bash tools/cluster/ray_job.sh --dry-run trainer.nnodes=2     # print the command only
#
# RAY_ADDRESS: the head's dashboard address (default http://127.0.0.1:8265); the head needs
#   ray[default] (bash tools/install.sh --cluster).
# RAY_JOB_PYTHON: the interpreter the job's driver runs with on the head (default: python).
# RAY_JOB_ID: a submission id of your choice (default: Ray picks one).
# RAY_JOB_AGENT_WAIT_S: how long to keep resubmitting while the head's job agent is not up yet,
#   as on a cluster that has just started (default 120; the head then refuses with "No available
#   agent to submit job" and creates no job, so submitting again cannot start it twice).
# Token authentication: export RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, or
#   ~/.ray/auth_token) here; docs/cluster.md.
# Afterwards: `ray job logs <id>` and `ray job status <id>`; metrics and checkpoints are in
#   trainer.default_local_dir on the node that ran the driver (the head).
set -euo pipefail
cd "$(dirname "$0")/../.."

dry_run=0
if [[ ${1:-} == --dry-run ]]; then dry_run=1; shift; fi
address=${RAY_ADDRESS:-http://127.0.0.1:8265}
cmd=(ray job submit --address "$address" --runtime-env tools/cluster/runtime_env.yaml)
[[ -n ${RAY_JOB_ID:-} ]] && cmd+=(--submission-id "$RAY_JOB_ID")
cmd+=(-- "${RAY_JOB_PYTHON:-python}" -m hybrid_rl.main "$@")

if (( dry_run )); then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
wait_s=${RAY_JOB_AGENT_WAIT_S:-120}
output=$(mktemp)
trap 'rm -f "$output"' EXIT
while true; do
  set +e
  "${cmd[@]}" 2>&1 | tee "$output"
  rc=${PIPESTATUS[0]}
  set -e
  # Resubmit only when the head refused before creating the job.
  if (( rc == 0 )) || ! grep -q "No available agent to submit job" "$output" \
      || grep -q "submitted successfully" "$output" || (( SECONDS >= wait_s )); then
    exit "$rc"
  fi
  echo "ray_job.sh: the head's job agent is not up yet (${SECONDS} s of ${wait_s}); submitting again in 5 s" >&2
  sleep 5
done
