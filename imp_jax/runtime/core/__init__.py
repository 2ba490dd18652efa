"""The engine core: its thread and loop (schedule -> build inputs -> launch -> read -> emit), admission,
the output stage, failure isolation, start-up (builder) and the asyncio face the server holds (AsyncEngine);
the encoder engine beside it."""
