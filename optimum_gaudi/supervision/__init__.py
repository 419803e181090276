"""Run supervision, in one folder: what watches a run and ends or mends it when a rank stalls, diverges or is told
to stop. ``RunSupervision`` (run.py) is the one object a trainer installs for its ``train()``: SIGTERM's checkpoint
and exit (preemption.py, the ranks agreeing through the job's store: agreement.py), non-finite steps stopped or
skipped (nonfinite.py), the progress watchdog on the loop's events (watch.py) over its thread and report
(watchdog.py) and the collectives the project counts (collective_count.py), and the straggler figures
(stragglers.py)."""
