"""`--engine ray`: the local engine's windows, embedded or answered by replicas in a Ray Data actor pool.

units.py (windows as work units) -> actor.py / replica.py (the local engine on one unit, in an
actor) -> commit.py / driver.py (the driver's ordered commit) -> merge.py (one report). Generation
has its replica, driver and merge beside them (generate_replica.py, generate_driver.py,
generate_merge.py) and shares the units, the actor, the pool and the ordered commit. Only the
drivers and the actor's process import Ray, and only when this engine runs.
"""
