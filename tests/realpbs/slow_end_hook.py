"""An OpenPBS execjob_end hook for the real-OpenPBS tier (installed by two_nodes.sh): a job whose name contains
``slowexit`` stays in state E for 20 s after it ended, long enough for a test to meet it there (qdel's answer).
Every other job passes at once. Runs inside the MoM's embedded Python (module ``pbs``), not under pytest."""

import time

import pbs

event = pbs.event()
if "slowexit" in str(event.job.Job_Name):
    time.sleep(20)
event.accept()
