"""Engines driven as a job drives them: admission (rows into an engine's queue, in prefix and
priority order or as they arrive), the one engine loop, an engine per device on a thread of its
own, and the pool that dispatches between them and moves work after a device fault."""
