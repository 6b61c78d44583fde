"""What every part records, at the bottom of the layers (it imports nothing of the governor's):
structured logs (:mod:`.logs`), the per-job measurements (:mod:`.metrics`) and the process's
memory (:mod:`.memory`). What operators read of it is :mod:`governor.ops`."""
