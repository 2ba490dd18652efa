"""The engine core: its thread and loop (schedule -> build inputs -> launch -> read -> emit), admission,
the step's inputs, the output stage, failure isolation, start-up (builder), the asyncio face the server holds
(AsyncEngine) and D of them behind one router (replicas, data parallelism); the encoder engine beside it."""
