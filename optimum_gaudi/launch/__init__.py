"""``optimum-gaudi launch``: the multi-process launcher, apart from the training-time parallelism (distributed/).

plan.py decides (settings, checks, the command line), launcher.py runs (signals, watching node 0, the failed
rank), torchrun.py is torchrun ending without its traceback, environment.py what the Gaudi bridge must find in
a rank's environment, ranks.py what the launcher and its ranks tell each other (environment variables, exit
codes). Every module here loads without torch: with Gaudi software 1.21+ importing torch loads the bridge,
which must happen in the ranks, with the environment the launcher gave them, never in the launcher.
"""
