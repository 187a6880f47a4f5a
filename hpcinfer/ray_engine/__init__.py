"""`--engine ray`: the local engine's windows, done by replicas in Ray actors, for any task.

units.py (windows as work units) -> cluster.py (the resources, the replicas' actors) -> replicas.py
(each actor's life and circuit breaker) -> schedule.py (every unit through them, around failures)
-> actor.py (the task's replica on one unit, in an actor; beat.py: its heartbeat) -> commit.py /
driver.py (the driver's ordered commit) -> merge.py (one report). What is a task's own (its
replica, how its window is committed, how its figures merge) is in tasks/<task>/replica.py and
cluster.py. Only the driver and the actor's process import Ray, and only when this engine runs.
"""
