"""What the commands share: option types and connections, starting and stopping processes by
their PIDs, a throwaway Redis, workloads, targets, the traffic harness, statistics and reports.

Nothing here imports a command (:mod:`loadtest.commands`, :mod:`loadtest.bench`).
"""
