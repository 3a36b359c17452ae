#!/usr/bin/env bash
# Rolling restart of a Ray cluster, unattended: preflight, bring up, restart the workers one by
# one (each drained first, refused when the others cannot carry the deployed apps), stop at the
# first failure. Every step leaves a run directory (`cluster runs`); exit codes: 0 ok,
# 1 warnings, 2 failures / refused / bad usage.
#
#   INVENTORY=cluster.yaml scripts/examples/rolling_restart.sh
set -euo pipefail

INVENTORY=${INVENTORY:-cluster.yaml}
CLUSTER=${CLUSTER:-cluster}
cl() { "$CLUSTER" -i "$INVENTORY" "$@"; }

# 1. Preflight as JSON; parse it with Python (jq works too: jq -r '.results[] | select(...)').
set +e
report=$(cl preflight --json)
code=$?
set -e
if [ "$code" -ge 2 ]; then
  echo "preflight failed (exit $code):" >&2
  python3 -c '
import json, sys
r = json.load(sys.stdin)
for x in r["results"]:
    if x["status"] in ("fail", "error"):
        print(f"  {x[\"node\"] or \"cluster\"}/{x[\"check\"]}: {x[\"summary\"]}")
' <<<"$report" >&2
  exit 2
fi

# 2. Bring the cluster up (idempotent; --yes: no terminal, no prompt), workers 2 at a time.
cl up --skip-preflight --yes --serial 2 --json >/dev/null || {
  echo "cluster up failed; see: $(cl runs --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["path"])')" >&2
  exit 2
}

# 3. The workers, from the inventory as JSON.
workers=$(cl inventory --json | python3 -c '
import json, sys
print(" ".join(n["name"] for n in json.load(sys.stdin)["nodes"] if n["role"] == "worker"))')

# 4. One by one: drain (Serve replicas move first), restart Ray, rejoin, verify. Stop at the first
#    failure or refusal (restart-node prints the capacity numbers when it refuses).
for node in $workers; do
  echo "restarting $node" >&2
  if ! out=$(cl restart-node "$node" --yes --json); then
    echo "restart-node $node failed: $(python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("stopped") or d.get("error"))' <<<"$out")" >&2
    exit 2
  fi
done

# 5. Every node alive?
cl status --json >/dev/null && echo "rolling restart done: every node alive" >&2
