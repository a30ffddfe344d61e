"""The autoscaler: grow or shrink a pool of rollout services from the dataflow's balance report.

    astralight autoscale --dataflow URL --raas-config RAAS.yaml --model-id policy --min 1 --max 4

- :mod:`.policy` (pure): bounds, cooldown, the target from the report, which instances to retire;
- :mod:`.backends`: how instances are started and stopped (local processes, or shell command
  templates for Slurm / kubectl / anything);
- :mod:`.service`: the loop that polls the dataflow, asks the policy, and acts through a backend.
"""
