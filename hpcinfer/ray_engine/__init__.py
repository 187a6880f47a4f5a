"""`--engine ray`: the local engine's windows, embedded by replicas in a Ray Data actor pool.

units.py (windows as work units) -> actor.py / replica.py (the local engine on one unit, in an
actor) -> commit.py / driver.py (the driver's ordered commit) -> merge.py (one report). Only
driver.py and the actor's process import Ray, and only when this engine runs.
"""
